//! A sharded policy's caches fed per shard (see [`crate::controller::cache::per_shard`]):
//! which shards each of its watches wants, and in which order a shard's caches fill.
//!
//! Its parents are watched per shard by uid where the API server narrows watches so
//! (`shardRange`, see [`crate::shards::selector`]), and by the shard label otherwise, which
//! [`super::shard_labels`] stamps on each; its children, always by the shard label the host
//! stamps on each child it applies.
//!
//! A shard this replica takes is watched first for its children, of every kind the policy
//! allows, and for its parents only once every children's cache holds the shard whole: a
//! parent reaches the cache, and so a reconcile, only with its children known, so no
//! reconcile takes a child it has not yet seen for one missing. A shard let go leaves the
//! children's caches and the parents' at once (no reconcile starts for it by then; see
//! [`crate::shards::ShardOwnership`]).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use futures::StreamExt as _;
use futures::stream::BoxStream;
use tokio::sync::{mpsc, watch};

use crate::controller::cache::per_shard::{Outside, Whole};
use crate::controller::policy_run::shard_labels::Unlabelled;
use crate::lock;
use crate::shards::ShardOwnership;

/// Where the parents' watches send the parents labelled wrong, and the labeller's end.
struct ParentLabelling {
    misplaced: mpsc::UnboundedSender<Unlabelled>,
    labeller: Mutex<Option<mpsc::UnboundedReceiver<Unlabelled>>>,
}

/// Which shards a policy's watches want, and which its caches hold whole.
pub(crate) struct ShardFeeds {
    pub ownership: Arc<ShardOwnership>,
    /// What each child kind's cache holds whole, one per kind.
    children: Mutex<Vec<watch::Receiver<Whole>>>,
    /// What the parents' cache holds whole.
    parents: watch::Sender<Whole>,
    /// Whether the API server sent a shard's watch objects of another shard.
    pub outside: Arc<Outside>,
    /// Where the API server does not narrow watches by uid, the parents are watched by the
    /// shard label: where those found labelled wrong go, and who takes them.
    labels: Option<ParentLabelling>,
}

impl ShardFeeds {
    /// The feeds of a policy's caches, its parents watched by uid if the API server
    /// `narrows` watches so, and by the shard label otherwise.
    pub fn new(ownership: Arc<ShardOwnership>, narrows: bool) -> Arc<Self> {
        let labels = (!narrows).then(|| {
            let (misplaced, labeller) = mpsc::unbounded_channel();
            ParentLabelling {
                misplaced,
                labeller: Mutex::new(Some(labeller)),
            }
        });
        Arc::new(Self {
            ownership,
            children: Mutex::default(),
            parents: watch::channel(Whole::new()).0,
            outside: Arc::default(),
            labels,
        })
    }

    /// Where the parents are watched by label, where their watches send a parent labelled
    /// wrong; `None` where the API server narrows them by uid.
    pub fn misplaced_parents(&self) -> Option<mpsc::UnboundedSender<Unlabelled>> {
        self.labels.as_ref().map(|l| l.misplaced.clone())
    }

    /// Where the parents are watched by label, what the labeller takes the misplaced
    /// parents from (once).
    pub fn labeller_input(&self) -> Option<mpsc::UnboundedReceiver<Unlabelled>> {
        self.labels.as_ref().and_then(|l| lock(&l.labeller).take())
    }

    /// The shards held, at once and on each change: what each children's watch wants.
    pub fn held(&self) -> BoxStream<'static, BTreeSet<u32>> {
        changes(self.ownership.subscribe())
            .map(|held| held.keys().copied().collect())
            .boxed()
    }

    /// Where a child kind's cache says which shards it holds whole.
    pub fn child_kind(&self) -> watch::Sender<Whole> {
        let (listed, receiver) = watch::channel(Whole::new());
        lock(&self.children).push(receiver);
        listed
    }

    /// Where the parents' cache says which shards it holds whole.
    pub fn parents_listed(&self) -> watch::Sender<Whole> {
        self.parents.clone()
    }

    /// The shards whose parents' cache holds them whole, as they change.
    pub fn parents_held(&self) -> watch::Receiver<Whole> {
        self.parents.subscribe()
    }

    /// The shards the parents' watch wants: those held whose children every child kind's
    /// cache holds whole. Read from its first poll on, when every child kind has joined.
    pub fn for_parents(self: &Arc<Self>) -> BoxStream<'static, BTreeSet<u32>> {
        let feeds = self.clone();
        futures::stream::once(async move {
            let held = feeds.ownership.subscribe();
            let children = lock(&feeds.children).clone();
            futures::stream::unfold(
                (held, children, None::<BTreeSet<u32>>),
                |(mut held, mut children, last)| async move {
                    loop {
                        let mut wanted: BTreeSet<u32> =
                            held.borrow_and_update().keys().copied().collect();
                        for listed in &mut children {
                            let listed = listed.borrow_and_update();
                            wanted.retain(|shard| listed.contains_key(shard));
                        }
                        if last.as_ref() != Some(&wanted) {
                            return Some((wanted.clone(), (held, children, Some(wanted))));
                        }
                        let mut waits: Vec<Change<'_>> = vec![Box::pin(held.changed())];
                        waits.extend(
                            children
                                .iter_mut()
                                .map(|c| -> Change<'_> { Box::pin(c.changed()) }),
                        );
                        let (changed, _, _) = futures::future::select_all(waits).await;
                        // The ownership or a children's cache is gone: the policy ends.
                        changed.ok()?;
                    }
                },
            )
        })
        .flatten()
        .boxed()
    }
}

/// A change of one of the values the parents' watch wants shards by.
type Change<'a> =
    std::pin::Pin<Box<dyn Future<Output = Result<(), watch::error::RecvError>> + Send + 'a>>;

/// `receiver`'s value now, then each change.
fn changes<T: Clone + Send + Sync + 'static>(
    receiver: watch::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::unfold((receiver, true), |(mut receiver, first)| async move {
        if !first {
            receiver.changed().await.ok()?;
        }
        let value = receiver.borrow_and_update().clone();
        Some((value, (receiver, false)))
    })
}
