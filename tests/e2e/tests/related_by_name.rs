//! Related objects chosen by name (`related[].nameFrom`) against a real control plane: the
//! plugin receives exactly the objects its parent names (an unlabelled ConfigMap named in
//! `spec.configMap`, the Secret named like the parent) and no other object of those kinds; a
//! change to a named object re-reconciles the parent; renaming follows; a named object that
//! goes away is reported by the plugin and nothing is deleted.

use std::sync::Arc;

use anyhow::Context as _;
use serde_json::{Value, json};
use wasmctrl::explain::{Bounds, Explain, Lookup};
use wasmctrl_e2e::*;

fn config_map(name: &str, currency: &str, labelled: bool) -> Value {
    let labels = if labelled {
        json!({"example.com/myapp-config": "true"})
    } else {
        json!({})
    };
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": name, "labels": labels}, "data": {"CURRENCY": currency}})
}

fn secret(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
           "data": {"password": "c2VjcmV0"}})
}

/// The related objects (kind/name) of the newest reconcile of `web` that had any.
fn related_in_last_request(explain: &Explain, ns: &str) -> Option<Vec<String>> {
    let Lookup::Found { records, .. } = explain.store.lookup("MyApp", Some(ns), "web", 50) else {
        return None;
    };
    records.iter().find_map(|record| {
        let record: Value = serde_json::from_str(record).ok()?;
        let related = record["case"]["related"].as_array()?;
        Some(
            related
                .iter()
                .map(|o| {
                    format!(
                        "{}/{}",
                        o["kind"].as_str().unwrap_or(""),
                        o["metadata"]["name"].as_str().unwrap_or("")
                    )
                })
                .collect(),
        )
    })
}

fn env_currency(deployment: &Value) -> Value {
    deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .and_then(|env| env.iter().find(|e| e["name"] == "CURRENCY"))
        .map(|e| e["value"].clone())
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_receives_exactly_the_objects_its_parent_names() -> anyhow::Result<()> {
    const TEST: &str = "related-by-name";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let mut spec = myapp_policy_spec(file_source("myapp_plugin"), json!({"service": false}));
    spec["related"] = json!([
        {"apiVersion": "v1", "kind": "ConfigMap", "nameFrom": "spec.configMap"},
        {"apiVersion": "v1", "kind": "Secret", "nameFrom": "metadata.name"},
    ]);
    apply_policy(&client, TEST, TEST, spec).await?;
    let explain = Arc::new(Explain::in_memory(Bounds {
        max_bytes: 8 << 20,
        per_parent: 50,
    }));
    let host = HostUnderTest::builder(TEST, &ns)
        .explained(explain.clone())
        .start()
        .await?;

    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let secrets = api(&client, &resource("", "v1", "Secret"), &ns);
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    // Named but unlabelled; labelled (a selector would pick it) but not named.
    apply(&config_maps, config_map("web-env", "EUR", false)).await?;
    apply(&config_maps, config_map("other", "GBP", true)).await?;
    apply(&secrets, secret("web")).await?;
    apply(&secrets, secret("unrelated")).await?;
    apply(&myapps, myapp("web", 1, "nginx:1.25", Some("web-env"))).await?;

    wait_for_object(&deployments, "web", "env from the named ConfigMap", |d| {
        env_currency(d) == "EUR"
    })
    .await?;
    let found = wait_for_object(&myapps, "web", "ConfigMapFound=True", |m| {
        condition(m, "ConfigMapFound").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    assert!(found["status"]["observedGeneration"].is_i64());
    let related = related_in_last_request(&explain, &ns).context("a recorded request")?;
    assert_eq!(
        related,
        ["ConfigMap/web-env", "Secret/web"],
        "exactly the named objects, in the policy's order"
    );

    // A change to the named ConfigMap re-reconciles the parent that names it.
    apply(&config_maps, config_map("web-env", "USD", false)).await?;
    wait_for_object(
        &deployments,
        "web",
        "env follows the named ConfigMap",
        |d| env_currency(d) == "USD",
    )
    .await?;

    // Naming another object: the plugin now gets that one, and only it.
    apply(&myapps, myapp("web", 1, "nginx:1.25", Some("other"))).await?;
    wait_for_object(
        &deployments,
        "web",
        "env from the newly named ConfigMap",
        |d| env_currency(d) == "GBP",
    )
    .await?;
    let related = related_in_last_request(&explain, &ns).context("a recorded request")?;
    assert_eq!(related, ["ConfigMap/other", "Secret/web"]);

    // The named ConfigMap goes: the plugin says so; its children stay.
    config_maps.delete("other", &Default::default()).await?;
    wait_for_object(&myapps, "web", "ConfigMapFound=False", |m| {
        condition(m, "ConfigMapFound").is_some_and(|c| c["status"] == "False")
    })
    .await?;
    assert!(
        get(&deployments, "web").await?.is_some(),
        "nothing is deleted"
    );
    let related = related_in_last_request(&explain, &ns).context("a recorded request")?;
    assert_eq!(related, ["Secret/web"]);

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}
