//! Per-parent exponential backoff. kube-runtime requeues a failed object after whatever delay
//! the error policy names and keeps no history, so the history lives here: each failure of a
//! parent doubles its next delay, a success forgets it.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

/// Failure counts per key and the schedule they map to.
#[derive(Debug)]
pub struct Backoff<K> {
    base: Duration,
    max: Duration,
    failures: Mutex<HashMap<K, u32>>,
}

/// One failure's place in the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    /// How many times in a row this key has failed, this time included.
    pub attempt: u32,
    /// How long to wait before the next attempt.
    pub delay: Duration,
}

impl<K: Eq + Hash + Clone> Backoff<K> {
    /// Delays start at `base` and double up to `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Record a failure of `key` and return when to retry it.
    pub fn failed(&self, key: &K) -> Retry {
        let mut failures = self.lock();
        let attempt = failures.entry(key.clone()).or_insert(0);
        *attempt = attempt.saturating_add(1);
        Retry {
            attempt: *attempt,
            delay: self.delay(*attempt),
        }
    }

    /// Forget `key`'s failures: its next failure starts the schedule over.
    pub fn succeeded(&self, key: &K) {
        self.lock().remove(key);
    }

    /// Drop the history of keys that no longer exist.
    pub fn retain(&self, mut keep: impl FnMut(&K) -> bool) {
        self.lock().retain(|key, _| keep(key));
    }

    /// Whether `key` is failing now.
    pub fn is_failing(&self, key: &K) -> bool {
        self.lock().contains_key(key)
    }

    /// How many keys are currently failing.
    pub fn failing(&self) -> usize {
        self.lock().len()
    }

    fn delay(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        self.base
            .checked_mul(1 << doublings)
            .map_or(self.max, |d| d.min(self.max))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, u32>> {
        // The map holds plain counters; a panic elsewhere cannot leave it inconsistent.
        crate::lock(&self.failures)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_resets_on_success() {
        let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(10));
        let delays: Vec<u64> = (0..6)
            .map(|_| backoff.failed(&"a").delay.as_secs())
            .collect();
        assert_eq!(delays, [1, 2, 4, 8, 10, 10]);
        assert_eq!(
            backoff.failed(&"b").delay,
            Duration::from_secs(1),
            "keys are independent"
        );
        assert_eq!(backoff.failing(), 2);
        backoff.succeeded(&"a");
        let retry = backoff.failed(&"a");
        assert_eq!((retry.attempt, retry.delay), (1, Duration::from_secs(1)));
    }

    #[test]
    fn survives_absurd_attempt_counts() {
        let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(300));
        for _ in 0..100 {
            backoff.failed(&1);
        }
        assert_eq!(backoff.failed(&1).delay, Duration::from_secs(300));
        backoff.retain(|k| *k != 1);
        assert_eq!(backoff.failing(), 0);
    }
}
