//! The compiler process (Linux only): how the host starts one, bounds it and reads its
//! answer, and what the process does when it is one. See the parent module for why.

use std::ffi::OsString;
use std::io::{Read as _, Write as _};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use super::bounds::{COMPILE_CHILD_ARG, ChildCompiler};
use super::in_process::compile_here;
use crate::error::LoadError;

/// The child's exit code for a component wasmtime cannot compile (its reason on stderr).
const INVALID_COMPONENT_EXIT: i32 = 3;

/// At most this much of the child's stderr goes into an error message.
const STDERR_KEPT: u64 = 4 << 10;

/// Compile `bytes` in a child process of this executable, within `bounds`.
pub(super) fn compile(bytes: &[u8], bounds: &ChildCompiler) -> Result<Vec<u8>, LoadError> {
    let started = Instant::now();
    let mut child = Command::new("/proc/self/exe")
        .arg(COMPILE_CHILD_ARG)
        .arg(bounds.max_memory_bytes.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| LoadError::Sandbox(format!("starting the plugin compiler process: {e}")))?;
    let pid = child.id();
    let (stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
    let (outcome, artifact, said) = std::thread::scope(|scope| {
        scope.spawn(move || {
            // A child that died early closes the pipe: its exit status says why.
            if let Some(mut stdin) = stdin {
                let _ = stdin.write_all(bytes);
            }
        });
        let artifact = scope.spawn(move || {
            let mut artifact = Vec::new();
            if let Some(mut out) = stdout {
                let _ = out.read_to_end(&mut artifact);
            }
            artifact
        });
        let said = scope.spawn(move || {
            let mut said = Vec::new();
            if let Some(mut err) = stderr {
                let _ = (&mut err).take(STDERR_KEPT).read_to_end(&mut said);
                // Drain the rest, or a chatty child would block on a full pipe.
                let _ = std::io::copy(&mut err, &mut std::io::sink());
            }
            String::from_utf8_lossy(&said).into_owned()
        });
        let outcome = wait_until(pid, started + bounds.timeout);
        (
            outcome,
            artifact.join().unwrap_or_default(),
            said.join().unwrap_or_default(),
        )
    });
    let said = said.trim();
    let outcome = outcome
        .map_err(|e| LoadError::Sandbox(format!("waiting for the plugin compiler process: {e}")))?;
    match outcome {
        Ended::Exited { code: 0, .. } if !artifact.starts_with(b"\x7fELF") => {
            Err(LoadError::Sandbox(format!(
                "the plugin compiler process answered with something other than an artifact ({} bytes)",
                artifact.len()
            )))
        }
        Ended::Exited { code: 0, peak_rss } => {
            tracing::info!(
                seconds = started.elapsed().as_secs_f64(),
                peak_rss_mib = peak_rss >> 20,
                artifact_bytes = artifact.len(),
                "compiled a plugin in a child process"
            );
            Ok(artifact)
        }
        Ended::Exited {
            code: INVALID_COMPONENT_EXIT,
            ..
        } => Err(LoadError::InvalidComponent(said.to_owned())),
        Ended::TimedOut => Err(LoadError::CompileLimitExceeded(format!(
            "compiling took longer than {} s",
            bounds.timeout.as_secs_f64()
        ))),
        Ended::Signalled(libc::SIGABRT) if said.contains("memory allocation") => {
            Err(LoadError::CompileLimitExceeded(format!(
                "compiling needed more than {} MiB of memory",
                bounds.max_memory_bytes >> 20
            )))
        }
        Ended::Signalled(libc::SIGKILL) => Err(LoadError::CompileLimitExceeded(
            "the compiler process was killed (SIGKILL), most likely by the kernel's OOM \
                 killer: the host's memory limit cannot hold this compile beside the host"
                .to_owned(),
        )),
        Ended::Exited { code, .. } => Err(LoadError::Sandbox(format!(
            "the plugin compiler process exited with code {code}: {said}"
        ))),
        Ended::Signalled(signal) => Err(LoadError::Sandbox(format!(
            "the plugin compiler process died of signal {signal}: {said}"
        ))),
    }
}

/// How a compiler process ended.
enum Ended {
    Exited {
        code: i32,
        peak_rss: u64,
    },
    Signalled(i32),
    /// Killed by us at its deadline.
    TimedOut,
}

/// Wait for child `pid` to end, killing it at `deadline`, and reap it (with its peak RSS,
/// which `std::process::Child` does not report).
#[allow(unsafe_code)] // see the SAFETY comments inside
fn wait_until(pid: u32, deadline: Instant) -> std::io::Result<Ended> {
    let pid = libc::pid_t::try_from(pid).map_err(std::io::Error::other)?;
    let mut timed_out = false;
    loop {
        let mut status = 0;
        // SAFETY: `rusage` is plain data; all zeroes is a valid value.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        let flags = if timed_out { 0 } else { libc::WNOHANG };
        // SAFETY: wait4 writes only to the two locals it is given, and `pid` is our own
        // child, not yet reaped (std's `Child` is never waited on).
        let reaped = unsafe { libc::wait4(pid, &raw mut status, flags, &raw mut usage) };
        if reaped < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if error.raw_os_error() != Some(libc::ECHILD) {
                // Not reaped, so still ours: stop it, or its pipes would never close.
                // SAFETY: kill only sends a signal to our own unreaped child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            return Err(error);
        }
        if reaped == pid {
            return Ok(if timed_out {
                Ended::TimedOut
            } else if libc::WIFEXITED(status) {
                Ended::Exited {
                    code: libc::WEXITSTATUS(status),
                    peak_rss: u64::try_from(usage.ru_maxrss).unwrap_or(0) << 10,
                }
            } else {
                Ended::Signalled(libc::WTERMSIG(status))
            });
        }
        if Instant::now() >= deadline {
            // SAFETY: kill only sends a signal; `pid` is our unreaped child, so it cannot
            // name another process.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            timed_out = true;
            continue;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The compiler's side of [`super::compile_child_if_asked`]: serve a compile if the
/// arguments ask for one.
pub(super) fn serve_if_asked() -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    let first: Option<OsString> = args.next();
    if first.as_deref() != Some(COMPILE_CHILD_ARG.as_ref()) {
        return None;
    }
    let bound = args.next();
    Some(match serve_compile(bound) {
        Ok(()) => ExitCode::SUCCESS,
        Err(LoadError::InvalidComponent(reason)) => {
            eprintln!("{reason}");
            ExitCode::from(INVALID_COMPONENT_EXIT as u8)
        }
        Err(error) => {
            eprintln!("{error}");
            ExitCode::FAILURE
        }
    })
}

/// The child's side: bound itself, read the component, compile, write the artifact.
fn serve_compile(bound: Option<OsString>) -> Result<(), LoadError> {
    let failed = |what: &str, e: std::io::Error| LoadError::Sandbox(format!("{what}: {e}"));
    let bound = bound
        .and_then(|bound| bound.to_str()?.parse::<u64>().ok())
        .ok_or_else(|| {
            LoadError::Sandbox(format!(
                "usage: {COMPILE_CHILD_ARG} <memory bound in bytes> < component > artifact"
            ))
        })?;
    limit_own_memory(bound).map_err(|e| failed("bounding the compiler's memory", e))?;
    // First in line for the OOM killer; raising one's own score needs no privilege. If it
    // fails (no /proc), the bound above still holds.
    let _ = std::fs::write("/proc/self/oom_score_adj", "1000");
    let mut bytes = Vec::new();
    std::io::stdin()
        .read_to_end(&mut bytes)
        .map_err(|e| failed("reading the component", e))?;
    let artifact = compile_here(&bytes)?;
    drop(bytes);
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(&artifact)
        .and_then(|()| stdout.flush())
        .map_err(|e| failed("writing the artifact", e))
}

/// Bound the memory this process may map (`RLIMIT_DATA` covers the heap and private
/// mappings, which is where the allocator takes the compiler's memory from).
#[allow(unsafe_code)] // see the SAFETY comment inside
fn limit_own_memory(bytes: u64) -> std::io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    // SAFETY: setrlimit reads the local `limit` and changes only this process's limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_DATA, &raw const limit) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
