//! This test binary run again as a child process (a host or replica that can be signalled,
//! killed, or measured on its own), and the guard that makes sure it does not outlive its
//! test.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;

/// Re-run this test binary as a child process that runs only its ignored test `entry`, with
/// `env` added to its environment. `entry` is an `#[ignore]`d test that does nothing unless
/// its environment says what to be, so the suite skips it and `--ignored` alone runs it
/// harmlessly. The child's standard output (libtest's own lines) is discarded; its standard
/// error is this test's. The guard kills it when dropped.
pub fn spawn_self(entry: &str, env: &[(&str, &str)]) -> anyhow::Result<SelfProcess> {
    let mut command = Command::new(std::env::current_exe()?);
    command
        .args(["--exact", entry, "--ignored", "--nocapture"])
        .envs(env.iter().copied())
        .stdout(Stdio::null());
    SelfProcess::spawn(&mut command).with_context(|| format!("starting {entry}"))
}

/// A child process running this executable again; dropped, it is killed (SIGKILL, or the
/// signal [`stop_on_drop_with`](Self::stop_on_drop_with) chose) and waited for, so a test
/// that fails half-way leaves none behind.
pub struct SelfProcess {
    child: Child,
    stop_signal: libc::c_int,
}

impl SelfProcess {
    /// Start `command`, which runs this executable again (as [`spawn_self`] does for a test
    /// binary; a bench without libtest's harness builds its own command).
    pub fn spawn(command: &mut Command) -> anyhow::Result<Self> {
        Ok(Self {
            child: command.spawn()?,
            stop_signal: libc::SIGKILL,
        })
    }

    /// When dropped, send `signal` (e.g. SIGTERM, to let it shut down as in production)
    /// instead of SIGKILL, then wait for it.
    pub fn stop_on_drop_with(mut self, signal: libc::c_int) -> Self {
        self.stop_signal = signal;
        self
    }

    /// Its process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Send it `signal`; nothing if it has already exited.
    #[allow(unsafe_code)] // see the SAFETY comment inside
    pub fn signal(&mut self, signal: libc::c_int) -> anyhow::Result<()> {
        // Once reaped, its pid may be another process's.
        if self.child.try_wait()?.is_some() {
            return Ok(());
        }
        let pid = libc::pid_t::try_from(self.child.id())?;
        // SAFETY: kill(2) on our own child's pid has no memory effects.
        if unsafe { libc::kill(pid, signal) } != 0 {
            anyhow::bail!(
                "signalling process {pid}: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }

    /// Its exit status if it has exited.
    pub fn try_wait(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// Wait for it to exit on its own, at most `within`; its exit status.
    pub async fn exit_within(&mut self, within: Duration) -> anyhow::Result<ExitStatus> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            anyhow::ensure!(
                started.elapsed() < within,
                "process {} did not exit within {within:?}",
                self.child.id()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL it and wait for it, saying if either fails (dropping it does the same, silently).
    pub fn kill(mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for SelfProcess {
    fn drop(&mut self) {
        if self.stop_signal == libc::SIGKILL {
            let _ = self.child.kill();
        } else {
            let _ = self.signal(self.stop_signal);
        }
        let _ = self.child.wait();
    }
}

/// A copy of the admin kubeconfig `admin` in `dir` that impersonates `identity` (still in
/// `system:masters`), so a replica process acts with every right while the audit log tells it
/// apart from the others.
pub fn impersonating_kubeconfig(
    admin: &std::path::Path,
    identity: &str,
    dir: &std::path::Path,
) -> anyhow::Result<std::path::PathBuf> {
    let admin = std::fs::read_to_string(admin)?;
    let mut config: serde_json::Value = serde_yaml_ng::from_str(&admin)?;
    for user in config["users"].as_array_mut().context("kubeconfig users")? {
        user["user"]["as"] = serde_json::json!(identity);
        user["user"]["as-groups"] = serde_json::json!(["system:masters", "system:authenticated"]);
    }
    let path = dir.join(format!("{identity}.kubeconfig"));
    std::fs::write(&path, serde_yaml_ng::to_string(&config)?)?;
    Ok(path)
}

/// A copy of the admin kubeconfig `admin` in `dir` whose user signs in with `token` instead
/// (as a person with an OIDC or exec login would), named `name`.
pub fn token_kubeconfig(
    admin: &std::path::Path,
    token: &str,
    name: &str,
    dir: &std::path::Path,
) -> anyhow::Result<std::path::PathBuf> {
    let admin = std::fs::read_to_string(admin)?;
    let mut config: serde_json::Value = serde_yaml_ng::from_str(&admin)?;
    for user in config["users"].as_array_mut().context("kubeconfig users")? {
        user["user"] = serde_json::json!({"token": token});
    }
    let path = dir.join(format!("{name}.kubeconfig"));
    std::fs::write(&path, serde_yaml_ng::to_string(&config)?)?;
    Ok(path)
}

/// Run `wasmctrl ARGS…` in this process, as the binary would (its output goes to the test's
/// stdout).
pub async fn wasmctrl_cli(args: &[&str]) -> anyhow::Result<()> {
    let mut all = vec!["wasmctrl"];
    all.extend_from_slice(args);
    <wasmctrl::cli::Cli as clap::Parser>::try_parse_from(all)?
        .run()
        .await
}

/// Run the pinned cosign with `args` in `dir` (its home too), with an empty key password and
/// no transparency log reachable; what it printed, or an error with it.
pub fn cosign(dir: &std::path::Path, args: &[&str]) -> anyhow::Result<String> {
    let output = std::process::Command::new(wasmctrl_testenv::signing::cosign()?)
        .current_dir(dir)
        .args(args)
        .env("COSIGN_PASSWORD", "")
        .env("HOME", dir)
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    anyhow::ensure!(output.status.success(), "cosign {args:?} failed: {text}");
    Ok(text)
}
