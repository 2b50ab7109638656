//! Whether the host is ready: it has listed the ReconcilePolicies it runs, and every policy
//! controller that got as far as watching has its caches synced. A standby (once leader
//! election exists) is ready on the same terms: its caches are warm for a takeover.
//!
//! A policy whose kinds cannot be watched holds readiness back — a new host that cannot see
//! what it should manage must not replace a working one — and says why on the policy.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The host's readiness, shared by the policy watch, the policy controllers and `/readyz`.
#[derive(Debug, Default)]
pub struct Readiness {
    policies_listed: AtomicBool,
    syncing: AtomicUsize,
}

impl Readiness {
    /// The first list of ReconcilePolicies is in.
    pub fn policies_listed(&self) {
        self.policies_listed.store(true, Ordering::Release);
    }

    /// A policy controller starts watching; ready again once the guard reports its caches
    /// synced (or is dropped, when the controller stops).
    pub fn syncing(self: &Arc<Self>) -> SyncGuard {
        self.syncing.fetch_add(1, Ordering::AcqRel);
        SyncGuard {
            readiness: Some(self.clone()),
        }
    }

    /// Why the host is not ready, if it is not.
    pub fn not_ready(&self) -> Option<String> {
        if !self.policies_listed.load(Ordering::Acquire) {
            return Some("ReconcilePolicies not listed yet".into());
        }
        match self.syncing.load(Ordering::Acquire) {
            0 => None,
            n => Some(format!(
                "{n} policy controller(s) waiting for caches to sync"
            )),
        }
    }
}

/// A policy controller whose caches have not synced yet.
#[derive(Debug)]
pub struct SyncGuard {
    readiness: Option<Arc<Readiness>>,
}

impl SyncGuard {
    /// A guard that holds nothing back: for a controller started again after a panic, which
    /// the host's readiness no longer waits for.
    pub fn already_synced() -> Self {
        Self { readiness: None }
    }

    /// The caches synced.
    pub fn synced(&mut self) {
        if let Some(readiness) = self.readiness.take() {
            readiness.syncing.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for SyncGuard {
    fn drop(&mut self) {
        self.synced();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_once_policies_are_listed_and_every_controller_synced() {
        let readiness = Arc::new(Readiness::default());
        assert!(readiness.not_ready().is_some(), "nothing listed yet");
        readiness.policies_listed();
        assert_eq!(readiness.not_ready(), None);
        let mut a = readiness.syncing();
        let b = readiness.syncing();
        assert!(
            readiness
                .not_ready()
                .is_some_and(|why| why.starts_with("2 "))
        );
        a.synced();
        a.synced();
        assert!(
            readiness
                .not_ready()
                .is_some_and(|why| why.starts_with("1 "))
        );
        drop(b);
        drop(a);
        assert_eq!(
            readiness.not_ready(),
            None,
            "a stopped controller no longer counts"
        );
    }
}
