//! How fast a failed watch tries again. kube-runtime's default climbs to 30 s between
//! attempts; after an API server restart that leaves the host's caches stale — and the host
//! acting on them, re-creating and re-writing what it cannot see — for up to half a minute.
//! Here the delay doubles from 500 ms to at most 5 s.
//!
//! The delay starts over only after the watch has gone [`QUIET`] without an error. A watch
//! reports an (error-free) "list starting" event before every attempt, and starting over on
//! that would retry a kind that is not served every 500 ms for ever.
//!
//! A kube-runtime `Controller` also backs off the *merged* stream of all its watches when any
//! one of them yields an error — with its default, up to 30 s and more, during which none of
//! the watches is polled and every cache stands still. Each of the host's watches already
//! backs off on its own, so the controller's trigger backoff is [`NoExtraDelay`].

use std::time::{Duration, Instant};

use kube::runtime::utils::Backoff;

const FIRST: Duration = Duration::from_millis(500);
const LONGEST: Duration = Duration::from_secs(5);
/// How long a watch must go without an error before its delay starts over.
const QUIET: Duration = Duration::from_secs(10);

/// Retry delays for the host's watches.
#[derive(Debug, Clone)]
pub(crate) struct WatchBackoff {
    next: Duration,
    last_error: Option<Instant>,
    quiet: Duration,
}

impl Default for WatchBackoff {
    fn default() -> Self {
        Self {
            next: FIRST,
            last_error: None,
            quiet: QUIET,
        }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.last_error = Some(Instant::now());
        let delay = self.next;
        self.next = (self.next * 2).min(LONGEST);
        Some(delay)
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        if self.last_error.is_none_or(|at| at.elapsed() >= self.quiet) {
            self.next = FIRST;
        }
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

    fn millis(backoff: &mut WatchBackoff) -> u128 {
        backoff.next().map_or(0, |d| d.as_millis())
    }

    #[test]
    fn doubles_to_five_seconds_even_when_reset_between_errors() {
        let mut backoff = WatchBackoff::default();
        let mut delays = Vec::new();
        for _ in 0..6 {
            delays.push(millis(&mut backoff));
            // The watch's "list starting" event between two failed attempts.
            backoff.reset();
        }
        assert_eq!(delays, [500, 1000, 2000, 4000, 5000, 5000]);
    }

    #[test]
    fn starts_over_once_quiet_long_enough() {
        let mut backoff = WatchBackoff {
            quiet: Duration::ZERO,
            ..WatchBackoff::default()
        };
        assert_eq!(millis(&mut backoff), 500);
        assert_eq!(millis(&mut backoff), 1000);
        backoff.reset();
        assert_eq!(millis(&mut backoff), 500);
    }
}
