//! Process-wide bounds on plugins being fetched and compiled at once, shared fairly between
//! tenants (a team's namespace, or a cluster policy of its own).
//!
//! A fetch buffers up to the plugin size limit and a compile takes a child process of up to
//! `--max-compile-memory-mib`; each is bounded, but not their number. Several policies
//! started or swapped together (a host restart, an edit of many policies, sources made to be
//! large) would multiply both past the pod's memory. So fetches and compiles each take a
//! permit, and the next waits for one:
//! - a fetch holds a *fetch* permit while its bytes arrive and until they go to a compile
//!   (so the fetches' bound holds the bytes waiting for a compile too), and a tenant holds
//!   at most one, so a team whose source drips (each fetch is bounded in time and rate, see
//!   `source::fetch`) holds up only its own next fetch;
//! - a compile holds a *compile* permit for the compile alone (seconds), never while bytes
//!   trickle in, so a swap or rollback of another policy starts within a compile's time; the
//!   permit stays with the compile to its end even when the load is given up;
//! - a freed permit goes to the waiting tenant that holds the fewest, earliest first.
//!
//! Plugins served from memory or from the precompiled cache take no permit: they cost
//! neither.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::oneshot;

use crate::metrics::Metrics;

/// Which of the two bounds a permit is for, for logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    Fetch,
    Compile,
}

impl Stage {
    fn as_str(self) -> &'static str {
        match self {
            Self::Fetch => "fetch",
            Self::Compile => "compile",
        }
    }
}

/// The fetch and compile permits, shared by every policy of the host.
pub(super) struct LoadBudget {
    fetches: Arc<FairPermits>,
    compiles: Arc<FairPermits>,
}

/// A permit to fetch or to compile one plugin, returned when dropped.
pub(super) struct LoadPermit {
    permits: Arc<FairPermits>,
    tenant: Arc<str>,
    /// False only while a grant that could not be delivered is being taken back.
    armed: bool,
}

impl Drop for LoadPermit {
    fn drop(&mut self) {
        if self.armed {
            self.permits.release(&self.tenant);
        }
    }
}

impl LoadBudget {
    /// At most `compiles` compiles at once and `fetches` fetches (each at least one), at
    /// most one fetch per tenant.
    pub fn new(compiles: usize, fetches: usize) -> Self {
        Self {
            fetches: FairPermits::new(Stage::Fetch, fetches, 1),
            compiles: FairPermits::new(Stage::Compile, compiles, usize::MAX),
        }
    }

    /// A permit for `tenant`'s `policy` to fetch a plugin, once one is free.
    pub async fn fetch(&self, tenant: &str, policy: &str, metrics: &Metrics) -> LoadPermit {
        self.fetches.acquire(tenant, policy, metrics).await
    }

    /// A permit for `tenant`'s `policy` to compile a plugin, once one is free.
    pub async fn compile(&self, tenant: &str, policy: &str, metrics: &Metrics) -> LoadPermit {
        self.compiles.acquire(tenant, policy, metrics).await
    }
}

/// Permits handed out fairly between tenants.
struct FairPermits {
    stage: Stage,
    total: usize,
    per_tenant: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    free: usize,
    held: HashMap<Arc<str>, usize>,
    waiting: VecDeque<(Arc<str>, oneshot::Sender<LoadPermit>)>,
}

impl FairPermits {
    fn new(stage: Stage, total: usize, per_tenant: usize) -> Arc<Self> {
        let total = total.max(1);
        Arc::new(Self {
            stage,
            total,
            per_tenant: per_tenant.max(1),
            state: Mutex::new(State {
                free: total,
                ..State::default()
            }),
        })
    }

    /// A permit for `tenant`, once one is free and the tenant is under its share. Waiting is
    /// logged and counted in `wasmctrl_plugin_loads_waiting`, so a load that seems stuck
    /// says what it waits for.
    async fn acquire(
        self: &Arc<Self>,
        tenant: &str,
        policy: &str,
        metrics: &Metrics,
    ) -> LoadPermit {
        let tenant: Arc<str> = Arc::from(tenant);
        let receiver = {
            let mut state = crate::lock(&self.state);
            let held = state.held.get(&tenant).copied().unwrap_or(0);
            // While a permit is free, every waiter is at its share (a release serves the
            // others first), so a tenant under its share takes it without queueing.
            if state.free > 0 && held < self.per_tenant {
                state.take(&tenant);
                return self.permit(tenant);
            }
            let (grant, receiver) = oneshot::channel();
            state.waiting.push_back((tenant.clone(), grant));
            receiver
        };
        tracing::info!(
            policy,
            %tenant,
            stage = self.stage.as_str(),
            permits = self.total,
            "plugin load waits: other plugins are being fetched or compiled (--max-concurrent-loads, --max-concurrent-fetches)"
        );
        let started = Instant::now();
        let waiting = Waiting::new(metrics);
        let permit = receiver.await;
        drop(waiting);
        tracing::info!(policy, stage = self.stage.as_str(), waited = ?started.elapsed(), "plugin load proceeds");
        match permit {
            Ok(permit) => permit,
            // The sender lives in `waiting` until it is granted; this cannot happen.
            Err(_) => unreachable!("a load permit's grant is never dropped unsent"),
        }
    }

    fn permit(self: &Arc<Self>, tenant: Arc<str>) -> LoadPermit {
        LoadPermit {
            permits: self.clone(),
            tenant,
            armed: true,
        }
    }

    /// Return `tenant`'s permit and pass free ones on, fewest-held first.
    fn release(self: &Arc<Self>, tenant: &Arc<str>) {
        let mut undeliverable = Vec::new();
        {
            let mut state = crate::lock(&self.state);
            state.give_back(tenant);
            while state.free > 0 {
                state.waiting.retain(|(_, grant)| !grant.is_closed());
                let next = state
                    .waiting
                    .iter()
                    .enumerate()
                    .map(|(index, (tenant, _))| {
                        (state.held.get(tenant).copied().unwrap_or(0), index)
                    })
                    .filter(|(held, _)| *held < self.per_tenant)
                    .min();
                let Some((_, index)) = next else { break };
                let Some((waiter, grant)) = state.waiting.remove(index) else {
                    break;
                };
                state.take(&waiter);
                if let Err(mut permit) = grant.send(self.permit(waiter.clone())) {
                    // The waiter gave up; take the grant back without recursing.
                    permit.armed = false;
                    undeliverable.push(permit);
                    state.give_back(&waiter);
                }
            }
        }
        drop(undeliverable);
    }
}

impl State {
    fn take(&mut self, tenant: &Arc<str>) {
        self.free -= 1;
        *self.held.entry(tenant.clone()).or_insert(0) += 1;
    }

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

/// Counts a load as waiting for as long as it lives, so a wait given up (the policy stopped)
/// is uncounted too.
struct Waiting<'a>(&'a Metrics);

impl<'a> Waiting<'a> {
    fn new(metrics: &'a Metrics) -> Self {
        metrics.load_waiting(1);
        Self(metrics)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.load_waiting(-1);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::FutureExt as _;

    use super::*;

    #[tokio::test]
    async fn a_third_compile_waits_while_two_hold_permits() {
        let budget = LoadBudget::new(2, 4);
        let metrics = Metrics::new();
        let first = budget.compile("a", "a", &metrics).await;
        let _second = budget.compile("b", "b", &metrics).await;

        let mut third = std::pin::pin!(budget.compile("c", "c", &metrics));
        assert!((&mut third).now_or_never().is_none(), "a third permit");
        assert!(
            metrics.encode().contains("wasmctrl_plugin_loads_waiting 1"),
            "the wait is visible"
        );

        // A wait given up is no longer counted.
        let given_up = budget.compile("d", "d", &metrics).now_or_never();
        assert!(given_up.is_none());
        assert!(metrics.encode().contains("wasmctrl_plugin_loads_waiting 1"));

        drop(first);
        let _third = tokio::time::timeout(Duration::from_secs(5), third)
            .await
            .expect("the third load proceeds once a permit is back");
        assert!(metrics.encode().contains("wasmctrl_plugin_loads_waiting 0"));
    }

    #[tokio::test]
    async fn a_tenant_fetches_one_at_a_time_and_others_pass_it() {
        let budget = LoadBudget::new(1, 3);
        let metrics = Metrics::new();
        let dripping = budget.fetch("team-a", "a1", &metrics).await;
        // team-a's second fetch waits for its first, though permits are free ...
        let mut again = std::pin::pin!(budget.fetch("team-a", "a2", &metrics));
        assert!(
            (&mut again).now_or_never().is_none(),
            "one fetch per tenant"
        );
        // ... while another team's fetch goes at once.
        let other = budget
            .fetch("team-b", "b1", &metrics)
            .now_or_never()
            .expect("another tenant is not held up");
        drop(other);
        drop(dripping);
        let _again = tokio::time::timeout(Duration::from_secs(5), again)
            .await
            .expect("team-a's next fetch once its first is done");
    }

    #[tokio::test]
    async fn a_freed_permit_goes_to_the_tenant_holding_the_fewest() {
        let budget = LoadBudget::new(2, 2);
        let metrics = Metrics::new();
        let a1 = budget.compile("a", "a1", &metrics).await;
        let _a2 = budget.compile("a", "a2", &metrics).await;
        // a queues first, then b; when a's permit frees, b (holding none) goes first.
        let a3 = tokio::spawn({
            let compiles = budget.compiles.clone();
            async move {
                let metrics = Metrics::new();
                compiles.acquire("a", "a3", &metrics).await
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let b = tokio::spawn({
            let compiles = budget.compiles.clone();
            async move {
                let metrics = Metrics::new();
                compiles.acquire("b", "b1", &metrics).await
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(a1);
        let b = tokio::time::timeout(Duration::from_secs(1), b)
            .await
            .expect("b served")
            .expect("task");
        assert_eq!(&*b.tenant, "b");
        assert!(!a3.is_finished(), "a waits: b held fewer");
        drop(b);
        tokio::time::timeout(Duration::from_secs(1), a3)
            .await
            .expect("a served next")
            .expect("task");
    }
}
