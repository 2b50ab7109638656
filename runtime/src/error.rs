use std::time::Duration;

use super::digest::Digest;

/// What can go wrong obtaining a plugin, before any call: verifying, compiling and
/// pre-instantiating it. Precise enough for the host to name the reason on the policy and for
/// a user to act on it.
///
/// Apart from [`CallError`] because a failed load is about a policy's plugin, not about one
/// parent's reconcile: the host reports it on the policy, and a policy that had a plugin
/// keeps serving it.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The bytes do not hash to the digest the policy pins.
    #[error("plugin digest mismatch: expected {expected}, the bytes hash to {actual}")]
    DigestMismatch {
        /// The digest the caller asked for.
        expected: Digest,
        /// The digest of the bytes received.
        actual: Digest,
    },
    /// Not a WebAssembly component, or one wasmtime cannot compile.
    #[error("not a valid plugin component: {0}")]
    InvalidComponent(String),
    /// Compiling the component needed more memory or time than the host allows a compile
    /// (`Compiler::Child`'s bounds), or the compiler process was killed for memory.
    #[error("the plugin could not be compiled within the host's limits: {0}")]
    CompileLimitExceeded(String),
    /// A component, but not one that implements the `wasmctrl:plugin` world.
    #[error("component does not implement the wasmctrl plugin world: {0}")]
    WrongWorld(String),
    /// Implements the contract, but a version this host does not serve.
    #[error(
        "plugin implements contract wasmctrl:plugin@{found}, but this host serves only @{supported}: rebuild the plugin with wasmctrl-plugin-sdk for contract {supported} (`wasmctrl plugin new` writes the SDK this host was built with), or run a wasmctrl that serves @{found}"
    )]
    ContractVersion {
        /// The version the plugin exports.
        found: String,
        /// The version this host serves.
        supported: &'static str,
    },
    /// The limits ask for more than the engine was configured to allow.
    #[error("invalid plugin limits: {0}")]
    InvalidLimits(String),
    /// The host failed around the plugin while loading it: the compiler could not be
    /// started or died, or the compiled artifact could not be brought into the engine. Not
    /// the plugin's fault as far as the host can tell, so the same load may succeed later.
    #[error("plugin sandbox failure: {0}")]
    Sandbox(String),
}

/// What can go wrong in one call of a loaded plugin, precise enough for the controller to
/// set the right condition and for a user to act on.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The plugin trapped (panic, unreachable, out-of-bounds access, exit, ...).
    #[error("plugin trapped: {message}{}", plugin_said.as_deref().map(|m| format!(" (plugin said: {m})")).unwrap_or_default())]
    Trap {
        /// What wasmtime reported.
        message: String,
        /// The plugin's last error-level message before the trap, such as a panic message.
        plugin_said: Option<String>,
    },
    /// The call ran past its wall-clock deadline and was interrupted.
    #[error("plugin exceeded its {}ms deadline", timeout.as_millis())]
    DeadlineExceeded {
        /// The configured deadline.
        timeout: Duration,
    },
    /// The plugin tried to grow its memory past the cap.
    #[error(
        "plugin exceeded its memory limit of {limit_bytes} bytes (asked for {requested_bytes})"
    )]
    MemoryExceeded {
        /// The configured cap.
        limit_bytes: usize,
        /// The size the plugin tried to grow to.
        requested_bytes: usize,
    },
    /// The response is bigger than allowed.
    #[error("plugin output is {size_bytes} bytes, over the limit of {limit_bytes}")]
    OutputTooLarge {
        /// Bytes returned.
        size_bytes: usize,
        /// The configured limit.
        limit_bytes: usize,
    },
    /// The plugin tried to hand the host more data in one call than its output limit allows
    /// (plus headroom for the answer's structure); the host stopped copying it.
    #[error(
        "plugin output exceeds the copy limit of {limit_bytes} bytes; the host stopped copying it"
    )]
    OutputCopyRefused {
        /// How much the host would copy.
        limit_bytes: usize,
    },
    /// More children than allowed.
    #[error("plugin returned {count} children, over the limit of {limit}")]
    TooManyChildren {
        /// Children returned.
        count: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The response is not what the contract promises (e.g. a child that is not a JSON object).
    #[error("plugin returned invalid output: {0}")]
    InvalidOutput(String),
    /// The plugin ran fine and reported that it could not decide.
    #[error("plugin reported {kind}: {message}")]
    Reported {
        /// How the host should treat it.
        kind: ReportedKind,
        /// The plugin's explanation.
        message: String,
    },
    /// The host failed around the call, not the plugin: the engine is shutting down or the
    /// call thread failed.
    #[error("plugin sandbox failure: {0}")]
    Sandbox(String),
    /// The instance pool had no room for this call (too many plugin instances at once).
    /// [`Plugin::reconcile_as`](super::plugin::Plugin::reconcile_as) waits and retries; only a
    /// caller that bypasses the call slots sees it.
    #[error("plugin sandbox failure: the instance pool is exhausted: {0}")]
    PoolExhausted(String),
}

/// The kinds of error a plugin can report, mirroring the contract's `reconcile-error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportedKind {
    /// The parent is malformed; retrying will not help until it changes.
    InvalidParent,
    /// May clear by itself; retry with backoff.
    Transient,
    /// Retrying will not help.
    Permanent,
}

impl std::fmt::Display for ReportedKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::InvalidParent => "invalid parent",
            Self::Transient => "a transient error",
            Self::Permanent => "a permanent error",
        })
    }
}

impl CallError {
    /// The outcome of a call that failed this way, as `wasmctrl_plugin_calls_total` labels it.
    pub fn outcome(&self) -> &'static str {
        match self {
            Self::Reported { .. } => "reported_error",
            Self::Trap { .. } => "trap",
            Self::DeadlineExceeded { .. } => "timeout",
            Self::MemoryExceeded { .. } => "out_of_memory",
            Self::OutputTooLarge { .. }
            | Self::OutputCopyRefused { .. }
            | Self::TooManyChildren { .. }
            | Self::InvalidOutput(_) => "invalid_output",
            Self::Sandbox(_) | Self::PoolExhausted(_) => "sandbox_error",
        }
    }

    /// True when retrying the same call could succeed (a deadline, a transient report or a
    /// sandbox hiccup); false when only a change to the parent or the plugin helps.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::DeadlineExceeded { .. }
                | Self::Sandbox(_)
                | Self::PoolExhausted(_)
                | Self::Reported {
                    kind: ReportedKind::Transient,
                    ..
                }
        )
    }
}
