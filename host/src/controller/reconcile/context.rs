//! What one policy's reconciles share: who they act as, the caches they read, what serves
//! them, and the bookkeeping behind the policy's status and metrics.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Client;
use kube::core::ApiResource;
use kube::runtime::reflector::ObjectRef;

use crate::controller::cache::cached::CachedObject;
use crate::controller::cache::stores::{ChildCache, Related};
use crate::controller::reconcile::backoff::Backoff;
use crate::controller::reconcile::children::AllowedKind;
use crate::controller::reconcile::events::EventSink;
use crate::controller::reconcile::prune_guard::PruneGuard;
use crate::controller::reconcile::serving::Serving;
use crate::metrics::PolicyMetrics;
use crate::plugin::Digest;

/// Everything one policy's reconciles share: who they act as, the caches they read, the
/// plugins that decide, and what earlier reconciles ended with.
pub(crate) struct PolicyContext {
    pub client: Client,
    pub policy: String,
    /// Value of the policy label stamped on children.
    pub policy_label: String,
    /// Server-side apply field manager for children and status.
    pub field_manager: String,
    /// The finalizer this policy holds on parents, when it asks for one.
    pub finalizer: Option<String>,
    /// Becomes true once the policy carries its own finalizer and has recorded where it
    /// finalizes (`status.finalizedScopes`): no parent gets the finalizer before, so none can
    /// be stranded by a later edit or deletion.
    pub finalizers_ready: tokio::sync::watch::Receiver<bool>,
    pub parent: Arc<ApiResource>,
    pub resync: Duration,
    pub events: EventSink,
    /// The policy's own series.
    pub metrics: PolicyMetrics,
    /// Parents waiting for a reconcile, for `workqueue_depth`.
    pub queue: Arc<crate::controller::reconcile::queue::QueueGauge>,
    /// A standby reconciles nothing; its caches stay warm for a takeover.
    pub leadership: Arc<crate::leader::Leadership>,
    /// What the reconciles read.
    pub caches: Caches,
    /// What serves the policy's reconciles: all a hot swap touches.
    pub serving: Arc<Serving>,
    /// Holds a change's mass deletion for an admin to confirm.
    pub prune_guard: Arc<PruneGuard>,
    /// What earlier reconciles ended with.
    pub outcomes: Outcomes,
    /// What each parent's last decision was made on, noted by the policy's watches.
    pub decisions: Arc<crate::controller::reconcile::decisions::Decisions>,
    /// Where each reconcile leaves its record.
    pub explain: Arc<crate::explain::Explain>,
    /// What records and cases must not show.
    pub redaction: Arc<crate::case::Redaction>,
    /// When parents may have gone, so what is kept per parent is swept: the parent watch
    /// marks a deletion or a re-list, and a reconcile that ended after its parent went
    /// marks what it noted of it.
    pub parents_gone: Arc<crate::controller::cache::removals::Removals>,
}

/// The caches of a policy's parents, children and related objects.
pub(crate) struct Caches {
    /// The parents: a reconcile that ends after its parent went says so (see
    /// [`PolicyContext::parents_gone`]).
    pub parents: kube::runtime::reflector::Store<CachedObject>,
    /// The child kinds the policy allows, in the order of `children`.
    pub allowed: Vec<AllowedKind>,
    pub children: Vec<ChildCache>,
    /// In the order of the policy's `related`.
    pub related: Vec<Related>,
    /// Becomes true once every child and related cache has listed its objects.
    pub ready: tokio::sync::watch::Receiver<bool>,
    /// Fed per shard (see [`crate::controller::cache::per_shard`]): the shards whose parents
    /// and children the caches hold whole. What reads a parent's children from the caches
    /// to let one go waits for its shard to be in it.
    pub shards_whole:
        Option<tokio::sync::watch::Receiver<crate::controller::cache::per_shard::Whole>>,
}

impl Caches {
    /// Whether the caches hold `shard`'s parents and children whole: always, unless fed
    /// per shard.
    pub fn hold_whole(&self, shard: u32) -> bool {
        self.shards_whole
            .as_ref()
            .is_none_or(|whole| whole.borrow().contains_key(&shard))
    }

    /// Whether the caches hold every shard of `held` whole.
    pub fn hold_all_whole(&self, held: &std::collections::BTreeSet<u32>) -> bool {
        self.shards_whole.as_ref().is_none_or(|whole| {
            let whole = whole.borrow();
            held.iter().all(|shard| whole.contains_key(shard))
        })
    }
}

/// What a policy's reconciles ended with, for retries and the policy's counts.
pub(crate) struct Outcomes {
    /// Retry delays of the failing parents.
    pub backoff: Backoff<ObjectRef<CachedObject>>,
    /// Parents whose last reconcile succeeded, and the plugin that decided it.
    pub reconciled: Mutex<HashMap<ObjectRef<CachedObject>, Option<Digest>>>,
    /// Status writes the parents' cache has not shown yet.
    pub status_writes: crate::controller::cache::pending_writes::PendingWrites,
    /// Parents whose last reconcile failed in a way only a change can mend (a permanent
    /// error, an invalid parent): the resync leaves them alone, as their status says.
    pub awaiting_change: Mutex<HashSet<ObjectRef<CachedObject>>>,
}

impl Outcomes {
    /// No parent reconciled yet; failures back off from `base` to `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            backoff: Backoff::new(base, max),
            reconciled: Mutex::default(),
            status_writes: Default::default(),
            awaiting_change: Mutex::default(),
        }
    }
}
