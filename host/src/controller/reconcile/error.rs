//! What can fail in one reconcile, as one value per cause: each variant is one condition
//! reason, and its message says what to do next.

use crate::controller::cache::named_objects::ReadError;
use crate::controller::cache::related::RelatedLimit;
use crate::controller::reconcile::backoff::Retry;
use crate::controller::reconcile::children::InvalidChild;
use crate::plugin::{self, CallError};

/// A failed reconcile and when to retry it.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub(crate) struct Failure {
    #[source]
    pub error: ReconcileError,
    pub retry: Retry,
    /// Retrying cannot help until something the reconcile reads changes: wait for a watch
    /// event instead of a timer.
    pub await_change: bool,
}

/// What can fail in one reconcile. Each variant is one condition reason.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReconcileError {
    #[error("the parent has no {0}")]
    MalformedParent(&'static str),
    #[error("{0}")]
    Plugin(#[from] CallError),
    #[error("the plugin's answer was refused, nothing was changed: {}", describe(.0))]
    InvalidChildren(Vec<InvalidChild>),
    #[error(
        "{kind} {name} already exists and is not controlled by this parent ({owner}); wasmctrl never changes an object it does not own: delete or rename it, or let the plugin choose another name"
    )]
    ChildConflict {
        kind: String,
        name: String,
        /// Who does control it, in words.
        owner: String,
    },
    #[error("applying {kind} {name}: {source}")]
    Apply {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("pruning {kind} {name}: {source}")]
    Prune {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the parent's status: {0}")]
    Status(#[source] kube::Error),
    #[error("updating the parent's finalizers: {0}")]
    Finalizer(#[source] kube::Error),
    #[error(
        "the caches of the policy's kinds have not synced; the policy's Ready condition says which kind cannot be watched and why"
    )]
    CachesNotReady,
    #[error(
        "the policy has not yet recorded where it finalizes parents (its own finalizer and status.finalizedScopes); this parent gets the finalizer once it has"
    )]
    FinalizersNotReady,
    #[error("{0}")]
    Related(Box<ReadError>),
    #[error("{parent}: {limit}; nothing was written or pruned")]
    RelatedTooLarge {
        /// The parent, as messages name it.
        parent: String,
        limit: RelatedLimit,
    },
}

impl From<ReadError> for ReconcileError {
    fn from(error: ReadError) -> Self {
        Self::Related(Box::new(error))
    }
}

impl ReconcileError {
    /// The condition and Event reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::MalformedParent(_) => "MalformedParent",
            Self::Plugin(CallError::Reported { .. }) => "PluginReportedError",
            Self::Plugin(_) => "PluginFailed",
            Self::InvalidChildren(_) => "InvalidChildren",
            Self::ChildConflict { .. } => "ChildConflict",
            Self::Apply { .. } => "ApplyFailed",
            Self::Prune { .. } => "PruneFailed",
            Self::Status(_) => "StatusWriteFailed",
            Self::Finalizer(_) => "FinalizerFailed",
            Self::CachesNotReady => "CachesNotReady",
            Self::FinalizersNotReady => "FinalizersNotReady",
            Self::Related(_) => "RelatedReadFailed",
            Self::RelatedTooLarge { .. } => "RelatedTooLarge",
        }
    }

    /// Whether to wait for a change rather than retry with backoff. For a failed plugin
    /// call the runtime's retry class decides ([`CallError::retry`]: only a permanent or
    /// invalid-parent report waits), so the host and the runtime cannot disagree. A parent
    /// that asks for more related objects than a request carries asks for the same until it
    /// or a related object changes. Every other failure (the API server, a refused answer, a
    /// child conflict) is retried with backoff.
    pub fn awaits_change(&self) -> bool {
        match self {
            Self::Plugin(error) => error.retry() == plugin::Retry::AfterChange,
            Self::RelatedTooLarge { .. } => true,
            _ => false,
        }
    }
}

/// The first few refusals, joined; enough to act on without flooding a condition.
pub(crate) fn describe(problems: &[InvalidChild]) -> String {
    const SHOWN: usize = 3;
    let mut text = problems
        .iter()
        .take(SHOWN)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    if problems.len() > SHOWN {
        text.push_str(&format!("; and {} more", problems.len() - SHOWN));
    }
    text
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::plugin::ReportedKind;

    fn reported(kind: ReportedKind) -> ReconcileError {
        ReconcileError::Plugin(CallError::Reported {
            kind,
            message: "m".into(),
        })
    }

    #[test]
    fn only_permanent_and_invalid_parent_reports_wait_for_a_change() {
        assert!(reported(ReportedKind::Permanent).awaits_change());
        assert!(reported(ReportedKind::InvalidParent).awaits_change());
        assert!(!reported(ReportedKind::Transient).awaits_change());
        assert!(
            !ReconcileError::Plugin(CallError::DeadlineExceeded {
                timeout: Duration::from_secs(1)
            })
            .awaits_change()
        );
    }

    #[test]
    fn too_many_related_objects_wait_for_a_change_under_their_own_reason() {
        let error = ReconcileError::RelatedTooLarge {
            parent: "MyApp a/web".into(),
            limit: RelatedLimit::TooManyNames {
                kind: "ConfigMap".into(),
                path: "spec.refs".into(),
                count: 65,
            },
        };
        assert_eq!(error.reason(), "RelatedTooLarge");
        assert!(error.awaits_change());
        let message = error.to_string();
        assert!(
            message.starts_with("MyApp a/web: its spec.refs names 65 ConfigMap objects")
                && message.ends_with("nothing was written or pruned"),
            "{message}"
        );
    }

    #[test]
    fn a_trap_is_retried_with_backoff_and_a_permanent_report_waits_as_the_runtime_classes_them() {
        let trap = CallError::Trap {
            message: "unreachable".into(),
            plugin_said: Some("panicked at src/lib.rs".into()),
        };
        assert_eq!(trap.retry(), plugin::Retry::WithBackoff);
        assert!(!ReconcileError::Plugin(trap).awaits_change());

        let permanent = CallError::Reported {
            kind: ReportedKind::Permanent,
            message: "the spec can never work".into(),
        };
        assert_eq!(permanent.retry(), plugin::Retry::AfterChange);
        assert!(ReconcileError::Plugin(permanent).awaits_change());
    }
}
