//! The kinds the tests reconcile: test-only kinds with a free-form spec, and the MyApp
//! example's policy.

use serde_json::{Value, json};

/// A CRD for a test-only namespaced kind with a status subresource and a free-form spec.
pub fn test_crd(group: &str, kind: &str) -> Value {
    let plural = format!("{}s", kind.to_lowercase());
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.{group}")},
        "spec": {
            "group": group,
            "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(), "listKind": format!("{kind}List")},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                    },
                }},
            }],
        },
    })
}

/// The MyApp policy's spec: Deployments and Services as children, the labelled ConfigMaps as
/// related objects, its plugin at `source` called with `config`.
pub fn myapp_policy_spec(source: Value, config: Value) -> Value {
    json!({
        "parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
        "children": [
            {"apiVersion": "apps/v1", "kind": "Deployment"},
            {"apiVersion": "v1", "kind": "Service"},
        ],
        "related": [{
            "apiVersion": "v1", "kind": "ConfigMap",
            "selector": {"matchLabels": {"example.com/myapp-config": "true"}},
        }],
        "plugin": {"source": source, "config": config},
    })
}

/// The MyApp policy's spec as the deployment tests use it: confined to `ns`, its plugin at
/// `source`.
pub fn myapp_policy_in(ns: &str, source: Value) -> Value {
    let mut spec = myapp_policy_spec(source, json!({"service": true}));
    spec["parent"]["namespace"] = json!(ns);
    spec
}
