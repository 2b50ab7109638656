//! wasmctrl: a Kubernetes operator host whose reconcile logic runs in sandboxed,
//! hot-swappable WebAssembly plugins.
//!
//! Data flows one way: policy → plugin registry → controller → cluster. This crate holds the
//! policy API ([`policy`]), the plugin [`registry`] over the plugin runtime ([`plugin`]), the
//! operator host ([`controller`]), its [`metrics`], [`health`] and [`leader`] election, their
//! HTTP [`server`], and the command line ([`cli`]).

pub mod case;
pub mod cli;
pub mod controller;
pub mod explain;
pub mod health;
pub mod leader;
pub mod metrics;
pub use wasmctrl_runtime as plugin;
pub mod policy;
pub mod registry;
pub mod server;
pub mod telemetry;
mod watch_backoff;
pub mod yaml;

/// The memory allocator the `wasmctrl` binary runs on (each binary that runs the host, as the
/// convergence benchmark does, declares it with `#[global_allocator]`). A host caching
/// tens of thousands of objects while reconciles allocate on every worker thread fragments
/// glibc's per-thread arenas: at 10,000 parents jemalloc held 21 MiB less and ran faster
/// (BENCHMARKS.md). It also spares the static (musl) image musl's own allocator.
pub type Allocator = tikv_jemallocator::Jemalloc;

/// Lock a mutex that only holds plain bookkeeping: a panic elsewhere cannot leave it
/// inconsistent, so poisoning is ignored.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
