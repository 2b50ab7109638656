//! The shard label on a sharded policy's parents, where the API server cannot narrow watches
//! by uid (its `ShardedListAndWatch` gate is off): each parent then carries
//! `wasmctrl.dev/uid-shard: <shard>-of-<count>`, the shard of its uid, and each replica
//! watches its shards' parents by that label, as it watches their children by theirs (see
//! [`super::shard_feeds`]).
//!
//! No one can set the label before the parent exists: its uid is given at creation, after
//! admission. So each replica watches the policy's parents that carry no label of this count
//! (their metadata only; in a steady state there are none) and labels those of the shards it
//! holds. That is one write per parent, once in its life, by the one replica holding its
//! shard: a shard moving writes nothing (a parent its new holder's cache holds labelled is
//! not labelled again), and a new shard count labels every parent once more. A parent
//! labelled wrong (by hand) reaches the watch of the shard its label names, which hands it
//! here ([`crate::controller::cache::per_shard::PerShard::misplaced`]) to be put right,
//! whoever holds its own shard: no other replica sees it. The label is a function of the
//! uid, so whoever writes it writes the same.
//!
//! The label is a merge patch naming the parent's uid, so it applies to the parent seen and
//! never to a successor of the same name (the API server refuses to change a uid). Until it
//! is labelled, a parent is in no replica's cache, and so is not reconciled.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject, PartialObjectMeta};
use kube::runtime::reflector::Store;
use kube::runtime::{WatchStreamExt as _, watcher};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::controller::cache::cached::CachedObject;
use crate::controller::cache::per_shard::Whole;
use crate::controller::cache::stores::object_ref;
use crate::controller::labels::{UID_SHARD_LABEL, shard_label_value};
use crate::controller::reconcile::lean_writes;
use crate::shards::ShardOwnership;
use crate::watch_backoff::WatchBackoff;

/// How soon a label that could not be written is tried again, the first time; the delay
/// doubles with each failure in a row, up to [`LONGEST_RETRY`].
const RETRY: Duration = Duration::from_secs(5);
const LONGEST_RETRY: Duration = Duration::from_secs(300);
/// How long a parent labelled may go on looking unlabelled (its watch behind the write)
/// before it is labelled again.
const LABELLED_GRACE: Duration = Duration::from_secs(60);
/// Labels written at once: enough to label a large collection quickly when sharding is
/// turned on, without crowding out the reconciles' writes.
const IN_FLIGHT: usize = 16;

/// A parent's place: namespace and name.
type Key = (Option<String>, String);

/// One parent: its place and its uid. A parent deleted and created again under the name is
/// another one, labelled on its own.
type Parent = (Key, String);

/// A parent whose label is missing or wrong, as a watch saw it.
#[derive(Debug, Clone)]
pub(crate) struct Unlabelled {
    pub namespace: Option<String>,
    pub name: String,
    pub uid: String,
}

impl Unlabelled {
    pub fn of(object: &impl kube::Resource) -> Option<Self> {
        let meta = object.meta();
        Some(Self {
            namespace: meta.namespace.clone(),
            name: meta.name.clone()?,
            uid: meta.uid.clone()?,
        })
    }

    fn parent(self) -> Parent {
        ((self.namespace, self.name), self.uid)
    }
}

/// What is known of one parent to label.
#[derive(Debug)]
struct Pending {
    shard: u32,
    /// Labelled wrong, rather than not at all: labelled whoever holds its shard, and
    /// forgotten once labelled (no watch tells when it is).
    misplaced: bool,
    /// Writes that failed in a row.
    failures: u32,
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// To label at this time (or now, if past).
    Due(Instant),
    Writing,
    /// Labelled then: the unlabelled parents' watch will drop it.
    Labelled(Instant),
}

/// The parents of one sharded policy that wait for their shard label, and the writes that
/// give it to them.
pub(crate) struct ParentLabels {
    client: Client,
    resource: Arc<ApiResource>,
    namespace: Option<String>,
    field_manager: String,
    ownership: Arc<ShardOwnership>,
    misplaced: mpsc::UnboundedReceiver<Unlabelled>,
    /// The policy's parents' cache: a parent it holds under the same uid is labelled already
    /// (it is cached only once its label names its own shard), or was until a moment ago
    /// (its watch will drop it).
    parents: Store<CachedObject>,
    /// The shards that cache holds whole: a shard's parents are labelled only once its
    /// cache holds those labelled already, so a shard taken over does not label again what
    /// its last holder labelled.
    whole: watch::Receiver<Whole>,
    pending: HashMap<Parent, Pending>,
    /// The parents that may be due now, to look at before anything else happens.
    ready: VecDeque<Parent>,
    /// Failures since the last one logged, and the last.
    failures: (usize, Option<String>),
}

/// The outcome of one label write: for which parent, and how it went.
type Written = (Parent, Result<(), kube::Error>);

impl ParentLabels {
    /// The labeller of the parents of `resource` (in `namespace`, or cluster-wide) that a
    /// policy acting through `client` reconciles, as `field_manager`, into the cache
    /// `parents`; `misplaced` brings the parents its shards' watches found labelled wrong.
    pub fn new(
        (client, resource, namespace): (Client, Arc<ApiResource>, Option<String>),
        (field_manager, parents, whole): (String, Store<CachedObject>, watch::Receiver<Whole>),
        ownership: Arc<ShardOwnership>,
        misplaced: mpsc::UnboundedReceiver<Unlabelled>,
    ) -> Self {
        Self {
            client,
            resource,
            namespace,
            field_manager,
            ownership,
            misplaced,
            parents,
            whole,
            pending: HashMap::new(),
            ready: VecDeque::new(),
            failures: (0, None),
        }
    }

    /// Label the parents that need it, for as long as the policy runs.
    pub async fn run(mut self) {
        let count = self.ownership.count();
        let api: Api<PartialObjectMeta<DynamicObject>> = match &self.namespace {
            Some(namespace) => {
                Api::namespaced_with(self.client.clone(), namespace, &*self.resource)
            }
            None => Api::all_with(self.client.clone(), &*self.resource),
        };
        let config = watcher::Config::default().labels(&unlabelled_selector(count));
        let mut unlabelled = watcher::watcher(api, config)
            .backoff(WatchBackoff::default())
            .boxed();
        let mut listing: Option<HashSet<Parent>> = None;
        let mut writes = FuturesUnordered::new();
        let mut misplaced_open = true;
        let mut tick = tokio::time::interval(RETRY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            self.start_due(&mut writes);
            tokio::select! {
                event = unlabelled.next() => match event {
                    Some(Ok(event)) => self.seen(event, &mut listing),
                    Some(Err(error)) => {
                        tracing::warn!(kind = %self.resource.kind, error = %error, "watching the parents without a shard label");
                    }
                    // The watch ends only with the policy.
                    None => return,
                },
                parent = self.misplaced.recv(), if misplaced_open => match parent {
                    Some(parent) => self.note(parent, true),
                    None => misplaced_open = false,
                },
                changed = self.whole.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    // A shard's cache whole: its parents waiting are due with it.
                    self.ready_all();
                }
                Some((parent, result)) = writes.next(), if !writes.is_empty() => {
                    self.written(parent, result);
                }
                _ = tick.tick() => {
                    self.ready_all();
                    self.log_failures();
                }
            }
        }
    }

    /// Take one event of the watch of the parents without a label of this count.
    fn seen(
        &mut self,
        event: watcher::Event<PartialObjectMeta<DynamicObject>>,
        listing: &mut Option<HashSet<Parent>>,
    ) {
        match event {
            watcher::Event::Init => *listing = Some(HashSet::new()),
            watcher::Event::InitApply(parent) | watcher::Event::Apply(parent) => {
                if let Some(parent) = Unlabelled::of(&parent) {
                    if let Some(listing) = listing.as_mut() {
                        listing.insert(parent.clone().parent());
                    }
                    self.note(parent, false);
                }
            }
            watcher::Event::InitDone => {
                // What the list did not bring was labelled or deleted while the watch was away.
                if let Some(listed) = listing.take() {
                    self.pending
                        .retain(|parent, pending| pending.misplaced || listed.contains(parent));
                }
            }
            // Labelled, or deleted.
            watcher::Event::Delete(parent) => {
                if let Some(parent) = Unlabelled::of(&parent).map(Unlabelled::parent)
                    && self.pending.get(&parent).is_some_and(|p| !p.misplaced)
                {
                    self.pending.remove(&parent);
                }
            }
        }
    }

    /// Note a parent to label. The same parent seen again keeps its state: a change to it
    /// while its label is on its way writes no second label.
    fn note(&mut self, parent: Unlabelled, misplaced: bool) {
        let shard = self.ownership.shard_of(&parent.uid);
        let parent = parent.parent();
        if let Some(pending) = self.pending.get_mut(&parent) {
            pending.misplaced |= misplaced;
            return;
        }
        self.ready.push_back(parent.clone());
        self.pending.insert(
            parent,
            Pending {
                shard,
                misplaced,
                failures: 0,
                state: State::Due(Instant::now()),
            },
        );
    }

    /// Look again at every parent waiting: a shard was taken, or time passed.
    fn ready_all(&mut self) {
        self.ready.clear();
        self.ready.extend(self.pending.keys().cloned());
    }

    /// Whether the parents' cache holds `parent`, so it is labelled for its own shard
    /// already (by this replica, or by the shard's last holder).
    fn cached(&self, ((namespace, name), uid): &Parent) -> bool {
        let key = object_ref(&self.resource, namespace.as_deref(), name);
        self.parents
            .get(&key)
            .is_some_and(|cached| cached.metadata.uid.as_ref() == Some(uid))
    }

    /// Start the label writes that are due, of the shards held (or labelled wrong), up to
    /// [`IN_FLIGHT`] at once.
    fn start_due(&mut self, writes: &mut FuturesUnordered<BoxFuture<'static, Written>>) {
        let now = Instant::now();
        let count = self.ownership.count();
        while writes.len() < IN_FLIGHT {
            let Some(parent) = self.ready.pop_front() else {
                return;
            };
            let (misplaced, shard) = match self.pending.get(&parent) {
                Some(pending) => (pending.misplaced, pending.shard),
                None => continue,
            };
            // One cached is labelled, and the watch will drop it; unless the cache is
            // behind a change that took its label off, which the next look finds.
            if !misplaced && (!self.whole.borrow().contains_key(&shard) || self.cached(&parent)) {
                continue;
            }
            let Some(pending) = self.pending.get_mut(&parent) else {
                continue;
            };
            let due = match pending.state {
                State::Due(at) => at <= now,
                State::Labelled(at) => at + LABELLED_GRACE <= now,
                State::Writing => false,
            };
            if !due {
                continue;
            }
            // The holder of its shard writes it, within its hold (see
            // `crate::shards::write_for`); one labelled wrong is written by whoever saw it.
            // A parent of a shard not held waits for the shard to be taken.
            let writing = self.ownership.start_writing(pending.shard);
            if writing.is_none() && !misplaced {
                continue;
            }
            pending.state = State::Writing;
            let write = label(
                (&self.client, &self.resource, &self.field_manager),
                &parent,
                shard_label_value(pending.shard, count),
            );
            writes.push(Box::pin(async move {
                let result = match writing {
                    Some(writing) => crate::shards::write_for(writing, write).await,
                    None => write.await,
                };
                (parent, result)
            }));
        }
    }

    /// Take the outcome of one label write.
    fn written(&mut self, parent: Parent, result: Result<(), kube::Error>) {
        let Some(pending) = self.pending.get_mut(&parent) else {
            // Deleted, or labelled by another, meanwhile.
            return;
        };
        let (code, error) = match result {
            Ok(()) if pending.misplaced => {
                self.pending.remove(&parent);
                return;
            }
            Ok(()) => {
                pending.state = State::Labelled(Instant::now());
                return;
            }
            Err(kube::Error::Api(status)) => (Some(status.code), status.message),
            Err(error) => (None, error.to_string()),
        };
        // Gone; or labelled wrong by hand and since replaced under its name (the uid
        // precondition fails): a successor comes through a watch of its own.
        if code == Some(404) || (pending.misplaced && matches!(code, Some(409 | 422))) {
            tracing::debug!(parent = ?parent.0, reason = %error, "not labelled: the parent is gone, or another");
            self.pending.remove(&parent);
            return;
        }
        if !pending.misplaced && !self.ownership.holds(pending.shard) {
            // The shard went while the write was on its way (the write gate refused it): its
            // holder labels the parent, or this replica once it takes the shard again.
            pending.state = State::Due(Instant::now());
            return;
        }
        // Tried again later; the watch drops the parent if it is deleted or labelled
        // meanwhile.
        pending.failures += 1;
        let doublings = pending.failures.min(7) - 1;
        let delay = RETRY.saturating_mul(1 << doublings).min(LONGEST_RETRY);
        pending.state = State::Due(Instant::now() + delay);
        let (namespace, name) = &parent.0;
        self.failures.0 += 1;
        self.failures.1 = Some(format!(
            "{}/{name}: {error}",
            namespace.as_deref().unwrap_or_default()
        ));
    }

    fn log_failures(&mut self) {
        if let (failed @ 1.., Some(last)) = (self.failures.0, self.failures.1.take()) {
            tracing::warn!(kind = %self.resource.kind, failed, last = %last, "could not label parents with their shard: they are not reconciled until they are; trying again");
        }
        self.failures.0 = 0;
    }
}

/// Run `labeller` where there is one (the parents are watched by label); else nothing.
pub(crate) async fn run(labeller: Option<ParentLabels>) {
    match labeller {
        Some(labeller) => labeller.run().await,
        None => std::future::pending().await,
    }
}

/// The parents without a label of `count` shards: none, another count's, or a malformed one.
pub(crate) fn unlabelled_selector(count: u32) -> String {
    let values: Vec<String> = (0..count)
        .map(|shard| shard_label_value(shard, count))
        .collect();
    format!("{UID_SHARD_LABEL} notin ({})", values.join(","))
}

/// Label `parent` with `value`.
fn label(
    (client, resource, field_manager): (&Client, &ApiResource, &str),
    parent: &Parent,
    value: String,
) -> impl Future<Output = Result<(), kube::Error>> + Send + 'static + use<> {
    let (client, resource) = (client.clone(), resource.clone());
    let ((namespace, name), uid) = parent.clone();
    let params = PatchParams {
        field_manager: Some(field_manager.to_owned()),
        ..PatchParams::default()
    };
    // The uid is a precondition: the API server refuses to change it.
    let patch = json!({"metadata": {"uid": uid, "labels": {UID_SHARD_LABEL: value}}});
    async move {
        let patch = Patch::Merge(&patch);
        lean_writes::patch(
            &client,
            &resource,
            namespace.as_deref(),
            &name,
            &params,
            &patch,
        )
        .await
        .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unlabelled_are_those_without_a_label_of_this_count() {
        // The API server's `notin` takes in objects without the key as well.
        assert_eq!(
            unlabelled_selector(3),
            "wasmctrl.dev/uid-shard notin (0-of-3,1-of-3,2-of-3)"
        );
    }
}
