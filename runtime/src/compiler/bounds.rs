//! What a compile in a child process may take, and the argument that asks an executable to
//! be that child.

use std::time::Duration;

/// The first argument that makes an executable a plugin compiler (see
/// [`compile_child_if_asked`](super::compile_child_if_asked)).
pub const COMPILE_CHILD_ARG: &str = "__wasmctrl-compile-plugin";

/// Bounds of a compile in a child process (Linux only; see the `compiler` module's docs).
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
