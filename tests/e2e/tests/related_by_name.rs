//! Related objects chosen by name (`related[].nameFrom`) against a real control plane: the
//! plugin receives exactly the objects its parent names (an unlabelled ConfigMap named in
//! `spec.configMap`, the Secret named like the parent) and no other object of those kinds; a
//! change to a named object re-reconciles the parent; renaming follows; a named object that
//! goes away is reported by the plugin and nothing is deleted. A parent that names more
//! objects, or more bytes of them, than one request carries fails with `RelatedTooLarge` and
//! keeps its children as they were.

use std::sync::Arc;

use anyhow::Context as _;
use serde_json::{Value, json};
use wasmctrl::explain::{Bounds, Explain, Lookup};
use wasmctrl_e2e::*;
use wasmctrl_testenv::cluster::eventually;

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

/// Wait until the newest recorded reconcile of `web` carried exactly `expected`. A reconcile's
/// record is stored once it has ended, a moment after its status write, so the test waits for
/// it rather than reading the store right after the status shows.
async fn related_become(explain: &Explain, ns: &str, expected: &[&str]) -> anyhow::Result<()> {
    let seen = std::sync::Mutex::new(None);
    let waited = eventually("the recorded request's related objects", ACT, || {
        let related = related_in_last_request(explain, ns);
        let matched = related.as_deref().is_some_and(|r| r == expected);
        *seen.lock().expect("not poisoned") = related;
        async move { Ok(matched) }
    })
    .await;
    waited.with_context(|| {
        format!(
            "expected {expected:?}, the newest record carried {:?}",
            seen.lock().expect("not poisoned")
        )
    })
}

/// The related objects (kind/name) of the newest reconcile of `web` that had any.
fn related_in_last_request(explain: &Explain, ns: &str) -> Option<Vec<String>> {
    let kinds = explain.store.kinds_named("MyApp");
    let Lookup::Found { records } = explain.store.lookup("MyApp", Some(ns), "web", 50, &kinds)
    else {
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
    // Exactly the named objects, in the policy's order.
    related_become(&explain, &ns, &["ConfigMap/web-env", "Secret/web"]).await?;

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
    related_become(&explain, &ns, &["ConfigMap/other", "Secret/web"]).await?;

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
    related_become(&explain, &ns, &["Secret/web"]).await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}

/// The `Reconciled` condition's message once it is `False` for `reason` with a message
/// that says `saying`.
async fn failed_with(
    widgets: &kube::Api<kube::api::DynamicObject>,
    name: &str,
    reason: &str,
    saying: &str,
) -> anyhow::Result<String> {
    let failed = wait_for_object(widgets, name, &format!("{reason} on {name}"), |w| {
        condition(w, "Reconciled").is_some_and(|c| {
            c["status"] == "False"
                && c["reason"] == reason
                && c["message"].as_str().is_some_and(|m| m.contains(saying))
        })
    })
    .await?;
    Ok(condition(&failed, "Reconciled")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned())
}

fn widget_naming(name: &str, refs: &[String]) -> Value {
    json!({"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget",
           "metadata": {"name": name}, "spec": {"refs": refs}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_naming_too_much_fails_and_keeps_its_children() -> anyhow::Result<()> {
    const TEST: &str = "related-too-large";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    install_crd(&client, &test_crd(TEST_GROUP, "Widget")).await?;
    // The misbehave plugin desires `<widget>-own` holding the widget's spec as its data.
    let spec = json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "related": [{"apiVersion": "v1", "kind": "ConfigMap", "nameFrom": "spec.refs"}],
        "plugin": {"source": file_source("misbehave_plugin"), "config": {"ownChild": true}},
    });
    apply_policy(&client, TEST, TEST, spec).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let widgets = widgets(&client, &ns);

    apply(&config_maps, config_map("small", "EUR", false)).await?;
    apply(&widgets, widget_naming("w", &["small".to_owned()])).await?;
    wait_for_object(&widgets, "w", "Reconciled=True", |w| {
        condition(w, "Reconciled").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    let child_refs = |child: &Value| child["data"]["refs"].as_str().unwrap_or("").to_owned();
    let child = get(&config_maps, "w-own")
        .await?
        .context("the widget's child")?;
    assert_eq!(child_refs(&child), r#"["small"]"#);

    // More names than one field may name: refused before any of them is read.
    let many: Vec<String> = (0..65).map(|i| format!("cm-{i}")).collect();
    apply(&widgets, widget_naming("w", &many)).await?;
    let message = failed_with(&widgets, "w", "RelatedTooLarge", "names 65").await?;
    assert!(
        message.contains(&format!(
            "Widget {ns}/w: its spec.refs names 65 ConfigMap objects"
        )) && message.contains("not retried until"),
        "{message}"
    );
    let child = get(&config_maps, "w-own")
        .await?
        .context("the child stays")?;
    assert_eq!(child_refs(&child), r#"["small"]"#, "nothing was written");

    // Few names, but more bytes than one request carries (9 × 950 kB over 8 MiB).
    let big: Vec<String> = (0..9).map(|i| format!("big-{i}")).collect();
    for name in &big {
        let filler = "x".repeat(950_000);
        apply(
            &config_maps,
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
                   "data": {"filler": filler}}),
        )
        .await?;
    }
    apply(&widgets, widget_naming("w", &big)).await?;
    let message = failed_with(&widgets, "w", "RelatedTooLarge", "bytes").await?;
    assert!(
        message.contains(&format!(
            "Widget {ns}/w: its related objects come to more than 8388608 bytes"
        )) && message.contains("bytes up to ConfigMap big-8)"),
        "{message}"
    );
    let child = get(&config_maps, "w-own")
        .await?
        .context("the child stays")?;
    assert_eq!(child_refs(&child), r#"["small"]"#, "nothing was written");
    let reasons = event_reasons(&client, &ns, "w").await?;
    assert!(
        reasons
            .iter()
            .any(|(_, reason)| reason == "RelatedTooLarge"),
        "{reasons:?}"
    );

    // Back within the limits: reconciled again.
    apply(&widgets, widget_naming("w", &big[..2])).await?;
    wait_for_object(&config_maps, "w-own", "the child follows the spec", |c| {
        child_refs(c) == r#"["big-0","big-1"]"#
    })
    .await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}

/// `wasmctrl_related_cache_bytes` of policy `policy`, as the host's metrics show it.
fn related_cache_bytes(host: &HostUnderTest, policy: &str) -> Option<u64> {
    let series = format!("wasmctrl_related_cache_bytes{{controller=\"{policy}\"}} ");
    host.metrics
        .encode()
        .lines()
        .find_map(|line| line.strip_prefix(&series)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_no_parent_names_any_more_leaves_the_cache() -> anyhow::Result<()> {
    const TEST: &str = "related-unnamed";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let mut spec = myapp_policy_spec(file_source("myapp_plugin"), json!({"service": false}));
    spec["related"] = json!([
        {"apiVersion": "v1", "kind": "ConfigMap", "nameFrom": "spec.configMap"},
    ]);
    apply_policy(&client, TEST, TEST, spec).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    let mut big = config_map("big", "EUR", false);
    big["data"]["PADDING"] = json!("x".repeat(64 << 10));
    apply(&config_maps, big).await?;
    apply(&config_maps, config_map("small", "GBP", false)).await?;

    apply(&myapps, myapp("web", 1, "nginx:1.25", Some("big"))).await?;
    wait_for_object(&deployments, "web", "env from big", |d| {
        env_currency(d) == "EUR"
    })
    .await?;
    let held = related_cache_bytes(&host, TEST).context("the cache's gauge")?;
    assert!(held > 64 << 10, "the big ConfigMap is held: {held} bytes");

    // The parent names another object: nothing names the big one any more, so it goes.
    apply(&myapps, myapp("web", 1, "nginx:1.25", Some("small"))).await?;
    wait_for_object(&deployments, "web", "env from small", |d| {
        env_currency(d) == "GBP"
    })
    .await?;
    let started = std::time::Instant::now();
    loop {
        let held = related_cache_bytes(&host, TEST).context("the cache's gauge")?;
        if held < 4 << 10 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < ACT,
            "the ConfigMap no parent names is still held: {held} bytes"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}
