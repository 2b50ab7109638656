//! The record `wasmctrl explain` shows of one webhook answer ([`WebhookRecord`]), kept in the
//! host's explain store beside the reconciles of the same object: no field of the object,
//! the plugin's own words, and the paths its defaults set.

use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};

use crate::explain::{Explain, ParentRef, WebhookRecord, timestamp};

/// What an answer leaves for its record, besides the response.
pub(super) struct Answered {
    /// When the review arrived.
    pub at: jiff::Timestamp,
    /// How long the answer took.
    pub took: std::time::Duration,
    /// The plugin that answered.
    pub plugin: Option<String>,
    /// The violations, `field: message`.
    pub violations: Vec<String>,
    /// The fields the defaults set, as JSON pointers.
    pub defaulted: Vec<String>,
}

/// Keep the record of `response` to `request` for `policy`. Quiet answers (allowed,
/// patched) go first when a parent's records are over their bound; denials and failures
/// stay to be explained.
pub(super) fn keep(
    explain: &Explain,
    policy: &str,
    webhook: &str,
    request: &AdmissionRequest<DynamicObject>,
    response: &AdmissionResponse,
    outcome: &str,
    answered: Answered,
) {
    if explain.store.bounds().max_bytes == 0 {
        return;
    }
    let object = request.object.as_ref().or(request.old_object.as_ref());
    let kind = &request.kind;
    let parent = ParentRef {
        api_version: if kind.group.is_empty() {
            kind.version.clone()
        } else {
            format!("{}/{}", kind.group, kind.version)
        },
        kind: kind.kind.clone(),
        plural: request.resource.resource.clone(),
        namespace: request.namespace.clone(),
        name: request.name.clone(),
        uid: object
            .and_then(|o| o.metadata.uid.clone())
            .unwrap_or_default(),
        generation: object.and_then(|o| o.metadata.generation),
        resource_version: object.and_then(|o| o.metadata.resource_version.clone()),
    };
    let refused = !response.allowed;
    let record = WebhookRecord {
        at: timestamp(answered.at),
        policy: policy.to_owned(),
        parent,
        webhook: webhook.to_owned(),
        operation: match request.operation {
            Operation::Create => "CREATE",
            Operation::Update => "UPDATE",
            Operation::Delete => "DELETE",
            Operation::Connect => "CONNECT",
        }
        .to_owned(),
        user: request.user_info.username.clone().unwrap_or_default(),
        plugin: answered.plugin,
        outcome: outcome.to_owned(),
        duration_ms: (answered.took.as_secs_f64() * 1e6).round() / 1e3,
        message: refused.then(|| response.result.message.clone()),
        violations: answered.violations,
        warnings: response.warnings.clone().unwrap_or_default(),
        defaulted: answered.defaulted,
        conversion: None,
    };
    let eventful = refused || outcome.starts_with("failed");
    match serde_json::to_string(&record) {
        Ok(json) => explain.store.push_answer(&record.parent, json, eventful),
        Err(error) => tracing::warn!(%error, "could not keep the webhook answer's record"),
    }
}

/// The fields a JSON patch sets (its operations' paths), not their values.
pub(super) fn patched_paths(patch: &json_patch::Patch) -> Vec<String> {
    serde_json::to_value(patch)
        .ok()
        .and_then(|ops| ops.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|op| op["path"].as_str().map(str::to_owned))
        .collect()
}
