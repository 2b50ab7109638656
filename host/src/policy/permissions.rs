//! The Kubernetes permissions a policy needs, computed from its spec: what `wasmctrl rbac`
//! prints and what the host checks it holds before it starts a policy's controller.
//!
//! One function decides both, so the RBAC users grant and the check the host makes cannot
//! drift apart. Nothing here is a wildcard: each rule names one resource and its verbs.

use std::collections::{BTreeMap, BTreeSet};

use super::ReconcilePolicySpec;

/// What the API server says about a kind: its group, its plural and its scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindScope {
    /// API group (`""` for the core group).
    pub group: String,
    /// Plural resource name, as RBAC rules name it.
    pub resource: String,
    /// Whether objects of the kind live in a namespace.
    pub namespaced: bool,
}

/// Verbs on one resource (or subresource) of one API group, in one namespace or (`None`)
/// cluster-wide.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Permission {
    /// `None`: cluster-wide (a ClusterRole); `Some`: that namespace only (a Role).
    pub namespace: Option<String>,
    /// API group.
    pub group: String,
    /// Resource, or `resource/subresource`.
    pub resource: String,
    /// The verb.
    pub verb: &'static str,
}

/// The parent's verbs: it is watched, patched (finalizers, the uid-bound metadata), and its
/// status is written.
const PARENT: &[&str] = &["get", "list", "watch", "patch"];
const PARENT_STATUS: &[&str] = &["get", "patch"];
/// Setting `blockOwnerDeletion` on a child's owner reference needs `update` on the parent's
/// finalizers (the OwnerReferencesPermissionEnforcement admission plugin).
const PARENT_FINALIZERS: &[&str] = &["update"];
const CHILDREN: &[&str] = &["get", "list", "watch", "create", "patch", "delete"];
const RELATED: &[&str] = &["get", "list", "watch"];
/// The Events a policy records about its parents (`events.k8s.io`; repeats are patched).
const EVENTS: &[&str] = &["create", "patch"];

/// Every permission `policy` needs, given how its kinds resolve and the namespace a host is
/// confined to (`--namespace`), if any.
pub fn required<E>(
    policy: &ReconcilePolicySpec,
    host_namespace: Option<&str>,
    mut resolve: impl FnMut(&str, &str) -> Result<KindScope, E>,
) -> Result<BTreeSet<Permission>, E> {
    let namespace = policy.parent.namespace.as_deref().or(host_namespace);
    let mut needed = BTreeSet::new();
    let mut grant = |kind: &KindScope, suffix: &str, verbs: &[&'static str]| {
        for verb in verbs {
            needed.insert(Permission {
                namespace: namespace.filter(|_| kind.namespaced).map(str::to_owned),
                group: kind.group.clone(),
                resource: format!("{}{suffix}", kind.resource),
                verb,
            });
        }
    };
    let parent = resolve(&policy.parent.api_version, &policy.parent.kind)?;
    grant(&parent, "", PARENT);
    grant(&parent, "/status", PARENT_STATUS);
    grant(&parent, "/finalizers", PARENT_FINALIZERS);
    let events = KindScope {
        group: "events.k8s.io".to_owned(),
        resource: "events".to_owned(),
        namespaced: parent.namespaced,
    };
    grant(&events, "", EVENTS);
    for child in &policy.children {
        grant(&resolve(&child.api_version, &child.kind)?, "", CHILDREN);
    }
    for related in &policy.related {
        grant(&resolve(&related.api_version, &related.kind)?, "", RELATED);
    }
    Ok(needed)
}

/// Permissions grouped as RBAC rules: per scope, per (group, resource), the verbs.
pub type Rules = BTreeMap<Option<String>, BTreeMap<(String, String), BTreeSet<&'static str>>>;

/// Group permissions into rules, one per resource and scope.
pub fn rules(permissions: impl IntoIterator<Item = Permission>) -> Rules {
    let mut rules = Rules::new();
    for p in permissions {
        rules
            .entry(p.namespace)
            .or_default()
            .entry((p.group, p.resource))
            .or_default()
            .insert(p.verb);
    }
    rules
}

/// Say what is missing, shortest first: `list, watch configmaps in namespace a; patch
/// myapps/status (example.com)`.
pub fn describe(missing: &[Permission]) -> String {
    rules(missing.iter().cloned())
        .into_iter()
        .flat_map(|(namespace, resources)| {
            resources
                .into_iter()
                .map(move |((group, resource), verbs)| {
                    let verbs = verbs.into_iter().collect::<Vec<_>>().join(", ");
                    let group = if group.is_empty() {
                        String::new()
                    } else {
                        format!(" ({group})")
                    };
                    let scope = namespace.as_deref().map_or_else(
                        || " cluster-wide".to_owned(),
                        |ns| format!(" in namespace {ns}"),
                    );
                    format!("{verbs} {resource}{group}{scope}")
                })
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(namespace: Option<&str>) -> ReconcilePolicySpec {
        let mut spec: ReconcilePolicySpec = serde_json::from_value(serde_json::json!({
            "parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
            "children": [
                {"apiVersion": "v1", "kind": "ConfigMap"},
                {"apiVersion": "apps/v1", "kind": "Deployment"},
            ],
            "related": [{"apiVersion": "v1", "kind": "Secret"}, {"apiVersion": "v1", "kind": "Namespace"}],
            "plugin": {"source": {"file": {"path": "/p.wasm"}}},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        spec.parent.namespace = namespace.map(str::to_owned);
        spec
    }

    fn resolve(_api_version: &str, kind: &str) -> Result<KindScope, String> {
        let (group, resource, namespaced) = match kind {
            "MyApp" => ("example.com", "myapps", true),
            "ConfigMap" => ("", "configmaps", true),
            "Deployment" => ("apps", "deployments", true),
            "Secret" => ("", "secrets", true),
            "Namespace" => ("", "namespaces", false),
            other => return Err(format!("unknown kind {other}")),
        };
        Ok(KindScope {
            group: group.into(),
            resource: resource.into(),
            namespaced,
        })
    }

    fn verbs(
        rules: &Rules,
        namespace: Option<&str>,
        group: &str,
        resource: &str,
    ) -> Vec<&'static str> {
        rules
            .get(&namespace.map(str::to_owned))
            .and_then(|r| r.get(&(group.to_owned(), resource.to_owned())))
            .map(|v| v.iter().copied().collect())
            .unwrap_or_default()
    }

    #[test]
    fn parent_children_and_related_get_exactly_their_verbs() {
        let needed = required(&spec(None), None, resolve).unwrap_or_default();
        let rules = rules(needed);
        assert_eq!(rules.len(), 1, "one cluster-wide role: {rules:?}");
        assert_eq!(
            verbs(&rules, None, "example.com", "myapps"),
            ["get", "list", "patch", "watch"]
        );
        assert_eq!(
            verbs(&rules, None, "example.com", "myapps/status"),
            ["get", "patch"]
        );
        assert_eq!(
            verbs(&rules, None, "example.com", "myapps/finalizers"),
            ["update"]
        );
        assert_eq!(
            verbs(&rules, None, "apps", "deployments"),
            ["create", "delete", "get", "list", "patch", "watch"]
        );
        assert_eq!(verbs(&rules, None, "", "secrets"), ["get", "list", "watch"]);
        assert_eq!(
            verbs(&rules, None, "events.k8s.io", "events"),
            ["create", "patch"]
        );
        let all: Vec<_> = rules.values().flat_map(|r| r.keys()).collect();
        assert!(all.iter().all(|(g, r)| g != "*" && r != "*"), "no wildcard");
    }

    #[test]
    fn a_namespaced_policy_needs_a_role_there_and_cluster_rules_only_for_cluster_kinds() {
        let rules = rules(required(&spec(Some("team-a")), None, resolve).unwrap_or_default());
        assert_eq!(verbs(&rules, Some("team-a"), "", "configmaps").len(), 6);
        assert_eq!(
            verbs(&rules, Some("team-a"), "events.k8s.io", "events"),
            ["create", "patch"]
        );
        assert!(verbs(&rules, None, "", "configmaps").is_empty());
        assert_eq!(
            verbs(&rules, None, "", "namespaces"),
            ["get", "list", "watch"]
        );
    }

    #[test]
    fn an_unresolvable_kind_is_an_error_and_missing_permissions_read_well() {
        let mut bad = spec(None);
        bad.children.push(crate::policy::KindRef {
            api_version: "x/v1".into(),
            kind: "Nope".into(),
        });
        assert_eq!(
            required(&bad, None, resolve),
            Err("unknown kind Nope".into())
        );
        let missing = [
            Permission {
                namespace: Some("a".into()),
                group: String::new(),
                resource: "configmaps".into(),
                verb: "watch",
            },
            Permission {
                namespace: Some("a".into()),
                group: String::new(),
                resource: "configmaps".into(),
                verb: "list",
            },
            Permission {
                namespace: None,
                group: "example.com".into(),
                resource: "myapps/status".into(),
                verb: "patch",
            },
        ];
        assert_eq!(
            describe(&missing),
            "patch myapps/status (example.com) cluster-wide; list, watch configmaps in namespace a"
        );
    }
}
