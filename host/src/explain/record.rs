//! What the host remembers of one reconcile: the record `wasmctrl explain` prints.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::case::Case;

/// RFC 3339 in UTC with exactly three decimals, so records from two replicas sort by time
/// as text.
pub fn timestamp(at: jiff::Timestamp) -> String {
    at.strftime("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
}

/// One reconcile of one parent, step by step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// When the reconcile started (RFC 3339, milliseconds).
    pub at: String,
    /// The policy that reconciled the parent.
    pub policy: String,
    /// The parent, as the reconcile read it.
    pub parent: ParentRef,
    /// The plugin that decided, when one was called.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<String>,
    /// How the reconcile ended.
    pub result: RecordResult,
    /// Wall-clock time of the whole reconcile, in milliseconds.
    pub duration_ms: f64,
    /// Time per step, in the order they ran.
    pub steps: Vec<StepTime>,
    /// What happened to each child: the desired ones, then the pruned ones.
    #[serde(default)]
    pub children: Vec<ChildRecord>,
    /// The status the reconcile wrote, or why it wrote none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<StatusRecord>,
    /// The Events the reconcile asked for.
    #[serde(default)]
    pub events: Vec<EventRecord>,
    /// Why the reconcile failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorRecord>,
    /// The candidate plugin's shadow verdict for this parent, when it has a candidate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<String>,
    /// What the plugin was asked and answered; `explain --save` writes it as a case file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub case: Option<Case>,
}

/// One admission review a policy's plugin answered: what `wasmctrl explain` shows beside the
/// reconciles. It keeps no field of the object written (the defaults as the paths they set,
/// not their values); the violations and warnings are the plugin's words, as the client got
/// them. Whoever may read the object's records (`get` on it) reads these.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WebhookRecord {
    /// When the review arrived (RFC 3339, milliseconds).
    pub at: String,
    /// The policy whose webhook it was.
    pub policy: String,
    /// The object written, as the review named it.
    pub parent: ParentRef,
    /// `validate`, `default` or `convert`.
    pub webhook: String,
    /// `CREATE`, `UPDATE`, `DELETE`, or `CONVERT`.
    pub operation: String,
    /// Who wrote.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub user: String,
    /// The plugin that answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<String>,
    /// `allowed`, `denied`, `patched`, `failed_closed`, `failed_open`, `unserved`.
    pub outcome: String,
    /// Wall-clock time of the answer, in milliseconds.
    pub duration_ms: f64,
    /// The denial or the failure, as the client saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The fields the plugin found wrong.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub violations: Vec<String>,
    /// The warnings the client got.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// The fields the defaults set, as JSON pointers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub defaulted: Vec<String>,
    /// A conversion's versions, `from → to`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversion: Option<String>,
}

/// A record `wasmctrl explain` shows: a reconcile, or a webhook answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Explained {
    /// A webhook answer (tried first: it has the fields a reconcile's record lacks).
    Webhook(Box<WebhookRecord>),
    /// A reconcile.
    Reconcile(Box<Record>),
}

impl Explained {
    /// When it happened (RFC 3339).
    pub fn at(&self) -> &str {
        match self {
            Self::Webhook(record) => &record.at,
            Self::Reconcile(record) => &record.at,
        }
    }
}

/// Which parent a record is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ParentRef {
    /// `apiVersion`.
    pub api_version: String,
    /// `kind`.
    pub kind: String,
    /// The resource's plural name, so `explain myapps/x` finds it too.
    pub plural: String,
    /// `metadata.namespace`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid`.
    #[serde(default)]
    pub uid: String,
    /// `metadata.generation` as read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// `metadata.resourceVersion` as read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
}

/// How a reconcile ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecordResult {
    /// The plugin decided, and the cluster now reflects it.
    Reconciled,
    /// Something failed; `error` says what.
    Failed,
    /// The parent is being deleted and the plugin has not finished cleaning up.
    Finalizing,
    /// The plugin finished cleaning up and the finalizer was removed.
    Finalized,
    /// The parent is being deleted without a finalizer of this policy: nothing to do.
    Deleting,
}

/// Time one step took.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StepTime {
    /// The step: `caches`, `finalizer`, `plugin`, `validate`, `apply`, `prune`, `status`,
    /// `events`.
    pub step: String,
    /// Milliseconds.
    pub ms: f64,
}

/// What the reconcile did to one child.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChildRecord {
    /// `kind`.
    pub kind: String,
    /// `metadata.name`.
    pub name: String,
    /// What was done.
    pub action: ChildAction,
    /// For a changed child, the desired fields whose live value differed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<String>,
    /// For a waiting child, what it waits for and why, e.g. `Job migrate: not complete`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
}

/// What a reconcile did to a child.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChildAction {
    /// It did not exist and was created.
    Created,
    /// It existed and drifted from the desired state; it was applied.
    Changed,
    /// It was already as desired; no write.
    Unchanged,
    /// It is no longer desired and was deleted.
    Pruned,
    /// It depends on a child that is not ready yet, so it was not applied.
    Waiting,
}

/// The status a reconcile wrote, if any.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusRecord {
    /// Whether it was written (an unchanged status costs no write).
    pub written: bool,
    /// The status as desired.
    pub status: Value,
}

/// An Event the reconcile asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventRecord {
    /// `Normal` or `Warning`.
    #[serde(rename = "type")]
    pub type_: String,
    /// The reason.
    pub reason: String,
    /// The message.
    pub message: String,
}

/// Why a reconcile failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorRecord {
    /// The condition reason (`PluginReportedError`, `ApplyFailed`, ...).
    pub reason: String,
    /// The error, with the plugin's own message when it reported one.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parent() -> ParentRef {
        ParentRef {
            api_version: "example.com/v1".to_owned(),
            kind: "MyApp".to_owned(),
            plural: "myapps".to_owned(),
            namespace: Some("ns".to_owned()),
            name: "web".to_owned(),
            uid: String::new(),
            generation: None,
            resource_version: None,
        }
    }

    #[test]
    fn a_reader_tells_a_webhook_answer_from_a_reconcile() {
        let reconcile = Record {
            at: "2026-12-06T07:00:00.000Z".to_owned(),
            policy: "p".to_owned(),
            parent: parent(),
            plugin: None,
            result: RecordResult::Reconciled,
            duration_ms: 1.0,
            steps: Vec::new(),
            children: Vec::new(),
            status: None,
            events: Vec::new(),
            error: None,
            shadow: None,
            case: None,
        };
        let webhook = WebhookRecord {
            at: "2026-12-06T07:00:01.000Z".to_owned(),
            policy: "p".to_owned(),
            parent: parent(),
            webhook: "validate".to_owned(),
            operation: "CREATE".to_owned(),
            user: "jane".to_owned(),
            plugin: None,
            outcome: "denied".to_owned(),
            duration_ms: 0.4,
            message: Some("no".to_owned()),
            violations: vec!["spec.x: no".to_owned()],
            warnings: Vec::new(),
            defaulted: Vec::new(),
            conversion: None,
        };
        let read = |json: String| serde_json::from_str::<Explained>(&json).expect("a record");
        let reconcile_read = read(serde_json::to_string(&reconcile).expect("JSON"));
        assert_eq!(reconcile_read, Explained::Reconcile(Box::new(reconcile)));
        let webhook_read = read(serde_json::to_string(&webhook).expect("JSON"));
        assert_eq!(webhook_read.at(), "2026-12-06T07:00:01.000Z");
        assert_eq!(webhook_read, Explained::Webhook(Box::new(webhook)));
    }
}
