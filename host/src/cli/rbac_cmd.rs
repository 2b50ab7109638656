//! `wasmctrl rbac`: the RBAC objects that exactly the given policies need, for the host's
//! ServiceAccount — the same rules the host checks it holds before it runs a policy.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context as _, bail};
use clap::Args;
use serde_json::{Value, json};

use super::input;
use super::kinds::KindTable;
use crate::policy::ReconcilePolicySpec;
use crate::policy::permissions::{self, KindScope, Rules};

/// Print the Roles, ClusterRole and bindings the given ReconcilePolicies need.
#[derive(Debug, Args)]
pub struct RbacCommand {
    /// ReconcilePolicy files (YAML or JSON, several documents each). CustomResourceDefinitions
    /// among them tell the plural and scope of their kinds.
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,
    /// The host's ServiceAccount, as NAMESPACE/NAME.
    #[arg(long, default_value = "wasmctrl/wasmctrl")]
    service_account: String,
    /// Name of the generated roles and bindings.
    #[arg(long, default_value = "wasmctrl-policies")]
    name: String,
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
        let (service_namespace, service_account) = self
            .service_account
            .split_once('/')
            .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
            .with_context(|| {
                format!(
                    "--service-account {:?} is not NAMESPACE/NAME",
                    self.service_account
                )
            })?;
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
            bail!("no ReconcilePolicy in {:?}", self.files);
        }
        let client = if self.discover {
            Some(
                kube::Client::try_default()
                    .await
                    .context("connecting to the cluster for --discover")?,
            )
        } else {
            None
        };
        let mut needed = Vec::new();
        for (name, spec) in &policies {
            for (api_version, kind) in kinds_of(spec) {
                if kinds.get(&api_version, &kind).is_none()
                    && let Some(client) = &client
                {
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
            }
            let permissions = permissions::required(spec, self.namespace.as_deref(), |v, k| {
                kinds.get(v, k).cloned().with_context(|| {
                    format!(
                        "policy {name}: {v} {k} is neither built in nor defined by a CustomResourceDefinition given; pass its CRD file or use --discover"
                    )
                })
            })?;
            needed.extend(permissions);
        }
        let documents = documents(
            &self.name,
            service_namespace,
            service_account,
            &permissions::rules(needed),
            &named_reads(&policies),
        );
        let mut text = String::from(
            "# Generated by `wasmctrl rbac`: exactly what these ReconcilePolicies need.\n",
        );
        for document in documents {
            text.push_str("---\n");
            text.push_str(&crate::yaml::to_string(&document)?);
        }
        Ok(text)
    }
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

/// The ClusterRole (cluster-wide rules), a Role per namespace, and their bindings.
fn documents(
    name: &str,
    service_namespace: &str,
    service_account: &str,
    rules: &Rules,
    named: &BTreeMap<(String, &'static str), Vec<String>>,
) -> Vec<Value> {
    let subject = json!([{"kind": "ServiceAccount", "name": service_account, "namespace": service_namespace}]);
    let labels = json!({"app.kubernetes.io/managed-by": "wasmctrl-rbac"});
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
