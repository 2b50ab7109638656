//! The kinds the tests reconcile: Widgets (test-only, with a free-form spec) and MyApps (the
//! example operator's), their objects, APIs and CRDs, and the MyApp policy.

use kube::Client;
use kube::api::{Api, DynamicObject};
use serde_json::{Value, json};
use wasmctrl_testenv::crds::{install_crd, install_repo_crds};

use crate::objects::{api, resource};
use crate::policies::{apply_policy, file_source, test_namespace};

/// The API group of the test-only kinds (Widget, and any a test adds with [`test_crd`]).
pub const TEST_GROUP: &str = "e2e.wasmctrl.dev";

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

/// Widget `name` (a kind of [`TEST_GROUP`]; its CRD is `test_crd(TEST_GROUP, "Widget")`),
/// with the spec `{"size": size}`, or an empty spec.
pub fn widget(name: &str, size: Option<u64>) -> Value {
    let spec = match size {
        Some(size) => json!({"size": size}),
        None => json!({}),
    };
    json!({"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget", "metadata": {"name": name}, "spec": spec})
}

/// The Widgets in `namespace`.
pub fn widgets(client: &Client, namespace: &str) -> Api<DynamicObject> {
    api(client, &resource(TEST_GROUP, "v1", "Widget"), namespace)
}

/// A namespace for `test` (and an admin client) with a policy running the misbehave plugin
/// with `config` on its Widgets (ConfigMaps as children).
pub async fn widget_test(test: &str, config: Value) -> anyhow::Result<(Client, String)> {
    let (client, ns) = test_namespace(test).await?;
    install_repo_crds(&client).await?;
    install_crd(&client, &test_crd(TEST_GROUP, "Widget")).await?;
    let spec = json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "plugin": {"source": file_source("misbehave_plugin"), "config": config},
    });
    apply_policy(&client, test, test, spec).await?;
    Ok((client, ns))
}

/// MyApp `name` with `replicas` of `image`, naming the ConfigMap `config_map` if any.
pub fn myapp(name: &str, replicas: i64, image: &str, config_map: Option<&str>) -> Value {
    let mut app = json!({
        "apiVersion": "example.com/v1", "kind": "MyApp",
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "image": image},
    });
    if let Some(config_map) = config_map {
        app["spec"]["configMap"] = json!(config_map);
    }
    app
}

/// The MyApps in `namespace`.
pub fn myapps(client: &Client, namespace: &str) -> Api<DynamicObject> {
    api(client, &resource("example.com", "v1", "MyApp"), namespace)
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
