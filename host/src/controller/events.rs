//! Kubernetes Events on parents, rate-limited: a parent failing the same way on every retry
//! produces one Event per interval, not one per attempt, and no parent gets more than
//! [`MAX_EVENTS_PER_PARENT`] Events per interval whatever reasons a plugin invents.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// Most Events one object may receive per interval, across all reasons.
pub const MAX_EVENTS_PER_PARENT: u32 = 30;

/// Publishes Events, at most one per (object, reason) per interval.
pub struct EventSink {
    recorder: Recorder,
    min_interval: Duration,
    recent: Mutex<Recent>,
}

/// What was published lately: per (object, reason) the last time, per object the current
/// window's start and count.
#[derive(Default)]
struct Recent {
    by_reason: HashMap<(String, String), Instant>,
    by_object: HashMap<String, (Instant, u32)>,
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
            recorder: Recorder::new(client, reporter),
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
        let uid = object.uid.clone().unwrap_or_default();
        let verdict = super::context::lock(&self.recent).admit(
            uid,
            reason,
            Instant::now(),
            self.min_interval,
        );
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
        if let Err(error) = self.recorder.publish(&event, object).await {
            tracing::warn!(reason, error = %error, "could not record event");
        }
        Published::Sent
    }
}

impl Recent {
    /// Decide whether an Event with `reason` on the object `uid` may go out at `now`, and
    /// remember it if so.
    fn admit(&mut self, uid: String, reason: &str, now: Instant, interval: Duration) -> Published {
        let fresh = |at: &Instant| now.duration_since(*at) < interval;
        let key = (uid, reason.to_owned());
        if self.by_reason.get(&key).is_some_and(fresh) {
            return Published::Repeated;
        }
        let window = self.by_object.entry(key.0.clone()).or_insert((now, 0));
        if !fresh(&window.0) {
            *window = (now, 0);
        }
        if window.1 >= MAX_EVENTS_PER_PARENT {
            return Published::OverQuota;
        }
        window.1 += 1;
        self.by_reason.retain(|_, last| fresh(last));
        self.by_object.retain(|_, (start, _)| fresh(start));
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
        assert_eq!(
            recent.admit("a".into(), "Failed", start, minute),
            Published::Sent
        );
        assert_eq!(
            recent.admit("a".into(), "Failed", start, minute),
            Published::Repeated
        );
        assert_eq!(
            recent.admit("b".into(), "Failed", start, minute),
            Published::Sent
        );
        for i in 1..MAX_EVENTS_PER_PARENT {
            assert_eq!(
                recent.admit("a".into(), &format!("R{i}"), start, minute),
                Published::Sent
            );
        }
        assert_eq!(
            recent.admit("a".into(), "OneMore", start, minute),
            Published::OverQuota
        );
        assert_eq!(
            recent.admit("b".into(), "Other", start, minute),
            Published::Sent
        );
        let later = start + minute;
        assert_eq!(
            recent.admit("a".into(), "OneMore", later, minute),
            Published::Sent
        );
        assert_eq!(
            recent.admit("a".into(), "Failed", later, minute),
            Published::Sent
        );
    }
}
