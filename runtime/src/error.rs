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
        "plugin implements contract wasmctrl:plugin@{found}, but this host serves only @{} to @{supported}: rebuild the plugin with wasmctrl-plugin-sdk for contract {supported} (`wasmctrl plugin new` writes the SDK this host was built with), or run a wasmctrl that serves @{found}",
        crate::contract::CONTRACT_VERSIONS[0]
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
    /// The plugin does not serve the webhook asked for: its `served` export leaves it out,
    /// or it exports no webhooks at all (a plugin of contract 0.1.0, or one that implements
    /// none).
    #[error("the plugin does not serve the `{0}` webhook")]
    NotServed(&'static str),
    /// The caller asked something the contract does not allow (a default without the object
    /// being written); the plugin was not called.
    #[error("invalid plugin call: {0}")]
    InvalidRequest(String),
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
            Self::NotServed(_) => "not_served",
            Self::InvalidRequest(_) => "invalid_request",
        }
    }

    /// When to call again after a call failed this way. Every variant has exactly one class,
    /// decided here for every host, so the host's retries and this crate cannot disagree.
    ///
    /// The two mistakes cost differently: retrying a call that fails the same way every time
    /// costs one call per backoff period (the host doubles the delay up to its maximum,
    /// 5 minutes by default), while waiting for a change after a failure that would have
    /// cleared leaves the parent unreconciled until someone happens to touch it. And only
    /// the plugin knows whether its failure is deterministic. So a call waits for a change
    /// only on the plugin's own word, as the contract defines the two reports:
    /// - [`ReportedKind::Permanent`] and [`ReportedKind::InvalidParent`]:
    ///   [`Retry::AfterChange`], the same request would fail the same way.
    ///
    /// Everything else is [`Retry::WithBackoff`]:
    /// - [`ReportedKind::Transient`]: the plugin says it may clear by itself.
    /// - `Trap`: a plugin bug or an input it did not expect. The plugin said nothing about
    ///   the next call (a panic on something it reads intermittently traps once), and a
    ///   deterministic trap costs only the backoff's calls.
    /// - `DeadlineExceeded`: wall-clock time depends on the machine's load (and a tenant
    ///   that ran out of time runs at idle priority for a while), not only on the input.
    /// - `MemoryExceeded`, `OutputTooLarge`, `OutputCopyRefused`, `TooManyChildren`,
    ///   `InvalidOutput`: the plugin's answer broke a limit or the contract. Likely the same
    ///   next time, but the plugin did not say so, and as with a trap being wrong about it
    ///   would strand the parent.
    /// - `Sandbox`, `PoolExhausted`: the host failed around the call, not the plugin, and
    ///   capacity comes back as running calls end.
    ///
    /// `NotServed` and `InvalidRequest` are [`Retry::AfterChange`]: only another plugin
    /// serves the webhook, and the same request is refused the same way.
    pub fn retry(&self) -> Retry {
        match self {
            Self::Reported { kind, .. } => match kind {
                ReportedKind::Permanent | ReportedKind::InvalidParent => Retry::AfterChange,
                ReportedKind::Transient => Retry::WithBackoff,
            },
            Self::Trap { .. }
            | Self::DeadlineExceeded { .. }
            | Self::MemoryExceeded { .. }
            | Self::OutputTooLarge { .. }
            | Self::OutputCopyRefused { .. }
            | Self::TooManyChildren { .. }
            | Self::InvalidOutput(_)
            | Self::Sandbox(_)
            | Self::PoolExhausted(_) => Retry::WithBackoff,
            Self::NotServed(_) | Self::InvalidRequest(_) => Retry::AfterChange,
        }
    }
}

/// When a failed call is worth making again: the class [`CallError::retry`] gives each
/// failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// The same call may succeed later: call again after a delay that grows with each
    /// failure in a row.
    WithBackoff,
    /// The same call would fail the same way: call again only once the parent, its children
    /// or related objects, or the plugin change.
    AfterChange,
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::time::Duration;

    use super::*;

    /// The class every failure must have, decided once more, variant by variant: a new
    /// variant does not compile until it is decided here too (no wildcard), and the name
    /// lets the test below check that each decision has an example.
    fn pinned(error: &CallError) -> (&'static str, Retry) {
        match error {
            CallError::Trap { .. } => ("Trap", Retry::WithBackoff),
            CallError::DeadlineExceeded { .. } => ("DeadlineExceeded", Retry::WithBackoff),
            CallError::MemoryExceeded { .. } => ("MemoryExceeded", Retry::WithBackoff),
            CallError::OutputTooLarge { .. } => ("OutputTooLarge", Retry::WithBackoff),
            CallError::OutputCopyRefused { .. } => ("OutputCopyRefused", Retry::WithBackoff),
            CallError::TooManyChildren { .. } => ("TooManyChildren", Retry::WithBackoff),
            CallError::InvalidOutput(_) => ("InvalidOutput", Retry::WithBackoff),
            CallError::Reported {
                kind: ReportedKind::Transient,
                ..
            } => ("Reported(Transient)", Retry::WithBackoff),
            CallError::Reported {
                kind: ReportedKind::Permanent,
                ..
            } => ("Reported(Permanent)", Retry::AfterChange),
            CallError::Reported {
                kind: ReportedKind::InvalidParent,
                ..
            } => ("Reported(InvalidParent)", Retry::AfterChange),
            CallError::Sandbox(_) => ("Sandbox", Retry::WithBackoff),
            CallError::PoolExhausted(_) => ("PoolExhausted", Retry::WithBackoff),
            CallError::NotServed(_) => ("NotServed", Retry::AfterChange),
            CallError::InvalidRequest(_) => ("InvalidRequest", Retry::AfterChange),
        }
    }

    fn reported(kind: ReportedKind) -> CallError {
        CallError::Reported {
            kind,
            message: "m".into(),
        }
    }

    #[test]
    fn every_call_error_has_the_retry_class_the_host_acts_on() {
        let examples = [
            CallError::Trap {
                message: "unreachable".into(),
                plugin_said: None,
            },
            CallError::DeadlineExceeded {
                timeout: Duration::from_millis(500),
            },
            CallError::MemoryExceeded {
                limit_bytes: 1,
                requested_bytes: 2,
            },
            CallError::OutputTooLarge {
                size_bytes: 2,
                limit_bytes: 1,
            },
            CallError::OutputCopyRefused { limit_bytes: 1 },
            CallError::TooManyChildren { count: 2, limit: 1 },
            CallError::InvalidOutput("child #0 is not a JSON object".into()),
            reported(ReportedKind::Transient),
            reported(ReportedKind::Permanent),
            reported(ReportedKind::InvalidParent),
            CallError::Sandbox("the plugin call thread failed".into()),
            CallError::PoolExhausted("no room".into()),
            CallError::NotServed("validate"),
            CallError::InvalidRequest("no object".into()),
        ];
        let mut decided = BTreeSet::new();
        for error in &examples {
            let (name, class) = pinned(error);
            assert_eq!(error.retry(), class, "{name}: {error}");
            decided.insert(name);
        }
        assert_eq!(
            decided.len(),
            14,
            "an example of every decision: {decided:?}"
        );
    }

    #[test]
    fn only_the_plugins_word_waits_for_a_change() {
        // What users see and the end-to-end tests pin: a trap is retried, a permanent or
        // invalid-parent report waits.
        let trap = CallError::Trap {
            message: "unreachable".into(),
            plugin_said: Some("panicked".into()),
        };
        assert_eq!(trap.retry(), Retry::WithBackoff);
        assert_eq!(
            reported(ReportedKind::Transient).retry(),
            Retry::WithBackoff
        );
        assert_eq!(
            reported(ReportedKind::Permanent).retry(),
            Retry::AfterChange
        );
        assert_eq!(
            reported(ReportedKind::InvalidParent).retry(),
            Retry::AfterChange
        );
    }
}
