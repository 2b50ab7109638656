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

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::ResourceExt as _;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation as ReviewOperation};
use kube::core::response::{StatusCause, StatusDetails, StatusSummary};
use serde_json::Value;

use super::explained;
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

/// What happens to a write when the plugin cannot answer for it, as a webhook
/// configuration's `failurePolicy` says (the policy's `spec.admission.failurePolicy`).
pub use crate::policy::admission::WebhookFailurePolicy as FailurePolicy;

/// The plugin that answers a review, with the config it is called with.
#[derive(Clone)]
pub struct Answering {
    /// The plugin.
    pub plugin: Plugin,
    /// The policy's plugin config for it, JSON.
    pub config: Option<String>,
}

/// The plugins a review is put to: the one whose answer the API server gets, and a
/// candidate asked the same in shadow, for comparison only.
pub struct Chosen {
    /// Answers.
    pub answering: Answering,
    /// Asked beside it; its answer is only compared ([`Choose::compared`]).
    pub shadow: Option<Answering>,
}

/// How a shadow candidate's answer compared with the answer the API server got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Comparison {
    /// The same decision (and the same defaults).
    Same,
    /// The candidate would refuse a write that was admitted: its message.
    WouldDeny(String),
    /// The candidate would admit a write that was refused.
    WouldAllow,
    /// The candidate would fill in other defaults.
    WouldDefaultDifferently,
    /// The candidate could not answer: why.
    WouldFail(String),
}

/// Which plugin answers each review of a policy, chosen per object as reconciles choose it
/// per parent (a candidate serves the parents of its share and its canary, and shadows the
/// others), and where shadow comparisons go.
pub trait Choose: Send + Sync {
    /// The plugins for a write of an object with these labels and uid (none on a create:
    /// the API server gives the object its uid between defaulting and validation, and both
    /// must be answered by the same plugin).
    fn choose(&self, hook: Hook, labels: &BTreeMap<String, String>, uid: Option<&str>) -> Chosen;
    /// `shadow`'s answer to a write of `object` (the object written, or the one deleted),
    /// compared with the answer given.
    fn compared(
        &self,
        hook: Hook,
        object: Option<&DynamicObject>,
        shadow: &Answering,
        comparison: Comparison,
    );
}

/// One plugin answering every review, nothing in shadow.
struct OnePlugin(Answering);

impl Choose for OnePlugin {
    fn choose(&self, _: Hook, _: &BTreeMap<String, String>, _: Option<&str>) -> Chosen {
        Chosen {
            answering: self.0.clone(),
            shadow: None,
        }
    }

    fn compared(&self, _: Hook, _: Option<&DynamicObject>, _: &Answering, _: Comparison) {}
}

/// Who answers a policy's webhooks: its plugins, as the policy's tenant of the engine's
/// call slots, under its failure policy.
#[derive(Clone)]
pub struct Answerer {
    /// The policy, for messages (`ReconcilePolicy/NAME`, or `NAMESPACE/NAME`).
    pub policy: String,
    /// Which plugin answers each review.
    pub plugins: Arc<dyn Choose>,
    /// The policy's share of the call slots.
    pub tenant: String,
    /// What a failure of the plugin does to the write.
    pub failure_policy: FailurePolicy,
    /// Shadow calls in flight at most; a review that finds them all taken is not
    /// shadowed (a candidate's comparison must never hold an answer up, nor pile up).
    pub shadow_slots: Arc<tokio::sync::Semaphore>,
    /// Where each answer's record is kept, for `wasmctrl explain`; none keeps none.
    pub explain: Option<Arc<crate::explain::Explain>>,
}

impl Answerer {
    /// `plugin` answers every review of `policy`, with `config`.
    pub fn with_plugin(
        policy: &str,
        plugin: Plugin,
        config: Option<String>,
        tenant: &str,
        failure_policy: FailurePolicy,
    ) -> Self {
        Self::choosing(
            policy,
            Arc::new(OnePlugin(Answering { plugin, config })),
            tenant,
            failure_policy,
        )
    }

    /// `plugins` choose who answers each review of `policy`.
    pub fn choosing(
        policy: &str,
        plugins: Arc<dyn Choose>,
        tenant: &str,
        failure_policy: FailurePolicy,
    ) -> Self {
        Self {
            policy: policy.to_owned(),
            plugins,
            tenant: tenant.to_owned(),
            failure_policy,
            shadow_slots: Arc::new(tokio::sync::Semaphore::new(SHADOW_CALLS)),
            explain: None,
        }
    }

    /// Keep a record of each answer in `explain`.
    #[must_use]
    pub fn explained(mut self, explain: Arc<crate::explain::Explain>) -> Self {
        self.explain = Some(explain);
        self
    }
}

/// Shadow calls one policy makes at once.
const SHADOW_CALLS: usize = 4;
/// Appended to a policy's tenant for its shadow calls.
const SHADOW_TENANT: &str = "/shadow";

/// How a review ended, for metrics: `allowed`, `denied`, `patched`, or the plugin's failure
/// under the failure policy (`failed_closed`, `failed_open`).
pub type Outcome = &'static str;

/// What a plugin decided about a write.
#[derive(Debug, Clone)]
enum Decision {
    /// Nothing to decide (a connect; a delete, to a defaulter).
    Nothing,
    /// `validate`'s verdict.
    Verdict(AdmissionVerdict),
    /// `default`'s patch from the object as written (empty: nothing to fill in).
    Defaults {
        patch: json_patch::Patch,
        warnings: Vec<String>,
    },
    /// The plugin could not answer: why.
    Failed(String),
    /// The plugin does not serve the webhook (a plugin swapped in that dropped it, until
    /// the leader removes its entry): nothing to judge the write by.
    Unserved,
}

/// Answer `request` with `answerer`'s plugin (and, in shadow, its candidate).
pub async fn answer(
    hook: Hook,
    answerer: &Answerer,
    request: &AdmissionRequest<DynamicObject>,
) -> (AdmissionResponse, Outcome) {
    let object = request.object.as_ref().or(request.old_object.as_ref());
    let labels = object.map(|o| o.labels().clone()).unwrap_or_default();
    let uid = object
        .and_then(|o| o.metadata.uid.as_deref())
        .filter(|_| request.operation != ReviewOperation::Create);
    let (at, started) = (jiff::Timestamp::now(), std::time::Instant::now());
    let chosen = answerer.plugins.choose(hook, &labels, uid);
    let decision = decide(hook, &chosen.answering, answerer, request, "").await;
    if let Some(shadow) = chosen.shadow {
        shadow_compare(hook, shadow, answerer, request, &decision);
    }
    let Some(explain) = &answerer.explain else {
        return respond(hook, answerer, request, decision);
    };
    let (violations, defaulted) = match &decision {
        Decision::Verdict(verdict) => (
            verdict
                .violations
                .iter()
                .map(|v| format!("{}: {}", v.field, v.message))
                .collect(),
            Vec::new(),
        ),
        Decision::Defaults { patch, .. } => (Vec::new(), explained::patched_paths(patch)),
        _ => (Vec::new(), Vec::new()),
    };
    let (response, outcome) = respond(hook, answerer, request, decision);
    let answered = explained::Answered {
        at,
        took: started.elapsed(),
        plugin: Some(chosen.answering.plugin.digest().to_string()),
        violations,
        defaulted,
    };
    explained::keep(
        explain,
        &answerer.policy,
        hook.name(),
        request,
        &response,
        outcome,
        answered,
    );
    (response, outcome)
}

/// Ask `shadow` the same in the background, and hand its comparison with `decision` to the
/// answerer's plugins; skipped when the answerer's shadow calls are all in flight.
fn shadow_compare(
    hook: Hook,
    shadow: Answering,
    answerer: &Answerer,
    request: &AdmissionRequest<DynamicObject>,
    decision: &Decision,
) {
    let Ok(slot) = answerer.shadow_slots.clone().try_acquire_owned() else {
        return;
    };
    let (answerer, request, decision) = (answerer.clone(), request.clone(), decision.clone());
    tokio::spawn(async move {
        let shadowed = decide(hook, &shadow, &answerer, &request, SHADOW_TENANT).await;
        drop(slot);
        let object = request.object.as_ref().or(request.old_object.as_ref());
        answerer
            .plugins
            .compared(hook, object, &shadow, compare(&decision, &shadowed));
    });
}

/// How `shadowed` differs from `answered`.
fn compare(answered: &Decision, shadowed: &Decision) -> Comparison {
    match (answered, shadowed) {
        (_, Decision::Failed(why)) => Comparison::WouldFail(why.clone()),
        (Decision::Verdict(_) | Decision::Defaults { .. }, Decision::Unserved) => {
            Comparison::WouldFail("it does not serve this webhook".to_owned())
        }
        (Decision::Verdict(a), Decision::Verdict(s)) if a.allowed() && !s.allowed() => {
            Comparison::WouldDeny(s.message())
        }
        (Decision::Verdict(a), Decision::Verdict(s)) if !a.allowed() && s.allowed() => {
            Comparison::WouldAllow
        }
        (Decision::Defaults { patch: a, .. }, Decision::Defaults { patch: s, .. }) if a != s => {
            Comparison::WouldDefaultDifferently
        }
        _ => Comparison::Same,
    }
}

/// What `answering` decides about `request`, as the answerer's tenant (with `lane`
/// appended: shadow calls are a tenant of their own, so a slow candidate never takes the
/// slots the answers wait for).
async fn decide(
    hook: Hook,
    answering: &Answering,
    answerer: &Answerer,
    request: &AdmissionRequest<DynamicObject>,
    lane: &str,
) -> Decision {
    let tenant = format!("{}{lane}", answerer.tenant);
    let Some(operation) = operation(&request.operation) else {
        // CONNECT is no write: nothing to judge.
        return Decision::Nothing;
    };
    let plugin_request = match plugin_request(operation, &answering.config, request) {
        Ok(plugin_request) => plugin_request,
        Err(why) => return Decision::Failed(why),
    };
    let plugin = &answering.plugin;
    match hook {
        Hook::Validate => match plugin.validate(&tenant, plugin_request).await {
            Ok(verdict) => Decision::Verdict(verdict),
            Err(CallError::NotServed(_)) => Decision::Unserved,
            Err(error) => Decision::Failed(error.to_string()),
        },
        Hook::Default => {
            let written = plugin_request.object.clone();
            match plugin.apply_defaults(&tenant, plugin_request).await {
                Ok(defaulted) => {
                    let before = Value::Object(written.unwrap_or_default());
                    Decision::Defaults {
                        patch: json_patch::diff(&before, &Value::Object(defaulted.object)),
                        warnings: defaulted.warnings,
                    }
                }
                // A delete: there is no object to default.
                Err(CallError::InvalidRequest(_)) if request.object.is_none() => Decision::Nothing,
                Err(CallError::NotServed(_)) => Decision::Unserved,
                Err(error) => Decision::Failed(error.to_string()),
            }
        }
    }
}

/// The API server's answer to `decision`.
fn respond(
    hook: Hook,
    answerer: &Answerer,
    request: &AdmissionRequest<DynamicObject>,
    decision: Decision,
) -> (AdmissionResponse, Outcome) {
    let response = AdmissionResponse::from(request);
    match decision {
        Decision::Nothing => (response, "allowed"),
        Decision::Verdict(verdict) => judged(response, request, verdict),
        Decision::Defaults { patch, warnings } => defaulted_to(answerer, response, patch, warnings),
        Decision::Failed(why) => failed(response, hook, answerer, &why),
        Decision::Unserved => {
            let mut response = response;
            response.warnings = Some(vec![format!(
                "not judged: the plugin of {} does not serve the {} webhook",
                answerer.policy,
                hook.name()
            )]);
            (response, "unserved")
        }
    }
}

/// The failure policy's answer to a review the plugin was not asked about, for `why`.
pub fn unanswered(
    hook: Hook,
    answerer: &Answerer,
    request: &AdmissionRequest<DynamicObject>,
    why: &str,
) -> (AdmissionResponse, Outcome) {
    respond(hook, answerer, request, Decision::Failed(why.to_owned()))
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
    config: &Option<String>,
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
        config: config.clone(),
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
    patch: json_patch::Patch,
    warnings: Vec<String>,
) -> (AdmissionResponse, Outcome) {
    if !warnings.is_empty() {
        response.warnings = Some(warnings);
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::Violation;

    fn verdict(denied: bool) -> Decision {
        Decision::Verdict(AdmissionVerdict {
            violations: if denied {
                vec![Violation {
                    field: "spec.x".to_owned(),
                    message: "no".to_owned(),
                }]
            } else {
                Vec::new()
            },
            warnings: Vec::new(),
        })
    }

    fn defaults(value: i64) -> Decision {
        let before = serde_json::json!({"spec": {}});
        Decision::Defaults {
            patch: json_patch::diff(&before, &serde_json::json!({"spec": {"port": value}})),
            warnings: Vec::new(),
        }
    }

    #[test]
    fn a_shadow_is_compared_on_what_the_api_server_would_do() {
        assert_eq!(
            compare(&verdict(false), &verdict(true)),
            Comparison::WouldDeny("spec.x: no".to_owned())
        );
        assert_eq!(
            compare(&verdict(true), &verdict(false)),
            Comparison::WouldAllow
        );
        assert_eq!(compare(&verdict(true), &verdict(true)), Comparison::Same);
        assert_eq!(compare(&defaults(80), &defaults(80)), Comparison::Same);
        assert_eq!(
            compare(&defaults(80), &defaults(8080)),
            Comparison::WouldDefaultDifferently
        );
        assert_eq!(
            compare(&verdict(false), &Decision::Failed("trap".to_owned())),
            Comparison::WouldFail("trap".to_owned())
        );
        // The active plugin failing is the failure policy's business, not the candidate's.
        assert_eq!(
            compare(&Decision::Failed("trap".to_owned()), &verdict(false)),
            Comparison::Same
        );
    }
}
