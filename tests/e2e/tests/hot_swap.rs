//! Hot swap, end to end: a new plugin goes live without a restart and reaches every parent;
//! a plugin that cannot load never replaces a working one; a plugin that fails on every call
//! is visible and deletes nothing; new bytes behind a file or ConfigMap source swap by
//! themselves; rolling back restores the old children.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::TryStreamExt as _;
use kube::ResourceExt as _;
use kube::runtime::{WatchStreamExt as _, watcher};
use serde_json::{Value, json};
use support::*;
use wasmctrl::plugin::Digest;
use wasmctrl_testenv::TestEnv;
use wasmctrl_testenv::plugins::guest;

const DIGEST_ANNOTATION: &str = "wasmctrl.dev/plugin-digest";
const VERSION_LABEL: &str = "example.com/plugin-version";

fn digest_of(plugin: &str) -> String {
    Digest::of(&std::fs::read(guest(plugin)).expect("built")).to_string()
}

fn policy(source: Value, digest: Option<&str>, config: Value) -> Value {
    let mut plugin = json!({"source": source, "config": config});
    if let Some(digest) = digest {
        plugin["digest"] = json!(digest);
    }
    json!({
        "parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
        "children": [{"apiVersion": "apps/v1", "kind": "Deployment"}, {"apiVersion": "v1", "kind": "Service"}],
        "plugin": plugin,
        "maxConcurrentReconciles": 8,
    })
}

fn myapp(name: &str) -> Value {
    json!({
        "apiVersion": "example.com/v1", "kind": "MyApp",
        "metadata": {"name": name},
        "spec": {"replicas": 1, "image": "nginx:1.27"},
    })
}

fn served_by(app: &Value, digest: &str) -> bool {
    app["metadata"]["annotations"][DIGEST_ANNOTATION] == digest
        && condition(app, "Reconciled").is_some_and(|c| c["status"] == "True")
        && app["status"]["observedGeneration"] == app["metadata"]["generation"]
}

/// When each parent was first seen reconciled by `digest`, and whether any parent reported a
/// failed reconcile, from a watch running alongside the test.
struct Rollout {
    reached: Arc<Mutex<HashMap<String, Instant>>>,
    failures: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Rollout {
    fn watch(api: kube::Api<kube::api::DynamicObject>, digest: String) -> Self {
        let reached = Arc::new(Mutex::new(HashMap::new()));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let (r, f) = (reached.clone(), failures.clone());
        let task = tokio::spawn(async move {
            let mut stream =
                std::pin::pin!(watcher(api, watcher::Config::default()).applied_objects());
            while let Ok(Some(app)) = stream.try_next().await {
                let app = serde_json::to_value(app).unwrap_or_default();
                let name = app["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                if let Some(c) = condition(&app, "Reconciled").filter(|c| c["status"] == "False") {
                    f.lock()
                        .expect("lock")
                        .push(format!("{name}: {}", c["message"]));
                }
                if app["metadata"]["annotations"][DIGEST_ANNOTATION] == digest.as_str() {
                    r.lock()
                        .expect("lock")
                        .entry(name)
                        .or_insert_with(Instant::now);
                }
            }
        });
        Self {
            reached,
            failures,
            task,
        }
    }
}

impl Drop for Rollout {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_plugin_reaches_every_parent_without_errors_and_rolls_back() -> anyhow::Result<()> {
    const TEST: &str = "swap-rollout";
    const PARENTS: usize = 200;
    let (client, ns) = TestEnv::get().namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let (v1, v2) = (digest_of("myapp_plugin"), digest_of("myapp_v2_plugin"));
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(file_source("myapp_plugin"), Some(&v1), json!({})),
    )
    .await?;
    let host = HostUnderTest::start(TEST, &ns).await?;
    let myapps = api(&client, &resource("example.com", "v1", "MyApp"), &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);

    for i in 0..PARENTS {
        apply(&myapps, myapp(&format!("app-{i:03}"))).await?;
    }
    let all = |digest: &str| {
        let myapps = myapps.clone();
        let digest = digest.to_owned();
        async move {
            let list = myapps.list(&Default::default()).await?;
            Ok::<_, anyhow::Error>(
                list.items.len() == PARENTS
                    && list
                        .items
                        .iter()
                        .all(|a| served_by(&serde_json::to_value(a).unwrap_or_default(), &digest)),
            )
        }
    };
    wasmctrl_testenv::cluster::eventually("200 MyApps on v1", Duration::from_secs(120), || {
        all(&v1)
    })
    .await?;

    // Swap to v2: every parent is re-reconciled by it, none fails on the way.
    let rollout = Rollout::watch(myapps.clone(), v2.clone());
    let swapped_at = Instant::now();
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(file_source("myapp_v2_plugin"), Some(&v2), json!({})),
    )
    .await?;
    wasmctrl_testenv::cluster::eventually("200 MyApps on v2", Duration::from_secs(120), || {
        all(&v2)
    })
    .await?;
    let deployments_list = deployments.list(&Default::default()).await?;
    assert_eq!(deployments_list.items.len(), PARENTS);
    for d in &deployments_list.items {
        assert_eq!(
            d.labels().get(VERSION_LABEL).map(String::as_str),
            Some("v2"),
            "{}",
            d.name_any()
        );
    }
    let times: Vec<Duration> = {
        let reached = rollout.reached.lock().expect("lock");
        let mut times: Vec<Duration> = reached
            .values()
            .map(|t| t.duration_since(swapped_at))
            .collect();
        times.sort();
        times
    };
    assert_eq!(times.len(), PARENTS, "the watch saw every parent reach v2");
    let failures = rollout.failures.lock().expect("lock").clone();
    assert!(
        failures.is_empty(),
        "no reconcile may fail during the swap: {failures:?}"
    );
    eprintln!(
        "swap v1 -> v2 over {PARENTS} parents: first reconciled by v2 after {:?}, last after {:?}",
        times[0],
        times[PARENTS - 1]
    );
    let policy_status = get(&policies(&client), TEST).await?.expect("policy");
    assert_eq!(policy_status["status"]["activeDigest"], v2.as_str());
    assert!(policy_status["status"]["activeSince"].is_string());

    // Roll back: v1's children come back (the label v2 added is gone).
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(file_source("myapp_plugin"), Some(&v1), json!({})),
    )
    .await?;
    wasmctrl_testenv::cluster::eventually(
        "200 MyApps back on v1",
        Duration::from_secs(120),
        || all(&v1),
    )
    .await?;
    let deployments_list = deployments.list(&Default::default()).await?;
    assert!(
        deployments_list
            .items
            .iter()
            .all(|d| !d.labels().contains_key(VERSION_LABEL))
    );

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_that_cannot_load_are_refused_and_one_that_traps_deletes_nothing()
-> anyhow::Result<()> {
    const TEST: &str = "swap-refusals";
    let (client, ns) = TestEnv::get().namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let v1 = digest_of("myapp_plugin");
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(file_source("myapp_plugin"), None, json!({})),
    )
    .await?;
    let host = HostUnderTest::start(TEST, &ns).await?;
    let myapps = api(&client, &resource("example.com", "v1", "MyApp"), &ns);
    let services = api(&client, &resource("", "v1", "Service"), &ns);
    let policy_api = policies(&client);
    apply(&myapps, myapp("web")).await?;
    wait_for_object(&myapps, "web", "web on v1", |a| served_by(a, &v1)).await?;

    let plugin_loaded = |reason: &'static str| {
        move |p: &Value| {
            condition(p, "PluginLoaded")
                .is_some_and(|c| c["status"] == "False" && c["reason"] == reason)
        }
    };
    // Bytes that do not compile.
    let dir = tempfile::tempdir()?;
    let garbage = dir.path().join("garbage.wasm");
    std::fs::write(&garbage, b"\0asm\x0d\0\x01\0 this is not a component")?;
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(json!({"file": {"path": garbage}}), None, json!({})),
    )
    .await?;
    let refused = wait_for_object(
        &policy_api,
        TEST,
        "garbage refused",
        plugin_loaded("InvalidPlugin"),
    )
    .await?;
    assert_eq!(
        refused["status"]["activeDigest"],
        v1.as_str(),
        "v1 keeps serving"
    );
    // The wrong digest.
    let wrong = format!("sha256:{}", "1".repeat(64));
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(file_source("myapp_v2_plugin"), Some(&wrong), json!({})),
    )
    .await?;
    wait_for_object(
        &policy_api,
        TEST,
        "wrong digest refused",
        plugin_loaded("DigestMismatch"),
    )
    .await?;
    // v1 still reconciles: a new parent is served by it.
    apply(&myapps, myapp("api")).await?;
    wait_for_object(&myapps, "api", "api on v1 while swaps are refused", |a| {
        served_by(a, &v1)
    })
    .await?;

    // A plugin that loads but traps on every call: visible, and nothing is deleted.
    let trap = digest_of("misbehave_plugin");
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(
            file_source("misbehave_plugin"),
            None,
            json!({"behavior": "panic"}),
        ),
    )
    .await?;
    wait_for_object(&policy_api, TEST, "the trapping plugin active", |p| {
        p["status"]["activeDigest"] == trap.as_str()
    })
    .await?;
    for name in ["web", "api"] {
        wait_for_object(&myapps, name, "PluginFailed on the parent", |a| {
            condition(a, "Reconciled")
                .is_some_and(|c| c["status"] == "False" && c["reason"] == "PluginFailed")
        })
        .await?;
        assert!(
            get(&services, name).await?.is_some(),
            "a trapping plugin must not delete children"
        );
    }
    let events = event_reasons(&client, &ns, "web").await?;
    assert!(
        events.contains(&("Warning".into(), "PluginFailed".into())),
        "{events:?}"
    );

    // Swapping back recovers.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(file_source("myapp_plugin"), Some(&v1), json!({})),
    )
    .await?;
    for name in ["web", "api"] {
        wait_for_object(&myapps, name, "recovered on v1", |a| served_by(a, &v1)).await?;
    }
    let recovered = get(&policy_api, TEST).await?.expect("policy");
    assert_eq!(
        condition(&recovered, "PluginLoaded").map(|c| c["status"].clone()),
        Some(json!("True"))
    );

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_bytes_behind_a_file_or_config_map_source_swap_by_themselves() -> anyhow::Result<()> {
    const TEST: &str = "swap-sources";
    let (client, ns) = TestEnv::get().namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let (v1, v2) = (digest_of("myapp_plugin"), digest_of("myapp_v2_plugin"));
    let myapps = api(&client, &resource("example.com", "v1", "MyApp"), &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);

    // A file source whose file is replaced (atomically, as a deploy tool would).
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("plugin.wasm");
    std::fs::copy(guest("myapp_plugin"), &file)?;
    let file_policy = format!("{TEST}-file");
    apply_policy(
        &client,
        TEST,
        &file_policy,
        policy(json!({"file": {"path": file}}), None, json!({})),
    )
    .await?;
    let host = HostUnderTest::start(TEST, &ns).await?;
    apply(&myapps, myapp("web")).await?;
    wait_for_object(&myapps, "web", "web on v1 from the file", |a| {
        served_by(a, &v1)
    })
    .await?;
    let staged = dir.path().join("plugin.wasm.new");
    std::fs::copy(guest("myapp_v2_plugin"), &staged)?;
    std::fs::rename(&staged, &file)?;
    wait_for_object(&myapps, "web", "web on v2 after the file changed", |a| {
        served_by(a, &v2)
    })
    .await?;
    policies(&client)
        .delete(&file_policy, &Default::default())
        .await?;

    // A ConfigMap source whose binaryData is updated.

    let binary = |plugin: &str| -> anyhow::Result<Value> {
        use base64::Engine as _;
        Ok(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "plugin"},
            "binaryData": {"plugin.wasm": base64::engine::general_purpose::STANDARD.encode(std::fs::read(guest(plugin))?)},
        }))
    };
    apply(&config_maps, binary("myapp_plugin")?).await?;
    let cm_policy = format!("{TEST}-configmap");
    apply_policy(
        &client,
        TEST,
        &cm_policy,
        policy(
            json!({"configMap": {"namespace": ns, "name": "plugin", "key": "plugin.wasm"}}),
            None,
            json!({}),
        ),
    )
    .await?;
    wait_for_object(&myapps, "web", "web on v1 from the ConfigMap", |a| {
        served_by(a, &v1)
    })
    .await?;
    apply(&config_maps, binary("myapp_v2_plugin")?).await?;
    wait_for_object(
        &myapps,
        "web",
        "web on v2 after the ConfigMap changed",
        |a| served_by(a, &v2),
    )
    .await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client)
        .delete(&cm_policy, &Default::default())
        .await?;
    Ok(())
}
