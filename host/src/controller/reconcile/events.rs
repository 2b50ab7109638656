//! Kubernetes Events on parents, rate-limited: a parent failing the same way on every retry
//! produces one Event per interval, not one per attempt, and no parent gets more than
//! [`MAX_EVENTS_PER_PARENT`] Events per interval whatever reasons a plugin invents.

use std::collections::HashMap;
use std::hash::{BuildHasher as _, RandomState};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// Most Events one object may receive per interval, across all reasons.
pub const MAX_EVENTS_PER_PARENT: u32 = 30;

/// Publishes Events, at most one per (object, reason) per interval.
pub struct EventSink {
    client: Client,
    reporter: Reporter,
    min_interval: Duration,
    recent: Mutex<Recent>,
}

/// What was published lately: per (object, reason) the last time, per object the current
/// window's start and count. Both are keyed by a hash of the object's uid (and the reason)
/// under a random key of the sink's own: held as strings, the uid and reason of an entry per
/// parent would take 2 MiB at 10,000 parents. Two keys colliding (about one in 10^11 at 10,000
/// parents) would only hold an Event back, and no one can pick uids or reasons to make them.
#[derive(Default)]
struct Recent {
    ids: RandomState,
    by_reason: HashMap<u64, Instant>,
    by_object: HashMap<u64, (Instant, u32)>,
    /// When expired entries were last dropped: once per interval, not on every Event, so
    /// publishing stays O(1) however many parents there are.
    pruned: Option<Instant>,
}

/// Whether an Event was passed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// Sent (or tried: failures to publish are logged).
    Sent,
    /// The same reason was recorded on the object within the interval.
    Repeated,
    /// The object had its quota of Events for this interval.
    OverQuota,
}

impl EventSink {
    /// Events are reported as coming from `controller` (e.g. `wasmctrl/<policy>`).
    pub fn new(client: Client, controller: String, min_interval: Duration) -> Self {
        let reporter = Reporter {
            controller,
            instance: std::env::var("POD_NAME").ok(),
        };
        Self {
            client,
            reporter,
            min_interval,
            recent: Mutex::new(Recent::default()),
        }
    }

    /// Record an Event on `object`, unless the same reason was recorded on it within the
    /// interval or the object had its quota. Failure to publish is logged, never fatal:
    /// Events are advisory.
    pub async fn publish(
        &self,
        object: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        message: String,
    ) -> Published {
        let uid = object.uid.as_deref().unwrap_or_default();
        let verdict =
            crate::lock(&self.recent).admit(uid, reason, Instant::now(), self.min_interval);
        if verdict != Published::Sent {
            return verdict;
        }
        let event = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(truncate(message, 1024)),
            action: action.to_owned(),
            secondary: None,
        };
        // A recorder per Event, as kube documents it (one per reconcile): a shared one keeps
        // every Event it published for six minutes and sweeps that whole cache on each
        // publish, which at 10,000 parents is tens of MiB and O(parents) per Event. Its
        // cache only turns repeats into a series; this sink already holds repeats back.
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        if let Err(error) = recorder.publish(&event, object).await {
            tracing::warn!(reason, error = %error, "could not record event");
        }
        Published::Sent
    }
}

impl Recent {
    /// Decide whether an Event with `reason` on the object `uid` may go out at `now`, and
    /// remember it if so.
    fn admit(&mut self, uid: &str, reason: &str, now: Instant, interval: Duration) -> Published {
        let fresh = |at: &Instant| now.duration_since(*at) < interval;
        let key = self.ids.hash_one((uid, reason));
        if self.by_reason.get(&key).is_some_and(fresh) {
            return Published::Repeated;
        }
        let window = self
            .by_object
            .entry(self.ids.hash_one(uid))
            .or_insert((now, 0));
        if !fresh(&window.0) {
            *window = (now, 0);
        }
        if window.1 >= MAX_EVENTS_PER_PARENT {
            return Published::OverQuota;
        }
        window.1 += 1;
        if self.pruned.is_none_or(|at| !fresh(&at)) {
            self.by_reason.retain(|_, last| fresh(last));
            self.by_object.retain(|_, (start, _)| fresh(start));
            self.pruned = Some(now);
        }
        self.by_reason.insert(key, now);
        Published::Sent
    }
}

/// Cut `text` to at most `max` bytes on a character boundary.
pub fn truncate(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max.saturating_sub(3);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_repeats_once_per_interval_and_an_object_has_a_quota() {
        let mut recent = Recent::default();
        let start = Instant::now();
        let minute = Duration::from_secs(60);
        assert_eq!(recent.admit("a", "Failed", start, minute), Published::Sent);
        assert_eq!(
            recent.admit("a", "Failed", start, minute),
            Published::Repeated
        );
        assert_eq!(recent.admit("b", "Failed", start, minute), Published::Sent);
        for i in 1..MAX_EVENTS_PER_PARENT {
            assert_eq!(
                recent.admit("a", &format!("R{i}"), start, minute),
                Published::Sent
            );
        }
        assert_eq!(
            recent.admit("a", "OneMore", start, minute),
            Published::OverQuota
        );
        assert_eq!(recent.admit("b", "Other", start, minute), Published::Sent);
        let later = start + minute;
        assert_eq!(recent.admit("a", "OneMore", later, minute), Published::Sent);
        assert_eq!(recent.admit("a", "Failed", later, minute), Published::Sent);
    }

    #[test]
    fn expired_entries_are_dropped_once_an_interval_has_passed() {
        let mut recent = Recent::default();
        let start = Instant::now();
        let minute = Duration::from_secs(60);
        for i in 0..100 {
            recent.admit(&format!("uid-{i}"), "Reconciled", start, minute);
        }
        assert_eq!(recent.by_reason.len(), 100);
        // Within the interval nothing is swept (nothing has expired).
        recent.admit("late", "Reconciled", start + minute / 2, minute);
        assert_eq!(recent.by_reason.len(), 101);
        // After it, the first hundred have expired and go; the half-interval one stays.
        recent.admit("later", "Reconciled", start + minute + minute / 4, minute);
        assert_eq!(recent.by_reason.len(), 2, "{:?}", recent.by_reason.keys());
        assert_eq!(recent.by_object.len(), 2);
    }
}
