//! How fast a failed watch tries again. kube-runtime's default climbs to 30 s between
//! attempts; after an API server restart that leaves the host's caches stale — and the host
//! acting on them, re-creating and re-writing what it cannot see — for up to half a minute.
//! Here the delay doubles from 500 ms to at most 5 s, and starts over after any success.
//!
//! A kube-runtime `Controller` also backs off the *merged* stream of all its watches when any
//! one of them yields an error — with its default, up to 30 s and more, during which none of
//! the watches is polled and every cache stands still. Each of the host's watches already
//! backs off on its own, so the controller's trigger backoff is [`NoExtraDelay`].

use std::time::Duration;

use kube::runtime::utils::Backoff;

const FIRST: Duration = Duration::from_millis(500);
const LONGEST: Duration = Duration::from_secs(5);

/// Retry delays for the host's watches.
#[derive(Debug, Clone)]
pub(crate) struct WatchBackoff {
    next: Duration,
}

impl Default for WatchBackoff {
    fn default() -> Self {
        Self { next: FIRST }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = (self.next * 2).min(LONGEST);
        Some(delay)
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = FIRST;
    }
}

/// A backoff that adds no delay: for a stream whose parts back off by themselves.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct NoExtraDelay;

impl Iterator for NoExtraDelay {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(Duration::ZERO)
    }
}

impl Backoff for NoExtraDelay {
    fn reset(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_five_seconds_and_starts_over_after_a_success() {
        let mut backoff = WatchBackoff::default();
        let delays: Vec<u64> = backoff
            .by_ref()
            .take(6)
            .map(|d| d.as_millis() as u64)
            .collect();
        assert_eq!(delays, [500, 1000, 2000, 4000, 5000, 5000]);
        backoff.reset();
        assert_eq!(backoff.next(), Some(FIRST));
    }
}
