//! The work queue as `workqueue_depth` and `workqueue_adds_total` report it.
//!
//! kube-runtime keeps its scheduler private, so the host counts at the queue's edges: every
//! watch event, swap or takeover that reaches the controller adds its parent, and the start
//! of a reconcile takes it out. A parent asked for twice before it runs waits once, as in
//! client-go's queue. Timed requeues (a plugin's, a failure's backoff) are not seen until they
//! run; the resync, which the policy's timer enqueues, is counted when it comes due.
//!
//! What kube-runtime drops without a reconcile must leave the count too, or it grows for
//! ever: a parent deleted while it waited (taken out on its delete, and by a re-list that
//! no longer shows it), and a child's owner reference to a parent that does not exist (not
//! counted at all). A standby's reconciles start like the leader's and end at once, so they
//! take their parents out as well.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::metrics::PolicyMetrics;

/// A parent by namespace and name.
pub(crate) type ParentKey = (Option<String>, String);

/// The parents of one policy waiting for a reconcile.
pub(crate) struct QueueGauge {
    metrics: PolicyMetrics,
    waiting: Mutex<HashSet<ParentKey>>,
}

impl QueueGauge {
    pub fn new(metrics: PolicyMetrics) -> Self {
        Self {
            metrics,
            waiting: Mutex::default(),
        }
    }

    /// These parents were asked to reconcile.
    pub fn added(&self, parents: impl IntoIterator<Item = ParentKey>) {
        let mut waiting = crate::lock(&self.waiting);
        let mut added = 0;
        for parent in parents {
            added += 1;
            waiting.insert(parent);
        }
        self.metrics.queued(added, waiting.len());
    }

    /// A reconcile of this parent started, or the parent is gone: it no longer waits.
    pub fn started(&self, parent: &ParentKey) {
        let mut waiting = crate::lock(&self.waiting);
        if waiting.remove(parent) {
            self.metrics.set_queue_depth(waiting.len());
        }
    }

    /// The parents' watch re-listed: only the parents for which `exists` holds can still
    /// be reconciled.
    pub fn retain(&self, exists: impl Fn(&ParentKey) -> bool) {
        let mut waiting = crate::lock(&self.waiting);
        let before = waiting.len();
        waiting.retain(|parent| exists(parent));
        if waiting.len() != before {
            self.metrics.set_queue_depth(waiting.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use crate::metrics::Metrics;

    #[test]
    fn a_parent_asked_for_twice_waits_once_and_leaves_when_it_starts() {
        let metrics = Arc::new(Metrics::new());
        let queue = QueueGauge::new(metrics.policy("p"));
        let a: ParentKey = (Some("ns".into()), "a".into());
        let b: ParentKey = (Some("ns".into()), "b".into());
        queue.added([a.clone(), a.clone(), b.clone()]);
        let text = metrics.encode();
        assert!(
            text.contains(r#"workqueue_adds_total{name="p"} 3"#),
            "{text}"
        );
        assert!(text.contains(r#"workqueue_depth{name="p"} 2"#), "{text}");
        queue.started(&a);
        queue.started(&a);
        assert!(metrics.encode().contains(r#"workqueue_depth{name="p"} 1"#));
        queue.started(&b);
        assert!(metrics.encode().contains(r#"workqueue_depth{name="p"} 0"#));
    }

    #[test]
    fn a_relist_takes_out_the_parents_that_are_gone() {
        let metrics = Arc::new(Metrics::new());
        let queue = QueueGauge::new(metrics.policy("p"));
        let key = |name: &str| -> ParentKey { (Some("ns".into()), name.into()) };
        queue.added([key("kept"), key("gone")]);
        queue.retain(|parent| parent.1 == "kept");
        assert!(metrics.encode().contains(r#"workqueue_depth{name="p"} 1"#));
        queue.started(&key("kept"));
        assert!(metrics.encode().contains(r#"workqueue_depth{name="p"} 0"#));
    }
}
