//! A plugin converts its kind between API versions, against a real API server: the host
//! points the CRD's conversion at its listener, the API server asks the plugin for every
//! object it reads or writes at another version than stored, `wasmctrl migrate` rewrites
//! what is stored at the old version, and the CRD's conversion goes back as it was once no
//! stored object needs the webhook.

use std::time::Duration;

use anyhow::Context as _;
use clap::Parser as _;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use wasmctrl_e2e::*;
use wasmctrl_testenv::cluster::eventually;

/// The Widget plugin's kind: `example.com`, at v1alpha1 (`address`, `replicaCount`) and v1
/// (`endpoint: {host, port}`, `replicas`).
const GROUP: &str = "example.com";
/// How long a CRD takes to change as asked (deleted with its objects, or rewritten by the
/// host).
const CRD_CHANGE: Duration = Duration::from_secs(60);

/// The Widget CRD, stored at `storage`.
fn widget_crd(storage: &str) -> Value {
    let schema = |spec: Value| {
        json!({"openAPIV3Schema": {"type": "object", "properties": {
            "spec": spec,
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
        }}})
    };
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("widgets.{GROUP}")},
        "spec": {
            "group": GROUP,
            "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
            "scope": "Namespaced",
            "versions": [
                {"name": "v1alpha1", "served": true, "storage": storage == "v1alpha1",
                 "subresources": {"status": {}},
                 "schema": schema(json!({"type": "object", "properties": {
                     "address": {"type": "string"}, "replicaCount": {"type": "integer"}}}))},
                {"name": "v1", "served": true, "storage": storage == "v1",
                 "subresources": {"status": {}},
                 "schema": schema(json!({"type": "object", "properties": {
                     "endpoint": {"type": "object", "properties": {
                         "host": {"type": "string"}, "port": {"type": "integer"}}},
                     "replicas": {"type": "integer"}}}))},
            ],
        },
    })
}

/// The CRD of `kind` (plural `kinds`) for the misbehaving plugin's converter (example.com
/// v1 ↔ v2, any spec).
fn misfit_crd(kind: &str) -> Value {
    let (singular, plural) = (kind.to_lowercase(), format!("{}s", kind.to_lowercase()));
    let version = |name: &str, storage: bool| {
        json!({"name": name, "served": true, "storage": storage,
               "subresources": {"status": {}},
               "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                   "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                   "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}}})
    };
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.{GROUP}")},
        "spec": {
            "group": GROUP,
            "names": {"kind": kind, "plural": plural, "singular": singular, "listKind": format!("{kind}List")},
            "scope": "Namespaced",
            "versions": [version("v1", true), version("v2", false)],
        },
    })
}

/// `kind`'s objects in `ns`, at `version`.
fn at(client: &Client, ns: &str, kind: &str, version: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(GROUP, version, kind);
    let plural = format!("{}s", kind.to_lowercase());
    Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::from_gvk_with_plural(&gvk, &plural),
    )
}

fn object(kind: &str, version: &str, name: &str, spec: Value) -> anyhow::Result<DynamicObject> {
    Ok(serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/{version}"), "kind": kind,
        "metadata": {"name": name}, "spec": spec,
    }))?)
}

/// The CRD `name`, as JSON.
async fn crd(client: &Client, name: &str) -> anyhow::Result<Value> {
    Ok(serde_json::to_value(crds_api(client).get(name).await?)?)
}

/// Wait until CRD `name` satisfies `check`.
async fn wait_for_crd(
    client: &Client,
    name: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> anyhow::Result<()> {
    let check = &check;
    eventually(&format!("CRD {name}: {what}"), CRD_CHANGE, || async move {
        Ok(check(&crd(client, name).await?))
    })
    .await
}

/// `crd` installed afresh: one a failed earlier run left (pointed at its host, or stored at
/// another version) is deleted first.
async fn fresh_crd(client: &Client, crd: &Value) -> anyhow::Result<()> {
    let name = crd["metadata"]["name"].as_str().context("a CRD name")?;
    if crds_api(client).get_opt(name).await?.is_some() {
        crds_api(client).delete(name, &Default::default()).await?;
        eventually(&format!("CRD {name} gone"), CRD_CHANGE, || async move {
            Ok(crds_api(client).get_opt(name).await?.is_none())
        })
        .await?;
    }
    install_crd(client, crd).await
}

/// A host serving webhooks for test `test` in `ns`, and its policy (named `ns`) with `spec`,
/// once its conversion is served: the host, and the policy as it then stands.
/// A namespace for `test`, a fresh CRD of `kind` (see [`misfit_crd`]) and a host whose
/// policy (named as the namespace) has the misbehaving plugin convert it between v1 and v2.
async fn misbehaving_converter(
    test: &str,
    kind: &str,
) -> anyhow::Result<(Client, String, HostUnderTest)> {
    let (client, ns) = test_namespace(test).await?;
    install_repo_crds(&client).await?;
    fresh_crd(&client, &misfit_crd(kind)).await?;
    let (host, _, _) = converting(
        &client,
        test,
        &ns,
        json!({
            "parent": {"apiVersion": format!("{GROUP}/v1"), "kind": kind},
            "plugin": {"source": file_source("misbehave_plugin"), "config": {}},
            "conversion": {"versions": ["v1", "v2"]},
        }),
    )
    .await?;
    Ok((client, ns, host))
}

async fn converting(
    client: &Client,
    test: &str,
    ns: &str,
    spec: Value,
) -> anyhow::Result<(HostUnderTest, String, Value)> {
    converting_recorded(client, test, ns, spec, None).await
}

/// [`converting`], the host recording every reconcile as a case in `cases`.
async fn converting_recorded(
    client: &Client,
    test: &str,
    ns: &str,
    spec: Value,
    cases: Option<&std::path::Path>,
) -> anyhow::Result<(HostUnderTest, String, Value)> {
    let (url, ca_bundle, answerers) = listener(client, ns, "wasmctrl-conversion").await?;
    let mut host =
        HostUnderTest::builder(test, ns).webhooks(hosting(ns, &url, &answerers, &ca_bundle));
    if let Some(dir) = cases {
        let explain = wasmctrl::explain::Explain::new(&wasmctrl::explain::ExplainOptions {
            record: Some(wasmctrl::explain::RecordOptions {
                dir: dir.to_owned(),
                max_files: 100,
                one_in: 1,
            }),
            ..Default::default()
        })?;
        host = host.explained(std::sync::Arc::new(explain));
    }
    let host = host.start().await?;
    apply_policy(client, test, ns, spec).await?;
    let served = wait_for_object(&policies(client), ns, "conversion served", |p| {
        condition(p, "ConversionServed").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    Ok((host, url, served))
}

/// The `wasmctrl migrate` command for `args`, run through `client`.
async fn migrate(client: &Client, kind: &str) -> anyhow::Result<wasmctrl::cli::Migrated> {
    let cli = wasmctrl::cli::Cli::try_parse_from(["wasmctrl", "migrate", kind])?;
    let wasmctrl::cli::Command::Migrate(command) = cli.command else {
        anyhow::bail!("not the migrate command");
    };
    command.run_with(client).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn widgets_read_at_either_version_and_migrate_retires_the_old_one() -> anyhow::Result<()> {
    const TEST: &str = "conversion-widgets";
    const CRD: &str = "widgets.example.com";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    // Widgets were made at v1alpha1, and stored so.
    fresh_crd(&client, &widget_crd("v1alpha1")).await?;
    let old = at(&client, &ns, "Widget", "v1alpha1");
    let new = at(&client, &ns, "Widget", "v1");
    for (name, address, count) in [
        ("db", "db.example.com:5432", 2),
        ("queue", "mq.local:5672", 1),
    ] {
        old.create(
            &PostParams::default(),
            &object(
                "Widget",
                "v1alpha1",
                name,
                json!({"address": address, "replicaCount": count}),
            )?,
        )
        .await?;
    }

    // A policy reconciles them at v1, and its plugin converts.
    let name = ns.clone();
    let cases = tempfile::tempdir()?;
    let spec = json!({
        "parent": {"apiVersion": format!("{GROUP}/v1"), "kind": "Widget"},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "plugin": {"source": file_source("widget_plugin")},
        "conversion": {"versions": ["v1alpha1", "v1"]},
    });
    let (host, url, served) =
        converting_recorded(&client, TEST, &ns, spec.clone(), Some(cases.path())).await?;
    assert_eq!(served["status"]["conversion"]["crd"], CRD);
    assert_eq!(
        served["status"]["conversion"]["storedVersions"],
        json!(["v1alpha1"])
    );
    let stanza = crd(&client, CRD).await?["spec"]["conversion"].clone();
    assert_eq!(stanza["strategy"], "Webhook", "{stanza}");
    assert_eq!(
        stanza["webhook"]["clientConfig"]["url"],
        format!("{url}/convert/{name}")
    );

    // Made at v1alpha1, read at v1 through the plugin: the address split in two, the count
    // renamed.
    let db = new.get("db").await?;
    assert_eq!(
        db.data["spec"],
        json!({"endpoint": {"host": "db.example.com", "port": 5432}, "replicas": 2})
    );
    // The plugin reconciles them at v1.
    let configmaps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let endpoint = wait_for_object(&configmaps, "queue-endpoint", "the child", |c| {
        c["data"]["host"] == "mq.local"
    })
    .await?;
    assert_eq!(endpoint["data"]["port"], "5672");
    // Made at v1, read at v1alpha1, and back.
    new.create(
        &PostParams::default(),
        &object(
            "Widget",
            "v1",
            "cache",
            json!({"endpoint": {"host": "cache.local", "port": 6379}, "replicas": 3}),
        )?,
    )
    .await?;
    let cache = old.get("cache").await?;
    assert_eq!(
        cache.data["spec"],
        json!({"address": "cache.local:6379", "replicaCount": 3})
    );
    assert_eq!(
        new.get("cache").await?.data["spec"]["endpoint"]["host"],
        "cache.local"
    );
    // Each conversion is on record for `wasmctrl explain`.
    let records = conversion_records(&host, &ns, "db")?;
    assert!(
        records.iter().any(|r| r.outcome == "converted"
            && r.conversion.as_deref() == Some("example.com/v1alpha1 → example.com/v1")),
        "{records:?}"
    );

    // A candidate whose converter does not take Widgets back to v1alpha1 is rolled back by
    // its replay gate before it serves any parent, and the active plugin keeps converting.
    let mut rolled = spec.clone();
    rolled["plugin"]["candidate"] =
        json!({"source": file_source("misbehave_plugin"), "config": {}});
    rolled["plugin"]["rollout"] = json!({
        "stages": [{"percent": 100, "maxWouldFail": 1.0}],
        "replay": {"recorded": true},
    });
    apply_policy(&client, TEST, &name, rolled).await?;
    let rolled_back = wait_for_object_within(
        &policies(&client),
        &name,
        "the candidate rolled back by its converter",
        Duration::from_secs(120),
        |p| p["status"]["rollout"]["phase"] == "RolledBack",
    )
    .await?;
    let state = &rolled_back["status"]["rollout"];
    assert!(
        state["examples"]
            .to_string()
            .contains("converting to example.com/v1alpha1 failed"),
        "{state}"
    );
    assert_eq!(
        rolled_back["status"]["candidate"]["canaryParents"], 0,
        "{state}"
    );
    apply_policy(&client, TEST, &name, spec.clone()).await?;
    assert_eq!(old.get("db").await?.data["spec"]["replicaCount"], 2);

    // v1 becomes the storage version: what was stored at v1alpha1 still needs the webhook.
    install_crd(&client, &widget_crd("v1")).await?;
    wait_for_crd(&client, CRD, "v1 stored", |c| {
        c["status"]["storedVersions"] == json!(["v1alpha1", "v1"])
    })
    .await?;
    // The policy goes, but its conversion stays until nothing needs it, and says why.
    policies(&client).delete(&name, &Default::default()).await?;
    let staying = wait_for_object(
        &policies(&client),
        &name,
        "the conversion still needed",
        |p| condition(p, "ConversionServed").is_some_and(|c| c["reason"] == "StillNeeded"),
    )
    .await?;
    let message = condition(&staying, "ConversionServed")
        .and_then(|c| c["message"].as_str().map(str::to_owned))
        .unwrap_or_default();
    assert!(message.contains("wasmctrl migrate"), "{message}");
    assert_eq!(
        crd(&client, CRD).await?["spec"]["conversion"]["strategy"],
        "Webhook"
    );
    assert_eq!(
        old.get("db").await?.data["spec"]["address"],
        "db.example.com:5432",
        "still read through the plugin"
    );

    // `wasmctrl migrate` rewrites every Widget at v1; v1alpha1 is no longer stored…
    let migrated = migrate(&client, CRD).await?;
    assert_eq!(migrated.crd, CRD);
    assert_eq!(migrated.storage_version, "v1");
    assert!(
        migrated.rewritten >= 1
            && migrated.rewritten + migrated.changed_meanwhile + migrated.already_current == 3
            && migrated.failed.is_empty(),
        "{migrated:?}"
    );
    // Run again, it finds nothing left to rewrite.
    let again = migrate(&client, CRD).await?;
    assert_eq!(
        (again.rewritten, again.already_current),
        (0, 3),
        "{again:?}"
    );
    assert_eq!(migrated.stored_versions, ["v1"]);
    // …so the CRD's conversion goes back as it was, and the policy with it.
    wait_for_crd(&client, CRD, "the conversion put back", |c| {
        c["spec"]["conversion"]["strategy"] == "None"
            && c["metadata"]["annotations"]["conversion.wasmctrl.dev/policy"].is_null()
    })
    .await?;
    wait_gone(&policies(&client), &name, "the policy gone").await?;
    // Stored at v1, the Widgets read as they were.
    assert_eq!(new.get("db").await?.data["spec"]["endpoint"]["port"], 5432);

    host.stop().await?;
    crds_api(&client).delete(CRD, &Default::default()).await?;
    delete_namespace(&client, &ns).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_converter_that_traps_fails_the_read_and_nothing_is_written() -> anyhow::Result<()> {
    const TEST: &str = "conversion-trap";
    const CRD: &str = "misfits.example.com";
    let (client, ns, host) = misbehaving_converter(TEST, "Misfit").await?;
    let name = ns.clone();
    let v1 = at(&client, &ns, "Misfit", "v1");
    let v2 = at(&client, &ns, "Misfit", "v2");
    v1.create(
        &PostParams::default(),
        &object("Misfit", "v1", "calm", json!({"kept": 1}))?,
    )
    .await?;
    let trapper = v1
        .create(
            &PostParams::default(),
            &object("Misfit", "v1", "trapper", json!({"behavior": "panic"}))?,
        )
        .await?;

    // One that converts reads at v2; one whose conversion traps fails the read with the
    // plugin's message and its name.
    assert_eq!(v2.get("calm").await?.data["spec"]["kept"], 1);
    let failed = v2.get("trapper").await.expect_err("the conversion traps");
    let message = failed.to_string();
    assert!(
        message.contains("could not convert") && message.contains("trapper"),
        "{message}"
    );
    assert!(message.contains("deliberate panic"), "{message}");
    // A list at v2 fails whole: no object is half-converted.
    assert!(v2.list(&Default::default()).await.is_err());
    // A write at v2 fails too, and nothing is written.
    let mut changed = object(
        "Misfit",
        "v2",
        "trapper",
        json!({"behavior": "panic", "x": 1}),
    )?;
    changed.metadata.resource_version = trapper.metadata.resource_version.clone();
    assert!(
        v2.replace("trapper", &PostParams::default(), &changed)
            .await
            .is_err()
    );
    let kept = v1.get("trapper").await?;
    assert_eq!(kept.data["spec"], json!({"behavior": "panic"}));
    assert!(kept.data["spec"]["x"].is_null());
    // The failure is on record.
    let failures: Vec<_> = webhook_records(&host, "Misfit", &ns, "trapper")?
        .into_iter()
        .filter(|r| r.webhook == "convert" && r.outcome == "failed")
        .collect();
    assert!(!failures.is_empty());
    assert!(
        failures[0]
            .message
            .as_deref()
            .is_some_and(|m| m.contains("deliberate panic")),
        "{failures:?}"
    );

    // Nothing was ever stored at v2: the policy goes, and the CRD's conversion with it.
    policies(&client).delete(&name, &Default::default()).await?;
    wait_for_crd(&client, CRD, "the conversion put back", |c| {
        c["spec"]["conversion"]["strategy"] == "None"
    })
    .await?;
    wait_gone(&policies(&client), &name, "the policy gone").await?;
    // The API server no longer asks the plugin (strategy None only relabels the version),
    // once it has taken up the CRD's change.
    let v2 = &v2;
    eventually(
        "trapper read at v2 without the plugin",
        ACT,
        || async move { Ok(v2.get("trapper").await?.data["spec"]["behavior"] == "panic") },
    )
    .await?;

    host.stop().await?;
    crds_api(&client).delete(CRD, &Default::default()).await?;
    delete_namespace(&client, &ns).await?;
    Ok(())
}

fn conversion_records(
    host: &HostUnderTest,
    ns: &str,
    name: &str,
) -> anyhow::Result<Vec<wasmctrl::explain::WebhookRecord>> {
    Ok(webhook_records(host, "Widget", ns, name)?
        .into_iter()
        .filter(|r| r.webhook == "convert")
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uninstall_puts_the_conversion_back_and_lets_the_policy_go() -> anyhow::Result<()> {
    const TEST: &str = "conversion-uninstall";
    const CRD: &str = "quirks.example.com";
    let (client, ns, host) = misbehaving_converter(TEST, "Quirk").await?;
    let name = ns.clone();
    let held = policies(&client).get(&name).await?;
    assert!(
        held.metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == "wasmctrl.dev/put-back-conversion")),
        "{:?}",
        held.metadata.finalizers
    );
    // The hosts go; the uninstall puts the CRD's conversion back and lets the policy go.
    host.stop().await?;
    let selector = format!("{TEST_LABEL}={TEST}");
    let cli = <wasmctrl::cli::Cli as clap::Parser>::try_parse_from([
        "wasmctrl",
        "uninstall",
        "--lease",
        &format!("{ns}/absent"),
        "--selector",
        &selector,
        "--force",
    ])?;
    let wasmctrl::cli::Command::Uninstall(command) = cli.command else {
        anyhow::bail!("not the uninstall command");
    };
    command.run_with(&client).await?;
    let put_back = crd(&client, CRD).await?;
    assert_eq!(
        put_back["spec"]["conversion"]["strategy"], "None",
        "{put_back}"
    );
    assert!(put_back["metadata"]["annotations"]["conversion.wasmctrl.dev/policy"].is_null());
    wait_gone(&policies(&client), &name, "the policy gone").await?;

    crds_api(&client).delete(CRD, &Default::default()).await?;
    delete_namespace(&client, &ns).await?;
    Ok(())
}
