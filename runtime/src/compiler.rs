//! Where a plugin that is not in the artifact cache gets compiled: in this process, or in a
//! child process with a memory bound and a deadline of its own.
//!
//! Compiling is the one thing a plugin makes the host do that its call limits do not bound.
//! Cranelift's working memory grows with the component: ~40 MiB for the 0.64 MB Rust MyApp,
//! ~340 MiB for the 18.8 MB Python one, and more for a component made to be hard to
//! compile. In the host's own process that memory would be added to a host already holding
//! every cache, and a compile past the pod's memory limit would kill the host — every policy
//! with it, again at each restart, as the policy is still there. In a child process the
//! compile cannot take more than [`ChildCompiler::max_memory_bytes`] (`RLIMIT_DATA`) or run
//! past [`ChildCompiler::timeout`], and it volunteers to the kernel's OOM killer
//! (`oom_score_adj` 1000), so if the pod runs out of memory the compile goes, not the host.
//! Any of those fails that one load, and a policy that had a plugin keeps it.
//!
//! The child is this very executable (`/proc/self/exe`: the file the host runs from, even if
//! it was replaced on disk since), started with [`COMPILE_CHILD_ARG`]; its `main` hands
//! control to [`compile_child_if_asked`] before anything else. It reads the component on
//! stdin and writes wasmtime's serialized artifact on stdout, which the host loads as it
//! loads a cached one.

use std::ffi::OsString;
use std::io::{Read as _, Write as _};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use wasmtime::{Config, Engine};

use super::error::LoadError;

/// The first argument that makes an executable a plugin compiler (see
/// [`compile_child_if_asked`]).
pub const COMPILE_CHILD_ARG: &str = "__wasmctrl-compile-plugin";

/// The child's exit code for a component wasmtime cannot compile (its reason on stderr).
const INVALID_COMPONENT_EXIT: i32 = 3;

/// Whether this executable's `main` called [`compile_child_if_asked`], so that it would serve
/// as its own compiler.
static SERVES_COMPILES: AtomicBool = AtomicBool::new(false);

/// At most this much of the child's stderr goes into an error message.
const STDERR_KEPT: u64 = 4 << 10;

/// How a [`PluginEngine`](super::engine::PluginEngine) compiles a plugin the artifact cache does not
/// hold.
#[derive(Debug, Clone, Default)]
pub enum Compiler {
    /// In this process, on an engine of its own (dropped when the compile ends). For one-shot
    /// tools and tests; a long-running host should use [`Compiler::Child`].
    #[default]
    InProcess,
    /// In a child process of this executable, bounded (see the module docs). The program's
    /// `main` must call [`compile_child_if_asked`] first; in one that does not (a test
    /// harness running the host as a library) plugins are compiled in process, with a
    /// warning.
    Child(ChildCompiler),
}

/// Bounds of a compile in a child process.
#[derive(Debug, Clone)]
pub struct ChildCompiler {
    /// The most memory the compile may map (`RLIMIT_DATA`, virtual: a little above what
    /// it touches).
    pub max_memory_bytes: u64,
    /// The longest the compile may run before it is killed.
    pub timeout: Duration,
}

impl Default for ChildCompiler {
    /// 1 GiB and 5 minutes: room for the largest plugin the host accepts (64 MiB; the 18.8 MB
    /// Python MyApp needs ~340 MiB) on a slow node.
    fn default() -> Self {
        Self {
            max_memory_bytes: 1 << 30,
            timeout: Duration::from_secs(300),
        }
    }
}

impl Compiler {
    /// Compile `bytes` (already known to be a component) into an artifact for an engine of
    /// [`compile_config`]'s settings.
    pub(crate) fn artifact(&self, bytes: &[u8]) -> Result<Vec<u8>, LoadError> {
        match self {
            Self::Child(child) if SERVES_COMPILES.load(Ordering::Relaxed) => child.compile(bytes),
            Self::Child(_) => {
                static WARNED: Once = Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        "this executable cannot compile plugins in a child process (its main does not call compile_child_if_asked); compiling them in process, without the compile's memory and time bounds"
                    );
                });
                compile_here(bytes)
            }
            Self::InProcess => compile_here(bytes),
        }
    }
}

/// What compiled code depends on: the settings an artifact must have been compiled with for
/// this host to run it. The engine that runs plugins adds how instances are allocated, which
/// compiled code does not depend on, so a plain engine of these settings can compile for it.
pub(crate) fn compile_config() -> Config {
    let mut config = Config::new();
    config.wasm_component_model(true).epoch_interruption(true);
    config
}

/// Compile on a throwaway engine of the host's compilation settings, on one thread.
///
/// wasmtime's compiler keeps its per-thread working state (register allocator arenas, code
/// buffers: ~10 MiB for a 600 KB component) for as long as its engine lives; a host compiles
/// rarely and runs for weeks, so that state goes with the engine when the compile ends. One
/// thread: a compile on each core would hold one set of that state per core, for work that is
/// rare and off the reconcile path.
fn compile_here(bytes: &[u8]) -> Result<Vec<u8>, LoadError> {
    let mut config = compile_config();
    config.parallel_compilation(false);
    let compiler = Engine::new(&config)
        .map_err(|e| LoadError::Sandbox(format!("starting the plugin compiler: {e:#}")))?;
    compiler
        .precompile_component(bytes)
        .map_err(|e| LoadError::InvalidComponent(format!("{e:#}")))
}

impl ChildCompiler {
    fn compile(&self, bytes: &[u8]) -> Result<Vec<u8>, LoadError> {
        let started = Instant::now();
        let mut child = Command::new("/proc/self/exe")
            .arg(COMPILE_CHILD_ARG)
            .arg(self.max_memory_bytes.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                LoadError::Sandbox(format!("starting the plugin compiler process: {e}"))
            })?;
        let pid = child.id();
        let (stdin, stdout, stderr) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take());
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
            let outcome = wait_until(pid, started + self.timeout);
            (
                outcome,
                artifact.join().unwrap_or_default(),
                said.join().unwrap_or_default(),
            )
        });
        let said = said.trim();
        let outcome = outcome.map_err(|e| {
            LoadError::Sandbox(format!("waiting for the plugin compiler process: {e}"))
        })?;
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
                self.timeout.as_secs_f64()
            ))),
            Ended::Signalled(libc::SIGABRT) if said.contains("memory allocation") => {
                Err(LoadError::CompileLimitExceeded(format!(
                    "compiling needed more than {} MiB of memory",
                    self.max_memory_bytes >> 20
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

/// If this process was started as a plugin compiler ([`COMPILE_CHILD_ARG`] is its first
/// argument, its memory bound in bytes the second), compile and return the exit code `main`
/// should return; `None` otherwise.
///
/// Every executable that runs a [`PluginEngine`](super::engine::PluginEngine) with
/// [`Compiler::Child`] calls this first thing in `main`.
pub fn compile_child_if_asked() -> Option<ExitCode> {
    SERVES_COMPILES.store(true, Ordering::Relaxed);
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
