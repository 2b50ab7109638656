//! `NamespacedReconcilePolicy`: a ReconcilePolicy a team makes in its own namespace, with no
//! cluster rights at all.
//!
//! ReconcilePolicies are cluster-scoped, and RBAC cannot confine the creation of a
//! cluster-scoped object to one team. A NamespacedReconcilePolicy has the same spec; RBAC on
//! it is an ordinary Role in the team's namespace. The host turns each into a
//! ReconcilePolicy named `<namespace>.<name>`, confined to that namespace
//! (`spec.parent.namespace`) and acting as a ServiceAccount of that namespace
//! (`spec.serviceAccount`, required), and copies that policy's status back. What the team
//! could not do with a Role — reconcile another namespace, act as another namespace's
//! account, read a file on the host or the host's registry credentials — the host refuses.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt as _;
use kube::core::{ApiResource, GroupVersionKind};

use super::{PluginSource, ReconcilePolicy, ReconcilePolicySpec};

/// The kind.
pub const KIND: &str = "NamespacedReconcilePolicy";
/// Its plural, as RBAC rules name it.
pub const PLURAL: &str = "namespacedreconcilepolicies";

/// The API resource of the kind.
pub fn api_resource() -> ApiResource {
    let policy = ReconcilePolicy::api_resource();
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(&policy.group, &policy.version, KIND),
        PLURAL,
    )
}

/// The CustomResourceDefinition: ReconcilePolicy's, with the namespaced kind's names and
/// scope (one schema for both, so they cannot drift apart).
pub fn crd() -> CustomResourceDefinition {
    let mut crd = ReconcilePolicy::crd();
    let group = crd.spec.group.clone();
    crd.metadata.name = Some(format!("{PLURAL}.{group}"));
    crd.spec.scope = "Namespaced".to_owned();
    let names = &mut crd.spec.names;
    names.kind = KIND.to_owned();
    names.plural = PLURAL.to_owned();
    names.singular = Some(KIND.to_lowercase());
    names.list_kind = Some(format!("{KIND}List"));
    names.short_names = Some(vec!["nrp".to_owned()]);
    crd
}

/// The name of the ReconcilePolicy made from NamespacedReconcilePolicy `name` in
/// `namespace`. A dot cannot occur in a namespace, so two sources never share one.
pub fn cluster_name(namespace: &str, name: &str) -> String {
    format!("{namespace}.{name}")
}

/// On each ReconcilePolicy made from a NamespacedReconcilePolicy: the source, as
/// `namespace/name`.
pub const SOURCE_ANNOTATION: &str = "wasmctrl.dev/namespaced-policy";

/// The NamespacedReconcilePolicy a ReconcilePolicy was made from (its namespace and name), by
/// [`SOURCE_ANNOTATION`]; `None` for an admin's own policy.
pub fn source(policy: &ReconcilePolicy) -> Option<(&str, &str)> {
    use kube::ResourceExt as _;
    policy.annotations().get(SOURCE_ANNOTATION)?.split_once('/')
}

/// Whom a policy's use of shared resources (plugin fetches and compiles) counts against: the
/// team's namespace for a policy made from a NamespacedReconcilePolicy, so that a team's
/// policies share one share however many it makes; a cluster policy (an admin's) counts as
/// its own.
pub fn tenant(policy: &ReconcilePolicy) -> String {
    use kube::ResourceExt as _;
    source(policy).map_or_else(
        || format!("policy/{}", policy.name_any()),
        |(namespace, _)| format!("namespace/{namespace}"),
    )
}

/// Why a NamespacedReconcilePolicy cannot run, as a condition's reason and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The condition's reason.
    pub reason: &'static str,
    /// What to change.
    pub message: String,
}

impl Refusal {
    fn new(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }
}

/// What the host's admin lets a team's policy ask for beyond what confines it to its
/// namespace (`--namespaced-max-memory-mib`, `--namespaced-max-concurrent-reconciles`,
/// `--namespaced-source-hosts`). `None`: no bound but the host's own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TeamBounds {
    /// The most `spec.limits.memoryMib` may be (a policy without one gets the host's 64).
    pub max_memory_mib: Option<u32>,
    /// The most `spec.maxConcurrentReconciles` may be (a policy without one gets 4).
    pub max_concurrent_reconciles: Option<u32>,
    /// The registry and web hosts (`host[:port]`, as the source writes them) a team's
    /// sources may name; `None` lets them name any.
    pub source_hosts: Option<Vec<String>>,
}

/// What a policy that names no memory limit gets (the engine's default, 64 MiB).
const DEFAULT_MEMORY_MIB: u32 = 64;
/// What a policy that names no concurrency gets.
const DEFAULT_CONCURRENT_RECONCILES: u32 = 4;

impl TeamBounds {
    /// Why `spec` asks for more than a team may, if it does.
    fn problem(&self, spec: &ReconcilePolicySpec) -> Option<Refusal> {
        let memory = spec
            .limits
            .as_ref()
            .and_then(|l| l.memory_mib)
            .unwrap_or(DEFAULT_MEMORY_MIB);
        let concurrency = spec
            .max_concurrent_reconciles
            .unwrap_or(DEFAULT_CONCURRENT_RECONCILES);
        let over = [
            ("spec.limits.memoryMib", memory, self.max_memory_mib, "--namespaced-max-memory-mib"),
            (
                "spec.maxConcurrentReconciles",
                concurrency,
                self.max_concurrent_reconciles,
                "--namespaced-max-concurrent-reconciles",
            ),
        ]
        .into_iter()
        .find_map(|(field, asked, max, flag)| {
            let max = max.filter(|max| asked > *max)?;
            Some(Refusal::new(
                "OverTeamLimit",
                format!(
                    "{field} is {asked}; this host lets a NamespacedReconcilePolicy ask at most {max} ({flag})"
                ),
            ))
        });
        if over.is_some() {
            return over;
        }
        let allowed = self.source_hosts.as_ref()?;
        let sources = std::iter::once(("spec.plugin.source", &spec.plugin.source)).chain(
            spec.plugin
                .candidate
                .iter()
                .map(|candidate| ("spec.plugin.candidate.source", &candidate.source)),
        );
        for (field, source) in sources {
            let host = source_host(source);
            if !host
                .as_deref()
                .is_some_and(|host| allowed.iter().any(|a| a.eq_ignore_ascii_case(host)))
            {
                return Some(Refusal::new(
                    "SourceHostNotAllowed",
                    format!(
                        "{field} names {}; this host lets a NamespacedReconcilePolicy fetch only from {} (--namespaced-source-hosts)",
                        host.map_or_else(|| "no host".to_owned(), |h| format!("{h:?}")),
                        allowed.join(", ")
                    ),
                ));
            }
        }
        None
    }
}

/// The host (`host[:port]`) an `oci` or `http` source fetches from.
fn source_host(source: &PluginSource) -> Option<String> {
    if let Some(oci) = &source.oci {
        let reference: oci_client::Reference = oci.reference.parse().ok()?;
        return Some(reference.registry().to_ascii_lowercase());
    }
    let url = url::Url::parse(&source.http.as_ref()?.url).ok()?;
    let host = url.host_str()?.to_ascii_lowercase();
    Some(match url.port() {
        Some(port) => format!("{host}:{port}"),
        None => host,
    })
}

/// The spec of the ReconcilePolicy that runs `spec` for `namespace`: confined to it, acting as
/// one of its accounts. Refused when it reaches outside the namespace, or asks for more than
/// `bounds` let a team.
pub fn confine(
    namespace: &str,
    mut spec: ReconcilePolicySpec,
    bounds: &TeamBounds,
) -> Result<ReconcilePolicySpec, Refusal> {
    match &spec.service_account {
        None => {
            return Err(Refusal::new(
                "IdentityRequired",
                format!(
                    "a NamespacedReconcilePolicy acts as a ServiceAccount of its own namespace: set spec.serviceAccount to {{namespace: {namespace}, name: …}}"
                ),
            ));
        }
        Some(account) if account.namespace != namespace => {
            return Err(Refusal::new(
                "IdentityOutsideNamespace",
                format!(
                    "spec.serviceAccount is in namespace {}; a policy in {namespace} may act only as an account of {namespace}",
                    account.namespace
                ),
            ));
        }
        Some(_) => {}
    }
    match spec.parent.namespace.as_deref() {
        Some(other) if other != namespace => {
            return Err(Refusal::new(
                "ParentOutsideNamespace",
                format!(
                    "spec.parent.namespace is {other}; a policy in {namespace} reconciles only parents in {namespace}"
                ),
            ));
        }
        _ => spec.parent.namespace = Some(namespace.to_owned()),
    }
    let sources = std::iter::once(("spec.plugin.source", &spec.plugin.source)).chain(
        spec.plugin
            .candidate
            .iter()
            .map(|candidate| ("spec.plugin.candidate.source", &candidate.source)),
    );
    for (field, source) in sources {
        if let Some(problem) = source_problem(source) {
            return Err(Refusal::new(
                "SourceNotAllowed",
                format!(
                    "{field}: {problem}; a NamespacedReconcilePolicy takes its plugin from an oci or http source without a secretRef"
                ),
            ));
        }
    }
    if spec
        .plugin
        .verify
        .as_ref()
        .is_some_and(|v| !v.keys_from.is_empty())
    {
        return Err(Refusal::new(
            "SourceNotAllowed",
            "spec.plugin.verify.keysFrom: its ConfigMaps are read with the host's rights; a NamespacedReconcilePolicy lists its keys in verify.keys".to_owned(),
        ));
    }
    if spec.conversion.is_some() {
        return Err(Refusal::new(
            "ConversionNotAllowed",
            "spec.conversion: a CRD's conversion serves every namespace; only a ReconcilePolicy (an admin's) may ask for it".to_owned(),
        ));
    }
    if let Some(refusal) = bounds.problem(&spec) {
        return Err(refusal);
    }
    Ok(spec)
}

/// Why a team may not use `source`: it would read what belongs to the host.
fn source_problem(source: &PluginSource) -> Option<&'static str> {
    if source.file.is_some() {
        return Some("a file source reads the host's filesystem");
    }
    if source.config_map.is_some() {
        return Some("a configMap source is read with the host's rights");
    }
    let secret = source
        .oci
        .as_ref()
        .and_then(|o| o.secret_ref.as_ref())
        .or(source.http.as_ref().and_then(|h| h.secret_ref.as_ref()));
    secret.map(|_| "a secretRef names the host's registry credentials")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(extra: serde_json::Value) -> ReconcilePolicySpec {
        let mut spec = serde_json::json!({
            "parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
            "children": [{"apiVersion": "apps/v1", "kind": "Deployment"}],
            "plugin": {
                "source": {"oci": {"reference": "registry.example.com/myapp:1"}},
                "digest": format!("sha256:{}", "0".repeat(64)),
            },
            "serviceAccount": {"namespace": "team-a", "name": "operator"},
        });
        json_merge(&mut spec, extra);
        serde_json::from_value(spec).unwrap_or_else(|e| panic!("{e}"))
    }

    fn json_merge(target: &mut serde_json::Value, patch: serde_json::Value) {
        match (target, patch) {
            (serde_json::Value::Object(target), serde_json::Value::Object(patch)) => {
                for (key, value) in patch {
                    json_merge(target.entry(key).or_insert(serde_json::Value::Null), value);
                }
            }
            (target, patch) => *target = patch,
        }
    }

    #[test]
    fn a_policy_is_confined_to_its_namespace_and_acts_as_one_of_its_accounts() {
        let confined = confine(
            "team-a",
            spec(serde_json::json!({})),
            &TeamBounds::default(),
        )
        .map_err(|r| r.message);
        assert_eq!(
            confined.map(|s| s.parent.namespace),
            Ok(Some("team-a".to_owned()))
        );
        let reason = |extra| {
            confine("team-a", spec(extra), &TeamBounds::default())
                .map(|_| ())
                .map_err(|r| r.reason)
        };
        assert_eq!(
            reason(serde_json::json!({"parent": {"namespace": "team-b"}})),
            Err("ParentOutsideNamespace")
        );
        assert_eq!(
            reason(serde_json::json!({"serviceAccount": {"namespace": "kube-system"}})),
            Err("IdentityOutsideNamespace")
        );
        assert_eq!(
            reason(serde_json::json!({"serviceAccount": null})),
            Err("IdentityRequired")
        );
        assert_eq!(
            reason(
                serde_json::json!({"plugin": {"source": {"oci": null, "file": {"path": "/var/run/secrets/kubernetes.io/serviceaccount/token"}}}})
            ),
            Err("SourceNotAllowed")
        );
        assert_eq!(
            reason(
                serde_json::json!({"plugin": {"source": {"oci": {"secretRef": {"namespace": "wasmctrl", "name": "registry"}}}}})
            ),
            Err("SourceNotAllowed")
        );
        assert_eq!(
            reason(
                serde_json::json!({"plugin": {"candidate": {"source": {"configMap": {"namespace": "team-a", "name": "p", "key": "k"}}}}})
            ),
            Err("SourceNotAllowed")
        );
    }

    #[test]
    fn the_namespaced_kind_shares_the_policy_schema() {
        let crd = serde_json::to_value(crd()).unwrap_or_default();
        let policy = serde_json::to_value(ReconcilePolicy::crd()).unwrap_or_default();
        assert_eq!(crd["spec"]["scope"], "Namespaced");
        assert_eq!(
            crd["metadata"]["name"],
            "namespacedreconcilepolicies.wasmctrl.dev"
        );
        assert_eq!(
            crd["spec"]["versions"][0]["schema"],
            policy["spec"]["versions"][0]["schema"]
        );
        assert_eq!(cluster_name("team-a", "app"), "team-a.app");
    }

    #[test]
    fn a_team_cannot_change_how_a_crd_converts() {
        let spec = spec(serde_json::json!({"conversion": {"versions": ["v1alpha1", "v1"]}}));
        let refused = confine("team-a", spec, &TeamBounds::default()).expect_err("refused");
        assert_eq!(refused.reason, "ConversionNotAllowed");
    }

    #[test]
    fn keys_from_a_config_map_are_the_hosts_to_read_not_a_teams() {
        let spec = spec(
            serde_json::json!({"plugin": {"verify": {"keysFrom": [{"configMap": {"namespace": "wasmctrl", "name": "keys"}}]}}}),
        );
        let refused = confine("team-a", spec, &TeamBounds::default()).expect_err("refused");
        assert_eq!(refused.reason, "SourceNotAllowed");
        assert!(
            refused.message.contains("verify.keysFrom"),
            "{}",
            refused.message
        );
    }

    #[test]
    fn a_team_asks_no_more_than_the_admin_lets_it_and_fetches_only_from_allowed_hosts() {
        let bounds = TeamBounds {
            max_memory_mib: Some(256),
            max_concurrent_reconciles: Some(8),
            source_hosts: Some(vec![
                "registry.example.com".to_owned(),
                "plugins.example.com:8443".to_owned(),
            ]),
        };
        let refusal = |extra| {
            confine("team-a", spec(extra), &bounds)
                .err()
                .map(|r| (r.reason, r.message))
        };
        assert_eq!(
            refusal(
                serde_json::json!({"limits": {"memoryMib": 256}, "maxConcurrentReconciles": 8})
            ),
            None
        );
        let (reason, message) =
            refusal(serde_json::json!({"limits": {"memoryMib": 2048}})).expect("too much memory");
        assert_eq!(reason, "OverTeamLimit");
        assert!(
            message.contains("at most 256 (--namespaced-max-memory-mib)"),
            "{message}"
        );
        let (reason, message) =
            refusal(serde_json::json!({"maxConcurrentReconciles": 48})).expect("too many");
        assert_eq!(reason, "OverTeamLimit");
        assert!(
            message.contains("--namespaced-max-concurrent-reconciles"),
            "{message}"
        );
        let elsewhere = serde_json::json!({"plugin": {"source": {"oci": {"reference": "evil.example/p:1"}}, "digest": format!("sha256:{}", "0".repeat(64))}});
        let (reason, message) = refusal(elsewhere).expect("another registry");
        assert_eq!(reason, "SourceHostNotAllowed");
        assert!(
            message.contains("\"evil.example\"") && message.contains("registry.example.com"),
            "{message}"
        );
        let allowed_http = serde_json::json!({"plugin": {"source": {"oci": null, "http": {"url": "https://plugins.example.com:8443/p.wasm"}}, "digest": format!("sha256:{}", "0".repeat(64))}});
        assert_eq!(refusal(allowed_http), None);
        let other_port = serde_json::json!({"plugin": {"source": {"oci": null, "http": {"url": "https://plugins.example.com/p.wasm"}}, "digest": format!("sha256:{}", "0".repeat(64))}});
        assert_eq!(
            refusal(other_port).map(|(r, _)| r),
            Some("SourceHostNotAllowed")
        );
        // Without bounds, anything the namespace allows goes.
        assert!(
            confine(
                "team-a",
                spec(serde_json::json!({"limits": {"memoryMib": 2048}})),
                &TeamBounds::default()
            )
            .is_ok()
        );
    }
}
