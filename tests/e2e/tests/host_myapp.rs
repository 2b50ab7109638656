//! The MyApp operator, end to end: a wasmctrl host running the MyApp plugin against the real
//! control plane (with a controller-manager, a scheduler and a kwok node, so Deployments
//! really become ready).

use serde_json::{Value, json};
use wasmctrl_e2e::*;
use wasmctrl_testenv::TestEnv;

fn myapp_policy(config: Value) -> Value {
    let mut spec = myapp_policy_spec(file_source("myapp_plugin"), config);
    spec["maxConcurrentReconciles"] = json!(4);
    spec
}

fn owner_is(child: &Value, parent: &Value) -> bool {
    child["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|refs| {
            refs.iter().any(|r| {
                r["uid"] == parent["metadata"]["uid"]
                    && r["controller"] == true
                    && r["blockOwnerDeletion"] == true
            })
        })
}

fn ready(app: &Value) -> bool {
    let status = &app["status"];
    status["readyReplicas"] == app["spec"]["replicas"]
        && status["observedGeneration"] == app["metadata"]["generation"]
        && condition(app, "Ready").is_some_and(|c| c["status"] == "True")
        && condition(app, "Reconciled").is_some_and(|c| c["status"] == "True")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn myapp_converges_follows_changes_repairs_drift_and_prunes() -> anyhow::Result<()> {
    const TEST: &str = "myapp-lifecycle";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    apply_policy(&client, TEST, TEST, myapp_policy(json!({}))).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;

    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    let services = api(&client, &resource("", "v1", "Service"), &ns);

    // Create: a Deployment and a Service owned by the MyApp; status converges to Ready.
    apply(&myapps, myapp("web", 3, "nginx:1.25", None)).await?;
    let app = wait_for_object(&myapps, "web", "MyApp web to be ready", ready).await?;
    let deployment =
        wait_for_object(&deployments, "web", "Deployment web", |d| owner_is(d, &app)).await?;
    let service = wait_for_object(&services, "web", "Service web", |s| owner_is(s, &app)).await?;
    assert_eq!(deployment["spec"]["replicas"], 3);
    assert_eq!(
        deployment["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "wasmctrl"
    );
    assert_eq!(service["metadata"]["labels"]["wasmctrl.dev/policy"], TEST);

    // Scale: the Deployment follows and the status catches up.
    let mut scaled = myapp("web", 5, "nginx:1.25", None);
    apply(&myapps, scaled.clone()).await?;
    wait_for_object(&deployments, "web", "Deployment scaled to 5", |d| {
        d["spec"]["replicas"] == 5
    })
    .await?;
    wait_for_object(&myapps, "web", "MyApp web ready at 5", |a| {
        ready(a) && a["status"]["readyReplicas"] == 5
    })
    .await?;

    // New image: the pod template is rolled.
    scaled["spec"]["image"] = json!("nginx:1.27");
    apply(&myapps, scaled).await?;
    wait_for_object(&deployments, "web", "Deployment on the new image", |d| {
        d["spec"]["template"]["spec"]["containers"][0]["image"] == "nginx:1.27"
    })
    .await?;

    // Drift: a deleted Service is recreated, a hand-edited replica count is corrected.
    let old_uid = service["metadata"]["uid"].clone();
    services.delete("web", &Default::default()).await?;
    wait_for_object(&services, "web", "Service web recreated", |s| {
        s["metadata"]["uid"] != old_uid
    })
    .await?;
    deployments
        .patch(
            "web",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"replicas": 1}})),
        )
        .await?;
    wait_for_object(&deployments, "web", "hand-edited replicas corrected", |d| {
        d["spec"]["replicas"] == 5
    })
    .await?;

    // A config change that drops the Service: it is pruned, the Deployment is not touched.
    // (Its controller keeps writing its status, so compare what wasmctrl would change: the
    // spec, through the generation, and the desired-state fingerprint.)
    let fingerprint = |d: &Value| {
        (
            d["metadata"]["generation"].clone(),
            d["metadata"]["annotations"]["wasmctrl.dev/desired-hash"].clone(),
        )
    };
    let before = fingerprint(&get(&deployments, "web").await?.expect("exists"));
    apply_policy(&client, TEST, TEST, myapp_policy(json!({"service": false}))).await?;
    wait_gone(&services, "web", "Service web pruned").await?;
    let deployment = get(&deployments, "web")
        .await?
        .expect("the Deployment stays");
    assert_eq!(
        fingerprint(&deployment),
        before,
        "the Deployment must not be written when only the Service changes"
    );

    // Delete: children are garbage-collected with their owner.
    myapps.delete("web", &Default::default()).await?;
    wait_collected(&deployments, "web", "Deployment web garbage-collected").await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_related_config_map_reaches_the_plugin_and_its_changes_re_reconcile() -> anyhow::Result<()>
{
    const TEST: &str = "myapp-related";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    apply_policy(&client, TEST, TEST, myapp_policy(json!({}))).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;

    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    let config = |greeting: &str| {
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "api-config", "labels": {"example.com/myapp-config": "true"}},
            "data": {"GREETING": greeting},
        })
    };
    apply(&config_maps, config("hello")).await?;
    apply(
        &myapps,
        myapp("api", 1, "ghcr.io/example/api:1.4.0", Some("api-config")),
    )
    .await?;

    let env_greeting =
        |d: &Value| d["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"].clone();
    let first = wait_for_object(&deployments, "api", "env from the ConfigMap", |d| {
        env_greeting(d) == "hello"
    })
    .await?;
    let first_hash =
        first["spec"]["template"]["metadata"]["annotations"]["example.com/config-hash"].clone();
    assert!(first_hash.is_string(), "the config hash annotation is set");

    apply(&config_maps, config("bonjour")).await?;
    let second = wait_for_object(&deployments, "api", "env follows the ConfigMap", |d| {
        env_greeting(d) == "bonjour"
    })
    .await?;
    assert_ne!(
        second["spec"]["template"]["metadata"]["annotations"]["example.com/config-hash"],
        first_hash,
        "a new config hash rolls the pods"
    );

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}

/// The data of the ConfigMaps the newest recorded reconcile of `kind` `name` read as related
/// objects, by name.
fn related_data(
    explain: &wasmctrl::explain::Explain,
    kind: &str,
    ns: &str,
    name: &str,
) -> Option<Vec<(String, Value)>> {
    let kinds = explain.store.kinds_named(kind);
    let wasmctrl::explain::Lookup::Found { records } =
        explain.store.lookup(kind, Some(ns), name, 50, &kinds)
    else {
        return None;
    };
    let record: Value = serde_json::from_str(records.first()?).ok()?;
    let related = record["case"]["related"].as_array()?;
    Some(
        related
            .iter()
            .map(|o| {
                let name = o["metadata"]["name"].as_str().unwrap_or_default();
                (name.to_owned(), o["data"].clone())
            })
            .collect(),
    )
}

/// The host's `wasmctrl_related_watches` of `resource`, as its metrics show it.
fn related_watches(host: &HostUnderTest, resource: &str) -> Option<i64> {
    let series = format!("wasmctrl_related_watches{{resource=\"{resource}\"}} ");
    host.metrics
        .encode()
        .lines()
        .find_map(|line| line.strip_prefix(&series)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_policies_reading_the_same_related_kind_share_one_watch_and_both_follow_it()
-> anyhow::Result<()> {
    const TEST: &str = "related-shared";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    install_crd(&client, &test_crd(TEST_GROUP, "Widget")).await?;
    // Two policies acting as the host in one namespace, reading the ConfigMaps one selector
    // picks: the MyApp policy, and a Widget policy with the same `related`.
    let myapp_spec = myapp_policy(json!({}));
    apply_policy(&client, TEST, "related-shared-myapp", myapp_spec.clone()).await?;
    let widget_spec = json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "related": myapp_spec["related"].clone(),
        "plugin": {"source": file_source("misbehave_plugin"), "config": {"ownChild": true}},
    });
    apply_policy(&client, TEST, "related-shared-widget", widget_spec).await?;
    let explain = std::sync::Arc::new(wasmctrl::explain::Explain::in_memory(
        wasmctrl::explain::Bounds {
            max_bytes: 8 << 20,
            per_parent: 50,
        },
    ));
    let host = HostUnderTest::builder(TEST, &ns)
        .explained(explain.clone())
        .start()
        .await?;

    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let config = |greeting: &str| {
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "shared", "labels": {"example.com/myapp-config": "true"}},
            "data": {"GREETING": greeting},
        })
    };
    apply(&config_maps, config("hello")).await?;
    apply(
        &myapps(&client, &ns),
        myapp("api", 1, "ghcr.io/example/api:1.4.0", Some("shared")),
    )
    .await?;
    apply(
        &widgets(&client, &ns),
        json!({"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget",
               "metadata": {"name": "w"}, "spec": {"size": 1}}),
    )
    .await?;

    // Both parents read the ConfigMap, and both read its change: each policy's parents
    // follow the one watch.
    for greeting in ["hello", "bonjour"] {
        apply(&config_maps, config(greeting)).await?;
        let expected = vec![("shared".to_owned(), json!({"GREETING": greeting}))];
        for (kind, name) in [("MyApp", "api"), ("Widget", "w")] {
            let seen = std::sync::Mutex::new(None);
            let waited = wasmctrl_testenv::cluster::eventually(
                "the newest reconcile's related ConfigMap",
                ACT,
                || {
                    let related = related_data(&explain, kind, &ns, name);
                    let matched = related.as_ref() == Some(&expected);
                    *seen.lock().expect("not poisoned") = related;
                    async move { Ok(matched) }
                },
            )
            .await;
            anyhow::Context::with_context(waited, || {
                format!(
                    "{kind} {name}: expected {expected:?}, the newest record read {:?}",
                    seen.lock().expect("not poisoned")
                )
            })?;
        }
    }
    // One watch of ConfigMaps by that selector, however many policies read them.
    assert_eq!(related_watches(&host, "v1/configmaps"), Some(1));

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    for policy in ["related-shared-myapp", "related-shared-widget"] {
        policies(&client)
            .delete(policy, &Default::default())
            .await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_converged_host_writes_nothing_on_restart_or_on_a_swap_to_the_same_decisions()
-> anyhow::Result<()> {
    const TEST: &str = "myapp-restart";
    let env = TestEnv::get();
    let Some(audit_log) = env.audit_log() else {
        eprintln!("skipped: this cluster has no audit log wasmctrl started");
        return Ok(());
    };
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    apply_policy(&client, TEST, TEST, myapp_policy(json!({}))).await?;
    let myapps = myapps(&client, &ns);
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    for name in ["a", "b", "c"] {
        apply(&myapps, myapp(name, 2, "nginx:1.25", None)).await?;
    }
    for name in ["a", "b", "c"] {
        wait_for_object(&myapps, name, "MyApp ready", ready).await?;
    }
    // Let the last status writes and their echoes settle, then restart.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    // A new parent cost its children and its status, nothing else: no write to a parent's
    // metadata (the host keeps no per-parent record of its plugin). The test's own applies
    // (field manager wasmctrl-e2e) are left out.
    let first_pass = writes_in(audit_log, &ns)?;
    let to_parents: Vec<_> = first_pass
        .iter()
        .filter(|w| w.contains("/myapps/") && !w.contains("fieldManager=wasmctrl-e2e"))
        .filter(|w| !w.contains("/status?"))
        .collect();
    assert!(
        to_parents.is_empty(),
        "only the status of a parent is written: {to_parents:#?}"
    );
    host.stop().await?;

    let before = writes_in(audit_log, &ns)?;
    // Where the swap below puts its plugin: a directory the restarted host may read from.
    let dir = tempfile::tempdir()?;
    let host = HostUnderTest::builder(TEST, &ns)
        .plugin_dir(dir.path())
        .start()
        .await?;
    // The restarted host lists everything and reconciles every parent at once; give it
    // ample time to write, if it were going to.
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    let after = writes_in(audit_log, &ns)?;
    let new: Vec<&String> = after.iter().skip(before.len()).collect();
    assert!(
        new.is_empty(),
        "a converged restart must not write, but wrote: {new:#?}"
    );

    // A swap to a plugin that decides the same (the same component with a custom section
    // added: another digest) is rolled out to every parent without a single write.
    let same = dir.path().join("myapp-same.wasm");
    let mut bytes = std::fs::read(wasmctrl_testenv::plugins::guest("myapp_plugin"))?;
    bytes.extend_from_slice(&custom_section(
        "wasmctrl-test",
        b"same decisions, new digest",
    ));
    std::fs::write(&same, &bytes)?;
    let digest = wasmctrl::plugin::Digest::of(&bytes).to_string();
    let mut swapped = myapp_policy(json!({}));
    swapped["plugin"]["source"] = json!({"file": {"path": same}});
    let before = writes_in(audit_log, &ns)?;
    apply_policy(&client, TEST, TEST, swapped).await?;
    wait_for_object(
        &policies(&client),
        TEST,
        "every parent on the new digest",
        |p| {
            p["status"]["activeDigest"] == digest.as_str()
                && p["status"]["parentsOnActiveDigest"] == 3
        },
    )
    .await?;
    let after = writes_in(audit_log, &ns)?;
    let new: Vec<&String> = after.iter().skip(before.len()).collect();
    assert!(
        new.is_empty(),
        "a swap to the same decisions must not write, but wrote: {new:#?}"
    );

    // And the restarted host is alive: a change is acted on.
    apply(&myapps, myapp("a", 3, "nginx:1.25", None)).await?;
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    wait_for_object(&deployments, "a", "restarted host scales a", |d| {
        d["spec"]["replicas"] == 3
    })
    .await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}

/// A WebAssembly custom section (id 0): valid at the top level of a component, ignored by
/// the runtime, so appending one changes the digest and nothing else.
fn custom_section(name: &str, payload: &[u8]) -> Vec<u8> {
    fn leb128(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(byte);
                return;
            }
            out.push(byte | 0x80);
        }
    }
    let mut body = Vec::new();
    leb128(name.len(), &mut body);
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(payload);
    let mut section = vec![0];
    leb128(body.len(), &mut section);
    section.extend(body);
    section
}

/// Writes by the admin user (the host in these tests) to objects in `namespace`, except
/// Events, in audit-log order.
fn writes_in(audit_log: &std::path::Path, namespace: &str) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(audit_log)?;
    let marker = format!("/namespaces/{namespace}/");
    Ok(text
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|e| {
            let uri = e["requestURI"].as_str().unwrap_or_default();
            let verb = e["verb"].as_str().unwrap_or_default();
            e["stage"] == "ResponseComplete"
                && uri.contains(&marker)
                && !uri.contains("/events")
                && matches!(verb, "create" | "update" | "patch" | "delete")
                && e["userAgent"]
                    .as_str()
                    .is_none_or(|ua| !ua.contains("kube-controller-manager"))
                && e["user"]["username"] == "admin"
        })
        .map(|e| {
            format!(
                "{} {}",
                e["verb"].as_str().unwrap_or_default(),
                e["requestURI"].as_str().unwrap_or_default()
            )
        })
        .collect())
}

/// The MyApp plugin as built for contract 0.1.0, before webhooks existed, checked in with how
/// it was built (`plugins/testdata/myapp-contract-0.1.0`).
fn contract_0_1_0() -> std::path::PathBuf {
    wasmctrl_testenv::repo_root()
        .join("plugins/testdata/myapp-contract-0.1.0/myapp-contract-0.1.0.wasm")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_built_for_the_first_contract_converges_myapps_as_today_s_does()
-> anyhow::Result<()> {
    const TEST: &str = "myapp-contract-0-1-0";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let fixture = contract_0_1_0();
    let mut spec = myapp_policy_spec(
        json!({"file": {"path": fixture.to_string_lossy()}}),
        json!({}),
    );
    apply_policy(&client, TEST, TEST, spec.clone()).await?;
    let fixture_dir = fixture.parent().expect("the fixture's directory");
    let host = HostUnderTest::builder(TEST, &ns)
        .plugin_dir(fixture_dir)
        .start()
        .await?;
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    for (name, replicas) in [("a", 1), ("b", 2)] {
        apply(&myapps, myapp(name, replicas, "nginx:1.27", None)).await?;
    }
    for name in ["a", "b"] {
        let app =
            wait_for_object(&myapps, name, "MyApp ready under the 0.1.0 plugin", ready).await?;
        wait_for_object(&deployments, name, "its Deployment", |d| owner_is(d, &app)).await?;
    }
    let policy_api = policies(&client);
    let policy = get(&policy_api, TEST).await?.expect("the policy");
    let digest = wasmctrl::plugin::Digest::of(&std::fs::read(&fixture)?);
    assert_eq!(
        policy["status"]["activeDigest"],
        digest.to_string(),
        "the 0.1.0 plugin serves: {}",
        policy["status"]
    );

    // Today's MyApp (contract 0.1.1, with webhooks) in shadow: it decides the same for every
    // parent, so old plugins and new ones are interchangeable.
    spec["plugin"]["candidate"] = json!({"source": file_source("myapp_plugin")});
    apply_policy(&client, TEST, TEST, spec).await?;
    wait_for_object(
        &policy_api,
        TEST,
        "today's MyApp evaluated in shadow, unchanged",
        |p| candidate_decides_the_same(p, 2),
    )
    .await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}
