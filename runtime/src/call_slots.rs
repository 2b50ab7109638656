//! The engine's call slots, shared fairly between tenants (in the host, policies).
//!
//! A plain semaphore hands slots out first come, first served: a policy whose plugin loops
//! until its deadline, reconciling many parents at once, would hold every slot and make the
//! other policies' calls queue behind it. Here:
//! - no tenant holds more than [`CallSlots::tenant_cap`] slots (it leaves a quarter of them,
//!   and at least one, to the others), so a newcomer finds a free slot at once;
//! - a freed slot goes to the waiting tenant that holds the fewest, earliest first among
//!   equals, so tenants converge to equal shares under contention.
//!
//! - a tenant whose call just ran into its deadline is *penalized* for a while: it may hold
//!   one slot only (and its calls run at idle priority, see `idle_lane`), so a looping
//!   plugin cannot take the machine's CPU from everyone else.
//!
//! A slot is a guard: dropping it (also when the call's future is cancelled, even between
//! being granted a slot and noticing) gives the slot back.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, oneshot};

/// Slots, who holds them, and who waits.
pub(crate) struct CallSlots {
    total: usize,
    state: Mutex<State>,
    /// Signalled whenever a slot is given back, for callers that wait on something a
    /// finishing call frees (instance-pool capacity).
    released: Notify,
}

#[derive(Default)]
struct State {
    free: usize,
    held: HashMap<Arc<str>, usize>,
    waiting: VecDeque<Waiter>,
    /// Tenants whose calls ran out of time, until when.
    penalized: HashMap<Arc<str>, Instant>,
}

struct Waiter {
    tenant: Arc<str>,
    grant: oneshot::Sender<Slot>,
}

/// One held slot; given back on drop.
pub(crate) struct Slot {
    slots: Arc<CallSlots>,
    tenant: Arc<str>,
    /// False only while a grant that could not be delivered is being taken back.
    armed: bool,
}

impl CallSlots {
    pub(crate) fn new(total: usize) -> Arc<Self> {
        let total = total.max(1);
        Arc::new(Self {
            total,
            state: Mutex::new(State {
                free: total,
                ..State::default()
            }),
            released: Notify::new(),
        })
    }

    /// The most slots one tenant may hold: all but a quarter (and at least one), unless there
    /// is only one slot.
    pub(crate) fn tenant_cap(&self) -> usize {
        if self.total >= 2 {
            self.total - (self.total / 4).max(1)
        } else {
            self.total
        }
    }

    /// Restrict `tenant` to one slot (and idle priority) for `period`: its last call ran out
    /// of time. The anonymous tenant (calls outside any policy) is never penalized.
    pub(crate) fn penalize(&self, tenant: &str, period: Duration) {
        if tenant.is_empty() {
            return;
        }
        self.lock()
            .penalized
            .insert(Arc::from(tenant), Instant::now() + period);
    }

    /// Lift `tenant`'s penalty: a call of its finished in time.
    pub(crate) fn forgive(&self, tenant: &str) {
        let mut state = self.lock();
        if !state.penalized.is_empty() {
            state.penalized.remove(tenant);
        }
    }

    /// Whether `tenant` is penalized now.
    pub(crate) fn is_penalized(&self, tenant: &str) -> bool {
        self.lock()
            .penalized
            .get(tenant)
            .is_some_and(|until| *until > Instant::now())
    }

    /// The most slots `tenant` may hold now.
    fn cap_for(&self, state: &State, tenant: &str) -> usize {
        match state.penalized.get(tenant) {
            Some(until) if *until > Instant::now() => 1,
            _ => self.tenant_cap(),
        }
    }

    /// Wait for a slot for `tenant`. `None` only if the slots are gone (never, in practice).
    pub(crate) async fn acquire(self: &Arc<Self>, tenant: &str) -> Option<Slot> {
        let receiver = {
            let mut state = self.lock();
            let tenant: Arc<str> = Arc::from(tenant);
            let held = state.held.get(&tenant).copied().unwrap_or(0);
            // While a slot is free, every waiter is at its cap (a release serves the others
            // first), so a caller under its cap takes the free slot without queueing.
            if state.free > 0 && held < self.cap_for(&state, &tenant) {
                state.take(&tenant);
                return Some(Slot {
                    slots: self.clone(),
                    tenant,
                    armed: true,
                });
            }
            let (grant, receiver) = oneshot::channel();
            state.waiting.push_back(Waiter { tenant, grant });
            receiver
        };
        receiver.await.ok()
    }

    /// Wait until some slot is given back.
    pub(crate) async fn released(&self) {
        self.released.notified().await;
    }

    /// Return a slot of `tenant` and pass free slots on to waiters, fewest-held first.
    fn release(self: &Arc<Self>, tenant: &Arc<str>) {
        let mut undeliverable = Vec::new();
        {
            let mut state = self.lock();
            state.give_back(tenant);
            while state.free > 0 {
                let Some(index) = self.next_waiter(&mut state) else {
                    break;
                };
                let Some(waiter) = state.waiting.remove(index) else {
                    break;
                };
                state.take(&waiter.tenant);
                let slot = Slot {
                    slots: self.clone(),
                    tenant: waiter.tenant.clone(),
                    armed: true,
                };
                if let Err(mut slot) = waiter.grant.send(slot) {
                    // The waiter gave up; take the grant back without recursing.
                    slot.armed = false;
                    undeliverable.push(slot);
                    state.give_back(&waiter.tenant);
                }
            }
        }
        drop(undeliverable);
        self.released.notify_waiters();
    }

    /// The waiter to serve next: among live waiters whose tenant is under its cap, the one
    /// whose tenant holds the fewest slots, earliest first.
    fn next_waiter(&self, state: &mut State) -> Option<usize> {
        state.waiting.retain(|w| !w.grant.is_closed());
        let now = Instant::now();
        state.penalized.retain(|_, until| *until > now);
        state
            .waiting
            .iter()
            .enumerate()
            .map(|(index, w)| (state.held.get(&w.tenant).copied().unwrap_or(0), index, w))
            .filter(|(held, _, w)| *held < self.cap_for(state, &w.tenant))
            .map(|(held, index, _)| (held, index))
            .min()
            .map(|(_, index)| index)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Counters only; a panic elsewhere cannot leave them half-updated.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl State {
    /// `tenant` takes a free slot.
    fn take(&mut self, tenant: &Arc<str>) {
        self.free -= 1;
        *self.held.entry(tenant.clone()).or_insert(0) += 1;
    }

    /// `tenant` gives a slot back.
    fn give_back(&mut self, tenant: &Arc<str>) {
        self.free += 1;
        if let Some(held) = self.held.get_mut(tenant) {
            *held -= 1;
            if *held == 0 {
                self.held.remove(tenant);
            }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.armed {
            self.slots.release(&self.tenant);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn no_slot_within(slots: &Arc<CallSlots>, tenant: &str, wait: Duration) -> bool {
        tokio::time::timeout(wait, slots.acquire(tenant))
            .await
            .is_err()
    }

    #[tokio::test]
    async fn one_tenant_cannot_take_every_slot() {
        let slots = CallSlots::new(8);
        assert_eq!(slots.tenant_cap(), 6);
        let mut held = Vec::new();
        for _ in 0..6 {
            held.push(slots.acquire("hog").await.expect("slot"));
        }
        assert!(
            no_slot_within(&slots, "hog", Duration::from_millis(50)).await,
            "the hog is at its cap"
        );
        // Another tenant gets one at once, while the hog holds its cap.
        let other = tokio::time::timeout(Duration::from_millis(50), slots.acquire("b"))
            .await
            .expect("immediate")
            .expect("slot");
        drop(other);
        drop(held);
    }

    #[test]
    fn a_tenant_always_leaves_a_slot_to_the_others() {
        let caps: Vec<usize> = [1, 2, 3, 4, 8, 64]
            .into_iter()
            .map(|total| CallSlots::new(total).tenant_cap())
            .collect();
        assert_eq!(caps, [1, 1, 2, 3, 6, 48]);
    }

    #[tokio::test]
    async fn a_freed_slot_goes_to_the_tenant_holding_the_fewest() {
        let slots = CallSlots::new(4);
        let a1 = slots.acquire("a").await.expect("slot");
        let _a1b = slots.acquire("a").await.expect("slot");
        let _b1 = slots.acquire("b").await.expect("slot");
        let _b2 = slots.acquire("b").await.expect("slot");
        // a queues first, then c. When one of a's slots frees, a still holds one and c none,
        // so c is served first.
        let a2 = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire("a").await.map(|s| s.tenant.to_string()) }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let c = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire("c").await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(a1);
        let served = tokio::time::timeout(Duration::from_millis(200), c)
            .await
            .expect("c served")
            .expect("task")
            .expect("slot");
        assert_eq!(&*served.tenant, "c");
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!a2.is_finished(), "a waits: c held fewer");
        // When c is done, a's turn comes.
        drop(served);
        let a = tokio::time::timeout(Duration::from_millis(200), a2)
            .await
            .expect("a served")
            .expect("task");
        assert_eq!(a.as_deref(), Some("a"));
    }

    #[tokio::test]
    async fn a_penalized_tenant_holds_one_slot_until_forgiven() {
        let slots = CallSlots::new(8);
        slots.penalize("loop", Duration::from_secs(60));
        assert!(slots.is_penalized("loop"));
        let first = slots.acquire("loop").await.expect("slot");
        assert!(
            no_slot_within(&slots, "loop", Duration::from_millis(50)).await,
            "one slot at a time"
        );
        let other = tokio::time::timeout(Duration::from_millis(50), slots.acquire("b"))
            .await
            .expect("others are not held back")
            .expect("slot");
        slots.forgive("loop");
        let second = tokio::time::timeout(Duration::from_millis(50), slots.acquire("loop"))
            .await
            .expect("forgiven")
            .expect("slot");
        drop((first, second, other));
        slots.penalize("", Duration::from_secs(60));
        assert!(
            !slots.is_penalized(""),
            "calls outside a policy are never penalized"
        );
    }

    #[tokio::test]
    async fn a_cancelled_waiter_does_not_leak_its_slot() {
        let slots = CallSlots::new(1);
        let first = slots.acquire("a").await.expect("slot");
        assert!(no_slot_within(&slots, "b", Duration::from_millis(20)).await);
        drop(first);
        let again = tokio::time::timeout(Duration::from_millis(100), slots.acquire("c"))
            .await
            .expect("the slot came back")
            .expect("slot");
        drop(again);
        assert_eq!(slots.lock().free, 1);
    }
}
