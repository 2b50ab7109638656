//! The webhook configurations the hosts keep: one `ValidatingWebhookConfiguration` and one
//! `MutatingWebhookConfiguration` for the whole installation (the chart makes both, empty,
//! so the host's grant names them and creates none), holding one webhook entry per policy
//! that serves webhooks, for its parent kind, pointing at the hosts' listener with the CA
//! bundle of their certificate ([`super::certs`]).
//!
//! Each policy's entry is written with server-side apply under a field manager of the
//! policy's own, so policies never touch each other's entries: applying none removes the
//! policy's entry alone. Uninstalling the chart deletes both configurations, entries and
//! all, before the hosts go: no webhook outlives what answers it.

use anyhow::Context as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations,
    ServiceReference, ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::Api;
use kube::api::{Patch, PatchParams};

use super::review::{FailurePolicy, Hook};

/// The configurations' name when the host is not told another (`--webhook-configuration`).
pub const DEFAULT_NAME: &str = "wasmctrl-webhooks";

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

/// How the API server reaches `path` on the hosts' listener at `endpoint`, trusting
/// `ca_bundle`.
pub fn client_config(endpoint: &Endpoint, path: String, ca_bundle: &str) -> WebhookClientConfig {
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
}

impl Scope {
    /// The webhook's own name, fully qualified as the API server requires.
    fn webhook_name(&self, hook: Hook) -> String {
        webhook_name(hook, &self.policy)
    }

    fn client_config(
        &self,
        hook: Hook,
        endpoint: &Endpoint,
        ca_bundle: &str,
    ) -> WebhookClientConfig {
        client_config(
            endpoint,
            format!("/{}/{}", hook.name(), self.policy),
            ca_bundle,
        )
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

    fn failure_policy(&self) -> String {
        match self.failure_policy {
            FailurePolicy::Fail => "Fail",
            FailurePolicy::Ignore => "Ignore",
        }
        .to_owned()
    }

    /// The policy's validating webhook.
    pub fn validating(&self, endpoint: &Endpoint, ca_bundle: &str) -> ValidatingWebhook {
        ValidatingWebhook {
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
        }
    }

    /// The policy's mutating webhook.
    pub fn mutating(&self, endpoint: &Endpoint, ca_bundle: &str) -> MutatingWebhook {
        MutatingWebhook {
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
        }
    }
}

/// The two configurations of one installation, by name, as one client writes them.
#[derive(Clone)]
pub struct Configurations {
    client: kube::Client,
    name: String,
}

impl Configurations {
    /// The configurations named `name`, written through `client`.
    pub fn new(client: kube::Client, name: &str) -> Self {
        Self {
            client,
            name: name.to_owned(),
        }
    }

    /// Their name (both share it).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Make the policy's entries exactly `validate` and `default` for `scope`. A
    /// configuration that does not exist yet is made (outside the chart: its grant names
    /// them and cannot create).
    pub async fn reconcile(
        &self,
        scope: &Scope,
        endpoint: &Endpoint,
        ca_bundle: &str,
        validate: bool,
        default: bool,
    ) -> anyhow::Result<()> {
        let manager = field_manager(&scope.policy);
        let apply = PatchParams::apply(&manager).force();
        let metadata = ObjectMeta {
            name: Some(self.name.clone()),
            ..ObjectMeta::default()
        };
        let validating = ValidatingWebhookConfiguration {
            metadata: metadata.clone(),
            webhooks: Some(
                validate
                    .then(|| scope.validating(endpoint, ca_bundle))
                    .into_iter()
                    .collect(),
            ),
        };
        Api::<ValidatingWebhookConfiguration>::all(self.client.clone())
            .patch(&self.name, &apply, &Patch::Apply(&validating))
            .await
            .with_context(|| {
                format!(
                    "writing {}'s webhook in ValidatingWebhookConfiguration {}",
                    scope.policy, self.name
                )
            })?;
        let mutating = MutatingWebhookConfiguration {
            metadata,
            webhooks: Some(
                default
                    .then(|| scope.mutating(endpoint, ca_bundle))
                    .into_iter()
                    .collect(),
            ),
        };
        Api::<MutatingWebhookConfiguration>::all(self.client.clone())
            .patch(&self.name, &apply, &Patch::Apply(&mutating))
            .await
            .with_context(|| {
                format!(
                    "writing {}'s webhook in MutatingWebhookConfiguration {}",
                    scope.policy, self.name
                )
            })?;
        Ok(())
    }

    /// Remove the entries of the policy whose listener path is `policy`, the validating one
    /// first; nothing (two reads) when it has none, so it may be asked whenever in doubt.
    pub async fn remove(&self, policy: &str) -> anyhow::Result<()> {
        let apply = PatchParams::apply(&field_manager(policy)).force();
        for (kind, entry) in KINDS.into_iter().zip(webhook_names(policy)) {
            if !self.entry_names(kind).await?.contains(&entry) {
                continue;
            }
            let empty = serde_json::json!({
                "apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
                "metadata": {"name": self.name}, "webhooks": [],
            });
            self.api(kind)
                .patch(&self.name, &apply, &Patch::Apply(empty))
                .await
                .with_context(|| {
                    format!("removing {policy}'s webhook from {kind} {}", self.name)
                })?;
        }
        Ok(())
    }

    /// Remove the entries of policies that no longer exist (deleted while no host ran):
    /// every entry the hosts write whose name is not among `kept` (see [`webhook_names`]).
    /// The number removed.
    pub async fn sweep(&self, kept: &std::collections::HashSet<String>) -> anyhow::Result<usize> {
        let mut removed = 0;
        for kind in KINDS {
            let names = self.entry_names(kind).await?;
            removed += self.remove_orphans(kind, names, kept).await?;
        }
        Ok(removed)
    }

    /// The configuration of `kind`, read untyped: both kinds hold their entries as
    /// `webhooks[].name`, which is all removal reads.
    fn api(&self, kind: &str) -> Api<kube::core::DynamicObject> {
        let resource = kube::core::ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            kind,
        ));
        Api::all_with(self.client.clone(), &resource)
    }

    /// The names of the entries in the configuration of `kind`, in order (none when it is
    /// not there).
    async fn entry_names(&self, kind: &str) -> anyhow::Result<Vec<String>> {
        let found = self
            .api(kind)
            .get_opt(&self.name)
            .await
            .with_context(|| format!("reading {kind} {}", self.name))?;
        Ok(found
            .and_then(|c| c.data["webhooks"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|w| w["name"].as_str().map(str::to_owned))
            .collect())
    }

    /// Remove, by position, the entries among `names` (in order) that the hosts write and
    /// `kept` does not hold; each removal tests the name first, so a configuration changed
    /// meanwhile is refused whole rather than losing another entry.
    async fn remove_orphans(
        &self,
        kind: &str,
        names: Vec<String>,
        kept: &std::collections::HashSet<String>,
    ) -> anyhow::Result<usize> {
        let orphans: Vec<(usize, String)> = names
            .into_iter()
            .enumerate()
            .filter(|(_, name)| name.ends_with(WEBHOOK_SUFFIX) && !kept.contains(name))
            .collect();
        if orphans.is_empty() {
            return Ok(0);
        }
        let mut operations = Vec::new();
        for (position, name) in orphans.iter().rev() {
            operations.push(serde_json::json!({"op": "test", "path": format!("/webhooks/{position}/name"), "value": name}));
            operations
                .push(serde_json::json!({"op": "remove", "path": format!("/webhooks/{position}")}));
        }
        let patch: json_patch::Patch =
            serde_json::from_value(serde_json::Value::Array(operations))?;
        self.api(kind)
            .patch(
                &self.name,
                &PatchParams::default(),
                &Patch::<()>::Json(patch),
            )
            .await
            .with_context(|| {
                format!(
                    "removing the webhooks of deleted policies from {kind} {}",
                    self.name
                )
            })?;
        tracing::info!(configuration = %self.name, removed = ?orphans.iter().map(|(_, n)| n).collect::<Vec<_>>(), "removed the webhooks of policies deleted while no host ran");
        Ok(orphans.len())
    }
}

/// The two kinds of configuration, in the order of [`webhook_names`]: validating, mutating.
const KINDS: [&str; 2] = [
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
];

/// The end of every webhook name the hosts write.
const WEBHOOK_SUFFIX: &str = ".webhooks.wasmctrl.dev";

/// The names of a policy's two webhooks, validating and mutating, as its entries carry them.
pub fn webhook_names(policy: &str) -> [String; 2] {
    [
        webhook_name(Hook::Validate, policy),
        webhook_name(Hook::Default, policy),
    ]
}

/// The field manager of a policy's entries: its own, so that applying none removes its
/// entries alone (within the API server's 128 characters: a long name is hashed).
fn field_manager(policy: &str) -> String {
    let whole = format!("wasmctrl-webhooks/{policy}");
    if whole.len() <= 128 {
        whole
    } else {
        format!("wasmctrl-webhooks/{}", short_hash(policy))
    }
}

/// A policy's webhook name, fully qualified as the API server requires (at most 253
/// characters: a long policy name is hashed).
fn webhook_name(hook: Hook, policy: &str) -> String {
    let whole = format!(
        "{}.{}.webhooks.wasmctrl.dev",
        hook.name(),
        policy.replace('/', ".")
    );
    if whole.len() <= 253 {
        whole
    } else {
        format!(
            "{}.p-{}.webhooks.wasmctrl.dev",
            hook.name(),
            short_hash(policy)
        )
    }
}

fn short_hash(text: &str) -> String {
    use sha2::Digest as _;
    hex::encode(&sha2::Sha256::digest(text.as_bytes())[..8])
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
        }
    }

    #[test]
    fn long_policy_names_still_make_valid_webhook_names_and_managers() {
        let long = "p".repeat(250);
        let name = webhook_name(Hook::Validate, &long);
        assert!(
            name.len() <= 253 && name.ends_with(".webhooks.wasmctrl.dev"),
            "{name}"
        );
        assert_ne!(name, webhook_name(Hook::Validate, &"q".repeat(250)));
        assert!(field_manager(&long).len() <= 128);
        assert_eq!(
            webhook_name(Hook::Default, "apps"),
            "default.apps.webhooks.wasmctrl.dev"
        );
    }

    #[test]
    fn a_confined_policy_judges_only_its_namespace_and_the_hosts_writes_pass() {
        let endpoint = Endpoint::Url("https://127.0.0.1:9443/".into());
        let hook = &scope("team-a/apps", Some("team-a")).validating(&endpoint, "CA");
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
        let hook = &scope("apps", None).mutating(&endpoint, "CA");
        let rule = &hook.rules.as_ref().expect("rules")[0];
        assert_eq!(rule.scope.as_deref(), Some("*"));
        assert_eq!(
            rule.operations.as_deref(),
            Some(&["CREATE".to_owned(), "UPDATE".to_owned()][..]),
            "a delete has nothing to default"
        );
    }
}
