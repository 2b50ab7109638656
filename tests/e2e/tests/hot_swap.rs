//! Hot swap, end to end: a new plugin goes live without a restart and reaches every parent;
//! a plugin that cannot load never replaces a working one; a plugin that fails on every call
//! is visible and deletes nothing; new bytes behind a file source swap by themselves, while
//! a ConfigMap source (pinned by digest) swaps only when the policy pins the new bytes;
//! rolling back restores the old children.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::TryStreamExt as _;
use kube::ResourceExt as _;
use kube::runtime::{WatchStreamExt as _, watcher};
use serde_json::{Value, json};
use wasmctrl::plugin::Digest;
use wasmctrl::registry::HOSTS_ANNOTATION;
use wasmctrl_e2e::*;
use wasmctrl_testenv::plugins::guest;

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

/// The parent is reconciled at its current generation.
fn reconciled_now(app: &Value) -> bool {
    condition(app, "Reconciled").is_some_and(|c| c["status"] == "True")
        && app["status"]["observedGeneration"] == app["metadata"]["generation"]
}

/// Which MyApp plugin built a child: `myapp-v2` labels every child it makes.
fn built_by_v2(child: &Value) -> bool {
    child["metadata"]["labels"][VERSION_LABEL] == "v2"
}

/// The two plugins the tests swap between, told apart by what they build.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Built {
    V1,
    V2,
}

impl Built {
    fn matches(self, child: &Value) -> bool {
        built_by_v2(child) == (self == Built::V2)
    }
}

/// Wait until MyApp `name`'s Deployment is the one `built` makes and the MyApp is reconciled.
async fn wait_served(
    myapps: &kube::Api<kube::api::DynamicObject>,
    deployments: &kube::Api<kube::api::DynamicObject>,
    name: &str,
    built: Built,
) -> anyhow::Result<()> {
    let what = format!("{name} served by {built:?}");
    wait_for_object(deployments, name, &what, |d| built.matches(d)).await?;
    wait_for_object(myapps, name, &what, reconciled_now).await?;
    Ok(())
}

/// When each parent's Deployment was first seen built by v2, and whether any parent reported
/// a failed reconcile, from watches running alongside the test.
struct Rollout {
    reached: Arc<Mutex<HashMap<String, Instant>>>,
    failures: Arc<Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Rollout {
    fn watch(
        myapps: kube::Api<kube::api::DynamicObject>,
        deployments: kube::Api<kube::api::DynamicObject>,
    ) -> Self {
        let reached = Arc::new(Mutex::new(HashMap::new()));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let (r, f) = (reached.clone(), failures.clone());
        let children = tokio::spawn(async move {
            let mut stream =
                std::pin::pin!(watcher(deployments, watcher::Config::default()).applied_objects());
            while let Ok(Some(child)) = stream.try_next().await {
                let child = serde_json::to_value(child).unwrap_or_default();
                if built_by_v2(&child) {
                    let name = child["metadata"]["name"].as_str().unwrap_or_default();
                    r.lock()
                        .expect("lock")
                        .entry(name.to_owned())
                        .or_insert_with(Instant::now);
                }
            }
        });
        let parents = tokio::spawn(async move {
            let mut stream =
                std::pin::pin!(watcher(myapps, watcher::Config::default()).applied_objects());
            while let Ok(Some(app)) = stream.try_next().await {
                let app = serde_json::to_value(app).unwrap_or_default();
                if let Some(c) = condition(&app, "Reconciled").filter(|c| c["status"] == "False") {
                    let name = app["metadata"]["name"].as_str().unwrap_or_default();
                    f.lock()
                        .expect("lock")
                        .push(format!("{name}: {}", c["message"]));
                }
            }
        });
        Self {
            reached,
            failures,
            tasks: vec![children, parents],
        }
    }
}

impl Drop for Rollout {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_plugin_reaches_every_parent_without_errors_and_rolls_back() -> anyhow::Result<()> {
    const TEST: &str = "swap-rollout";
    const PARENTS: usize = 200;
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let (v1, v2) = (digest_of("myapp_plugin"), digest_of("myapp_v2_plugin"));
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(file_source("myapp_plugin"), Some(&v1), json!({})),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);

    for i in 0..PARENTS {
        apply(
            &myapps,
            myapp(&format!("app-{i:03}"), 1, "nginx:1.27", None),
        )
        .await?;
    }
    let all = |built: Built| {
        let (myapps, deployments) = (myapps.clone(), deployments.clone());
        async move {
            let apps = myapps.list(&Default::default()).await?.items;
            let children = deployments.list(&Default::default()).await?.items;
            let value = |o| serde_json::to_value(o).unwrap_or_default();
            Ok::<_, anyhow::Error>(
                apps.len() == PARENTS
                    && children.len() == PARENTS
                    && apps.iter().all(|a| reconciled_now(&value(a)))
                    && children.iter().all(|d| built.matches(&value(d))),
            )
        }
    };
    let on_active = |digest: &str| {
        let (policies, digest) = (policies(&client), digest.to_owned());
        async move {
            let policy = get(&policies, TEST).await?.unwrap_or_default();
            Ok::<_, anyhow::Error>(
                policy["status"]["activeDigest"] == digest.as_str()
                    && policy["status"]["parentsOnActiveDigest"] == PARENTS,
            )
        }
    };
    wasmctrl_testenv::cluster::eventually("200 MyApps on v1", Duration::from_secs(120), || {
        all(Built::V1)
    })
    .await?;
    wasmctrl_testenv::cluster::eventually(
        "the policy counts 200 parents on v1",
        Duration::from_secs(30),
        || on_active(&v1),
    )
    .await?;

    // Swap to v2: every parent is re-reconciled by it, none fails on the way.
    let rollout = Rollout::watch(myapps.clone(), deployments.clone());
    let swapped_at = Instant::now();
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(file_source("myapp_v2_plugin"), Some(&v2), json!({})),
    )
    .await?;
    wasmctrl_testenv::cluster::eventually("200 MyApps on v2", Duration::from_secs(120), || {
        all(Built::V2)
    })
    .await?;
    wasmctrl_testenv::cluster::eventually(
        "the policy counts 200 parents on v2",
        Duration::from_secs(30),
        || on_active(&v2),
    )
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
    assert_eq!(
        times.len(),
        PARENTS,
        "the watch saw every child rebuilt by v2"
    );
    let failures = rollout.failures.lock().expect("lock").clone();
    assert!(
        failures.is_empty(),
        "no reconcile may fail during the swap: {failures:?}"
    );
    eprintln!(
        "swap v1 -> v2 over {PARENTS} parents: first child rebuilt by v2 after {:?}, last after {:?}",
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
        || all(Built::V1),
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
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let v1 = digest_of("myapp_plugin");
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(file_source("myapp_plugin"), None, json!({})),
    )
    .await?;
    // A directory of this test's own plugin files, one the host may read from.
    let dir = tempfile::tempdir()?;
    let host = HostUnderTest::builder(TEST, &ns)
        .plugin_dir(dir.path())
        .start()
        .await?;
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    let services = api(&client, &resource("", "v1", "Service"), &ns);
    let policy_api = policies(&client);
    apply(&myapps, myapp("web", 1, "nginx:1.27", None)).await?;
    wait_served(&myapps, &deployments, "web", Built::V1).await?;

    let plugin_loaded = |reason: &'static str| {
        move |p: &Value| {
            condition(p, "PluginLoaded")
                .is_some_and(|c| c["status"] == "False" && c["reason"] == reason)
        }
    };
    // A file outside the host's plugin directories is not read, whatever it holds.
    let elsewhere = tempfile::tempdir()?;
    let outside = elsewhere.path().join("plugin.wasm");
    std::fs::copy(guest("myapp_v2_plugin"), &outside)?;
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(json!({"file": {"path": outside}}), None, json!({})),
    )
    .await?;
    let refused = wait_for_object(
        &policy_api,
        TEST,
        "a file outside the plugin directories refused",
        plugin_loaded("InvalidSource"),
    )
    .await?;
    let message = condition(&refused, "PluginLoaded")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains("outside the directories")
            && message.contains(&dir.path().display().to_string()),
        "{message}"
    );
    assert_eq!(
        refused["status"]["activeDigest"],
        v1.as_str(),
        "v1 keeps serving"
    );
    // Bytes that do not compile.
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
    apply(&myapps, myapp("api", 1, "nginx:1.27", None)).await?;
    wait_served(&myapps, &deployments, "api", Built::V1).await?;

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
        wait_served(&myapps, &deployments, name, Built::V1).await?;
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
async fn new_bytes_behind_a_file_swap_by_themselves_and_behind_a_config_map_only_when_pinned()
-> anyhow::Result<()> {
    const TEST: &str = "swap-sources";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let (v1, v2) = (digest_of("myapp_plugin"), digest_of("myapp_v2_plugin"));
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let active = |policy: &str, digest: &str| {
        let (policy, digest) = (policy.to_owned(), digest.to_owned());
        let policies = policies(&client);
        async move {
            wait_for_object(&policies, &policy, &format!("{policy} on {digest}"), |p| {
                p["status"]["activeDigest"] == digest.as_str()
            })
            .await
        }
    };

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
    let host = HostUnderTest::builder(TEST, &ns)
        .plugin_dir(dir.path())
        .start()
        .await?;
    apply(&myapps, myapp("web", 1, "nginx:1.27", None)).await?;
    wait_served(&myapps, &deployments, "web", Built::V1).await?;
    active(&file_policy, &v1).await?;
    let staged = dir.path().join("plugin.wasm.new");
    std::fs::copy(guest("myapp_v2_plugin"), &staged)?;
    std::fs::rename(&staged, &file)?;
    wait_served(&myapps, &deployments, "web", Built::V2).await?;
    active(&file_policy, &v2).await?;
    policies(&client)
        .delete(&file_policy, &Default::default())
        .await?;

    // A ConfigMap source, pinned: whoever may edit the ConfigMap cannot swap the plugin.

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
    let cm_source = json!({"configMap": {"namespace": ns, "name": "plugin", "key": "plugin.wasm"}});
    let unpinned = apply_policy(
        &client,
        TEST,
        &cm_policy,
        policy(cm_source.clone(), None, json!({})),
    )
    .await
    .expect_err("an unpinned ConfigMap source is refused");
    assert!(
        format!("{unpinned:#}").contains("from a ConfigMap needs a digest"),
        "{unpinned:#}"
    );
    apply_policy(
        &client,
        TEST,
        &cm_policy,
        policy(cm_source.clone(), Some(&v1), json!({})),
    )
    .await?;
    // A new parent: web's children still carry the label the file policy's v2 set, which a
    // policy with another field manager does not own and so cannot drop.
    apply(&myapps, myapp("api", 1, "nginx:1.27", None)).await?;
    wait_served(&myapps, &deployments, "api", Built::V1).await?;
    active(&cm_policy, &v1).await?;
    // New bytes in the ConfigMap are not the pinned digest: v1 keeps serving.
    apply(&config_maps, binary("myapp_v2_plugin")?).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let api_deployment = get(&deployments, "api").await?.expect("api's Deployment");
    assert!(Built::V1.matches(&api_deployment), "still built by v1");
    active(&cm_policy, &v1).await?;
    // Pinning the new digest swaps.
    apply_policy(
        &client,
        TEST,
        &cm_policy,
        policy(cm_source, Some(&v2), json!({})),
    )
    .await?;
    wait_served(&myapps, &deployments, "api", Built::V2).await?;
    active(&cm_policy, &v2).await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client)
        .delete(&cm_policy, &Default::default())
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_runs_in_shadow_then_as_a_canary_then_is_promoted() -> anyhow::Result<()> {
    const TEST: &str = "swap-candidate";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let (v1, v2) = (digest_of("myapp_plugin"), digest_of("myapp_v2_plugin"));
    let with_candidate = |candidate: Value| {
        let mut spec = policy(file_source("myapp_plugin"), Some(&v1), json!({}));
        spec["plugin"]["candidate"] = candidate;
        spec
    };
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(file_source("myapp_plugin"), Some(&v1), json!({})),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    let policy_api = policies(&client);
    for (name, track) in [
        ("a", "stable"),
        ("b", "stable"),
        ("c", "canary"),
        ("d", "canary"),
    ] {
        let mut app = myapp(name, 1, "nginx:1.27", None);
        app["metadata"]["labels"] = json!({"track": track});
        apply(&myapps, app).await?;
    }
    for name in ["a", "b", "c", "d"] {
        wait_served(&myapps, &deployments, name, Built::V1).await?;
    }
    let v2_label = |d: &Value| d["metadata"]["labels"][VERSION_LABEL] == "v2";

    // Shadow: every parent evaluated by v2, differences counted, nothing applied.
    apply_policy(
        &client,
        TEST,
        TEST,
        with_candidate(json!({"source": file_source("myapp_v2_plugin"), "digest": v2})),
    )
    .await?;
    let shadow = wait_for_object(&policy_api, TEST, "shadow counts", |p| {
        let c = &p["status"]["candidate"];
        c["digest"] == v2.as_str()
            && c["evaluated"] == 4
            && c["wouldChange"] == 4
            && c["unchanged"] == 0
    })
    .await?;
    let example = &shadow["status"]["candidate"]["examples"][0];
    assert_eq!(example["verdict"], "WouldChange");
    assert!(
        example["detail"]
            .as_str()
            .is_some_and(|d| d.contains("plugin-version")),
        "{example}"
    );
    for name in ["a", "b", "c", "d"] {
        let d = get(&deployments, name).await?.expect("exists");
        assert!(!v2_label(&d), "a shadow candidate applies nothing");
        assert!(reconciled_now(&get(&myapps, name).await?.expect("exists")));
    }

    // A candidate that would fail is counted as such.
    let failing =
        json!({"source": file_source("misbehave_plugin"), "config": {"behavior": "panic"}});
    apply_policy(&client, TEST, TEST, with_candidate(failing)).await?;
    wait_for_object(&policy_api, TEST, "would-fail counts", |p| {
        p["status"]["candidate"]["wouldFail"] == 4
    })
    .await?;

    // Canary: the selected parents move to v2, the others stay on v1 (and stay in shadow).
    let canary = json!({
        "source": file_source("myapp_v2_plugin"), "digest": v2,
        "canary": {"selector": {"matchLabels": {"track": "canary"}}},
    });
    apply_policy(&client, TEST, TEST, with_candidate(canary)).await?;
    for name in ["c", "d"] {
        wait_served(&myapps, &deployments, name, Built::V2).await?;
        wait_for_object(&deployments, name, "canary children from v2", v2_label).await?;
    }
    wait_for_object(&policy_api, TEST, "canary counts", |p| {
        let c = &p["status"]["candidate"];
        c["canaryParents"] == 2 && c["evaluated"] == 2 && c["wouldChange"] == 2
    })
    .await?;
    for name in ["a", "b"] {
        assert!(reconciled_now(&get(&myapps, name).await?.expect("exists")));
        assert!(!v2_label(&get(&deployments, name).await?.expect("exists")));
    }

    // Promote: v2 becomes the active plugin for everyone.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(file_source("myapp_v2_plugin"), Some(&v2), json!({})),
    )
    .await?;
    for name in ["a", "b", "c", "d"] {
        wait_for_object(&deployments, name, "promoted to v2", v2_label).await?;
    }
    let promoted = wait_for_object(&policy_api, TEST, "no candidate left", |p| {
        p["status"]["candidate"].is_null()
    })
    .await?;
    assert_eq!(promoted["status"]["activeDigest"], v2.as_str());

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}

/// A digest no plugin has: pinned, it can only be served by fetching its source.
const NEVER_LOADED: &str =
    "sha256:0000000000000000000000000000000000000000000000000000000000000000";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_come_over_http_with_credentials_retries_and_a_mandatory_digest()
-> anyhow::Result<()> {
    const TEST: &str = "swap-http";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let (v1, v2) = (digest_of("myapp_plugin"), digest_of("myapp_v2_plugin"));
    // Served until the test ends (the server stops when dropped).
    let server = serve_plugins(Some("s3cret"))?;
    let address = server.address;
    let secrets = api(&client, &resource("", "v1", "Secret"), &ns);
    // The token is for this server only (see host_safety.rs for one bound elsewhere).
    apply(&secrets, json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "registry", "annotations": {HOSTS_ANNOTATION: address.to_string()}}, "stringData": {"token": "s3cret"}})).await?;
    let http = |file: &str, secret: bool| {
        let mut source = json!({"http": {"url": format!("http://{address}/{file}.wasm")}});
        if secret {
            source["http"]["secretRef"] = json!({"namespace": ns, "name": "registry"});
        }
        source
    };
    let policy_api = policies(&client);

    // The schema insists on a digest for http sources.
    let refused = apply_policy(
        &client,
        TEST,
        TEST,
        policy(http("myapp_plugin", true), None, json!({})),
    )
    .await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| format!("{e:#}").contains("needs a digest")),
        "{refused:?}"
    );

    // First download: a 503 (retried), then the plugin, with the bearer token from the Secret.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(http("myapp_plugin", true), Some(&v1), json!({})),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns)
        .without_disk_cache()
        .start()
        .await?;
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    apply(&myapps, myapp("web", 1, "nginx:1.27", None)).await?;
    wait_served(&myapps, &deployments, "web", Built::V1).await?;

    // Without credentials the server says 401, and the policy says why v1 stays. (A digest
    // this host has loaded or compiled before is served without a fetch, whatever the URL, so
    // the failing fetches name one it has never seen.)
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(
            http("myapp_v2_plugin", false),
            Some(NEVER_LOADED),
            json!({}),
        ),
    )
    .await?;
    let unavailable = wait_for_object(&policy_api, TEST, "401 reported", |p| {
        condition(p, "PluginLoaded").is_some_and(|c| c["reason"] == "SourceUnavailable")
    })
    .await?;
    let message = condition(&unavailable, "PluginLoaded")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned();
    assert!(message.contains("401"), "{message}");
    // Bytes that do not match the digest are refused before compiling.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(http("myapp_v2_plugin", true), Some(NEVER_LOADED), json!({})),
    )
    .await?;
    wait_for_object(&policy_api, TEST, "digest mismatch", |p| {
        condition(p, "PluginLoaded").is_some_and(|c| c["reason"] == "DigestMismatch")
    })
    .await?;
    // And the right ones swap in.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(http("myapp_v2_plugin", true), Some(&v2), json!({})),
    )
    .await?;
    wait_served(&myapps, &deployments, "web", Built::V2).await?;

    // A rollback to a digest the host still holds needs no fetch: v1 comes back even though
    // its URL now answers 401 (no credentials).
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(http("myapp_plugin", false), Some(&v1), json!({})),
    )
    .await?;
    wait_served(&myapps, &deployments, "web", Built::V1).await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}

/// `wasmctrl plugin push` of a built plugin to `registry` (plain HTTP, no credentials); the
/// reference it was pushed to.
async fn push_plugin(registry: &str, repository: &str, plugin: &str) -> anyhow::Result<String> {
    let reference = format!("{registry}/{repository}:{}", plugin.replace('_', "-"));
    let file = guest(plugin).display().to_string();
    wasmctrl_cli(&["plugin", "push", &file, &reference, "--plain-http"]).await?;
    Ok(reference)
}

/// Read `reference`'s manifest and config back with another client than the one that
/// pushed them, as `oras pull` would: the Wasm artifact layout, and the manifest's digest.
async fn read_back_layout(reference: &str, plugin: &str) -> anyhow::Result<String> {
    use oci_client::client::{ClientConfig, ClientProtocol};
    let client = oci_client::Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..Default::default()
    });
    let reference: oci_client::Reference = reference.parse()?;
    let anonymous = oci_client::secrets::RegistryAuth::Anonymous;
    let (raw, digest) = client
        .pull_manifest_raw(
            &reference,
            &anonymous,
            &["application/vnd.oci.image.manifest.v1+json"],
        )
        .await?;
    let manifest: Value = serde_json::from_slice(&raw)?;
    assert_eq!(
        manifest["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        manifest["config"]["mediaType"],
        "application/vnd.wasm.config.v0+json"
    );
    let layers = manifest["layers"].as_array().cloned().unwrap_or_default();
    assert_eq!(layers.len(), 1, "one layer: {manifest}");
    assert_eq!(layers[0]["mediaType"], "application/wasm");
    assert_eq!(
        layers[0]["digest"].as_str(),
        Some(digest_of(plugin).as_str())
    );
    let mut config = Vec::new();
    let descriptor: oci_client::manifest::OciDescriptor =
        serde_json::from_value(manifest["config"].clone())?;
    client
        .pull_blob(&reference, &descriptor, &mut config)
        .await?;
    let config: Value = serde_json::from_slice(&config)?;
    assert_eq!(config["architecture"], "wasm", "{config}");
    assert_eq!(
        config["layerDigests"],
        json!([digest_of(plugin)]),
        "{config}"
    );
    assert!(
        config["component"]["exports"]
            .as_array()
            .is_some_and(|exports| exports.iter().any(|e| e
                .as_str()
                .is_some_and(|e| e.starts_with("wasmctrl:plugin/")))),
        "the config names the plugin contract it exports: {config}"
    );
    Ok(digest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_come_from_an_oci_registry() -> anyhow::Result<()> {
    const TEST: &str = "swap-oci";
    let registry =
        tokio::task::spawn_blocking(wasmctrl_testenv::registry::Registry::start).await??;
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let (v1, v2) = (digest_of("myapp_plugin"), digest_of("myapp_v2_plugin"));
    let v1_ref = push_plugin(&registry.address, "plugins/myapp", "myapp_plugin").await?;
    let v2_ref = push_plugin(&registry.address, "plugins/myapp", "myapp_v2_plugin").await?;
    // What `plugin push` wrote is the layout other tools read; `pull` gives the bytes back,
    // and pushing the same component again gives the same manifest.
    let v1_manifest = read_back_layout(&v1_ref, "myapp_plugin").await?;
    let v2_manifest = read_back_layout(&v2_ref, "myapp_v2_plugin").await?;
    let again = push_plugin(&registry.address, "plugins/again", "myapp_plugin").await?;
    assert_eq!(
        read_back_layout(&again, "myapp_plugin").await?,
        v1_manifest,
        "reproducible"
    );
    assert_ne!(v1_manifest, v2_manifest);
    let pulled = tempfile::tempdir()?;
    let pulled_file = pulled.path().join("myapp.wasm").display().to_string();
    wasmctrl_cli(&[
        "plugin",
        "pull",
        &v1_ref,
        "--output-file",
        &pulled_file,
        "--plain-http",
    ])
    .await?;
    assert_eq!(
        std::fs::read(&pulled_file)?,
        std::fs::read(guest("myapp_plugin"))?
    );
    wasmctrl_cli(&["plugin", "inspect", &v1_ref, "--plain-http"]).await?;
    let oci = |reference: &str| json!({"oci": {"reference": reference, "insecure": true}});
    let policy_api = policies(&client);

    let refused = apply_policy(&client, TEST, TEST, policy(oci(&v1_ref), None, json!({}))).await;
    assert!(refused.is_err_and(|e| format!("{e:#}").contains("needs a digest")));

    apply_policy(
        &client,
        TEST,
        TEST,
        policy(oci(&v1_ref), Some(&v1), json!({})),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns)
        .without_disk_cache()
        .start()
        .await?;
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    apply(&myapps, myapp("web", 1, "nginx:1.27", None)).await?;
    wait_served(&myapps, &deployments, "web", Built::V1).await?;

    // A tag that does not exist is reported; v1 keeps serving.
    let missing = format!("{}/plugins/myapp:absent", registry.address);
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(oci(&missing), Some(NEVER_LOADED), json!({})),
    )
    .await?;
    wait_for_object(&policy_api, TEST, "missing tag reported", |p| {
        condition(p, "PluginLoaded").is_some_and(|c| c["reason"] == "SourceUnavailable")
    })
    .await?;

    apply_policy(
        &client,
        TEST,
        TEST,
        policy(oci(&v2_ref), Some(&v2), json!({})),
    )
    .await?;
    wait_served(&myapps, &deployments, "web", Built::V2).await?;

    // The manifest's digest pasted where the component's belongs is named as such; v2 keeps
    // serving.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(oci(&v1_ref), Some(&v1_manifest), json!({})),
    )
    .await?;
    let wrong = wait_for_object(&policy_api, TEST, "manifest digest refused", |p| {
        condition(p, "PluginLoaded").is_some_and(|c| c["reason"] == "DigestMismatch")
    })
    .await?;
    let message = condition(&wrong, "PluginLoaded").map(|c| c["message"].to_string());
    assert!(
        message
            .as_ref()
            .is_some_and(|m| m.contains("digest of the artifact's manifest") && m.contains(&v1)),
        "{message:?}"
    );
    wait_served(&myapps, &deployments, "web", Built::V2).await?;

    // Pinned by the manifest alone (a reference by digest, no component digest): v1 again.
    let by_manifest = |manifest: &str| format!("{}/plugins/myapp@{manifest}", registry.address);
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(oci(&by_manifest(&v1_manifest)), None, json!({})),
    )
    .await?;
    wait_served(&myapps, &deployments, "web", Built::V1).await?;
    // A manifest digest the repository does not hold is reported; v1 keeps serving.
    let absent = format!("sha256:{}", "0".repeat(64));
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(oci(&by_manifest(&absent)), None, json!({})),
    )
    .await?;
    wait_for_object(&policy_api, TEST, "absent manifest reported", |p| {
        condition(p, "PluginLoaded").is_some_and(|c| c["reason"] == "SourceUnavailable")
    })
    .await?;
    wait_served(&myapps, &deployments, "web", Built::V1).await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_that_changes_a_secret_never_puts_its_values_in_the_policy_status()
-> anyhow::Result<()> {
    use base64::Engine as _;
    const TEST: &str = "swap-candidate-secret";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    install_crd(&client, &test_crd(TEST_GROUP, "Widget")).await?;
    let b64 = |text: &str| base64::engine::general_purpose::STANDARD.encode(text);
    // One Secret written as plain text (`stringData`), one as base64 (`data`).
    let secrets = |plain: &str, encoded: &str| {
        json!({"children": [
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "plain"},
             "stringData": {"password": plain}},
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "encoded"},
             "data": {"token": b64(encoded)}},
        ]})
    };
    let spec = |candidate: Option<Value>| {
        let mut spec = json!({
            "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
            "children": [{"apiVersion": "v1", "kind": "Secret"}],
            "plugin": {"source": file_source("misbehave_plugin"),
                       "config": secrets("old-plain-pw", "old-encoded-token")},
        });
        if let Some(candidate) = candidate {
            spec["plugin"]["candidate"] = candidate;
        }
        spec
    };
    apply_policy(&client, TEST, TEST, spec(None)).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w", None)).await?;
    let secrets_api = api(&client, &resource("", "v1", "Secret"), &ns);
    wait_for_object(&secrets_api, "encoded", "the Secret child", |s| {
        s["data"]["token"] == b64("old-encoded-token").as_str()
    })
    .await?;

    // A candidate in shadow that changes both Secrets, then one that changes only the
    // base64 one.
    let candidate = |plain: &str, encoded: &str| json!({"source": file_source("misbehave_plugin"), "config": secrets(plain, encoded)});
    let policy_api = policies(&client);
    apply_policy(
        &client,
        TEST,
        TEST,
        spec(Some(candidate("new-plain-pw", "new-encoded-token"))),
    )
    .await?;
    let shadowed = wait_for_object(&policy_api, TEST, "the candidate's verdict", |p| {
        p["status"]["candidate"]["wouldChange"] == 1
    })
    .await?;
    let detail = shadowed["status"]["candidate"]["examples"][0]["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        detail.contains("Secret encoded: .data.token")
            && detail.contains("Secret plain: .stringData.password"),
        "the status still says where each Secret changed: {detail}"
    );
    apply_policy(
        &client,
        TEST,
        TEST,
        spec(Some(candidate("old-plain-pw", "newer-encoded-token"))),
    )
    .await?;
    let shadowed_again =
        wait_for_object(&policy_api, TEST, "the second candidate's verdict", |p| {
            p["status"]["candidate"]["examples"][0]["detail"]
                .as_str()
                .is_some_and(|d| {
                    d.contains("Secret encoded: .data.token") && !d.contains("Secret plain")
                })
        })
        .await?;

    for status in [&shadowed["status"], &shadowed_again["status"]] {
        let text = status.to_string();
        for value in [
            "old-plain-pw",
            "new-plain-pw",
            "old-encoded-token",
            "new-encoded-token",
            "newer-encoded-token",
        ] {
            for form in [value.to_owned(), b64(value)] {
                assert!(
                    !text.contains(&form),
                    "{form} ({value}) is in the policy status: {text}"
                );
            }
        }
    }
    host.stop().await?;
    policy_api.delete(TEST, &Default::default()).await?;
    delete_namespace(&client, &ns).await
}
