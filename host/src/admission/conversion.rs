//! One ConversionReview answered by a policy's plugin: every object of the review rewritten
//! to the version the API server asks for, by the plugin's `convert`, each answer checked
//! by the runtime (the version reached; kind, name, namespace and uid kept; the rest of the
//! metadata put back).
//!
//! A conversion is all or nothing: when one object cannot be converted, the review fails
//! with that object's name and the plugin's message, and the API server fails the read or
//! write that needed it. Nothing is stored half-converted. Unlike a validating webhook there
//! is no failure policy to fall back on: the API server has no other way to read the object.
//!
//! The active plugin converts: a rollout's candidate serves its share of reconciles, but an
//! object must read the same whichever host or replica the API server asks, so a candidate
//! converts nothing until it is promoted (and its converter is checked before it serves).

use std::sync::Arc;

use futures::{StreamExt as _, TryStreamExt as _};
use kube::core::Status;
use kube::core::conversion::{ConversionRequest, ConversionResponse};
use serde_json::Value;

use crate::explain::{Explain, ParentRef, WebhookRecord, timestamp};
use crate::plugin::Plugin;

/// Objects of one review converted at once (each in a sandbox of its own); the others wait.
/// A review carries a page of a list at most (500 objects by default).
pub const OBJECTS_AT_ONCE: usize = 4;

/// The parent kind, as `explain` knows its records.
#[derive(Debug, Clone)]
pub struct ConvertedKind {
    /// The version the policy reconciles at, `group/version`.
    pub api_version: String,
    /// The kind.
    pub kind: String,
    /// Its plural.
    pub plural: String,
}

/// Who converts a policy's parent kind.
#[derive(Clone)]
pub struct Converter {
    /// The policy, for messages and metrics.
    pub policy: String,
    /// The policy's share of the call slots.
    pub tenant: String,
    /// The plugin that converts now (the policy's active plugin).
    pub plugin: Arc<dyn Fn() -> Plugin + Send + Sync>,
    /// The kind, for the records `explain` keeps.
    pub kind: ConvertedKind,
    /// Where each conversion's record is kept; none keeps none.
    pub explain: Option<Arc<Explain>>,
}

/// How a review ended, for metrics: `converted` or `failed`.
pub type Outcome = &'static str;

/// Convert every object of `request`, in order.
pub async fn answer(
    converter: &Converter,
    mut request: ConversionRequest,
) -> (ConversionResponse, Outcome) {
    let plugin = (converter.plugin)();
    let desired = request.desired_api_version.clone();
    let objects = std::mem::take(&mut request.objects);
    let converted: Result<Vec<Value>, String> = futures::stream::iter(objects)
        .map(|object| convert_one(converter, &plugin, object, &desired))
        .buffered(OBJECTS_AT_ONCE)
        .try_collect()
        .await;
    let response = ConversionResponse::for_request(request);
    match converted {
        Ok(objects) => (response.success(objects), "converted"),
        Err(message) => (
            response.failure(Status::failure(&message, "ConversionFailed")),
            "failed",
        ),
    }
}

/// One object converted, or why not (naming it).
async fn convert_one(
    converter: &Converter,
    plugin: &Plugin,
    object: Value,
    desired: &str,
) -> Result<Value, String> {
    let from = object["apiVersion"].as_str().unwrap_or_default().to_owned();
    if from == desired {
        return Ok(object);
    }
    let named = named(&object);
    let at = jiff::Timestamp::now();
    let started = std::time::Instant::now();
    let result = match object {
        Value::Object(map) => plugin
            .convert(&converter.tenant, map, desired)
            .await
            .map(Value::Object)
            .map_err(|error| error.to_string()),
        _ => Err("the API server sent no JSON object".to_owned()),
    };
    let result = result.map_err(|error| {
        format!(
            "policy {}'s plugin could not convert {named} from {from} to {desired}: {error}",
            converter.policy
        )
    });
    if let Some(explain) = &converter.explain {
        keep(
            explain,
            converter,
            plugin,
            &named,
            (&from, desired),
            (at, started.elapsed()),
            &result,
        );
    }
    result
}

/// `namespace/name` (or `name`), for messages.
fn named(object: &Value) -> String {
    let metadata = &object["metadata"];
    let name = metadata["name"].as_str().unwrap_or("(no name)");
    match metadata["namespace"].as_str() {
        Some(namespace) => format!("{namespace}/{name}"),
        None => name.to_owned(),
    }
}

/// Keep the record of one object's conversion: quiet when it converted (those go first when
/// a parent's records are over their bound), eventful when it failed.
fn keep(
    explain: &Explain,
    converter: &Converter,
    plugin: &Plugin,
    named: &str,
    (from, to): (&str, &str),
    (at, took): (jiff::Timestamp, std::time::Duration),
    result: &Result<Value, String>,
) {
    if explain.store.bounds().max_bytes == 0 {
        return;
    }
    let (namespace, name) = match named.split_once('/') {
        Some((namespace, name)) => (Some(namespace.to_owned()), name.to_owned()),
        None => (None, named.to_owned()),
    };
    let kind = &converter.kind;
    let record = WebhookRecord {
        at: timestamp(at),
        policy: converter.policy.clone(),
        parent: ParentRef {
            api_version: kind.api_version.clone(),
            kind: kind.kind.clone(),
            plural: kind.plural.clone(),
            namespace,
            name,
            uid: String::new(),
            generation: None,
            resource_version: None,
        },
        webhook: "convert".to_owned(),
        operation: "CONVERT".to_owned(),
        user: String::new(),
        plugin: Some(plugin.digest().to_string()),
        outcome: if result.is_ok() {
            "converted"
        } else {
            "failed"
        }
        .to_owned(),
        duration_ms: (took.as_secs_f64() * 1e6).round() / 1e3,
        message: result.as_ref().err().cloned(),
        violations: Vec::new(),
        warnings: Vec::new(),
        defaulted: Vec::new(),
        conversion: Some(format!("{from} → {to}")),
    };
    match serde_json::to_string(&record) {
        Ok(json) => explain
            .store
            .push(&record.parent, json, None, result.is_err()),
        Err(error) => tracing::warn!(%error, "could not keep the conversion's record"),
    }
}

/// Convert `object` to `to` and back to its own version with `plugin`, on behalf of
/// `tenant`: what failed, or what does not come back (a conversion that loses what the other
/// version holds), if anything. How a candidate's converter is checked before it serves.
pub async fn round_trip(
    plugin: &Plugin,
    tenant: &str,
    object: &crate::plugin::JsonObject,
    to: &str,
) -> Result<(), String> {
    let Some(from) = object.get("apiVersion").and_then(Value::as_str) else {
        return Err("the object has no apiVersion to convert back to".to_owned());
    };
    let there = plugin
        .convert(tenant, object.clone(), to)
        .await
        .map_err(|error| format!("converting to {to} failed: {error}"))?;
    let back = plugin
        .convert(tenant, there, from)
        .await
        .map_err(|error| format!("converting back from {to} to {from} failed: {error}"))?;
    if &back == object {
        return Ok(());
    }
    let differs = ["spec", "status", "metadata"]
        .into_iter()
        .find(|field| back.get(*field) != object.get(*field))
        .unwrap_or("the object");
    Err(format!(
        "converting to {to} and back to {from} does not give the original ({differs} differs)"
    ))
}

/// The apiVersions of `versions` in the group of `api_version` (`group/version`) other than
/// its own: where a parent at `api_version` is converted to.
pub fn other_versions(api_version: &str, versions: &[String]) -> Vec<String> {
    let (group, own) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    versions
        .iter()
        .filter(|v| v.as_str() != own)
        .map(|v| {
            if group.is_empty() {
                v.clone()
            } else {
                format!("{group}/{v}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parent_is_converted_to_every_other_version_of_its_group() {
        let versions = ["v1alpha1".to_owned(), "v1".to_owned(), "v2".to_owned()];
        assert_eq!(
            other_versions("example.com/v1", &versions),
            ["example.com/v1alpha1", "example.com/v2"]
        );
    }

    #[test]
    fn objects_are_named_with_their_namespace() {
        let object = serde_json::json!({"metadata": {"name": "a", "namespace": "team"}});
        assert_eq!(named(&object), "team/a");
        assert_eq!(named(&serde_json::json!({"metadata": {"name": "b"}})), "b");
    }
}
