//! Whether this replica leads, and until when: shared by the elector (which sets it), the
//! write gate and the controllers (which ask it). See the parent module for the clock rule.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;
use tokio::time::Instant;

/// The shard whose holder does the per-policy work of a sharded host.
const POLICY_SHARD: u32 = 0;

/// Whether this replica leads, shared by the elector, the write gate and the controllers.
#[derive(Debug)]
pub struct Leadership {
    leading: AtomicBool,
    /// Until when leading counts: the start of the last successful renewal plus the renew
    /// deadline. `None` for a host that leads without an election.
    until: std::sync::Mutex<Option<Instant>>,
    changes: watch::Sender<bool>,
    /// The shards this replica holds, when the host is sharded: it writes for a parent only
    /// while it holds the parent's shard, and not at all while a shard it was told it holds
    /// is past its deadline (the process stood still).
    shards: std::sync::OnceLock<Arc<crate::shards::ShardOwnership>>,
}

impl Leadership {
    /// Leading from the start and for ever: a host run without leader election.
    pub fn always() -> Arc<Self> {
        Arc::new(Self::starting(true))
    }

    /// A standby until an elector makes it the leader.
    pub fn standby() -> Arc<Self> {
        Arc::new(Self::starting(false))
    }

    fn starting(leading: bool) -> Self {
        Self {
            leading: AtomicBool::new(leading),
            until: std::sync::Mutex::new(None),
            changes: watch::channel(leading).0,
            shards: std::sync::OnceLock::new(),
        }
    }

    /// Whether this replica may write now: it leads, and the time its last renewal bought
    /// has not run out (see the module docs); when sharded, no shard it holds is past its
    /// deadline either. What it may write for a parent is then up to the parent's shard.
    pub fn may_write(&self) -> bool {
        self.leading.load(Ordering::Acquire)
            && crate::lock(&self.until).is_none_or(|until| Instant::now() < until)
            && self.shards.get().is_none_or(|shards| !shards.stalled())
    }

    /// Whether this replica does the work of which there must be one doer per policy (its
    /// status, rollout, finalizers, teardown, webhook and conversion setup): the elected
    /// leader, or, when sharded, the holder of shard 0 (held by the same clock rule).
    pub fn is_leader(&self) -> bool {
        self.may_write()
            && self
                .shards
                .get()
                .is_none_or(|shards| shards.holds(POLICY_SHARD))
    }

    /// Write by `shards` from now on: for a parent only while its shard is held (a host
    /// sharded over Leases leads without an election), and lead the policies while shard 0
    /// is held ([`subscribe`](Self::subscribe) follows it). Set once; a second call is
    /// ignored. Spawns the task that follows shard 0, so call it within a runtime.
    pub fn shard_by(self: &Arc<Self>, shards: Arc<crate::shards::ShardOwnership>) {
        if self.shards.set(shards.clone()).is_err() {
            return;
        }
        let mut held = shards.subscribe();
        let leads = held.borrow_and_update().contains_key(&POLICY_SHARD);
        self.changes.send_replace(leads);
        let leadership = Arc::downgrade(self);
        tokio::spawn(async move {
            while held.changed().await.is_ok() {
                let leads = held.borrow_and_update().contains_key(&POLICY_SHARD);
                let Some(leadership) = leadership.upgrade() else {
                    return;
                };
                leadership
                    .changes
                    .send_if_modified(|leading| std::mem::replace(leading, leads) != leads);
            }
        });
    }

    /// The shards this replica holds, when the host is sharded.
    pub fn shards(&self) -> Option<&Arc<crate::shards::ShardOwnership>> {
        self.shards.get()
    }

    /// Changes of leadership, starting from the current state (seen); when sharded, whether
    /// shard 0 is held. A lead that runs out by the clock alone shows here only once the
    /// elector (or the shard coordinator) notices; writes are refused from the deadline on
    /// regardless.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.changes.subscribe()
    }

    /// Completes once this replica leads (when sharded, holds shard 0).
    pub async fn until_leader(&self) {
        let mut changes = self.subscribe();
        // The sender lives in `self`, so waiting cannot fail while `self` is borrowed.
        let _ = changes.wait_for(|leading| *leading).await;
    }

    /// Lead until `deadline` (the elector's last successful renewal plus its renew
    /// deadline); each renewal moves it on.
    pub fn lead_until(&self, deadline: Instant) {
        *crate::lock(&self.until) = Some(deadline);
        self.leading.store(true, Ordering::Release);
        self.changes
            .send_if_modified(|leading| !std::mem::replace(leading, true));
    }

    /// Stop leading. Closes the write gate before anything else sees it.
    pub fn stop_leading(&self) {
        self.leading.store(false, Ordering::Release);
        self.changes.send_replace(false);
    }
}
