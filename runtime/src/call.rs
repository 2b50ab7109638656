//! The request and response of one reconcile call as the controller sees them: plain data,
//! no wasmtime types. Responses are validated here, once, so everything downstream can trust
//! their shape.

use std::time::Duration;

use serde_json::{Map, Value};

use super::contract::wit;
use super::error::{CallError, ReportedKind};
use super::limits::Limits;

/// A JSON object: one Kubernetes object or a status.
pub type JsonObject = Map<String, Value>;

/// What the host sends a plugin. Objects are JSON text, as they cross the boundary.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileRequest {
    /// The parent object.
    pub parent: String,
    /// Observed children owned by the parent.
    pub children: Vec<ObservedObject>,
    /// Related read-only objects.
    pub related: Vec<ObservedObject>,
    /// The policy's plugin config.
    pub config: Option<String>,
    /// The parent is being deleted.
    pub finalizing: bool,
}

/// An observed object and its identity. The host knows the identity from its caches, so the
/// plugin does not have to parse every object to find the ones it wants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ObservedObject {
    /// `apiVersion`.
    pub api_version: String,
    /// `kind`.
    pub kind: String,
    /// `metadata.name`.
    pub name: String,
    /// The object as JSON.
    pub json: String,
}

impl ObservedObject {
    /// Describe `object`, reading its identity from its fields (absent fields read as empty).
    pub fn from_value(object: &Value) -> Self {
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        Self {
            api_version: text(&object["apiVersion"]),
            kind: text(&object["kind"]),
            name: text(&object["metadata"]["name"]),
            json: object.to_string(),
        }
    }
}

impl From<ObservedObject> for wit::Observed {
    fn from(o: ObservedObject) -> Self {
        Self {
            api_version: o.api_version,
            kind: o.kind,
            name: o.name,
            object: o.json,
        }
    }
}

/// A plugin's decision, validated: every child and the status are JSON objects, and the whole
/// fits the plugin's limits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReconcileResponse {
    /// Desired children.
    pub children: Vec<JsonObject>,
    /// Desired parent status.
    pub status: Option<JsonObject>,
    /// Requested requeue delay.
    pub requeue_after: Option<Duration>,
    /// Events to record on the parent.
    pub events: Vec<PluginEvent>,
    /// Clean-up is complete (finalizing requests only).
    pub finalized: bool,
}

/// An event the plugin asks the host to record.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PluginEvent {
    /// `Normal` or `Warning`.
    #[serde(rename = "type")]
    pub type_: EventType,
    /// CamelCase reason.
    pub reason: String,
    /// Message.
    pub message: String,
}

/// Kubernetes event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum EventType {
    /// Expected.
    Normal,
    /// Needs attention.
    Warning,
}

impl From<ReconcileRequest> for wit::ReconcileRequest {
    fn from(r: ReconcileRequest) -> Self {
        Self {
            parent: r.parent,
            children: r.children.into_iter().map(Into::into).collect(),
            related: r.related.into_iter().map(Into::into).collect(),
            config: r.config,
            finalizing: r.finalizing,
        }
    }
}

/// Map the plugin's answer to the host's types, enforcing the output limits.
pub(crate) fn accept(
    answer: Result<wit::ReconcileResponse, wit::ReconcileError>,
    limits: &Limits,
) -> Result<ReconcileResponse, CallError> {
    let response = match answer {
        Ok(response) => response,
        Err(error) => {
            let (kind, message) = match error {
                wit::ReconcileError::InvalidParent(m) => (ReportedKind::InvalidParent, m),
                wit::ReconcileError::Transient(m) => (ReportedKind::Transient, m),
                wit::ReconcileError::Permanent(m) => (ReportedKind::Permanent, m),
            };
            return Err(CallError::Reported { kind, message });
        }
    };
    let size_bytes = response.children.iter().map(String::len).sum::<usize>()
        + response.status.as_ref().map_or(0, String::len)
        + response
            .events
            .iter()
            .map(|e| e.reason.len() + e.message.len())
            .sum::<usize>();
    if size_bytes > limits.max_output_bytes {
        return Err(CallError::OutputTooLarge {
            size_bytes,
            limit_bytes: limits.max_output_bytes,
        });
    }
    if response.children.len() > limits.max_children {
        return Err(CallError::TooManyChildren {
            count: response.children.len(),
            limit: limits.max_children,
        });
    }
    let children = response
        .children
        .iter()
        .enumerate()
        .map(|(i, json)| {
            serde_json::from_str::<JsonObject>(json).map_err(|e| {
                CallError::InvalidOutput(format!("child #{i} is not a JSON object: {e}"))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let status = response
        .status
        .as_deref()
        .map(|json| {
            serde_json::from_str::<JsonObject>(json)
                .map_err(|e| CallError::InvalidOutput(format!("status is not a JSON object: {e}")))
        })
        .transpose()?;
    Ok(ReconcileResponse {
        children,
        status,
        requeue_after: response.requeue_after_ms.map(Duration::from_millis),
        events: response
            .events
            .into_iter()
            .map(|e| PluginEvent {
                type_: match e.kind {
                    wit::EventType::Normal => EventType::Normal,
                    wit::EventType::Warning => EventType::Warning,
                },
                reason: e.reason,
                message: e.message,
            })
            .collect(),
        finalized: response.finalized,
    })
}
