//! Run the host's image the way a kubelet runs a Pod's container, with runc from Debian's
//! packages: the image's layers as a read-only root, the image's non-root user, no
//! capabilities, the ServiceAccount token, CA and namespace at
//! `/var/run/secrets/kubernetes.io/serviceaccount`, `KUBERNETES_SERVICE_HOST`/`PORT`, and a
//! tmpfs where the chart mounts its `emptyDir`.
//!
//! The one difference from a Pod: the container shares the host's network namespace, so it
//! reaches the local API server on loopback (a Pod reaches it through the `kubernetes`
//! Service). crun is not used because it refuses this machine's hybrid cgroup layout.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

/// Where a Pod finds its ServiceAccount credentials.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// What the container is given, as a Pod spec would give it.
#[derive(Debug, Clone)]
pub struct ContainerSpec {
    /// The unpacked image.
    pub rootfs: PathBuf,
    /// The full command line (entrypoint first).
    pub args: Vec<String>,
    /// Environment, beyond what the image sets.
    pub env: Vec<(String, String)>,
    /// User and group the process runs as.
    pub user: u32,
    /// A directory holding `token`, `ca.crt` and `namespace`, mounted read-only.
    pub service_account: PathBuf,
    /// Writable tmpfs mounts (the chart's `emptyDir`s), owned by `user`.
    pub scratch: Vec<String>,
    /// Read-only bind mounts: (host path, container path).
    pub binds: Vec<(PathBuf, String)>,
}

/// A running container; killed and deleted when dropped.
pub struct Container {
    id: String,
    child: Option<Child>,
    /// stdout and stderr of the container.
    pub log: PathBuf,
    _bundle: tempfile::TempDir,
}

/// runc, installed from Debian's packages if missing.
fn runc() -> anyhow::Result<&'static str> {
    if Command::new("runc").arg("--version").output().is_err() {
        crate::tools::debian_package("runc", "the OCI runtime the image tests run it with")?;
    }
    Ok("runc")
}

impl Container {
    /// Start a container named `id` from `spec`.
    pub fn start(id: &str, spec: &ContainerSpec) -> anyhow::Result<Self> {
        let runc = runc()?;
        let bundle = tempfile::tempdir()?;
        std::fs::write(
            bundle.path().join("config.json"),
            serde_json::to_vec_pretty(&runtime_config(spec))?,
        )?;
        let log = bundle.path().join("container.log");
        let out = std::fs::File::create(&log)?;
        let child = Command::new(runc)
            .args(["run", "--bundle"])
            .arg(bundle.path())
            .arg(id)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting runc")?;
        Ok(Self {
            id: id.to_owned(),
            child: Some(child),
            log,
            _bundle: bundle,
        })
    }

    /// Send `signal` (e.g. `TERM`, `KILL`) to the container's process.
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let status = Command::new("runc")
            .args(["kill", &self.id, signal])
            .status()?;
        if !status.success() {
            bail!("runc kill {} {signal} failed ({status})", self.id);
        }
        Ok(())
    }

    /// The container process's pid on the host.
    pub fn pid(&self) -> anyhow::Result<u32> {
        let output = Command::new("runc").args(["state", &self.id]).output()?;
        let state: Value = serde_json::from_slice(&output.stdout)
            .with_context(|| format!("runc state {}", self.id))?;
        state["pid"]
            .as_u64()
            .and_then(|pid| u32::try_from(pid).ok())
            .context("runc state has no pid")
    }

    /// Wait up to `within` for the container to exit; its exit status.
    pub fn wait(&mut self, within: Duration) -> anyhow::Result<ExitStatus> {
        let child = self.child.as_mut().context("already waited for")?;
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(status);
            }
            if started.elapsed() > within {
                bail!("container {} did not exit within {within:?}", self.id);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What the container printed so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("runc")
            .args(["kill", &self.id, "KILL"])
            .stderr(Stdio::null())
            .status();
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
        let _ = Command::new("runc")
            .args(["delete", "--force", &self.id])
            .stderr(Stdio::null())
            .status();
    }
}

/// The OCI runtime config: runc's defaults, minus the network namespace and every
/// capability, with the Pod's mounts.
fn runtime_config(spec: &ContainerSpec) -> Value {
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
        json!({"destination": SERVICE_ACCOUNT_DIR, "type": "bind",
               "source": spec.service_account, "options": ["rbind", "ro"]}),
    ];
    for path in &spec.scratch {
        mounts.push(json!({"destination": path, "type": "tmpfs", "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=0700", format!("uid={}", spec.user), format!("gid={}", spec.user)]}));
    }
    for (source, destination) in &spec.binds {
        mounts.push(
            json!({"destination": destination, "type": "bind", "source": source,
            "options": ["rbind", "ro"]}),
        );
    }
    let mut env = vec!["PATH=/usr/local/bin".to_owned()];
    env.extend(spec.env.iter().map(|(k, v)| format!("{k}={v}")));
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": spec.user, "gid": spec.user},
            "args": spec.args,
            "env": env,
            "cwd": "/",
            "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []},
            "noNewPrivileges": true,
        },
        "root": {"path": spec.rootfs, "readonly": true},
        "hostname": "wasmctrl",
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
            "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    })
}

/// Write the files a kubelet projects into a Pod for its ServiceAccount.
pub fn service_account_files(
    dir: &Path,
    token: &str,
    ca_crt: &[u8],
    namespace: &str,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("token"), token)?;
    std::fs::write(dir.join("ca.crt"), ca_crt)?;
    std::fs::write(dir.join("namespace"), namespace)?;
    Ok(())
}
