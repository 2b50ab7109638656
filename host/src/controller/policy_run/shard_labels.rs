//! The shard label on a sharded policy's parents, where the API server cannot narrow watches
//! by uid (its `ShardedListAndWatch` gate is off): each parent then carries
//! `wasmctrl.dev/shard: <shard>-of-<count>`, the shard of its uid, and each replica watches
//! its shards' parents by that label, as it watches their children (see
//! [`super::shard_feeds`]).
//!
//! No one can set the label before the parent exists: its uid is given at creation, after
//! admission. So each replica watches the policy's parents that carry no label of this count
//! (their metadata only; in a steady state there are none) and labels those of the shards it
//! holds. That is one write per parent, once in its life, by the one replica holding its
//! shard: a shard moving writes nothing, and a new shard count labels every parent once more.
//! A parent labelled wrong (by hand) reaches the watch of the shard its label names, which
//! hands it here ([`crate::controller::cache::per_shard::PerShard::misplaced`]) to be put
//! right, whoever holds its own shard: no other replica sees it.
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
use kube::api::{Api, Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject, PartialObjectMeta};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Client, Resource as _};
use serde_json::json;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::controller::labels::{SHARD_LABEL, shard_label_value};
use crate::controller::reconcile::lean_writes;
use crate::shards::ShardOwnership;
use crate::watch_backoff::WatchBackoff;

/// How soon a label that could not be written is tried again.
const RETRY: Duration = Duration::from_secs(5);
/// How long a parent labelled may go on looking unlabelled (its watch behind the write)
/// before it is labelled again.
const LABELLED_GRACE: Duration = Duration::from_secs(60);
/// Labels written at once: enough to label a large collection quickly when sharding is
/// turned on, without crowding out the reconciles' writes.
const IN_FLIGHT: usize = 16;

/// A parent's place: namespace and name.
type Key = (Option<String>, String);

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
}

/// What is known of one parent to label.
#[derive(Debug)]
struct Pending {
    uid: String,
    shard: u32,
    /// Labelled wrong, rather than not at all: labelled whoever holds its shard, and
    /// forgotten once labelled (no watch tells when it is).
    misplaced: bool,
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
    resource: ApiResource,
    namespace: Option<String>,
    field_manager: String,
    ownership: Arc<ShardOwnership>,
    misplaced: mpsc::UnboundedReceiver<Unlabelled>,
    pending: HashMap<Key, Pending>,
    /// The parents that may be due now, to look at before anything else happens.
    ready: VecDeque<Key>,
    /// Failures since the last one logged, and the last.
    failures: (usize, Option<String>),
}

/// The outcome of one label write: for which parent (its key and uid), and how it went.
type Written = (Key, String, Result<(), kube::Error>);

impl ParentLabels {
    /// The labeller of the parents of `resource` (in `namespace`, or cluster-wide) that a
    /// policy acting through `client` reconciles, as `field_manager`; `misplaced` brings the
    /// parents its shards' watches found labelled wrong.
    pub fn new(
        (client, resource, namespace): (Client, ApiResource, Option<String>),
        field_manager: String,
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
            pending: HashMap::new(),
            ready: VecDeque::new(),
            failures: (0, None),
        }
    }

    /// Label the parents that need it, for as long as the policy runs.
    pub async fn run(mut self) {
        let count = self.ownership.count();
        let api: Api<PartialObjectMeta<DynamicObject>> = match &self.namespace {
            Some(namespace) => Api::namespaced_with(self.client.clone(), namespace, &self.resource),
            None => Api::all_with(self.client.clone(), &self.resource),
        };
        let config = watcher::Config::default().labels(&unlabelled_selector(count));
        let mut unlabelled = watcher::watcher(api, config)
            .backoff(WatchBackoff::default())
            .boxed();
        let mut held = self.ownership.subscribe();
        let mut listing: Option<HashSet<Key>> = None;
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
                changed = held.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    // A shard taken: its parents waiting are due with it.
                    self.ready_all();
                }
                Some((key, uid, result)) = writes.next(), if !writes.is_empty() => {
                    self.written(key, &uid, result);
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
        listing: &mut Option<HashSet<Key>>,
    ) {
        match event {
            watcher::Event::Init => *listing = Some(HashSet::new()),
            watcher::Event::InitApply(parent) | watcher::Event::Apply(parent) => {
                if let Some(parent) = Unlabelled::of(&parent) {
                    if let Some(listing) = listing.as_mut() {
                        listing.insert((parent.namespace.clone(), parent.name.clone()));
                    }
                    self.note(parent, false);
                }
            }
            watcher::Event::InitDone => {
                // What the list did not bring was labelled or deleted while the watch was away.
                if let Some(listed) = listing.take() {
                    self.pending
                        .retain(|key, pending| pending.misplaced || listed.contains(key));
                }
            }
            watcher::Event::Delete(parent) => {
                let meta = parent.meta();
                let key = (
                    meta.namespace.clone(),
                    meta.name.clone().unwrap_or_default(),
                );
                if self
                    .pending
                    .get(&key)
                    .is_some_and(|p| Some(&p.uid) == meta.uid.as_ref() && !p.misplaced)
                {
                    self.pending.remove(&key);
                }
            }
        }
    }

    /// Note a parent to label. The same parent seen again keeps its state: a change to it
    /// while its label is on its way writes no second label.
    fn note(&mut self, parent: Unlabelled, misplaced: bool) {
        let key = (parent.namespace, parent.name);
        if let Some(pending) = self.pending.get_mut(&key)
            && pending.uid == parent.uid
        {
            pending.misplaced |= misplaced;
            return;
        }
        let shard = self.ownership.shard_of(&parent.uid);
        self.ready.push_back(key.clone());
        self.pending.insert(
            key,
            Pending {
                uid: parent.uid,
                shard,
                misplaced,
                state: State::Due(Instant::now()),
            },
        );
    }

    /// Look again at every parent waiting: a shard was taken, or time passed.
    fn ready_all(&mut self) {
        self.ready.clear();
        self.ready.extend(self.pending.keys().cloned());
    }

    /// Start the label writes that are due, of the shards held (or labelled wrong), up to
    /// [`IN_FLIGHT`] at once.
    fn start_due(&mut self, writes: &mut FuturesUnordered<BoxFuture<'static, Written>>) {
        let now = Instant::now();
        let count = self.ownership.count();
        while writes.len() < IN_FLIGHT {
            let Some(key) = self.ready.pop_front() else {
                return;
            };
            let Some(pending) = self.pending.get_mut(&key) else {
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
            if writing.is_none() && !pending.misplaced {
                continue;
            }
            pending.state = State::Writing;
            let write = label(
                (&self.client, &self.resource, &self.field_manager),
                &key,
                &pending.uid,
                shard_label_value(pending.shard, count),
            );
            let uid = pending.uid.clone();
            writes.push(Box::pin(async move {
                let result = match writing {
                    Some(writing) => crate::shards::write_for(writing, write).await,
                    None => write.await,
                };
                (key, uid, result)
            }));
        }
    }

    /// Take the outcome of one label write.
    fn written(&mut self, key: Key, uid: &str, result: Result<(), kube::Error>) {
        let Some(pending) = self.pending.get_mut(&key).filter(|p| p.uid == uid) else {
            // Deleted, or another parent of that name since: nothing to do for this one.
            return;
        };
        match result {
            Ok(()) if pending.misplaced => {
                self.pending.remove(&key);
            }
            Ok(()) => pending.state = State::Labelled(Instant::now()),
            // Gone, or replaced by a parent of another uid (which the watch brings).
            Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409 | 422) => {
                tracing::debug!(parent = ?key, reason = %status.message, "not labelled: the parent is gone or another");
                self.pending.remove(&key);
            }
            Err(error) => {
                pending.state = State::Due(Instant::now() + RETRY);
                self.failures.0 += 1;
                self.failures.1 = Some(format!(
                    "{}/{}: {error}",
                    key.0.as_deref().unwrap_or_default(),
                    key.1
                ));
            }
        }
    }

    fn log_failures(&mut self) {
        if let (failed @ 1.., Some(last)) = (self.failures.0, self.failures.1.take()) {
            tracing::warn!(kind = %self.resource.kind, failed, last = %last, retry_in = ?RETRY, "could not label parents with their shard: they are not reconciled until they are");
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
    format!("{SHARD_LABEL} notin ({})", values.join(","))
}

/// Label the parent `key` (of `uid`) with `value`.
fn label(
    (client, resource, field_manager): (&Client, &ApiResource, &str),
    key: &Key,
    uid: &str,
    value: String,
) -> impl Future<Output = Result<(), kube::Error>> + Send + 'static + use<> {
    let (client, resource) = (client.clone(), resource.clone());
    let (namespace, name) = key.clone();
    let params = PatchParams {
        field_manager: Some(field_manager.to_owned()),
        ..PatchParams::default()
    };
    // The uid is a precondition: the API server refuses to change it.
    let patch = json!({"metadata": {"uid": uid, "labels": {SHARD_LABEL: value}}});
    async move {
        lean_writes::patch(
            &client,
            &resource,
            namespace.as_deref(),
            &name,
            &params,
            &Patch::Merge(&patch),
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
        assert_eq!(
            unlabelled_selector(3),
            "wasmctrl.dev/shard notin (0-of-3,1-of-3,2-of-3)"
        );
        // The API server's `notin` takes in objects without the key as well.
    }
}
