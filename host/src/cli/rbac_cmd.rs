//! `wasmctrl rbac`: the RBAC objects that exactly the given policies need — the same rules
//! the host checks before it runs a policy. A policy that names a ServiceAccount gets that
//! account, its rules bound to it, and the grant that lets the host impersonate it; the rules
//! of a policy that names none go to the host's own ServiceAccount. NamespacedReconcilePolicies
//! are read as the host runs them: confined to their namespace.
//!
//! Every object it prints is named after the policies it was run for (unless `--name` says
//! otherwise), so running it once per policy composes: a later run adds its own objects and
//! replaces none of an earlier one's.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context as _, bail};
use clap::Args;
use serde_json::{Value, json};

use super::input;
use super::kinds::KindTable;
use crate::policy::permissions::{self, KindScope, Permission, Rules};
use crate::policy::{ReconcilePolicySpec, ServiceAccountRef};

/// Print the ServiceAccounts, Roles, ClusterRoles and bindings the given ReconcilePolicies
/// need, and the host's grant to act as each policy's ServiceAccount.
#[derive(Debug, Args)]
pub struct RbacCommand {
    /// ReconcilePolicy files (YAML or JSON, several documents each). CustomResourceDefinitions
    /// among them tell the plural and scope of their kinds.
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,
    /// The host's ServiceAccount, as NAMESPACE/NAME.
    #[arg(long, default_value = "wasmctrl/wasmctrl")]
    service_account: String,
    /// Name of the generated roles and bindings. Default: `wasmctrl-policy:<policy>` for one
    /// policy, `wasmctrl-policies:<hash of their names>` for several, so runs for different
    /// policies never replace each other's objects (nor the chart's, which use no `:`).
    #[arg(long)]
    name: Option<String>,
    /// The namespace the host is confined to (its `--namespace`), if any.
    #[arg(long)]
    namespace: Option<String>,
    /// Resolve kinds through the cluster's discovery (kubeconfig or in-cluster) instead of
    /// the CRDs given and the built-in kinds.
    #[arg(long)]
    discover: bool,
}

impl RbacCommand {
    /// Read the policies, compute their permissions and print them as YAML.
    pub async fn run(self) -> anyhow::Result<()> {
        print!("{}", self.render().await?);
        Ok(())
    }

    /// The YAML `run` prints.
    pub async fn render(&self) -> anyhow::Result<String> {
        let (service_namespace, service_account) =
            input::namespace_and_name("--service-account", &self.service_account)?;
        let mut policies = Vec::new();
        let mut kinds = KindTable::builtin();
        for path in &self.files {
            for object in input::read_objects(path)? {
                match object["kind"].as_str() {
                    Some("ReconcilePolicy") => {
                        let name = object["metadata"]["name"]
                            .as_str()
                            .unwrap_or("?")
                            .to_owned();
                        let spec: ReconcilePolicySpec =
                            serde_json::from_value(object["spec"].clone()).with_context(|| {
                                format!("{}: policy {name} has an invalid spec", path.display())
                            })?;
                        policies.push((name, spec));
                    }
                    Some("NamespacedReconcilePolicy") => {
                        let name = object["metadata"]["name"].as_str().unwrap_or("?");
                        let namespace = object["metadata"]["namespace"].as_str().with_context(
                            || {
                                format!(
                                    "{}: NamespacedReconcilePolicy {name} names no metadata.namespace",
                                    path.display()
                                )
                            },
                        )?;
                        let spec: ReconcilePolicySpec =
                            serde_json::from_value(object["spec"].clone()).with_context(|| {
                                format!("{}: policy {name} has an invalid spec", path.display())
                            })?;
                        // As the host runs it: confined, acting as an account of its namespace.
                        let spec = crate::policy::namespaced::confine(
                            namespace,
                            spec,
                            &crate::policy::namespaced::TeamBounds::default(),
                        )
                        .map_err(|refusal| {
                            anyhow::anyhow!(
                                "{}: NamespacedReconcilePolicy {namespace}/{name} would be refused ({}): {}",
                                path.display(),
                                refusal.reason,
                                refusal.message
                            )
                        })?;
                        policies.push((
                            crate::policy::namespaced::cluster_name(namespace, name),
                            spec,
                        ));
                    }
                    Some("CustomResourceDefinition") => {
                        kinds.add_crd(&object).with_context(|| {
                            format!("{}: a CustomResourceDefinition", path.display())
                        })?
                    }
                    _ => {}
                }
            }
        }
        if policies.is_empty() {
            bail!(
                "no ReconcilePolicy or NamespacedReconcilePolicy in {:?}",
                self.files
            );
        }
        let needed = self.needed(&policies, &mut kinds).await?;
        let host = Subject {
            namespace: service_namespace,
            name: service_account,
        };
        let documents = self.documents_for(&host, needed, &policies);
        let mut text = String::from(
            "# Generated by `wasmctrl rbac`: exactly what these ReconcilePolicies need.\n",
        );
        for document in documents {
            text.push_str("---\n");
            text.push_str(&crate::yaml::to_string(&document)?);
        }
        Ok(text)
    }

    /// What each identity needs: a policy's own ServiceAccount, or (`None`) the host's for a
    /// policy that names none.
    async fn needed(
        &self,
        policies: &[(String, ReconcilePolicySpec)],
        kinds: &mut KindTable,
    ) -> anyhow::Result<BTreeMap<Option<ServiceAccountRef>, Vec<Permission>>> {
        let client = if self.discover {
            Some(
                kube::Client::try_default()
                    .await
                    .context("connecting to the cluster for --discover")?,
            )
        } else {
            None
        };
        let mut needed: BTreeMap<Option<ServiceAccountRef>, Vec<Permission>> = BTreeMap::new();
        for (name, spec) in policies {
            if let Some(client) = &client {
                discover(client, spec, kinds).await?;
            }
            let permissions = permissions::required(spec, self.namespace.as_deref(), |v, k| {
                kinds.get(v, k).cloned().with_context(|| {
                    format!(
                        "policy {name}: {v} {k} is neither built in nor defined by a CustomResourceDefinition given; pass its CRD file or use --discover"
                    )
                })
            })?;
            needed
                .entry(spec.service_account.clone())
                .or_default()
                .extend(permissions);
        }
        Ok(needed)
    }

    /// The host's rules (for policies without an identity, and the plugin sources it reads
    /// whoever the policies act as); each policy account with its rules; and the host's grant
    /// to act as exactly those accounts.
    fn documents_for(
        &self,
        host: &Subject<'_>,
        mut needed: BTreeMap<Option<ServiceAccountRef>, Vec<Permission>>,
        policies: &[(String, ReconcilePolicySpec)],
    ) -> Vec<Value> {
        let name = self.name_for(policies);
        let mut documents = documents(
            &name,
            host,
            &permissions::rules(needed.remove(&None).unwrap_or_default()),
            &named_reads(policies),
        );
        let mut impersonated: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (account, permissions) in &needed {
            let Some(account) = account else { continue };
            documents.push(json!({
                "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": account.name, "namespace": account.namespace, "labels": labels()},
            }));
            let subject = Subject {
                namespace: &account.namespace,
                name: &account.name,
            };
            documents.extend(self::documents(
                // `:` is in no namespace, account or policy name: distinct inputs never
                // make one name.
                &format!("{name}:{}:{}", account.namespace, account.name),
                &subject,
                &permissions::rules(permissions.iter().cloned()),
                &BTreeMap::new(),
            ));
            impersonated
                .entry(&account.namespace)
                .or_default()
                .push(&account.name);
        }
        for (namespace, names) in impersonated {
            let role = format!("{name}:impersonate");
            documents.push(json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": role, "namespace": namespace, "labels": labels()},
                "rules": [{"apiGroups": [""], "resources": ["serviceaccounts"], "resourceNames": names, "verbs": ["impersonate"]}],
            }));
            documents.push(json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": role, "namespace": namespace, "labels": labels()},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                "subjects": host.json(),
            }));
        }
        documents
    }
}

impl RbacCommand {
    /// `--name`, or one made from the policies' names.
    fn name_for(&self, policies: &[(String, ReconcilePolicySpec)]) -> String {
        use sha2::Digest as _;
        if let Some(name) = &self.name {
            return name.clone();
        }
        match policies {
            [(only, _)] => format!("wasmctrl-policy:{only}"),
            many => {
                let mut names: Vec<&str> = many.iter().map(|(name, _)| name.as_str()).collect();
                names.sort_unstable();
                let hash = sha2::Sha256::digest(names.join("\n").as_bytes());
                format!("wasmctrl-policies:{}", &hex::encode(hash)[..10])
            }
        }
    }
}

/// Resolve through the cluster's discovery the kinds of `spec` that `kinds` does not know.
async fn discover(
    client: &kube::Client,
    spec: &ReconcilePolicySpec,
    kinds: &mut KindTable,
) -> anyhow::Result<()> {
    for (api_version, kind) in kinds_of(spec) {
        if kinds.get(&api_version, &kind).is_some() {
            continue;
        }
        let resolved = crate::controller::kinds::resolve(
            client,
            &crate::policy::KindRef {
                api_version: api_version.clone(),
                kind: kind.clone(),
            },
        )
        .await?;
        kinds.insert(
            &api_version,
            &kind,
            KindScope {
                group: resolved.resource.group.clone(),
                resource: resolved.resource.plural.clone(),
                namespaced: resolved.namespaced,
            },
        );
    }
    Ok(())
}

/// Every kind a policy names, as (apiVersion, kind).
fn kinds_of(spec: &ReconcilePolicySpec) -> Vec<(String, String)> {
    std::iter::once((spec.parent.api_version.clone(), spec.parent.kind.clone()))
        .chain(
            spec.children
                .iter()
                .map(|c| (c.api_version.clone(), c.kind.clone())),
        )
        .chain(
            spec.related
                .iter()
                .map(|r| (r.api_version.clone(), r.kind.clone())),
        )
        .collect()
}

/// `get` on the ConfigMaps and Secrets the policies' plugin sources name, per namespace:
/// (namespace, resource) → names.
fn named_reads(
    policies: &[(String, ReconcilePolicySpec)],
) -> BTreeMap<(String, &'static str), Vec<String>> {
    let mut reads: BTreeMap<(String, &'static str), Vec<String>> = BTreeMap::new();
    for (_, spec) in policies {
        let sources = std::iter::once(&spec.plugin.source)
            .chain(spec.plugin.candidate.iter().map(|c| &c.source));
        for source in sources {
            if let Some(config_map) = &source.config_map {
                reads
                    .entry((config_map.namespace.clone(), "configmaps"))
                    .or_default()
                    .push(config_map.name.clone());
            }
            let secret = source
                .oci
                .as_ref()
                .and_then(|o| o.secret_ref.as_ref())
                .or(source.http.as_ref().and_then(|h| h.secret_ref.as_ref()));
            if let Some(secret) = secret {
                reads
                    .entry((secret.namespace.clone(), "secrets"))
                    .or_default()
                    .push(secret.name.clone());
            }
        }
    }
    for names in reads.values_mut() {
        names.sort();
        names.dedup();
    }
    reads
}

fn rule_list(
    resources: &BTreeMap<(String, String), std::collections::BTreeSet<&'static str>>,
) -> Vec<Value> {
    resources
        .iter()
        .map(|((group, resource), verbs)| {
            json!({"apiGroups": [group], "resources": [resource], "verbs": verbs})
        })
        .collect()
}

/// A ServiceAccount that rules are granted to.
struct Subject<'a> {
    namespace: &'a str,
    name: &'a str,
}

impl Subject<'_> {
    /// As a binding's `subjects`.
    fn json(&self) -> Value {
        json!([{"kind": "ServiceAccount", "name": self.name, "namespace": self.namespace}])
    }
}

/// The labels of every object `wasmctrl rbac` prints.
fn labels() -> Value {
    json!({"app.kubernetes.io/managed-by": "wasmctrl-rbac"})
}

/// The ClusterRole (cluster-wide rules), a Role per namespace, and their bindings to
/// `subject`.
fn documents(
    name: &str,
    subject: &Subject<'_>,
    rules: &Rules,
    named: &BTreeMap<(String, &'static str), Vec<String>>,
) -> Vec<Value> {
    let subject = subject.json();
    let labels = labels();
    let mut namespaced: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    let mut documents = Vec::new();
    for (scope, resources) in rules {
        match scope {
            None => {
                documents.push(json!({
                    "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                    "metadata": {"name": name, "labels": labels},
                    "rules": rule_list(resources),
                }));
                documents.push(json!({
                    "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                    "metadata": {"name": name, "labels": labels},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                    "subjects": subject,
                }));
            }
            Some(namespace) => namespaced
                .entry(namespace.clone())
                .or_default()
                .extend(rule_list(resources)),
        }
    }
    for ((namespace, resource), names) in named {
        namespaced.entry(namespace.clone()).or_default().push(
            json!({"apiGroups": [""], "resources": [resource], "resourceNames": names, "verbs": ["get"]}),
        );
    }
    for (namespace, rules) in namespaced {
        documents.push(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "rules": rules,
        }));
        documents.push(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": subject,
        }));
    }
    documents
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `wasmctrl rbac` on the given policy documents, as objects.
    async fn render(policies: &str, host_namespace: Option<&str>) -> Vec<Value> {
        render_named(policies, host_namespace, Some("wasmctrl-policies"))
            .await
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// The same with `--name` (or none).
    async fn render_named(
        policies: &str,
        host_namespace: Option<&str>,
        name: Option<&str>,
    ) -> anyhow::Result<Vec<Value>> {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let file = dir.path().join("policies.yaml");
        std::fs::write(&file, policies).unwrap_or_else(|e| panic!("{e}"));
        let command = RbacCommand {
            files: vec![file],
            service_account: "wasmctrl/wasmctrl".into(),
            name: name.map(str::to_owned),
            namespace: host_namespace.map(str::to_owned),
            discover: false,
        };
        let text = command.render().await?;
        Ok(serde_yaml_ng::Deserializer::from_str(&text)
            .filter_map(|document| serde::Deserialize::deserialize(document).ok())
            .filter(|document: &Value| !document.is_null())
            .collect())
    }

    /// Kind, namespace and name of each object.
    fn identities(documents: &[Value]) -> Vec<(String, String, String)> {
        documents
            .iter()
            .map(|d| {
                let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
                (
                    text(&d["kind"]),
                    text(&d["metadata"]["namespace"]),
                    text(&d["metadata"]["name"]),
                )
            })
            .collect()
    }

    fn policy(name: &str, account: &str) -> String {
        format!(
            "apiVersion: wasmctrl.dev/v1alpha1\nkind: ReconcilePolicy\nmetadata: {{name: {name}}}\nspec:\n  parent: {{apiVersion: apps/v1, kind: Deployment, namespace: shop}}\n  serviceAccount: {{namespace: shop, name: {account}}}\n  children: [{{apiVersion: v1, kind: Service}}]\n  plugin: {{source: {{oci: {{reference: r.example/p:1}}}}, digest: sha256:{}}}\n",
            "0".repeat(64)
        )
    }

    #[tokio::test]
    async fn runs_for_two_policies_sharing_a_namespace_replace_none_of_each_others_objects() {
        let first = render_named(&policy("web", "web-operator"), None, None)
            .await
            .expect("web");
        let second = render_named(&policy("shop", "shop-operator"), None, None)
            .await
            .expect("shop");
        let (a, b) = (identities(&first), identities(&second));
        for object in &a {
            assert!(
                object.0 == "ServiceAccount" || !b.contains(object),
                "both runs print {object:?}"
            );
        }
        let grant = |documents: &[Value], account: &str| {
            documents.iter().any(|d| {
                d["kind"] == "Role"
                    && d["rules"][0]["verbs"] == json!(["impersonate"])
                    && d["rules"][0]["resourceNames"] == json!([account])
            })
        };
        assert!(grant(&first, "web-operator") && grant(&second, "shop-operator"));
        assert!(
            a.iter()
                .any(|(kind, _, name)| kind == "Role" && name == "wasmctrl-policy:web:impersonate"),
            "{a:?}"
        );
    }

    #[tokio::test]
    async fn a_namespaced_policy_is_read_as_the_host_runs_it() {
        let team = format!(
            "apiVersion: wasmctrl.dev/v1alpha1\nkind: NamespacedReconcilePolicy\nmetadata: {{name: web, namespace: team-a}}\nspec:\n  parent: {{apiVersion: apps/v1, kind: Deployment}}\n  serviceAccount: {{namespace: team-a, name: operator}}\n  children: [{{apiVersion: v1, kind: Service}}]\n  plugin: {{source: {{oci: {{reference: r.example/p:1}}}}, digest: sha256:{}}}\n",
            "0".repeat(64)
        );
        let documents = render_named(&team, None, None).await.expect("rendered");
        let role = documents
            .iter()
            .find(|d| {
                d["kind"] == "Role"
                    && d["metadata"]["name"] == "wasmctrl-policy:team-a.web:team-a:operator"
            })
            .unwrap_or_else(|| panic!("{documents:#?}"));
        assert_eq!(role["metadata"]["namespace"], "team-a", "confined: {role}");
        assert!(role["rules"].to_string().contains("deployments"), "{role}");

        let elsewhere = team.replace(
            "{namespace: team-a, name: operator}",
            "{namespace: kube-system, name: operator}",
        );
        let error = render_named(&elsewhere, None, None)
            .await
            .expect_err("an account outside the namespace");
        assert!(
            format!("{error:#}").contains("IdentityOutsideNamespace"),
            "{error:#}"
        );
    }

    const POLICIES: &str = r#"
apiVersion: wasmctrl.dev/v1alpha1
kind: ReconcilePolicy
metadata: {name: shop}
spec:
  parent: {apiVersion: apps/v1, kind: Deployment, namespace: shop}
  serviceAccount: {namespace: shop, name: operator}
  children: [{apiVersion: v1, kind: Service}]
  plugin: {source: {configMap: {namespace: wasmctrl, name: plugins, key: shop}}}
---
apiVersion: wasmctrl.dev/v1alpha1
kind: ReconcilePolicy
metadata: {name: legacy}
spec:
  parent: {apiVersion: v1, kind: ConfigMap}
  plugin: {source: {file: {path: /p.wasm}}}
"#;

    #[tokio::test]
    async fn a_policy_with_an_identity_gets_its_account_its_rules_and_the_hosts_grant() {
        let documents = render(POLICIES, None).await;
        let find = |kind: &str, name: &str| {
            documents
                .iter()
                .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
                .cloned()
                .unwrap_or_else(|| panic!("no {kind} {name} in {documents:#?}"))
        };
        // The account, with the policy's rules bound to it, in the namespace it is confined to.
        let account = find("ServiceAccount", "operator");
        assert_eq!(account["metadata"]["namespace"], "shop");
        let role = find("Role", "wasmctrl-policies:shop:operator");
        assert_eq!(role["metadata"]["namespace"], "shop");
        let resources: Vec<&Value> = role["rules"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|rule| &rule["resources"][0])
            .collect();
        assert!(resources.contains(&&json!("services")), "{role}");
        assert!(resources.contains(&&json!("deployments/status")), "{role}");
        let binding = find("RoleBinding", "wasmctrl-policies:shop:operator");
        assert_eq!(
            binding["subjects"],
            json!([{"kind": "ServiceAccount", "name": "operator", "namespace": "shop"}])
        );
        // The host may impersonate exactly that account.
        let grant = find("Role", "wasmctrl-policies:impersonate");
        assert_eq!(grant["metadata"]["namespace"], "shop");
        assert_eq!(
            grant["rules"],
            json!([{"apiGroups": [""], "resources": ["serviceaccounts"], "resourceNames": ["operator"], "verbs": ["impersonate"]}])
        );
        let grant_binding = find("RoleBinding", "wasmctrl-policies:impersonate");
        assert_eq!(
            grant_binding["subjects"],
            json!([{"kind": "ServiceAccount", "name": "wasmctrl", "namespace": "wasmctrl"}])
        );
        // The host keeps the rules of the policy without an identity, and its plugin source
        // reads; none of the identity's kinds.
        let host_role = find("ClusterRole", "wasmctrl-policies");
        let host_rules = host_role["rules"].to_string();
        assert!(host_rules.contains("configmaps"), "{host_rules}");
        assert!(!host_rules.contains("services"), "{host_rules}");
        assert!(!host_rules.contains("deployments"), "{host_rules}");
        let host_reads = find("Role", "wasmctrl-policies");
        assert_eq!(host_reads["metadata"]["namespace"], "wasmctrl");
        assert!(
            host_reads["rules"].to_string().contains("plugins"),
            "{host_reads}"
        );
    }

    #[test]
    fn built_in_kinds_know_their_plural_and_scope() {
        let table = KindTable::builtin();
        let deployments = table.get("apps/v1", "Deployment").cloned();
        assert_eq!(
            deployments,
            Some(KindScope {
                group: "apps".into(),
                resource: "deployments".into(),
                namespaced: true
            })
        );
        assert_eq!(
            table.get("v1", "Namespace").map(|k| k.namespaced),
            Some(false)
        );
        assert_eq!(
            table
                .get("policy/v1", "PodDisruptionBudget")
                .map(|k| k.resource.as_str()),
            Some("poddisruptionbudgets")
        );
    }
}
