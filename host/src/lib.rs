//! wasmctrl: a Kubernetes operator host whose reconcile logic runs in sandboxed,
//! hot-swappable WebAssembly plugins.
//!
//! Data flows one way: policy → plugin registry → controller → cluster. This crate holds the
//! policy API ([`policy`]), the plugin [`registry`] over the plugin runtime ([`plugin`]), the
//! operator host ([`controller`]), its [`metrics`], [`health`] and [`leader`] election, their
//! HTTP [`server`], and the command line ([`cli`]).

pub mod admission;
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
pub mod shards;
pub mod signing;
pub mod telemetry;
mod watch_backoff;
mod watch_lists;
pub mod yaml;

/// The memory allocator the `wasmctrl` binary runs on (each binary that runs the host, as the
/// convergence benchmark does, declares it with [`host_allocator!`]). A host caching
/// tens of thousands of objects while reconciles allocate on every worker thread fragments
/// glibc's per-thread arenas: at 10,000 parents jemalloc held 21 MiB less and ran faster
/// (BENCHMARKS.md). It also spares the static (musl) image musl's own allocator.
pub type Allocator = tikv_jemallocator::Jemalloc;

/// How the host names itself to the API servers and registries it talks to: in their audit
/// logs and request metrics, its requests are told apart from every other client's.
pub const USER_AGENT: &str = concat!("wasmctrl/", env!("CARGO_PKG_VERSION"));

/// `config`, with every request carrying the host's [`USER_AGENT`].
pub fn identified(mut config: kube::Config) -> kube::Config {
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(USER_AGENT),
    ));
    config
}

/// jemalloc's settings for the host, compiled in (`MALLOC_CONF` syntax). jemalloc's defaults
/// suit a server allocating on dozens of cores; a host reconciles on a few, and pays for
/// each arena (four per CPU by default) and for freed pages kept for ten seconds in its peak
/// memory. Two arenas, and freed pages returned after a second: at 10,000 parents the
/// peak RSS fell from 179 to 164 MiB (207 to 190 MiB in a restart's burst) at the same
/// reconcile rate (BENCHMARKS.md). `_RJEM_MALLOC_CONF` in the environment overrides them.
pub const ALLOCATOR_SETTINGS: &std::ffi::CStr = c"narenas:2,dirty_decay_ms:1000,muzzy_decay_ms:0";

/// Declare [`Allocator`], with [`ALLOCATOR_SETTINGS`], as the global allocator of the binary
/// it is invoked in (once, at the crate root).
#[macro_export]
macro_rules! host_allocator {
    () => {
        #[global_allocator]
        static ALLOCATOR: $crate::Allocator = $crate::Allocator {};

        // SAFETY: jemalloc reads this symbol once, at its first allocation, as a `const
        // char *` (which `Option<&c_char>` is laid out as); it points at a NUL-terminated
        // static string and nothing writes it.
        #[allow(unsafe_code, non_upper_case_globals)]
        #[unsafe(export_name = "_rjem_malloc_conf")]
        static malloc_conf: Option<&'static std::ffi::c_char> =
            Some(unsafe { &*$crate::ALLOCATOR_SETTINGS.as_ptr() });
    };
}

/// Pick rustls' ring provider for every TLS client and server of the host. Both ring and
/// aws-lc-rs end up in the dependency graph (kube uses ring; the OCI client and sigstore
/// bring aws-lc-rs), and rustls refuses to guess between them. Called before anything
/// builds a TLS client or server; public for tests and benchmarks that build their own.
pub fn ensure_crypto_provider() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        // An error means another provider was installed first, which works just as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Lock a mutex that only holds plain bookkeeping: a panic elsewhere cannot leave it
/// inconsistent, so poisoning is ignored.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
