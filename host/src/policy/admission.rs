//! `spec.admission`: the webhooks the policy's plugin serves for its parent kind, and
//! `status.webhooks`, what the hosts serve of them.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// What the API server waits for a webhook answer when the policy does not say (seconds).
pub const DEFAULT_TIMEOUT_SECONDS: u32 = 5;
/// What a plugin's webhook call may take when the policy does not say (milliseconds).
pub const DEFAULT_PLUGIN_TIMEOUT_MS: u32 = 2000;

/// The plugin validates and defaults the parent kind's writes, as admission webhooks the
/// hosts serve and register with the API server. The plugin must export the contract's
/// `webhooks` interface and serve the webhooks asked for: one it does not serve is not
/// registered, and the `WebhooksServed` condition says so (`WebhookNotServed`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.validate || self.default").message("admission serves validate, default or both: set at least one"))]
#[x_kube(validation = Rule::new("(has(self.pluginTimeoutMs) ? self.pluginTimeoutMs : 2000) < (has(self.timeoutSeconds) ? self.timeoutSeconds : 5) * 1000").message("pluginTimeoutMs must be below timeoutSeconds: the API server must get the plugin's answer, or its failure, before it gives up"))]
pub struct AdmissionSpec {
    /// Serve the plugin's `validate`: writes it denies are refused with its message.
    #[serde(default)]
    pub validate: bool,
    /// Serve the plugin's `default`: the fields it fills in are patched into writes.
    #[serde(default)]
    pub default: bool,
    /// What happens to a write when the plugin (or every host) cannot answer: `Fail`
    /// refuses it (the default), `Ignore` lets it through unchecked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_policy: Option<WebhookFailurePolicy>,
    /// How long the API server waits for an answer, in seconds (1 to 30; default 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 30))]
    pub timeout_seconds: Option<u32>,
    /// How long the plugin's call may take, in milliseconds (default 2000); below
    /// `timeoutSeconds`, so that a plugin that runs out of time is still answered for under
    /// the failure policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 29000))]
    pub plugin_timeout_ms: Option<u32>,
    /// The writes judged (default `CREATE` and `UPDATE`). A delete is validated only, never
    /// defaulted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 3))]
    #[x_kube(validation = Rule::new("self.all(o, self.exists_one(p, p == o))").message("each operation may be listed once"))]
    pub operations: Vec<WebhookOperation>,
}

impl AdmissionSpec {
    /// Whether any webhook is asked for.
    pub fn serves_any(&self) -> bool {
        self.validate || self.default
    }

    /// The failure policy, defaulted.
    pub fn failure_policy(&self) -> WebhookFailurePolicy {
        self.failure_policy.unwrap_or_default()
    }

    /// The API server's wait, defaulted.
    pub fn timeout_seconds(&self) -> u32 {
        self.timeout_seconds.unwrap_or(DEFAULT_TIMEOUT_SECONDS)
    }

    /// The plugin call's deadline, defaulted.
    pub fn plugin_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(u64::from(
            self.plugin_timeout_ms.unwrap_or(DEFAULT_PLUGIN_TIMEOUT_MS),
        ))
    }

    /// The operations judged, defaulted, as the API server names them.
    pub fn operations(&self) -> Vec<String> {
        let operations: &[WebhookOperation] = if self.operations.is_empty() {
            &[WebhookOperation::Create, WebhookOperation::Update]
        } else {
            &self.operations
        };
        operations.iter().map(|o| o.as_str().to_owned()).collect()
    }

    /// Why the API server could not wait for the plugin, when it could not (a policy written
    /// before its schema said so).
    pub fn problem(&self) -> Option<String> {
        if !self.serves_any() {
            return None;
        }
        let wait = std::time::Duration::from_secs(u64::from(self.timeout_seconds()));
        (self.plugin_timeout() >= wait).then(|| {
            format!(
                "spec.admission.pluginTimeoutMs ({} ms) must be below timeoutSeconds ({} s)",
                self.plugin_timeout().as_millis(),
                self.timeout_seconds()
            )
        })
    }
}

/// What a write gets when its webhook cannot answer.
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum WebhookFailurePolicy {
    /// The write is refused.
    #[default]
    Fail,
    /// The write goes through unchecked.
    Ignore,
}

/// A write the webhooks judge.
#[derive(schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "UPPERCASE")]
pub enum WebhookOperation {
    /// A create.
    Create,
    /// An update (of the object, not its status).
    Update,
    /// A delete (validated only).
    Delete,
}

impl WebhookOperation {
    /// The API server's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "CREATE",
            Self::Update => "UPDATE",
            Self::Delete => "DELETE",
        }
    }
}

/// A webhook the hosts serve for the policy, in `status.webhooks`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServedWebhook {
    /// `validate` or `default`.
    pub webhook: String,
    /// The `ValidatingWebhookConfiguration` or `MutatingWebhookConfiguration` that sends the
    /// API server to the hosts.
    pub configuration: String,
    /// Its failure policy.
    pub failure_policy: WebhookFailurePolicy,
    /// Since when the configuration has been in place as it is.
    pub since: Time,
}

/// A shadow candidate's webhook answers, compared with those the API server got.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ShadowWebhooks {
    /// Writes the candidate was asked about too.
    #[serde(default)]
    pub evaluated: u64,
    /// Writes admitted that the candidate would refuse: what to look at before promoting it.
    #[serde(default)]
    pub would_deny: u64,
    /// Writes refused that the candidate would admit.
    #[serde(default)]
    pub would_allow: u64,
    /// Writes the candidate would fill in other defaults for.
    #[serde(default)]
    pub would_default_differently: u64,
    /// Writes the candidate could not answer for.
    #[serde(default)]
    pub would_fail: u64,
    /// A few of the differences, newest first: `namespace/name`, the webhook, what differs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_judge_creates_and_updates_and_fail_closed() {
        let spec: AdmissionSpec =
            serde_json::from_value(serde_json::json!({"validate": true})).expect("spec");
        assert_eq!(spec.operations(), ["CREATE", "UPDATE"]);
        assert_eq!(spec.failure_policy(), WebhookFailurePolicy::Fail);
        assert_eq!(spec.timeout_seconds(), 5);
        assert_eq!(spec.plugin_timeout().as_millis(), 2000);
        assert_eq!(spec.problem(), None);
    }

    #[test]
    fn a_plugin_deadline_the_api_server_would_not_wait_for_is_a_problem() {
        let spec: AdmissionSpec = serde_json::from_value(serde_json::json!({
            "default": true, "timeoutSeconds": 2, "pluginTimeoutMs": 2000,
            "operations": ["DELETE"], "failurePolicy": "Ignore",
        }))
        .expect("spec");
        assert_eq!(spec.operations(), ["DELETE"]);
        assert_eq!(spec.failure_policy(), WebhookFailurePolicy::Ignore);
        assert!(
            spec.problem()
                .is_some_and(|p| p.contains("must be below timeoutSeconds (2 s)")),
            "{:?}",
            spec.problem()
        );
    }
}
