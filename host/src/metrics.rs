//! The host's Prometheus metrics, named as controller-runtime names them where they mean the
//! same thing, so dashboards and alerts written for Go operators work unchanged.
//!
//! One [`Metrics`] per host, shared by every policy controller; each series is labelled with
//! the policy (`controller`). Encoding is the OpenMetrics text format that Prometheus scrapes.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// How a reconcile ended, as controller-runtime's `result` label spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReconcileResult {
    /// Succeeded; next run at the resync period.
    Success,
    /// Succeeded and asked to run again after a delay.
    RequeueAfter,
    /// Failed.
    Error,
}

impl ReconcileResult {
    fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::RequeueAfter => "requeue_after",
            Self::Error => "error",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    controller: String,
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabels {
    name: String,
}

/// Every metric the host exports.
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ResultLabels, Counter>,
    reconcile_errors: Family<ControllerLabels, Counter>,
    events_dropped: Family<ControllerLabels, Counter>,
    leader: Family<LeaseLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry holding the host's metrics, all at zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let reconciles = Family::<ResultLabels, Counter>::default();
        registry.register(
            "controller_runtime_reconcile",
            "Total number of reconciliations per controller",
            reconciles.clone(),
        );
        let reconcile_errors = Family::<ControllerLabels, Counter>::default();
        registry.register(
            "controller_runtime_reconcile_errors",
            "Total number of reconciliation errors per controller",
            reconcile_errors.clone(),
        );
        let events_dropped = Family::<ControllerLabels, Counter>::default();
        registry.register(
            "wasmctrl_plugin_events_dropped",
            "Events a plugin asked for that the host did not record (over the per-reconcile or per-parent cap)",
            events_dropped.clone(),
        );
        let leader = Family::<LeaseLabels, Gauge>::default();
        registry.register(
            "leader_election_master_status",
            "Whether this replica leads (1) or stands by (0), per Lease",
            leader.clone(),
        );
        Self {
            registry,
            reconciles,
            reconcile_errors,
            events_dropped,
            leader,
        }
    }

    /// Count one finished reconcile of `policy`.
    pub fn reconciled(&self, policy: &str, result: ReconcileResult) {
        self.reconciles
            .get_or_create(&ResultLabels {
                controller: policy.to_owned(),
                result: result.as_str(),
            })
            .inc();
        if result == ReconcileResult::Error {
            self.reconcile_errors
                .get_or_create(&ControllerLabels {
                    controller: policy.to_owned(),
                })
                .inc();
        }
    }

    /// Count plugin Events that were not recorded.
    pub fn events_dropped(&self, policy: &str, count: u64) {
        self.events_dropped
            .get_or_create(&ControllerLabels {
                controller: policy.to_owned(),
            })
            .inc_by(count);
    }

    /// Whether this replica holds the Lease `name`.
    pub fn set_leader(&self, name: &str, leading: bool) {
        self.leader
            .get_or_create(&LeaseLabels {
                name: name.to_owned(),
            })
            .set(i64::from(leading));
    }

    /// How many reconciles of `policy` ended with `result` so far.
    pub fn reconcile_count(&self, policy: &str, result: ReconcileResult) -> u64 {
        self.reconciles
            .get_or_create(&ResultLabels {
                controller: policy.to_owned(),
                result: result.as_str(),
            })
            .get()
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciles_are_counted_per_policy_and_result_with_errors_apart() {
        let metrics = Metrics::new();
        metrics.reconciled("a", ReconcileResult::Success);
        metrics.reconciled("a", ReconcileResult::Error);
        metrics.reconciled("b", ReconcileResult::RequeueAfter);
        assert_eq!(metrics.reconcile_count("a", ReconcileResult::Success), 1);
        assert_eq!(metrics.reconcile_count("a", ReconcileResult::Error), 1);
        assert_eq!(metrics.reconcile_count("b", ReconcileResult::Error), 0);
        let text = metrics.encode();
        assert!(
            text.contains(
                r#"controller_runtime_reconcile_total{controller="a",result="success"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"controller_runtime_reconcile_errors_total{controller="a"} 1"#),
            "{text}"
        );
    }
}
