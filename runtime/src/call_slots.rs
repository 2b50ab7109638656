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
//! - a call also reserves its plugin's memory limit from the engine's *memory budget* for
//!   calls in flight before it starts, since a call may touch all of it: the sum of the
//!   limits of running calls never passes the budget, however many slots there are and
//!   whatever each policy's concurrency. A call whose turn has come but whose memory does
//!   not fit yet waits, and holds back the calls behind it, so a large call is not starved
//!   by a stream of small ones; a call larger than the whole budget is refused.
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
    /// Bytes of plugin memory the calls in flight may reserve together.
    memory_budget: usize,
    state: Mutex<State>,
    /// Signalled whenever a slot is given back, for callers that wait on something a
    /// finishing call frees (instance-pool capacity).
    released: Notify,
}

#[derive(Default)]
struct State {
    free: usize,
    /// Bytes of the memory budget not reserved by a call in flight.
    memory_free: usize,
    held: HashMap<Arc<str>, usize>,
    waiting: VecDeque<Waiter>,
    /// Tenants whose calls ran out of time, until when.
    penalized: HashMap<Arc<str>, Instant>,
}

struct Waiter {
    tenant: Arc<str>,
    memory: usize,
    grant: oneshot::Sender<Slot>,
}

/// A call that can never be given a slot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refused {
    /// Its plugin's memory limit is more than the whole budget for calls in flight.
    #[error(
        "the plugin's memory limit of {asked} bytes is more than the host's budget of {budget} bytes for plugin calls in flight"
    )]
    OverBudget { asked: usize, budget: usize },
    /// The slots are gone (the engine is shutting down).
    #[error("the plugin engine is shutting down")]
    Closed,
}

/// One held slot and the memory reserved with it; given back on drop.
pub(crate) struct Slot {
    slots: Arc<CallSlots>,
    tenant: Arc<str>,
    memory: usize,
    /// False only while a grant that could not be delivered is being taken back.
    armed: bool,
}

impl CallSlots {
    /// `total` slots sharing `memory_budget` bytes (`usize::MAX`: no budget).
    pub(crate) fn new(total: usize, memory_budget: usize) -> Arc<Self> {
        let total = total.max(1);
        Arc::new(Self {
            total,
            memory_budget,
            state: Mutex::new(State {
                free: total,
                memory_free: memory_budget,
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
    pub(crate) fn forgive(self: &Arc<Self>, tenant: &str) {
        let undeliverable = {
            let mut state = self.lock();
            if state.penalized.remove(tenant).is_none() {
                return;
            }
            // Its waiters may go now, with no slot coming back to hand them one.
            self.dispatch(&mut state)
        };
        drop(undeliverable);
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

    /// The memory budget for calls in flight, in bytes.
    pub(crate) fn memory_budget(&self) -> usize {
        self.memory_budget
    }

    /// Bytes of the budget reserved by calls in flight now.
    pub(crate) fn memory_reserved(&self) -> usize {
        self.memory_budget - self.lock().memory_free
    }

    /// Wait for a slot for `tenant`, reserving `memory` bytes of the budget with it.
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        tenant: &str,
        memory: usize,
    ) -> Result<Slot, Refused> {
        if memory > self.memory_budget {
            return Err(Refused::OverBudget {
                asked: memory,
                budget: self.memory_budget,
            });
        }
        let receiver = {
            let mut state = self.lock();
            let tenant: Arc<str> = Arc::from(tenant);
            let held = state.held.get(&tenant).copied().unwrap_or(0);
            // While a slot is free, every waiter is at its cap or waits for memory (a
            // release serves the others first). A caller under its cap takes the free slot
            // without queueing when its memory fits and no one waits for memory before it.
            if state.free > 0
                && held < self.cap_for(&state, &tenant)
                && state.memory_free >= memory
                && !self.someone_waits_for_memory(&mut state)
            {
                state.take(&tenant, memory);
                return Ok(Slot {
                    slots: self.clone(),
                    tenant,
                    memory,
                    armed: true,
                });
            }
            let (grant, receiver) = oneshot::channel();
            state.waiting.push_back(Waiter {
                tenant,
                memory,
                grant,
            });
            // A waiter may have become free to go without any slot coming back (a penalty
            // ran out, a waiter for memory gave up): hand out what is free now.
            let undeliverable = self.dispatch(&mut state);
            drop(state);
            drop(undeliverable);
            receiver
        };
        receiver.await.map_err(|_| Refused::Closed)
    }

    /// Whether a live waiter under its cap waits (for memory: a slot would have served it).
    fn someone_waits_for_memory(&self, state: &mut State) -> bool {
        // Most calls find nobody waiting: no sweep of the queue and penalties for them.
        !state.waiting.is_empty() && self.next_waiter(state).is_some()
    }

    /// Wait until some slot is given back.
    pub(crate) async fn released(&self) {
        self.released.notified().await;
    }

    /// Return a slot of `tenant` and the `memory` it reserved, and pass free slots on to
    /// waiters, fewest-held first; the next in line whose memory does not fit yet stops the
    /// handing out until enough comes back.
    fn release(self: &Arc<Self>, tenant: &Arc<str>, memory: usize) {
        let undeliverable = {
            let mut state = self.lock();
            state.give_back(tenant, memory);
            self.dispatch(&mut state)
        };
        drop(undeliverable);
        self.released.notify_waiters();
    }

    /// Pass free slots on to waiters, fewest-held first; the next in line whose memory does
    /// not fit yet stops the handing out until enough comes back. Returns the grants whose
    /// waiters had gone, to be dropped once the state is unlocked.
    fn dispatch(self: &Arc<Self>, state: &mut State) -> Vec<Slot> {
        let mut undeliverable = Vec::new();
        while state.free > 0 {
            let Some(index) = self.next_waiter(state) else {
                break;
            };
            if state.waiting[index].memory > state.memory_free {
                break;
            }
            let Some(waiter) = state.waiting.remove(index) else {
                break;
            };
            state.take(&waiter.tenant, waiter.memory);
            let slot = Slot {
                slots: self.clone(),
                tenant: waiter.tenant.clone(),
                memory: waiter.memory,
                armed: true,
            };
            if let Err(mut slot) = waiter.grant.send(slot) {
                // The waiter gave up; take the grant back without recursing.
                slot.armed = false;
                undeliverable.push(slot);
                state.give_back(&waiter.tenant, waiter.memory);
            }
        }
        undeliverable
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
    /// `tenant` takes a free slot and `memory` bytes of the budget.
    fn take(&mut self, tenant: &Arc<str>, memory: usize) {
        self.free -= 1;
        self.memory_free -= memory;
        *self.held.entry(tenant.clone()).or_insert(0) += 1;
    }

    /// `tenant` gives a slot and `memory` bytes back.
    fn give_back(&mut self, tenant: &Arc<str>, memory: usize) {
        self.free += 1;
        self.memory_free += memory;
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
            self.slots.release(&self.tenant, self.memory);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn no_slot_within_for(
        slots: &Arc<CallSlots>,
        tenant: &str,
        memory: usize,
        wait: Duration,
    ) -> bool {
        tokio::time::timeout(wait, slots.acquire(tenant, memory))
            .await
            .is_err()
    }

    async fn no_slot_within(slots: &Arc<CallSlots>, tenant: &str, wait: Duration) -> bool {
        tokio::time::timeout(wait, slots.acquire(tenant, 0))
            .await
            .is_err()
    }

    #[tokio::test]
    async fn one_tenant_cannot_take_every_slot() {
        let slots = CallSlots::new(8, usize::MAX);
        assert_eq!(slots.tenant_cap(), 6);
        let mut held = Vec::new();
        for _ in 0..6 {
            held.push(slots.acquire("hog", 0).await.expect("slot"));
        }
        assert!(
            no_slot_within(&slots, "hog", Duration::from_millis(50)).await,
            "the hog is at its cap"
        );
        // Another tenant gets one at once, while the hog holds its cap.
        let other = tokio::time::timeout(Duration::from_millis(50), slots.acquire("b", 0))
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
            .map(|total| CallSlots::new(total, usize::MAX).tenant_cap())
            .collect();
        assert_eq!(caps, [1, 1, 2, 3, 6, 48]);
    }

    #[tokio::test]
    async fn a_freed_slot_goes_to_the_tenant_holding_the_fewest() {
        let slots = CallSlots::new(4, usize::MAX);
        let a1 = slots.acquire("a", 0).await.expect("slot");
        let _a1b = slots.acquire("a", 0).await.expect("slot");
        let _b1 = slots.acquire("b", 0).await.expect("slot");
        let _b2 = slots.acquire("b", 0).await.expect("slot");
        // a queues first, then c. When one of a's slots frees, a still holds one and c none,
        // so c is served first.
        let a2 = tokio::spawn({
            let slots = slots.clone();
            async move {
                slots
                    .acquire("a", 0)
                    .await
                    .ok()
                    .map(|s| s.tenant.to_string())
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let c = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire("c", 0).await }
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
        let slots = CallSlots::new(8, usize::MAX);
        slots.penalize("loop", Duration::from_secs(60));
        assert!(slots.is_penalized("loop"));
        let first = slots.acquire("loop", 0).await.expect("slot");
        assert!(
            no_slot_within(&slots, "loop", Duration::from_millis(50)).await,
            "one slot at a time"
        );
        let other = tokio::time::timeout(Duration::from_millis(50), slots.acquire("b", 0))
            .await
            .expect("others are not held back")
            .expect("slot");
        slots.forgive("loop");
        let second = tokio::time::timeout(Duration::from_millis(50), slots.acquire("loop", 0))
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
        let slots = CallSlots::new(1, usize::MAX);
        let first = slots.acquire("a", 0).await.expect("slot");
        assert!(no_slot_within(&slots, "b", Duration::from_millis(20)).await);
        drop(first);
        let again = tokio::time::timeout(Duration::from_millis(100), slots.acquire("c", 0))
            .await
            .expect("the slot came back")
            .expect("slot");
        drop(again);
        assert_eq!(slots.lock().free, 1);
    }

    #[tokio::test]
    async fn calls_in_flight_never_reserve_more_than_the_memory_budget() {
        let slots = CallSlots::new(8, 100);
        let first = slots.acquire("a", 40).await.expect("slot");
        let second = slots.acquire("b", 40).await.expect("slot");
        assert_eq!(slots.memory_reserved(), 80);
        // A free slot, but not 40 bytes of budget: the third waits.
        let third = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire("c", 40).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!third.is_finished(), "the budget is spent");
        drop(first);
        let third = tokio::time::timeout(Duration::from_millis(200), third)
            .await
            .expect("served once memory came back")
            .expect("task")
            .expect("slot");
        assert_eq!(slots.memory_reserved(), 80);
        drop((second, third));
        assert_eq!(slots.memory_reserved(), 0);
    }

    #[tokio::test]
    async fn a_call_larger_than_the_budget_is_refused_and_a_large_one_is_not_starved() {
        let slots = CallSlots::new(8, 100);
        assert_eq!(
            slots.acquire("a", 101).await.err(),
            Some(Refused::OverBudget {
                asked: 101,
                budget: 100
            })
        );
        let held = slots.acquire("a", 60).await.expect("slot");
        let large = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire("b", 80).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        // 10 bytes would fit now, but the large call waits before it: the small one queues.
        assert!(
            no_slot_within_for(&slots, "c", 10, Duration::from_millis(50)).await,
            "a small call does not pass a large one waiting for memory"
        );
        let small = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire("c", 10).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held);
        let large = tokio::time::timeout(Duration::from_millis(200), large)
            .await
            .expect("the large call is served first")
            .expect("task")
            .expect("slot");
        let small = tokio::time::timeout(Duration::from_millis(200), small)
            .await
            .expect("the small one fits beside it")
            .expect("task")
            .expect("slot");
        assert_eq!(slots.memory_reserved(), 90);
        drop((large, small));
    }

    #[tokio::test]
    async fn a_waiter_free_to_go_is_served_without_waiting_for_a_release() {
        let slots = CallSlots::new(8, usize::MAX);
        slots.penalize("loop", Duration::from_secs(60));
        let first = slots.acquire("loop", 0).await.expect("slot");
        let second = tokio::spawn({
            let slots = slots.clone();
            async move { slots.acquire("loop", 0).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!second.is_finished(), "one slot while penalized");
        // Forgiven, it may hold more: its waiter goes at once, though no slot came back.
        slots.forgive("loop");
        let second = tokio::time::timeout(Duration::from_millis(200), second)
            .await
            .expect("served on forgiveness")
            .expect("task")
            .expect("slot");
        drop((first, second));
    }
}
