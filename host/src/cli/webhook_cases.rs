//! Golden cases for the webhooks a plugin serves, as `wasmctrl plugin test` runs them beside
//! reconcile cases, and one webhook call on a given object, as `plugin run --validate |
//! --default | --convert-to` makes it.
//!
//! A case file names its webhook by its one top-level key besides `expect` (one case per
//! file):
//!
//! ```yaml
//! validate:                 # or `default:`
//!   object: {...}           # the object as written (absent for a DELETE)
//!   oldObject: {...}        # the object as stored: makes the write an UPDATE (or a DELETE)
//!   operation: UPDATE       # optional; from the objects given when left out
//!   user: {username: jane, groups: [dev]}
//!   config: {...}           # the policy's plugin config
//! expect: {allowed: false, violations: [{field: spec.replicas, message: ...}], warnings: []}
//! ```
//!
//! ```yaml
//! convert:
//!   object: {...}           # at one version of the kind
//!   to: example.com/v1alpha1
//! expect: {object: {...}}   # the object at `to`; converting it back must give `object`
//! ```

use std::path::Path;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::plugin::{
    AdmissionRequest, AdmissionVerdict, CallError, JsonObject, Operation, Plugin, UserInfo,
};

/// A write the plugin is asked to validate or default.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Write {
    /// CREATE, UPDATE or DELETE; from the objects given when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<Operation>,
    /// The object as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<JsonObject>,
    /// The object as stored before the write.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_object: Option<JsonObject>,
    /// Who writes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<UserInfo>,
    /// The plugin config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<Value>,
}

impl Write {
    /// The request the runtime takes: the operation is CREATE for an object alone, UPDATE
    /// for an object and an old one, DELETE for an old one alone, unless the case says.
    pub fn request(&self) -> anyhow::Result<AdmissionRequest> {
        let operation = match (self.operation, &self.object, &self.old_object) {
            (Some(operation), _, _) => operation,
            (None, Some(_), None) => Operation::Create,
            (None, Some(_), Some(_)) => Operation::Update,
            (None, None, Some(_)) => Operation::Delete,
            (None, None, None) => anyhow::bail!("a write needs `object`, `oldObject` or both"),
        };
        Ok(AdmissionRequest {
            operation,
            object: self.object.clone(),
            old_object: self.old_object.clone(),
            user: self.user.clone(),
            config: self.config.as_ref().map(Value::to_string),
        })
    }
}

/// An object to convert, and the version to convert it to.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Conversion {
    /// The object, at one version of its kind.
    pub object: JsonObject,
    /// The `apiVersion` to convert it to.
    pub to: String,
}

/// One golden case of a webhook.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookCase {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    validate: Option<Write>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    default: Option<Write>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    convert: Option<Conversion>,
    /// The answer the case expects, as `plugin run` prints it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expect: Option<Value>,
}

/// How a case ended.
pub enum CaseResult {
    /// The answer is the one expected.
    Passed,
    /// It is not; what differs.
    Failed(String),
    /// It was not, and the case now expects the plugin's answer; what differed.
    Updated(String),
}

/// Whether `text` (a case file) is a webhook case rather than a reconcile case.
pub fn is_webhook_case(text: &str) -> bool {
    serde_yaml_ng::from_str::<Value>(text).is_ok_and(|case| {
        ["validate", "default", "convert"]
            .iter()
            .any(|key| case.get(key).is_some())
    })
}

/// The plugin's `validate` answer as `plugin run` prints it and cases expect it.
pub fn verdict_output(verdict: &AdmissionVerdict) -> Value {
    serde_json::json!({
        "allowed": verdict.allowed(),
        "violations": verdict.violations,
        "warnings": verdict.warnings,
    })
}

/// A failed call as a case expects it.
fn error_output(error: &CallError) -> Value {
    serde_json::json!({ "error": error.to_string() })
}

/// Call `validate` on `write`: the verdict as cases expect it.
pub async fn validate(plugin: &Plugin, request: AdmissionRequest) -> Result<Value, CallError> {
    let verdict = plugin.validate("", request).await?;
    Ok(verdict_output(&verdict))
}

/// Call `default` on `write`: the defaulted object and warnings as cases expect them.
pub async fn default(plugin: &Plugin, request: AdmissionRequest) -> Result<Value, CallError> {
    let defaulted = plugin.apply_defaults("", request).await?;
    Ok(serde_json::json!({
        "object": defaulted.object,
        "warnings": defaulted.warnings,
    }))
}

/// Call `convert`, and convert the answer back: the answer as cases expect it, and what
/// differs on the way back (a conversion that loses what the other version holds), if
/// anything.
pub async fn convert(
    plugin: &Plugin,
    conversion: &Conversion,
) -> Result<(Value, Option<String>), CallError> {
    let converted = plugin
        .convert("", conversion.object.clone(), &conversion.to)
        .await?;
    let from = conversion.object.get("apiVersion").and_then(Value::as_str);
    let round_trip = match from {
        None => Some("the object has no apiVersion to convert back to".to_owned()),
        Some(from) => match plugin.convert("", converted.clone(), from).await {
            Ok(back) if back == conversion.object => None,
            Ok(back) => Some(format!(
                "converting back to {from} does not give the original: {}",
                first_difference(
                    &Value::Object(conversion.object.clone()),
                    &Value::Object(back)
                )
            )),
            Err(error) => Some(format!("converting back to {from} failed: {error}")),
        },
    };
    Ok((serde_json::json!({ "object": converted }), round_trip))
}

/// Run the webhook case in `text` (read from `path`) on `plugin`; with `update`, write the
/// plugin's answer into a case it does not match.
pub async fn run_case(
    plugin: &Plugin,
    path: &Path,
    text: &str,
    update: bool,
) -> anyhow::Result<CaseResult> {
    let mut case: WebhookCase = serde_yaml_ng::from_str(text)
        .with_context(|| format!("{} is not a webhook case", path.display()))?;
    let answer = match (&case.validate, &case.default, &case.convert) {
        (Some(write), None, None) => validate(plugin, write.request()?)
            .await
            .map(|answer| (answer, None)),
        (None, Some(write), None) => default(plugin, write.request()?)
            .await
            .map(|answer| (answer, None)),
        (None, None, Some(conversion)) => convert(plugin, conversion).await,
        _ => anyhow::bail!(
            "{}: a webhook case has exactly one of `validate`, `default` and `convert`",
            path.display()
        ),
    };
    let (actual, broken) = match answer {
        // No expectation makes a plugin serve a webhook it does not: not even `--update`.
        Err(error @ CallError::NotServed(_)) => return Ok(CaseResult::Failed(error.to_string())),
        Err(error) => (error_output(&error), None),
        Ok(answer) => answer,
    };
    if let Some(broken) = broken {
        // No expectation fixes a conversion that does not come back.
        return Ok(CaseResult::Failed(broken));
    }
    let differs = match &case.expect {
        Some(expected) if *expected == actual => return Ok(CaseResult::Passed),
        Some(expected) => match (expected.get("error"), actual.get("error")) {
            (None, Some(Value::String(error))) => format!("the call failed: {error}"),
            _ => first_difference(expected, &actual),
        },
        None if update => "no expected answer yet".to_owned(),
        None => anyhow::bail!(
            "{} has no expected answer (`expect:`); `wasmctrl plugin test PLUGIN CASES --update` writes the plugin's",
            path.display()
        ),
    };
    if !update {
        return Ok(CaseResult::Failed(differs));
    }
    case.expect = Some(actual);
    let text = if path.extension().is_some_and(|e| e == "json") {
        serde_json::to_string_pretty(&case)? + "\n"
    } else {
        format!(
            "# A wasmctrl webhook case: `wasmctrl plugin test PLUGIN FILE` checks the answer against `expect`.\n{}",
            crate::yaml::to_string(&case)?
        )
    };
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(CaseResult::Updated(differs))
}

/// Where two JSON values first differ, as `path: expected → actual`.
fn first_difference(expected: &Value, actual: &Value) -> String {
    fn walk(path: &str, expected: &Value, actual: &Value) -> Option<String> {
        match (expected, actual) {
            (Value::Object(e), Value::Object(a)) => {
                let keys: std::collections::BTreeSet<&String> = e.keys().chain(a.keys()).collect();
                keys.into_iter().find_map(|key| {
                    let at = if path.is_empty() {
                        key.clone()
                    } else {
                        format!("{path}.{key}")
                    };
                    walk(
                        &at,
                        e.get(key).unwrap_or(&Value::Null),
                        a.get(key).unwrap_or(&Value::Null),
                    )
                })
            }
            (Value::Array(e), Value::Array(a)) if e.len() == a.len() => e
                .iter()
                .zip(a)
                .enumerate()
                .find_map(|(i, (e, a))| walk(&format!("{path}[{i}]"), e, a)),
            _ if expected == actual => None,
            _ => Some(format!(
                "{}: expected {expected}, got {actual}",
                if path.is_empty() { "(whole)" } else { path }
            )),
        }
    }
    walk("", expected, actual).unwrap_or_else(|| "they differ".to_owned())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_operation_follows_from_the_objects_given() {
        let object = json!({"a": 1}).as_object().cloned();
        let write = |object: Option<JsonObject>, old_object: Option<JsonObject>| Write {
            operation: None,
            object,
            old_object,
            user: None,
            config: None,
        };
        let op = |w: Write| w.request().expect("a write").operation;
        assert_eq!(op(write(object.clone(), None)), Operation::Create);
        assert_eq!(op(write(object.clone(), object.clone())), Operation::Update);
        assert_eq!(op(write(None, object)), Operation::Delete);
        assert!(write(None, None).request().is_err());
    }

    #[test]
    fn webhook_cases_are_told_from_reconcile_cases() {
        assert!(is_webhook_case("validate:\n  object: {}\n"));
        assert!(is_webhook_case("convert: {object: {}, to: v1}\n"));
        assert!(!is_webhook_case("parent: {}\nchildren: []\n"));
    }

    #[test]
    fn a_difference_is_named_by_its_path() {
        assert_eq!(
            first_difference(
                &json!({"object": {"spec": {"port": 80}}}),
                &json!({"object": {"spec": {"port": 81}}})
            ),
            "object.spec.port: expected 80, got 81"
        );
    }
}
