use std::time::Duration;

use serde::Serialize;

use crate::Error;

/// A plugin's decision for one parent: the complete desired children and the parent's status.
///
/// Children are serialized when added, so the response holds JSON text, which is what crosses
/// the Wasm boundary; nothing is encoded twice.
#[derive(Debug, Default, Clone)]
pub struct Response {
    pub(crate) children: Vec<String>,
    pub(crate) status: Option<String>,
    pub(crate) requeue_after: Option<Duration>,
    pub(crate) events: Vec<Event>,
    pub(crate) finalized: bool,
}

/// An event to record on the parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Normal or Warning.
    pub kind: EventType,
    /// CamelCase reason, e.g. `ScaledUp`.
    pub reason: String,
    /// Human-readable message.
    pub message: String,
}

/// The Kubernetes event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Something expected happened.
    Normal,
    /// Something the user should look at.
    Warning,
}

impl Response {
    /// An empty decision: no children (every owned child would be pruned), status untouched.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a desired child: a full manifest with `apiVersion`, `kind` and `metadata.name`.
    /// k8s-openapi types serialize their `apiVersion` and `kind` themselves.
    pub fn add_child<T: Serialize + ?Sized>(&mut self, child: &T) -> Result<&mut Self, Error> {
        self.children.push(serde_json::to_string(child)?);
        Ok(self)
    }

    /// Add a desired child that is already JSON text (e.g. rendered from a template). It is
    /// not checked here; the host rejects a response whose children are not JSON objects.
    pub fn add_child_json(&mut self, json: String) -> &mut Self {
        self.children.push(json);
        self
    }

    /// Set the parent's desired status (serialized as a JSON object).
    pub fn set_status<T: Serialize + ?Sized>(&mut self, status: &T) -> Result<&mut Self, Error> {
        self.status = Some(serde_json::to_string(status)?);
        Ok(self)
    }

    /// Ask to be reconciled again after `delay`, even if nothing changes.
    pub fn requeue_after(&mut self, delay: Duration) -> &mut Self {
        self.requeue_after = Some(delay);
        self
    }

    /// Record an event on the parent.
    pub fn event(
        &mut self,
        kind: EventType,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> &mut Self {
        self.events.push(Event {
            kind,
            reason: reason.into(),
            message: message.into(),
        });
        self
    }

    /// Declare clean-up complete; lets the host remove its finalizer.
    pub fn finalized(&mut self) -> &mut Self {
        self.finalized = true;
        self
    }

    /// The desired children as JSON text.
    pub fn children(&self) -> &[String] {
        &self.children
    }
}

/// Reading a response back, for tests and tools.
impl Response {
    /// The desired child of type `K` named `name`, decoded.
    pub fn child<K>(&self, name: &str) -> Option<K>
    where
        K: k8s_openapi::Resource + serde::de::DeserializeOwned,
    {
        self.children
            .iter()
            .filter_map(|json| serde_json::from_str::<serde_json::Value>(json).ok())
            .find(|v| {
                v["apiVersion"] == K::API_VERSION
                    && v["kind"] == K::KIND
                    && v["metadata"]["name"] == name
            })
            .and_then(|v| serde_json::from_value(v).ok())
    }

    /// The desired status decoded into `T`.
    pub fn status<T: serde::de::DeserializeOwned>(&self) -> Option<T> {
        self.status
            .as_deref()
            .and_then(|json| serde_json::from_str(json).ok())
    }

    /// The desired status as JSON text.
    pub fn status_json(&self) -> Option<&str> {
        self.status.as_deref()
    }

    /// The requested requeue delay.
    pub fn requeue(&self) -> Option<Duration> {
        self.requeue_after
    }

    /// The events to record.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Whether clean-up is complete.
    pub fn is_finalized(&self) -> bool {
        self.finalized
    }
}
