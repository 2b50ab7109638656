//! The webhook configurations the host owns for a policy: one `ValidatingWebhookConfiguration`
//! and one `MutatingWebhookConfiguration` per policy that serves webhooks, each with one
//! webhook for the policy's parent kind, pointing at the hosts' listener with the CA bundle
//! of their certificate ([`super::certs`]).
//!
//! They are written with server-side apply under the host's field manager and removed when
//! the policy stops asking (or goes), the validating one with `failurePolicy: Fail` first:
//! a webhook that refuses every write of a kind must never outlive what answers it.

use anyhow::Context as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations,
    ServiceReference, ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams};

use super::review::{FailurePolicy, Hook};

/// The field manager of the configurations.
const MANAGER: &str = "wasmctrl-webhooks";

/// Where the API server reaches the hosts' listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A Service in front of the hosts (in a cluster).
    Service {
        /// The Service's namespace.
        namespace: String,
        /// The Service's name.
        name: String,
        /// Its port.
        port: i32,
    },
    /// A URL (a host outside the cluster, e.g. on a developer's machine), without a path.
    Url(String),
}

/// What a policy's webhooks cover.
#[derive(Debug, Clone, PartialEq)]
pub struct Scope {
    /// The listener's path for the policy: its name, or `namespace/name`.
    pub policy: String,
    /// The parent kind's API group (empty for the core group).
    pub group: String,
    /// The parent kind's version.
    pub version: String,
    /// The parent kind's resource (plural).
    pub plural: String,
    /// Only objects in this namespace (a namespaced or confined policy).
    pub namespace: Option<String>,
    /// The operations judged: `CREATE`, `UPDATE`, `DELETE`.
    pub operations: Vec<String>,
    /// What a failure of the plugin (or of the host) does to the write.
    pub failure_policy: FailurePolicy,
    /// How long the API server waits, in seconds (1 to 30): longer than the plugin's
    /// webhook deadline, or the API server gives up before the plugin's answer.
    pub timeout_seconds: i32,
    /// Users whose writes are not sent to the webhooks: the hosts' own (finalizers, field
    /// hand-overs), which must go through even while the plugin cannot answer.
    pub exempt_users: Vec<String>,
    /// The policy, as the configurations' owner: deleting it deletes them (garbage
    /// collection), even while no host runs.
    pub owner: Option<OwnerReference>,
    /// The configurations' labels (who manages them, for which policy).
    pub labels: std::collections::BTreeMap<String, String>,
}

impl Scope {
    /// The configurations' name: `wasmctrl-<policy>` for a cluster policy,
    /// `wasmctrl.<namespace>.<policy>` for a namespaced one (a namespace has no dot, so no
    /// two policies share a name).
    pub fn configuration_name(&self) -> String {
        configuration_name(&self.policy)
    }

    /// The webhook's own name, fully qualified as the API server requires.
    fn webhook_name(&self, hook: Hook) -> String {
        format!(
            "{}.{}.webhooks.wasmctrl.dev",
            hook.name(),
            self.policy.replace('/', ".")
        )
    }

    fn client_config(
        &self,
        hook: Hook,
        endpoint: &Endpoint,
        ca_bundle: &str,
    ) -> WebhookClientConfig {
        let path = format!("/{}/{}", hook.name(), self.policy);
        let ca_bundle = Some(ByteString(ca_bundle.as_bytes().to_vec()));
        match endpoint {
            Endpoint::Service {
                namespace,
                name,
                port,
            } => WebhookClientConfig {
                ca_bundle,
                service: Some(ServiceReference {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    path: Some(path),
                    port: Some(*port),
                }),
                url: None,
            },
            Endpoint::Url(base) => WebhookClientConfig {
                ca_bundle,
                service: None,
                url: Some(format!("{}{path}", base.trim_end_matches('/'))),
            },
        }
    }

    /// The writes sent: the policy's operations of the parent resource (not its status),
    /// only namespaced ones when the policy is confined to a namespace (a namespace selector
    /// does not apply to cluster-scoped objects).
    fn rules(&self, operations: Vec<String>) -> Vec<RuleWithOperations> {
        vec![RuleWithOperations {
            api_groups: Some(vec![self.group.clone()]),
            api_versions: Some(vec![self.version.clone()]),
            resources: Some(vec![self.plural.clone()]),
            operations: Some(operations),
            scope: Some(
                if self.namespace.is_some() {
                    "Namespaced"
                } else {
                    "*"
                }
                .to_owned(),
            ),
        }]
    }

    fn match_conditions(&self) -> Option<Vec<MatchCondition>> {
        if self.exempt_users.is_empty() {
            return None;
        }
        let users = self
            .exempt_users
            .iter()
            .map(|user| format!("'{}'", user.replace('\\', "\\\\").replace('\'', "\\'")))
            .collect::<Vec<_>>()
            .join(", ");
        Some(vec![MatchCondition {
            name: "not-the-hosts-own-writes".to_owned(),
            expression: format!("!(request.userInfo.username in [{users}])"),
        }])
    }

    fn namespace_selector(&self) -> Option<LabelSelector> {
        self.namespace.as_ref().map(|namespace| LabelSelector {
            match_labels: Some(
                [("kubernetes.io/metadata.name".to_owned(), namespace.clone())].into(),
            ),
            ..LabelSelector::default()
        })
    }

    fn metadata(&self) -> ObjectMeta {
        ObjectMeta {
            name: Some(self.configuration_name()),
            labels: Some(self.labels.clone()).filter(|l| !l.is_empty()),
            owner_references: self.owner.clone().map(|owner| vec![owner]),
            ..ObjectMeta::default()
        }
    }

    fn failure_policy(&self) -> String {
        match self.failure_policy {
            FailurePolicy::Fail => "Fail",
            FailurePolicy::Ignore => "Ignore",
        }
        .to_owned()
    }

    /// The validating configuration.
    pub fn validating(
        &self,
        endpoint: &Endpoint,
        ca_bundle: &str,
    ) -> ValidatingWebhookConfiguration {
        ValidatingWebhookConfiguration {
            metadata: self.metadata(),
            webhooks: Some(vec![ValidatingWebhook {
                name: self.webhook_name(Hook::Validate),
                admission_review_versions: vec!["v1".to_owned()],
                client_config: self.client_config(Hook::Validate, endpoint, ca_bundle),
                failure_policy: Some(self.failure_policy()),
                match_conditions: self.match_conditions(),
                match_policy: Some("Equivalent".to_owned()),
                namespace_selector: self.namespace_selector(),
                rules: Some(self.rules(self.operations.clone())),
                side_effects: "None".to_owned(),
                timeout_seconds: Some(self.timeout_seconds),
                ..ValidatingWebhook::default()
            }]),
        }
    }

    /// The mutating configuration.
    pub fn mutating(&self, endpoint: &Endpoint, ca_bundle: &str) -> MutatingWebhookConfiguration {
        MutatingWebhookConfiguration {
            metadata: self.metadata(),
            webhooks: Some(vec![MutatingWebhook {
                name: self.webhook_name(Hook::Default),
                admission_review_versions: vec!["v1".to_owned()],
                client_config: self.client_config(Hook::Default, endpoint, ca_bundle),
                failure_policy: Some(self.failure_policy()),
                match_conditions: self.match_conditions(),
                match_policy: Some("Equivalent".to_owned()),
                namespace_selector: self.namespace_selector(),
                // Defaults first, then validation sees them: one pass is enough for a
                // plugin's defaults, which depend only on the object.
                reinvocation_policy: Some("Never".to_owned()),
                // A delete has no object to default.
                rules: Some(
                    self.rules(
                        self.operations
                            .iter()
                            .filter(|op| op.as_str() != "DELETE")
                            .cloned()
                            .collect(),
                    ),
                ),
                side_effects: "None".to_owned(),
                timeout_seconds: Some(self.timeout_seconds),
                ..MutatingWebhook::default()
            }]),
        }
    }
}

/// Write (or remove) the configurations of `scope` so that exactly `validate` and `default`
/// are served.
pub async fn reconcile(
    client: &kube::Client,
    scope: &Scope,
    endpoint: &Endpoint,
    ca_bundle: &str,
    validate: bool,
    default: bool,
) -> anyhow::Result<()> {
    let name = scope.configuration_name();
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let apply = PatchParams::apply(MANAGER).force();
    if validate {
        validating
            .patch(
                &name,
                &apply,
                &Patch::Apply(scope.validating(endpoint, ca_bundle)),
            )
            .await
            .with_context(|| format!("writing ValidatingWebhookConfiguration {name}"))?;
    } else {
        remove(&validating, &name).await?;
    }
    if default {
        mutating
            .patch(
                &name,
                &apply,
                &Patch::Apply(scope.mutating(endpoint, ca_bundle)),
            )
            .await
            .with_context(|| format!("writing MutatingWebhookConfiguration {name}"))?;
    } else {
        remove(&mutating, &name).await?;
    }
    Ok(())
}

/// Remove both configurations of the policy whose listener path is `policy`: the validating
/// one first.
pub async fn remove_all(client: &kube::Client, policy: &str) -> anyhow::Result<()> {
    let name = configuration_name(policy);
    remove(
        &Api::<ValidatingWebhookConfiguration>::all(client.clone()),
        &name,
    )
    .await?;
    remove(
        &Api::<MutatingWebhookConfiguration>::all(client.clone()),
        &name,
    )
    .await
}

fn configuration_name(policy: &str) -> String {
    match policy.split_once('/') {
        Some((namespace, name)) => format!("wasmctrl.{namespace}.{name}"),
        None => format!("wasmctrl-{policy}"),
    }
}

async fn remove<K>(api: &Api<K>, name: &str) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(error) => Err(error).with_context(|| format!("removing webhook configuration {name}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(policy: &str, namespace: Option<&str>) -> Scope {
        Scope {
            policy: policy.to_owned(),
            group: "example.com".to_owned(),
            version: "v1".to_owned(),
            plural: "myapps".to_owned(),
            namespace: namespace.map(str::to_owned),
            operations: vec!["CREATE".into(), "UPDATE".into(), "DELETE".into()],
            failure_policy: FailurePolicy::Fail,
            timeout_seconds: 5,
            exempt_users: vec!["system:serviceaccount:wasmctrl:wasmctrl".into()],
            owner: None,
            labels: Default::default(),
        }
    }

    #[test]
    fn no_two_policies_share_a_configuration() {
        assert_eq!(scope("a.b", None).configuration_name(), "wasmctrl-a.b");
        assert_eq!(scope("a/b", Some("a")).configuration_name(), "wasmctrl.a.b");
        assert_ne!(
            scope("a.b", None).configuration_name(),
            scope("a/b", Some("a")).configuration_name()
        );
    }

    #[test]
    fn a_confined_policy_judges_only_its_namespace_and_the_hosts_writes_pass() {
        let endpoint = Endpoint::Url("https://127.0.0.1:9443/".into());
        let validating = scope("team-a/apps", Some("team-a")).validating(&endpoint, "CA");
        let hook = &validating.webhooks.as_ref().expect("webhooks")[0];
        assert_eq!(hook.name, "validate.team-a.apps.webhooks.wasmctrl.dev");
        assert_eq!(
            hook.client_config.url.as_deref(),
            Some("https://127.0.0.1:9443/validate/team-a/apps")
        );
        let rule = &hook.rules.as_ref().expect("rules")[0];
        assert_eq!(rule.scope.as_deref(), Some("Namespaced"));
        assert_eq!(
            hook.namespace_selector
                .as_ref()
                .and_then(|s| s.match_labels.clone()),
            Some(
                [(
                    "kubernetes.io/metadata.name".to_owned(),
                    "team-a".to_owned()
                )]
                .into()
            )
        );
        assert_eq!(
            hook.match_conditions.as_ref().expect("conditions")[0].expression,
            "!(request.userInfo.username in ['system:serviceaccount:wasmctrl:wasmctrl'])"
        );
        let mutating = scope("apps", None).mutating(&endpoint, "CA");
        let hook = &mutating.webhooks.as_ref().expect("webhooks")[0];
        let rule = &hook.rules.as_ref().expect("rules")[0];
        assert_eq!(rule.scope.as_deref(), Some("*"));
        assert_eq!(
            rule.operations.as_deref(),
            Some(&["CREATE".to_owned(), "UPDATE".to_owned()][..]),
            "a delete has nothing to default"
        );
    }
}
