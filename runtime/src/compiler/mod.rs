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
//! loads a cached one. `bounds` says what the child may take, `process` runs it, and
//! `in_process` compiles here.
//!
//! The child process is Linux only, as every bound it relies on is: `/proc/self/exe`,
//! `oom_score_adj`, and an `RLIMIT_DATA` that covers `mmap` (macOS does not enforce it).
//! Elsewhere — a workstation trying the host — [`Compiler::Child`] compiles in process,
//! unbounded, and says so once in the log.

mod bounds;
mod in_process;
#[cfg(target_os = "linux")]
mod process;

use std::process::ExitCode;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};

pub use bounds::{COMPILE_CHILD_ARG, ChildCompiler};
pub(crate) use in_process::compile_config;
use in_process::compile_here;

use super::error::LoadError;

/// Whether this executable's `main` called [`compile_child_if_asked`], so that it would serve
/// as its own compiler.
static SERVES_COMPILES: AtomicBool = AtomicBool::new(false);

/// Why a [`Compiler::Child`] compiles in process after all: logged once.
#[cfg(target_os = "linux")]
const IN_PROCESS_INSTEAD: &str = "this executable cannot compile plugins in a child process (its main does not call compile_child_if_asked); compiling them in process, without the compile's memory and time bounds";
#[cfg(not(target_os = "linux"))]
const IN_PROCESS_INSTEAD: &str = "compiling plugins in process, without the compile's memory and time bounds: the bounded compiler process is Linux only";

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
    /// harness running the host as a library), and on any system but Linux, plugins are
    /// compiled in process, with a warning.
    Child(ChildCompiler),
}

impl Compiler {
    /// Compile `bytes` (already known to be a component) into an artifact for an engine of
    /// [`compile_config`]'s settings.
    pub(crate) fn artifact(&self, bytes: &[u8]) -> Result<Vec<u8>, LoadError> {
        match self {
            #[cfg(target_os = "linux")]
            Self::Child(bounds) if SERVES_COMPILES.load(Ordering::Relaxed) => {
                process::compile(bytes, bounds)
            }
            Self::Child(_) => {
                static WARNED: Once = Once::new();
                WARNED.call_once(|| tracing::warn!("{IN_PROCESS_INSTEAD}"));
                compile_here(bytes)
            }
            Self::InProcess => compile_here(bytes),
        }
    }
}

/// If this process was started as a plugin compiler ([`COMPILE_CHILD_ARG`] is its first
/// argument, its memory bound in bytes the second), compile and return the exit code `main`
/// should return; `None` otherwise (and always `None` outside Linux, where no compiler process
/// is started).
///
/// Every executable that runs a [`PluginEngine`](super::engine::PluginEngine) with
/// [`Compiler::Child`] calls this first thing in `main`.
pub fn compile_child_if_asked() -> Option<ExitCode> {
    SERVES_COMPILES.store(true, Ordering::Relaxed);
    #[cfg(target_os = "linux")]
    return process::serve_if_asked();
    #[cfg(not(target_os = "linux"))]
    None
}
