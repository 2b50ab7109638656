//! A test's own namespace, and the ReconcilePolicies it applies, labelled for its host and
//! confined to that namespace.

use anyhow::Context as _;
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};
use wasmctrl_testenv::TestEnv;

use crate::TEST_LABEL;
use crate::objects::resource;

/// The ReconcilePolicy API.
pub fn policies(client: &Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &resource("wasmctrl.dev", "v1alpha1", "ReconcilePolicy"),
    )
}

/// The NamespacedReconcilePolicy API in `namespace`.
pub fn namespaced_policies(client: &Client, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        namespace,
        &resource("wasmctrl.dev", "v1alpha1", "NamespacedReconcilePolicy"),
    )
}

/// The namespace each test made with [`test_namespace`], by test name.
static TEST_NAMESPACES: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// A fresh namespace for `test` and an admin client. Policies the test applies reconcile
/// parents in this namespace only (`spec.parent.namespace`), so tests that share a parent
/// kind run side by side without claiming it from each other. The namespace is labelled
/// `TEST_LABEL=test`, so the team policies made in it are placed with the test's host.
pub async fn test_namespace(test: &str) -> anyhow::Result<(Client, String)> {
    let (client, namespace) = TestEnv::get().namespace(test).await?;
    place_namespace(&client, &namespace, test).await?;
    TEST_NAMESPACES
        .lock()
        .expect("not poisoned")
        .push((test.to_owned(), namespace.clone()));
    Ok((client, namespace))
}

/// Label `namespace` as an admin places it with the host of `test`: its team policies run
/// there (a host's `--policy-selector` matches its namespaces' labels).
pub async fn place_namespace(client: &Client, namespace: &str, test: &str) -> anyhow::Result<()> {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .patch(
            namespace,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {TEST_LABEL: test}}})),
        )
        .await
        .with_context(|| format!("labelling namespace {namespace}"))?;
    Ok(())
}

/// Delete a test's namespace once it passed (a failed test leaves it for inspection).
pub async fn delete_namespace(client: &Client, namespace: &str) -> anyhow::Result<()> {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .delete(namespace, &Default::default())
        .await
        .with_context(|| format!("deleting namespace {namespace}"))?;
    Ok(())
}

/// Create or update policy `name` for `test` with `spec`. Unless the spec names a parent
/// namespace, the policy is confined to the test's namespace.
pub async fn apply_policy(
    client: &Client,
    test: &str,
    name: &str,
    mut spec: Value,
) -> anyhow::Result<()> {
    let namespace = TEST_NAMESPACES
        .lock()
        .expect("not poisoned")
        .iter()
        .rev()
        .find(|(t, _)| t == test)
        .map(|(_, ns)| ns.clone());
    if let (Some(namespace), Some(parent)) = (namespace, spec["parent"].as_object_mut()) {
        parent
            .entry("namespace")
            .or_insert_with(|| json!(namespace));
    }
    let policy = json!({
        "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
        "metadata": {"name": name, "labels": {TEST_LABEL: test}},
        "spec": spec,
    });
    policies(client)
        .patch(
            name,
            &PatchParams::apply("wasmctrl-e2e").force(),
            &Patch::Apply(&policy),
        )
        .await
        .with_context(|| format!("applying policy {name}"))?;
    Ok(())
}

/// The path of a built plugin, as a file source.
pub fn file_source(plugin: &str) -> Value {
    let path = wasmctrl_testenv::plugins::guest(plugin);
    json!({"file": {"path": path.to_string_lossy()}})
}

/// Whether the policy's shadow candidate has been evaluated on at least `parents` parents and
/// would change and fail on none: it decides as the active plugin does.
pub fn candidate_decides_the_same(policy: &Value, parents: u64) -> bool {
    let c = &policy["status"]["candidate"];
    c["evaluated"].as_u64().is_some_and(|n| n >= parents)
        && c["unchanged"] == c["evaluated"]
        && c["wouldChange"] == 0
        && c["wouldFail"] == 0
}
