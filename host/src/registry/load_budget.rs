//! A process-wide bound on plugins being fetched and compiled at once.
//!
//! A fetch buffers up to the plugin size limit, and a compile takes a child process of up
//! to `--max-compile-memory-mib`; each is bounded, but not their number. Several policies
//! started or swapped together (a host restart, an edit of many policies, sources made to be
//! large) would multiply both past the pod's memory. So a load holds a permit from its fetch
//! to the end of its compile, and the next waits for one. Plugins served from memory or from
//! the precompiled cache take no permit: they cost neither.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::Metrics;

/// The permits, shared by every policy of the host.
pub(super) struct LoadBudget {
    permits: Arc<Semaphore>,
    size: usize,
}

/// A permit to fetch and compile one plugin, returned when dropped.
pub(super) struct LoadPermit {
    _permit: OwnedSemaphorePermit,
}

impl LoadBudget {
    /// At most `size` loads at once (at least one).
    pub fn new(size: usize) -> Self {
        let size = size.max(1);
        Self {
            permits: Arc::new(Semaphore::new(size)),
            size,
        }
    }

    /// A permit for `policy`'s load, once one is free. Waiting is logged and counted in
    /// `wasmctrl_plugin_loads_waiting`, so a load that seems stuck says what it waits for.
    pub async fn acquire(&self, policy: &str, metrics: &Metrics) -> LoadPermit {
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return LoadPermit { _permit: permit };
        }
        tracing::info!(
            policy,
            max_concurrent_loads = self.size,
            "plugin load waits: other plugins are being fetched or compiled (--max-concurrent-loads)"
        );
        let started = Instant::now();
        let waiting = Waiting::new(metrics);
        let permit = self.permits.clone().acquire_owned().await;
        drop(waiting);
        let Ok(permit) = permit else {
            unreachable!("the load budget's semaphore is never closed")
        };
        tracing::info!(policy, waited = ?started.elapsed(), "plugin load proceeds");
        LoadPermit { _permit: permit }
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
    use futures::FutureExt as _;

    use super::*;

    #[tokio::test]
    async fn a_third_load_waits_while_two_hold_permits() {
        let budget = LoadBudget::new(2);
        let metrics = Metrics::new();
        let first = budget.acquire("a", &metrics).await;
        let _second = budget.acquire("b", &metrics).await;

        let mut third = std::pin::pin!(budget.acquire("c", &metrics));
        assert!((&mut third).now_or_never().is_none(), "a third permit");
        assert!(
            metrics.encode().contains("wasmctrl_plugin_loads_waiting 1"),
            "the wait is visible"
        );

        // A wait given up is no longer counted.
        let given_up = budget.acquire("d", &metrics).now_or_never();
        assert!(given_up.is_none());
        assert!(metrics.encode().contains("wasmctrl_plugin_loads_waiting 1"));

        drop(first);
        let _third = tokio::time::timeout(std::time::Duration::from_secs(5), third)
            .await
            .expect("the third load proceeds once a permit is back");
        assert!(metrics.encode().contains("wasmctrl_plugin_loads_waiting 0"));
    }
}
