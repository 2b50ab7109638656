//! Kubernetes Events on parents, rate-limited: a parent failing the same way on every retry
//! produces one Event per interval, not one per attempt.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// Publishes Events, at most one per (object, reason) per interval.
pub struct EventSink {
    recorder: Recorder,
    min_interval: Duration,
    recent: Mutex<HashMap<(String, String), Instant>>,
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
            recent: Mutex::new(HashMap::new()),
        }
    }

    /// Record an Event on `object`, unless the same reason was recorded on it within the
    /// interval. Failure to publish is logged, never fatal: Events are advisory.
    pub async fn publish(
        &self,
        object: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        message: String,
    ) {
        let key = (object.uid.clone().unwrap_or_default(), reason.to_owned());
        {
            let mut recent = self
                .recent
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = Instant::now();
            if recent
                .get(&key)
                .is_some_and(|last| now.duration_since(*last) < self.min_interval)
            {
                return;
            }
            recent.retain(|_, last| now.duration_since(*last) < self.min_interval);
            recent.insert(key, now);
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
