//! One AdmissionReview answered by a policy's plugin: the write as the plugin's contract
//! states it, the plugin's verdict or defaults as the API server takes them back.
//!
//! - A validate verdict that denies becomes a `422 Invalid` status whose message names each
//!   field and whose `details.causes` carry them one by one (`kubectl` prints them); its
//!   warnings reach the client either way.
//! - A default becomes a JSON patch from the object as written to the object as defaulted
//!   (none when nothing changes).
//! - When the plugin fails (a trap, its deadline, an answer that breaks the contract, a
//!   webhook it does not serve), the policy's failure policy decides: `Fail` denies with a
//!   message that says the plugin could not decide and why, `Ignore` admits with a warning
//!   that says the write went through unchecked. The API server never waits on a host
//!   error: every failure is an answer.

use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation as ReviewOperation};
use kube::core::response::{StatusCause, StatusDetails, StatusSummary};
use serde_json::Value;

use crate::plugin::{
    AdmissionRequest as PluginRequest, AdmissionVerdict, CallError, JsonObject, Operation, Plugin,
    UserInfo,
};

/// Which webhook the API server called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// A validating webhook: allow or deny.
    Validate,
    /// A mutating webhook: fill in defaults.
    Default,
}

impl Hook {
    /// The name metrics and messages use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Validate => "validate",
            Self::Default => "default",
        }
    }
}

/// What happens to a write when the plugin cannot answer for it, as a webhook configuration's
/// `failurePolicy` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// The write is refused.
    #[default]
    Fail,
    /// The write goes through unchecked.
    Ignore,
}

/// Who answers a policy's webhooks: its active plugin, with the policy's config, as the
/// policy's tenant of the engine's call slots.
#[derive(Clone)]
pub struct Answerer {
    /// The policy, for messages (`ReconcilePolicy/NAME`, or `NAMESPACE/NAME`).
    pub policy: String,
    /// The plugin that answers.
    pub plugin: Plugin,
    /// The policy's plugin config, JSON.
    pub config: Option<String>,
    /// The policy's share of the call slots.
    pub tenant: String,
    /// What a failure of the plugin does to the write.
    pub failure_policy: FailurePolicy,
}

/// How a review ended, for metrics: `allowed`, `denied`, `patched`, or the plugin's failure
/// under the failure policy (`failed_closed`, `failed_open`).
pub type Outcome = &'static str;

/// Answer `request` with `answerer`'s plugin.
pub async fn answer(
    hook: Hook,
    answerer: &Answerer,
    request: &AdmissionRequest<DynamicObject>,
) -> (AdmissionResponse, Outcome) {
    let response = AdmissionResponse::from(request);
    let Some(operation) = operation(&request.operation) else {
        // CONNECT is no write: nothing to judge.
        return (response, "allowed");
    };
    let plugin_request = match plugin_request(operation, answerer, request) {
        Ok(plugin_request) => plugin_request,
        Err(why) => return failed(response, hook, answerer, &why),
    };
    match hook {
        Hook::Validate => {
            match answerer
                .plugin
                .validate(&answerer.tenant, plugin_request)
                .await
            {
                Ok(verdict) => judged(response, request, verdict),
                Err(error) => failed(response, hook, answerer, &error.to_string()),
            }
        }
        Hook::Default => {
            let written = plugin_request.object.clone();
            match answerer
                .plugin
                .apply_defaults(&answerer.tenant, plugin_request)
                .await
            {
                Ok(defaulted) => defaulted_to(
                    answerer,
                    response,
                    written,
                    defaulted.object,
                    defaulted.warnings,
                ),
                Err(CallError::InvalidRequest(_)) if request.object.is_none() => {
                    // A delete: there is no object to default.
                    (response, "allowed")
                }
                Err(error) => failed(response, hook, answerer, &error.to_string()),
            }
        }
    }
}

fn operation(operation: &ReviewOperation) -> Option<Operation> {
    match operation {
        ReviewOperation::Create => Some(Operation::Create),
        ReviewOperation::Update => Some(Operation::Update),
        ReviewOperation::Delete => Some(Operation::Delete),
        ReviewOperation::Connect => None,
    }
}

/// The write as the plugin's contract states it.
fn plugin_request(
    operation: Operation,
    answerer: &Answerer,
    request: &AdmissionRequest<DynamicObject>,
) -> Result<PluginRequest, String> {
    let json = |object: &Option<DynamicObject>| -> Result<Option<JsonObject>, String> {
        object
            .as_ref()
            .map(|object| match serde_json::to_value(object) {
                Ok(Value::Object(map)) => Ok(map),
                Ok(_) => Err("the object is not a JSON object".to_owned()),
                Err(e) => Err(format!("the object cannot be read: {e}")),
            })
            .transpose()
    };
    Ok(PluginRequest {
        operation,
        object: json(&request.object)?,
        old_object: json(&request.old_object)?,
        user: Some(UserInfo {
            username: request.user_info.username.clone().unwrap_or_default(),
            groups: request.user_info.groups.clone().unwrap_or_default(),
        }),
        config: answerer.config.clone(),
    })
}

/// The API server's answer to a verdict: allowed, or `422 Invalid` with a cause per field.
fn judged(
    mut response: AdmissionResponse,
    request: &AdmissionRequest<DynamicObject>,
    verdict: AdmissionVerdict,
) -> (AdmissionResponse, Outcome) {
    if !verdict.warnings.is_empty() {
        response.warnings = Some(verdict.warnings.clone());
    }
    if verdict.allowed() {
        return (response, "allowed");
    }
    let kind = &request.kind.kind;
    let message = format!(
        "{kind} {:?} is invalid: {}",
        request.name,
        verdict.message()
    );
    let mut response = response.deny(message);
    response.result.status = Some(StatusSummary::Failure);
    response.result.code = 422;
    response.result.reason = "Invalid".to_owned();
    response.result.details = Some(StatusDetails {
        name: request.name.clone(),
        group: request.kind.group.clone(),
        kind: kind.clone(),
        uid: String::new(),
        causes: verdict
            .violations
            .into_iter()
            .map(|violation| StatusCause {
                reason: "FieldValueInvalid".to_owned(),
                message: violation.message,
                field: violation.field,
            })
            .collect(),
        retry_after_seconds: 0,
    });
    (response, "denied")
}

/// The API server's answer to a default: the JSON patch from the object as written.
fn defaulted_to(
    answerer: &Answerer,
    mut response: AdmissionResponse,
    written: Option<JsonObject>,
    defaulted: JsonObject,
    warnings: Vec<String>,
) -> (AdmissionResponse, Outcome) {
    if !warnings.is_empty() {
        response.warnings = Some(warnings);
    }
    let before = Value::Object(written.unwrap_or_default());
    let patch = json_patch::diff(&before, &Value::Object(defaulted));
    if patch.0.is_empty() {
        return (response, "allowed");
    }
    let unpatched = response.clone();
    match response.with_patch(patch) {
        Ok(patched) => (patched, "patched"),
        Err(error) => failed(
            unpatched,
            Hook::Default,
            answerer,
            &format!("the defaults cannot be sent: {error}"),
        ),
    }
}

/// The plugin could not answer: the failure policy decides.
fn failed(
    response: AdmissionResponse,
    hook: Hook,
    answerer: &Answerer,
    why: &str,
) -> (AdmissionResponse, Outcome) {
    let policy = &answerer.policy;
    // The reason may carry the plugin's own words (a panic message): one bounded line.
    let why = crate::plugin::one_line(why, MAX_REASON_BYTES);
    match answerer.failure_policy {
        FailurePolicy::Fail => {
            let mut response = response.deny(format!(
                "the plugin of {policy} could not {} this write, and its failure policy is Fail: {why}",
                hook.name()
            ));
            response.result.status = Some(StatusSummary::Failure);
            response.result.code = 500;
            response.result.reason = "InternalError".to_owned();
            (response, "failed_closed")
        }
        FailurePolicy::Ignore => {
            let mut response = response;
            response.warnings.get_or_insert_with(Vec::new).push(format!(
                "admitted without the {} webhook of {policy} (its failure policy is Ignore): {why}",
                hook.name()
            ));
            (response, "failed_open")
        }
    }
}

/// Bytes kept of the reason a plugin could not answer.
const MAX_REASON_BYTES: usize = 1024;
