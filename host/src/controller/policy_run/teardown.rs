//! Teardown in reverse order. A child that other children of its parent depend on carries
//! [`TEARDOWN_FINALIZER`] (stamped when it is applied), so whoever deletes it — the garbage
//! collector after the parent is gone, or the host's prune — finds it held. This task, one
//! per running policy and active on the leader only, lets it go once no child of the same
//! parent that depends on it is left.
//!
//! It reads the order from the children as stored (their `wasmctrl.dev/depends-on`
//! annotations), never from the plugin, so teardown keeps its order when the parent is
//! already gone and when the plugin is broken, missing or rolled back. A child whose
//! dependents are still there past the policy's `teardownTimeoutSeconds` is reported (a
//! Warning Event on it and a log line), and keeps waiting: a blocked wave is never skipped.
//!
//! It is woken by the child watches (a child being deleted, or a child that depends on
//! others changing or going) for that child's parent, and sweeps every child being deleted
//! every [`SWEEP`] and whenever leadership changes, which also catches what a restart or a
//! takeover missed. On a sharded host, a parent's children are let go by the holder of the
//! parent's shard, fenced as its reconciles are, and every shard gained is swept.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Resource as _;
use kube::runtime::events::EventType;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::controller::cache::cached::CachedObject;
use crate::controller::cache::store_index::controller_uid;
use crate::controller::cache::stores::ChildCache;
use crate::controller::labels::{DEPENDS_ON_ANNOTATION, TEARDOWN_FINALIZER};
use crate::controller::policy_run::release::remove_finalizer;
use crate::controller::reconcile::children::order;
use crate::controller::reconcile::context::PolicyContext;

/// How often every child being deleted is looked at again: what reports a blocked teardown
/// once its timeout has passed, and catches a wake-up lost to a restart.
pub(crate) const SWEEP: Duration = Duration::from_secs(30);

/// How long a child may wait for its dependents, while being deleted, before it is
/// reported, when the policy does not say.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Wakes the teardown task for a parent (by uid).
pub(crate) type Wake = mpsc::UnboundedSender<String>;

/// Whether an event on `child` may let a sibling go, or hold one: it is being deleted, or
/// it depends on others (so its change or deletion may free them).
pub(crate) fn concerns(child: &CachedObject) -> bool {
    // The cache holds annotations as text; a mention of the key is enough to look (a
    // value that merely mentions it costs one look, nothing more).
    child.metadata.deletion_timestamp.is_some()
        || child
            .annotations_text()
            .is_some_and(|annotations| annotations.contains(DEPENDS_ON_ANNOTATION))
}

/// Whether `child` is being deleted and held for its dependents.
fn held(child: &CachedObject) -> bool {
    child.metadata.deletion_timestamp.is_some()
        && child
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|finalizers| finalizers.iter().any(|f| f == TEARDOWN_FINALIZER))
}

/// One policy's teardown task.
pub(crate) struct Teardown {
    ctx: Arc<PolicyContext>,
    wake: mpsc::UnboundedReceiver<String>,
    /// The policy's `teardownTimeoutSeconds`.
    timeout: Duration,
    /// Children (by uid) already reported as blocked: once each.
    reported: HashSet<String>,
}

impl Teardown {
    /// The teardown of `policy`, whose reconciles share `ctx`, woken through `wake`.
    pub fn new(
        ctx: Arc<PolicyContext>,
        wake: mpsc::UnboundedReceiver<String>,
        policy: &crate::policy::ReconcilePolicy,
    ) -> Self {
        let timeout = policy
            .spec
            .teardown_timeout_seconds
            .map_or(DEFAULT_TIMEOUT, |s| Duration::from_secs(u64::from(s)));
        Self {
            ctx,
            wake,
            timeout,
            reported: HashSet::new(),
        }
    }

    /// Run until the policy's watches end.
    pub async fn run(mut self) {
        let mut ready = self.ctx.caches.ready.clone();
        if ready.wait_for(|ready| *ready).await.is_err() {
            return;
        }
        let mut leading = self.ctx.leadership.subscribe();
        // A sharded host looks again at each shard it gains: its parents' teardowns are its own now.
        let mut gained = self
            .ctx
            .leadership
            .shards()
            .map(|shards| shards.subscribe());
        let shard_gained = async |gained: &mut Option<tokio::sync::watch::Receiver<_>>| match gained
        {
            Some(gained) => gained.changed().await,
            None => std::future::pending().await,
        };
        // Fed per shard, a shard's teardowns wait for its caches to be whole.
        let mut whole = self.ctx.caches.shards_whole.clone();
        let shard_whole = async |whole: &mut Option<tokio::sync::watch::Receiver<_>>| match whole {
            Some(whole) => whole.changed().await,
            None => std::future::pending().await,
        };
        let mut sweep = tokio::time::interval(SWEEP);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                woken = self.wake.recv() => {
                    let Some(uid) = woken else { return };
                    let mut parents = BTreeSet::from([uid]);
                    while let Ok(uid) = self.wake.try_recv() {
                        parents.insert(uid);
                    }
                    for parent in parents {
                        self.release(&parent).await;
                    }
                }
                _ = sweep.tick() => self.sweep().await,
                Ok(()) = leading.changed() => self.sweep().await,
                Ok(()) = shard_gained(&mut gained) => self.sweep().await,
                Ok(()) = shard_whole(&mut whole) => self.sweep().await,
            }
        }
    }

    /// Look at the children of every parent that has one being deleted and held.
    async fn sweep(&mut self) {
        let parents: BTreeSet<String> = self
            .ctx
            .caches
            .children
            .iter()
            .flat_map(|cache| cache.store.state())
            .filter(|child| held(child))
            .filter_map(|child| controller_uid(child.as_ref()))
            .collect();
        for parent in parents {
            self.release(&parent).await;
        }
    }

    /// Let go of each child of the parent `uid` that is being deleted, held, and that no
    /// sibling still there depends on; report those blocked past the timeout.
    async fn release(&mut self, uid: &str) {
        let ctx = self.ctx.clone();
        let children = children_of(&ctx.caches.children, uid);
        if !children.iter().any(|(_, child)| held(child)) {
            return;
        }
        match ctx.leadership.shards() {
            None if ctx.leadership.is_leader() => self.release_children(&children).await,
            None => {}
            // Sharded: the holder of the parent's shard, fenced as its reconciles are.
            Some(shards) => {
                // Only once the caches hold all its children: one not yet listed would
                // look like no dependent at all.
                let shard = shards.shard_of(uid);
                if !ctx.caches.hold_whole(shard) {
                    return;
                }
                if let Some(writing) = shards.start_writing(shard) {
                    crate::shards::write_for(writing, self.release_children(&children)).await;
                }
            }
        }
    }

    /// [`release`](Self::release) for one parent's `children`, as this replica may write.
    async fn release_children(&mut self, children: &[(usize, Arc<CachedObject>)]) {
        let ctx = self.ctx.clone();
        let caches = &ctx.caches.children;
        let values: Vec<Value> = children.iter().map(|(_, child)| child.to_value()).collect();
        for (position, (index, child)) in children.iter().enumerate() {
            if !held(child) {
                continue;
            }
            let value = &values[position];
            let kind = value["kind"].as_str().unwrap_or_default();
            let name = child.metadata.name.as_deref().unwrap_or_default();
            let siblings = values
                .iter()
                .enumerate()
                .filter(|(other, _)| *other != position)
                .map(|(_, sibling)| sibling);
            match order::dependent_of(kind, name, siblings) {
                None => {
                    if let Err(error) = self.let_go(&caches[*index], child).await {
                        tracing::warn!(policy = %self.ctx.policy, child = %format!("{kind} {name}"), error = %format!("{error:#}"), "could not release a child from the teardown order; will try again");
                    } else {
                        tracing::info!(policy = %self.ctx.policy, child = %format!("{kind} {name}"), "every child that depended on it is gone: released for deletion");
                    }
                }
                Some(dependent) => {
                    let reference = child.object_ref(&caches[*index].resource);
                    self.report_if_blocked(child, reference, &dependent).await;
                }
            }
        }
    }

    /// Remove the teardown finalizer from `child`, if it is still the object the cache
    /// showed and still holds it.
    async fn let_go(&self, cache: &ChildCache, child: &CachedObject) -> anyhow::Result<()> {
        let released = remove_finalizer(
            &self.ctx.client,
            &cache.resource,
            &child.metadata,
            TEARDOWN_FINALIZER,
        )
        .await;
        match released {
            // Changed since the cache showed it: the next event decides again.
            Err(kube::Error::Api(status)) if matches!(status.code, 409 | 422) => Ok(()),
            other => other.map(drop).map_err(Into::into),
        }
    }

    /// Report `child` once when it has waited for `dependent` longer than the timeout.
    async fn report_if_blocked(
        &mut self,
        child: &CachedObject,
        reference: ObjectReference,
        dependent: &order::ChildName,
    ) {
        let Some(since) = &child.metadata.deletion_timestamp else {
            return;
        };
        let waited = (jiff::Timestamp::now() - since.0).get_seconds().max(0);
        let uid = child.metadata.uid.clone().unwrap_or_default();
        if waited < i64::try_from(self.timeout.as_secs()).unwrap_or(i64::MAX)
            || !self.reported.insert(uid)
        {
            return;
        }
        let kind = reference.kind.as_deref().unwrap_or_default();
        let name = reference.name.as_deref().unwrap_or_default();
        let message = format!(
            "{kind} {name} has waited {waited} s to be deleted, longer than the policy's teardown timeout ({} s): {} {} still depends on it and is not gone; it keeps waiting",
            self.timeout.as_secs(),
            dependent.kind,
            dependent.name
        );
        tracing::warn!(policy = %self.ctx.policy, child = %format!("{kind} {name}"), dependent = %dependent, waited_seconds = waited, "teardown blocked");
        self.ctx
            .events
            .publish(
                &reference,
                EventType::Warning,
                "TeardownBlocked",
                "Teardown",
                message,
            )
            .await;
    }
}

/// The children of the parent `uid` in `caches`, each with its cache's position, one per
/// object (a resource served under two of the policy's kinds shows in both caches).
fn children_of(caches: &[ChildCache], uid: &str) -> Vec<(usize, Arc<CachedObject>)> {
    let mut seen = HashSet::new();
    caches
        .iter()
        .enumerate()
        .flat_map(|(index, cache)| {
            cache
                .by_controller
                .get(uid)
                .into_iter()
                .filter_map(|key| cache.store.get(&key))
                .map(move |child| (index, child))
                .collect::<Vec<_>>()
        })
        .filter(|(_, child)| seen.insert(child.metadata.uid.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn cached(value: Value) -> CachedObject {
        CachedObject::from_value(value).expect("an object")
    }

    #[test]
    fn deleting_children_and_dependents_concern_teardown() {
        let plain = cached(json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "a", "namespace": "n"}}));
        assert!(!concerns(&plain));
        assert!(!held(&plain));
        let dependent = cached(json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "app", "namespace": "n",
                "annotations": {DEPENDS_ON_ANNOTATION: "Job/migrate"}}}));
        assert!(concerns(&dependent));
        let deleting = cached(json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "migrate", "namespace": "n",
                "deletionTimestamp": "2026-12-06T10:00:00Z",
                "finalizers": [TEARDOWN_FINALIZER]}}));
        assert!(concerns(&deleting));
        assert!(held(&deleting));
    }
}
