//! Which shards this replica holds, and until when; and the reconciles running for each, so
//! that a shard is given back only once none is left writing for it.
//!
//! Holding a shard is bounded by a clock, as leading is (see [`crate::leader`]): each
//! successful renewal of the shard's Lease lets this replica hold it until the renewal's
//! start plus the renew deadline, and [`ShardOwnership::holds`] answers no from that instant
//! on, whether or not the coordinator ran since. Another replica takes the Lease over only a
//! whole lease duration after it last saw it renewed, so the two never both hold a shard,
//! even when this process was stopped (SIGSTOP, a paused VM) past its deadline.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::lock;

/// The shards this replica holds, shared by its coordinator (which sets them), its
/// controllers (which ask before a reconcile) and the writes they make.
#[derive(Debug)]
pub struct ShardOwnership {
    count: u32,
    state: Mutex<Vec<Shard>>,
    /// A reconcile of a shard being given back ended.
    ended: Notify,
    /// The shards held, as the coordinator last set them (not by the clock alone), each
    /// with the count of the times it was taken: a shard let go and taken again between
    /// two looks still shows as taken again.
    changes: watch::Sender<BTreeMap<u32, u64>>,
    /// How many times shards were taken, for those counts.
    taken: std::sync::atomic::AtomicU64,
    /// What this replica and the holders of the other shards counted of the parents.
    reports: super::reports::ShardReports,
}

#[derive(Debug, Default, Clone)]
struct Shard {
    /// Held until then; `None` when not held.
    until: Option<Instant>,
    /// Reconciles running for the shard.
    writing: usize,
}

impl Shard {
    /// Whether the shard is held at `now`, by the clock.
    fn held_at(&self, now: Instant) -> bool {
        self.until.is_some_and(|until| now < until)
    }

    /// Whether it was held and its deadline passed without a renewal or a let-go.
    fn past_deadline_at(&self, now: Instant) -> bool {
        self.until.is_some_and(|until| now >= until)
    }
}

/// A reconcile running for a shard this replica held when it started; dropping it says the
/// reconcile ended. While one runs, the shard is not given back.
#[derive(Debug)]
pub struct Writing {
    ownership: Arc<ShardOwnership>,
    shard: u32,
}

impl Writing {
    /// The shard written for.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// Whether the shard is still held now: a write checks this just before it is sent.
    pub fn still_held(&self) -> bool {
        self.ownership.holds(self.shard)
    }
}

/// The shards taken between two looks at [`ShardOwnership::subscribe`]: held in `now` and
/// not held in `before`, or let go and taken again in between (its count of takings moved).
pub fn gained(before: &BTreeMap<u32, u64>, now: &BTreeMap<u32, u64>) -> BTreeSet<u32> {
    now.iter()
        .filter(|(shard, taken)| before.get(shard) != Some(taken))
        .map(|(shard, _)| *shard)
        .collect()
}

tokio::task_local! {
    /// The shard the writes of this task are for, while a reconcile of one of its parents
    /// runs (see [`write_for`]).
    static WRITING: Writing;
}

/// Run `reconcile` as the writer for `writing`'s shard: each of its writes is refused from
/// the moment the shard is no longer held ([`writes_allowed`], asked by the write gate
/// every time a write under way is polled), and the shard is not given back before it ends.
pub async fn write_for<F: std::future::Future>(writing: Writing, reconcile: F) -> F::Output {
    WRITING.scope(writing, reconcile).await
}

/// Whether the task asking may write now: outside [`write_for`], always; inside it, while
/// its shard is held. `Err` names the shard that is not.
pub fn writes_allowed() -> Result<(), u32> {
    WRITING
        .try_with(|writing| {
            if writing.still_held() {
                Ok(())
            } else {
                Err(writing.shard)
            }
        })
        .unwrap_or(Ok(()))
}

impl Drop for Writing {
    fn drop(&mut self) {
        let mut state = lock(&self.ownership.state);
        if let Some(shard) = state.get_mut(self.shard as usize) {
            shard.writing = shard.writing.saturating_sub(1);
        }
        drop(state);
        self.ownership.ended.notify_waiters();
    }
}

impl ShardOwnership {
    /// `count` shards, none held.
    pub fn new(count: u32) -> Arc<Self> {
        Arc::new(Self {
            count,
            state: Mutex::new(vec![Shard::default(); count as usize]),
            ended: Notify::new(),
            changes: watch::channel(BTreeMap::new()).0,
            taken: std::sync::atomic::AtomicU64::new(0),
            reports: super::reports::ShardReports::default(),
        })
    }

    /// The parents' counts per shard: this replica's for the shards it holds, the Leases'
    /// for the others.
    pub fn reports(&self) -> &super::reports::ShardReports {
        &self.reports
    }

    /// How many shards the parents are cut into.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// The shard of the parent with `uid`.
    pub fn shard_of(&self, uid: &str) -> u32 {
        super::map::shard_of(uid, self.count)
    }

    /// The shard of `parent` (by its uid; one without a uid hashes as the empty one).
    pub fn shard_of_parent(&self, parent: &impl kube::Resource) -> u32 {
        self.shard_of(parent.meta().uid.as_deref().unwrap_or_default())
    }

    /// Whether this replica holds `parent`'s shard now, by the clock.
    pub fn holds_parent(&self, parent: &impl kube::Resource) -> bool {
        self.holds(self.shard_of_parent(parent))
    }

    /// Whether this replica may write for `shard` now: it holds it, and the time its last
    /// renewal bought has not run out.
    pub fn holds(&self, shard: u32) -> bool {
        lock(&self.state)
            .get(shard as usize)
            .is_some_and(|shard| shard.held_at(Instant::now()))
    }

    /// Whether a shard this replica was told it holds has run past its deadline without
    /// being renewed or let go: the process stood still (a SIGSTOP, a paused VM, a long
    /// stall) or could not reach the API server for a renew deadline. The write connections
    /// end while this holds, dropping what they had not yet written (see
    /// [`crate::leader::write_gate`]), until the coordinator lets the shard go.
    pub fn stalled(&self) -> bool {
        let now = Instant::now();
        lock(&self.state)
            .iter()
            .any(|shard| shard.past_deadline_at(now))
    }

    /// The shards held now, by the clock.
    pub fn held(&self) -> BTreeSet<u32> {
        let now = Instant::now();
        let state = lock(&self.state);
        (0..self.count)
            .filter(|&i| state[i as usize].held_at(now))
            .collect()
    }

    /// Start a reconcile for `shard`: `None` unless it is held now. Until the returned
    /// [`Writing`] is dropped, the shard is not given back.
    pub fn start_writing(self: &Arc<Self>, shard: u32) -> Option<Writing> {
        let now = Instant::now();
        let mut state = lock(&self.state);
        let entry = state.get_mut(shard as usize)?;
        if !entry.held_at(now) {
            return None;
        }
        entry.writing += 1;
        Some(Writing {
            ownership: self.clone(),
            shard,
        })
    }

    /// Changes of the shards held, starting from the current set (seen): a controller
    /// reconciles the parents of each shard it gains (see [`gained`]).
    pub fn subscribe(&self) -> watch::Receiver<BTreeMap<u32, u64>> {
        self.changes.subscribe()
    }

    /// Hold `shard` until `deadline` (the start of the renewal that took or kept it plus the
    /// renew deadline).
    pub fn hold_until(&self, shard: u32, deadline: Instant) {
        let mut state = lock(&self.state);
        let Some(entry) = state.get_mut(shard as usize) else {
            return;
        };
        let taken = entry.until.replace(deadline).is_none();
        drop(state);
        if taken {
            let time = self
                .taken
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1;
            self.changes.send_modify(|held| {
                held.insert(shard, time);
            });
        }
    }

    /// Stop holding `shard` at once: no reconcile starts for it, and every write for it is
    /// refused from now on. [`drained`](Self::drained) says when the last one ended.
    pub fn let_go(&self, shard: u32) {
        let mut state = lock(&self.state);
        let Some(entry) = state.get_mut(shard as usize) else {
            return;
        };
        entry.until = None;
        drop(state);
        self.changes
            .send_if_modified(|held| held.remove(&shard).is_some());
    }

    /// How many reconciles run for `shard` now.
    pub fn writing(&self, shard: u32) -> usize {
        lock(&self.state)
            .get(shard as usize)
            .map_or(0, |shard| shard.writing)
    }

    /// Wait until no reconcile runs for `shard` (one that started while it was held).
    pub async fn drained(&self, shard: u32) {
        loop {
            let ended = self.ended.notified();
            let mut ended = std::pin::pin!(ended);
            // Registered before the check, so an end between the two is not missed.
            ended.as_mut().enable();
            let writing = lock(&self.state)
                .get(shard as usize)
                .map_or(0, |shard| shard.writing);
            if writing == 0 {
                return;
            }
            ended.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_shard_is_held_until_its_deadline_and_not_after() {
        let ownership = ShardOwnership::new(4);
        assert!(!ownership.holds(1));
        assert!(ownership.start_writing(1).is_none(), "not held");
        ownership.hold_until(1, Instant::now() + Duration::from_secs(10));
        assert!(ownership.holds(1));
        assert_eq!(ownership.held(), BTreeSet::from([1]));
        assert!(!ownership.holds(7), "no such shard");
        // The process stops past the deadline: nothing may write when it resumes.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(!ownership.holds(1));
        assert!(ownership.held().is_empty());
        assert!(ownership.start_writing(1).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_shard_let_go_is_drained_of_its_reconciles() {
        let ownership = ShardOwnership::new(2);
        ownership.hold_until(0, Instant::now() + Duration::from_secs(10));
        let writing = ownership.start_writing(0).expect("held");
        assert!(writing.still_held());
        let other = ownership.start_writing(1);
        assert!(other.is_none());
        ownership.let_go(0);
        assert!(!writing.still_held(), "a write after letting go is refused");
        assert!(ownership.start_writing(0).is_none(), "no reconcile starts");
        let drained = ownership.drained(0);
        let mut drained = std::pin::pin!(drained);
        assert!(
            futures::poll!(drained.as_mut()).is_pending(),
            "a reconcile still runs"
        );
        drop(writing);
        tokio::time::timeout(Duration::from_secs(1), drained)
            .await
            .expect("drained once the reconcile ended");
        ownership.drained(1).await;
    }

    #[tokio::test(start_paused = true)]
    async fn writes_for_a_shard_stop_when_it_is_let_go_or_its_deadline_passes() {
        let ownership = ShardOwnership::new(2);
        assert_eq!(
            writes_allowed(),
            Ok(()),
            "no shard: a write of the host's own"
        );
        ownership.hold_until(1, Instant::now() + Duration::from_secs(10));
        let writing = ownership.start_writing(1).expect("held");
        let checks = write_for(writing, {
            let ownership = ownership.clone();
            async move {
                let before = writes_allowed();
                assert!(!ownership.stalled());
                tokio::time::advance(Duration::from_secs(10)).await;
                (before, writes_allowed(), ownership.stalled())
            }
        })
        .await;
        assert_eq!(checks, (Ok(()), Err(1), true), "refused past the deadline");
        ownership.let_go(1);
        assert!(
            !ownership.stalled(),
            "let go: nothing is held past its deadline"
        );
        assert_eq!(
            ownership.writing(1),
            0,
            "the reconcile ended with its scope"
        );
    }

    #[tokio::test]
    async fn changes_name_the_shards_held() {
        let ownership = ShardOwnership::new(3);
        let mut changes = ownership.subscribe();
        let far = Instant::now() + Duration::from_secs(60);
        ownership.hold_until(2, far);
        assert!(changes.has_changed().unwrap_or(false));
        let first = changes.borrow_and_update().get(&2).copied();
        assert!(first.is_some());
        ownership.hold_until(2, far + Duration::from_secs(1));
        assert!(
            !changes.has_changed().unwrap_or(true),
            "a renewal is no change"
        );
        let before = changes.borrow_and_update().clone();
        ownership.hold_until(1, far);
        ownership.let_go(2);
        ownership.hold_until(2, far);
        let now = changes.borrow_and_update().clone();
        let again = now.get(&2).copied();
        assert!(
            again > first,
            "let go and taken again between two looks: {first:?} {again:?}"
        );
        assert_eq!(
            gained(&before, &now),
            BTreeSet::from([1, 2]),
            "1 new, 2 again"
        );
        assert!(gained(&now, &now).is_empty());
        ownership.let_go(1);
        ownership.let_go(2);
        assert!(changes.borrow_and_update().is_empty());
    }
}
