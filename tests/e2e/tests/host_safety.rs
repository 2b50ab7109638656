//! The host never touches what it does not own, and no plugin can turn it against the
//! cluster: an existing object is never taken over, two parents never fight over a child,
//! a deleted parent is never re-created, a plugin cannot loop or flood Events, an error the
//! plugin calls permanent waits for a change, and plugin credentials stay where they belong.
//!
//! These use the `misbehave` test plugin, which desires exactly the children its config lists.

use std::time::Duration;

use kube::api::DynamicObject;
use serde_json::{Value, json};
use wasmctrl::metrics::ReconcileResult;
use wasmctrl_e2e::*;
use wasmctrl_testenv::cluster::eventually;

fn policy(children: Value, config: Value) -> Value {
    json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
        "children": children,
        "plugin": {"source": file_source("misbehave_plugin"), "config": config},
    })
}

fn config_maps_allowed() -> Value {
    json!([{"apiVersion": "v1", "kind": "ConfigMap"}])
}

fn config_map(name: &str, value: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"k": value}})
}

fn reconciled(object: &Value) -> Option<&Value> {
    condition(object, "Reconciled")
}

async fn install_kinds(client: &kube::Client) -> anyhow::Result<()> {
    install_repo_crds(client).await?;
    install_crd(client, &test_crd(TEST_GROUP, "Widget")).await
}

/// Wait until `name`'s `Reconciled` condition has `reason`, and return its message.
async fn failure_message(
    widgets: &kube::Api<DynamicObject>,
    name: &str,
    reason: &str,
) -> anyhow::Result<String> {
    let failed = wait_for_object(widgets, name, &format!("{reason} on {name}"), |w| {
        reconciled(w).is_some_and(|c| c["reason"] == reason)
    })
    .await?;
    Ok(reconciled(&failed)
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned())
}

fn controller_uid(object: &Value) -> Option<&str> {
    object["metadata"]["ownerReferences"]
        .as_array()?
        .iter()
        .find(|o| o["controller"] == true)?["uid"]
        .as_str()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_object_with_the_childs_name_is_never_taken_over() -> anyhow::Result<()> {
    const TEST: &str = "safety-takeover";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    // A user's own ConfigMap, made by hand before any policy desired that name.
    let mine = apply(&config_maps, config_map("precious", "user data")).await?;
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(
            config_maps_allowed(),
            json!({"children": [config_map("precious", "plugin data"), config_map("fresh", "x")]}),
        ),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w", None)).await?;

    let message = failure_message(&widgets, "w", "ChildConflict").await?;
    assert!(
        message.contains("ConfigMap precious already exists")
            && message.contains("it has no controller"),
        "{message}"
    );
    // Retries change nothing either.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = get(&config_maps, "precious").await?.expect("still there");
    assert_eq!(
        after["metadata"]["resourceVersion"],
        mine.metadata.resource_version.clone().unwrap_or_default(),
        "the user's object must not be written: {after}"
    );
    assert_eq!(after["data"]["k"], "user data");
    assert!(after["metadata"]["ownerReferences"].is_null(), "{after}");
    assert!(after["metadata"]["labels"].is_null(), "{after}");

    // Once the user removes their object, the child is created and the parent converges.
    config_maps.delete("precious", &Default::default()).await?;
    wait_for_object(&widgets, "w", "w reconciled", |w| {
        reconciled(w).is_some_and(|c| c["status"] == "True")
    })
    .await?;
    let created = get(&config_maps, "precious").await?.expect("created");
    assert_eq!(created["data"]["k"], "plugin data");
    assert_eq!(
        controller_uid(&created),
        widgets.get("w").await?.metadata.uid.as_deref()
    );

    host.stop().await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_parents_desiring_one_child_do_not_fight_the_first_keeps_it() -> anyhow::Result<()> {
    const TEST: &str = "safety-shared-child";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    // Every parent desires the same fixed name, and asks to be reconciled every second.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(
            config_maps_allowed(),
            json!({"children": [config_map("shared", "x")], "requeueAfterMs": 1000}),
        ),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    apply(&widgets, widget("first", None)).await?;
    let first = wait_for_object(&widgets, "first", "first reconciled", |w| {
        reconciled(w).is_some_and(|c| c["status"] == "True")
    })
    .await?;
    let shared = get(&config_maps, "shared").await?.expect("created");
    apply(&widgets, widget("second", None)).await?;
    let message = failure_message(&widgets, "second", "ChildConflict").await?;
    let first_uid = first["metadata"]["uid"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("its controller is Widget first (uid {first_uid})")),
        "{message}"
    );
    // Several resyncs of both later, the child has not moved or been rewritten.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = get(&config_maps, "shared").await?.expect("still there");
    assert_eq!(controller_uid(&after), Some(first_uid));
    assert_eq!(
        after["metadata"]["resourceVersion"],
        shared["metadata"]["resourceVersion"]
    );
    let first = get(&widgets, "first").await?.expect("exists");
    assert_eq!(
        reconciled(&first).map(|c| &c["status"]),
        Some(&json!("True"))
    );

    host.stop().await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_deleted_during_its_reconcile_is_not_re_created() -> anyhow::Result<()> {
    const TEST: &str = "safety-deleted-parent";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    // The plugin busy-loops for a second or two (well inside its deadline) before answering.
    let mut spec = policy(
        config_maps_allowed(),
        json!({"behavior": "spin", "spins": 4_000_000_000u64}),
    );
    spec["limits"] = json!({"timeoutMs": 30000});
    apply_policy(&client, TEST, TEST, spec).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w", None)).await?;
    wait_for_object(&widgets, "w", "w reconciled", |w| {
        reconciled(w).is_some_and(|c| c["status"] == "True")
    })
    .await?;
    // A spec change starts a reconcile that will write the status (its observedGeneration
    // moves): the write that, without a uid precondition, would create the parent anew.
    widgets
        .patch(
            "w",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"size": 2}})),
        )
        .await?;
    // Deleted while the plugin is still thinking about it.
    tokio::time::sleep(Duration::from_millis(400)).await;
    widgets.delete("w", &Default::default()).await?;
    wait_gone(&widgets, "w", "w deleted").await?;
    // Long enough for the reconcile in flight to finish and write what it would.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        get(&widgets, "w").await?.is_none(),
        "a write to a deleted parent must not bring it back"
    );
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

/// How many of the host's reconciles are running now, over all its policies.
fn reconciles_in_flight(host: &HostUnderTest) -> f64 {
    host.metric_sum("controller_runtime_active_workers", &[])
}

/// What a reconcile that ended after its parent's deletion noted of the parent (its outcome)
/// is forgotten at the policy's next report, not kept in its counts until the sweep that runs
/// at least once a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_that_ends_after_its_parent_was_deleted_leaves_nothing_in_the_counts()
-> anyhow::Result<()> {
    const TEST: &str = "safety-ends-after-delete";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let mut spec = policy(config_maps_allowed(), json!({}));
    // Every call of the plugin may think for 10 s: a call that loops ends at that deadline.
    spec["limits"] = json!({"timeoutMs": 10000});
    apply_policy(&client, TEST, TEST, spec.clone()).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w", None)).await?;
    let policy_api = policies(&client);
    wait_for_object(&policy_api, TEST, "w counted as reconciled", |p| {
        p["status"]["parentsReconciled"] == 1
    })
    .await?;
    eventually(
        "no reconcile in flight",
        Duration::from_secs(60),
        || async { Ok(reconciles_in_flight(&host) == 0.0) },
    )
    .await?;

    // A config change re-reconciles w with a plugin that loops until its deadline: longer than
    // the policy's report interval (5 s), so the report that follows the deletion runs first.
    spec["plugin"]["config"] = json!({"behavior": "loop"});
    apply_policy(&client, TEST, TEST, spec).await?;
    eventually(
        "w's reconcile in flight",
        Duration::from_secs(60),
        || async { Ok(reconciles_in_flight(&host) >= 1.0) },
    )
    .await?;
    widgets.delete("w", &Default::default()).await?;
    wait_gone(&widgets, "w", "w deleted").await?;
    // The report after the deletion forgets w's earlier outcome...
    wait_for_object(&policy_api, TEST, "w no longer counted", |p| {
        p["status"]["parentsReconciled"] == 0 && p["status"]["parentsFailing"] == 0
    })
    .await?;
    anyhow::ensure!(
        reconciles_in_flight(&host) >= 1.0,
        "w's reconcile ended before the policy's report: the plugin must think for longer for \
         this test to show anything"
    );
    // ...and what the reconcile in flight notes when it ends is forgotten at the report after.
    eventually("w's reconcile ended", Duration::from_secs(60), || async {
        Ok(reconciles_in_flight(&host) == 0.0)
    })
    .await?;
    let ended = std::time::Instant::now();
    while ended.elapsed() < Duration::from_secs(12) {
        let status = get(&policy_api, TEST).await?.expect("the policy exists")["status"].clone();
        anyhow::ensure!(
            status["parentsReconciled"] == 0 && status["parentsFailing"] == 0,
            "the deleted parent is counted again: {status}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_cannot_hot_loop_a_parent_or_flood_it_with_events() -> anyhow::Result<()> {
    const TEST: &str = "safety-hot-loop";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    // requeue-after 0 and 100 Events with 100 different reasons, on every reconcile.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(
            config_maps_allowed(),
            json!({"requeueAfterMs": 0, "events": 100}),
        ),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w", None)).await?;
    wait_for_object(&widgets, "w", "w reconciled", |w| {
        reconciled(w).is_some_and(|c| c["status"] == "True")
    })
    .await?;
    let count = || {
        host.metrics
            .reconcile_count(TEST, ReconcileResult::RequeueAfter)
    };
    let before = count();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let during = count() - before;
    // One reconcile per second (the floor), give or take scheduling.
    assert!(
        (3..=7).contains(&during),
        "{during} reconciles in 5 s; the requeue floor is 1 s"
    );
    let flood = event_reasons(&client, &ns, "w")
        .await?
        .into_iter()
        .filter(|(_, reason)| reason.starts_with("Flood"))
        .count();
    assert!(
        (1..=10).contains(&flood),
        "{flood} plugin Events recorded; at most 10 per reconcile, and the reasons repeat"
    );
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_error_waits_for_a_change_instead_of_retrying() -> anyhow::Result<()> {
    const TEST: &str = "safety-permanent";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    // A 2 s resync: the resync, too, leaves the parent alone until it changes.
    let mut spec = policy(config_maps_allowed(), json!({"behavior": "permanent"}));
    spec["resyncPeriodSeconds"] = json!(2);
    apply_policy(&client, TEST, TEST, spec).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w", None)).await?;
    let message = failure_message(&widgets, "w", "PluginReportedError").await?;
    assert!(
        message.contains("w can never work")
            && message.contains("(attempt 1, not retried until the parent"),
        "{message}"
    );
    // With the suite's 0.5 s backoff, a retried parent would be at attempt 4 by now, and a
    // resynced one at attempt 2 or 3.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        host.metrics.reconcile_count(TEST, ReconcileResult::Error),
        1
    );

    // A change to the parent is a new question: it is asked once more.
    apply(&widgets, widget("w", Some(2))).await?;
    wait_for_object(&widgets, "w", "attempt 2 after the change", |w| {
        reconciled(w)
            .and_then(|c| c["message"].as_str())
            .is_some_and(|m| m.contains("(attempt 2, not retried"))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        host.metrics.reconcile_count(TEST, ReconcileResult::Error),
        2
    );
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_credentials_come_only_from_the_hosts_namespace_and_only_over_tls()
-> anyhow::Result<()> {
    const TEST: &str = "safety-credentials";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let digest = wasmctrl::plugin::Digest::of(&std::fs::read(wasmctrl_testenv::plugins::guest(
        "misbehave_plugin",
    ))?)
    .to_string();
    let with_source = |source: Value| {
        json!({
            "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
            "children": [],
            "plugin": {"source": source, "digest": digest},
        })
    };
    // A Secret in another namespace (here kube-system's) is out of reach.
    apply_policy(
        &client,
        TEST,
        TEST,
        with_source(json!({"http": {
            "url": "https://127.0.0.1:1/plugin.wasm",
            "secretRef": {"namespace": "kube-system", "name": "anything"},
        }})),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let policy_api = policies(&client);
    // (The policy may be left from an earlier run: only a verdict on this spec counts.)
    let current = |p: &Value, c: &Value| c["observedGeneration"] == p["metadata"]["generation"];
    let refused = wait_for_object(&policy_api, TEST, "the secretRef refused", |p| {
        condition(p, "PluginLoaded")
            .is_some_and(|c| c["reason"] == "InvalidSource" && current(p, c))
    })
    .await?;
    let message = condition(&refused, "PluginLoaded")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains("secretRef names namespace \"kube-system\"")
            && message.contains(&format!("only from \"{ns}\"")),
        "{message}"
    );

    // Credentials never go to a remote server in clear text (nothing is sent: the refusal
    // comes before any connection, and before the Secret is read).
    apply_policy(
        &client,
        TEST,
        TEST,
        with_source(json!({"http": {
            "url": "http://plugins.example.invalid/plugin.wasm",
            "secretRef": {"namespace": ns, "name": "registry"},
        }})),
    )
    .await?;
    let refused = wait_for_object(&policy_api, TEST, "clear-text credentials refused", |p| {
        condition(p, "PluginLoaded").is_some_and(|c| {
            current(p, c)
                && c["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("refusing to send credentials"))
        })
    })
    .await?;
    let message = condition(&refused, "PluginLoaded").map(|c| c["message"].clone());
    assert!(
        message
            .as_ref()
            .and_then(Value::as_str)
            .is_some_and(|m| m.contains("without TLS")),
        "{message:?}"
    );
    host.stop().await?;
    policy_api.delete(TEST, &Default::default()).await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_credentials_go_only_to_the_hosts_their_secret_names() -> anyhow::Result<()> {
    const TEST: &str = "safety-credential-hosts";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let digest = wasmctrl::plugin::Digest::of(&std::fs::read(wasmctrl_testenv::plugins::guest(
        "misbehave_plugin",
    ))?)
    .to_string();
    // A plugin server on loopback (no TLS needed there) that counts requests bearing the token.
    let server = serve_plugins(Some("s3cret"))?;
    let here = server.address.to_string();
    let with_secret = |secret: &str| {
        json!({
            "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
            "children": [],
            "plugin": {
                "source": {"http": {
                    "url": format!("http://{here}/misbehave_plugin.wasm"),
                    "secretRef": {"namespace": ns, "name": secret},
                }},
                "digest": digest,
            },
        })
    };
    let secrets = api(&client, &resource("", "v1", "Secret"), &ns);
    let token_secret = |name: &str, hosts: Option<&str>| {
        let mut secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": {"token": "s3cret"}});
        if let Some(hosts) = hosts {
            secret["metadata"]["annotations"] =
                json!({wasmctrl::registry::HOSTS_ANNOTATION: hosts});
        }
        secret
    };
    apply(
        &secrets,
        token_secret("for-another-host", Some("registry.example.com, ghcr.io")),
    )
    .await?;
    apply(&secrets, token_secret("for-no-host", None)).await?;
    // What `kubectl create secret docker-registry --docker-server=registry.example.com` makes.
    let docker_config = json!({"auths": {"registry.example.com": {"registrytoken": "s3cret"}}});
    apply(
        &secrets,
        json!({
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
            "metadata": {"name": "docker-for-another-host"},
            "stringData": {".dockerconfigjson": docker_config.to_string()},
        }),
    )
    .await?;
    apply_policy(&client, TEST, TEST, with_secret("for-another-host")).await?;
    // No disk cache: a digest the host has not loaded itself must be fetched.
    let host = HostUnderTest::builder(TEST, &ns)
        .without_disk_cache()
        .start()
        .await?;
    let policy_api = policies(&client);
    let current = |p: &Value, c: &Value| c["observedGeneration"] == p["metadata"]["generation"];

    for (secret, says) in [
        ("for-another-host", format!("not for \"{here}\"")),
        (
            "for-no-host",
            format!("annotate it with {}", wasmctrl::registry::HOSTS_ANNOTATION),
        ),
        (
            "docker-for-another-host",
            format!("no credentials for registry \"{here}\""),
        ),
    ] {
        apply_policy(&client, TEST, TEST, with_secret(secret)).await?;
        let refused = wait_for_object(&policy_api, TEST, &format!("{secret} refused"), |p| {
            condition(p, "PluginLoaded")
                .is_some_and(|c| current(p, c) && c["reason"] == "InvalidSource")
        })
        .await?;
        let message = condition(&refused, "PluginLoaded")
            .and_then(|c| c["message"].as_str())
            .unwrap_or_default()
            .to_owned();
        assert!(message.contains(&says), "{secret}: {message}");
        assert_eq!(
            condition(&refused, "Ready").map(|c| (c["status"].clone(), c["reason"].clone())),
            Some((json!("False"), json!("PluginNotLoaded"))),
            "{secret}"
        );
    }
    assert_eq!(
        server.requests_with_token(),
        0,
        "a credential reached a host its Secret does not name"
    );

    // Bound to this server, the same token fetches the plugin.
    apply(&secrets, token_secret("for-this-host", Some(&here))).await?;
    apply_policy(&client, TEST, TEST, with_secret("for-this-host")).await?;
    wait_for_object(
        &policy_api,
        TEST,
        "the plugin fetched with the token",
        |p| condition(p, "PluginLoaded").is_some_and(|c| current(p, c) && c["status"] == "True"),
    )
    .await?;
    assert!(
        server.requests_with_token() > 0,
        "the token went to its host"
    );

    host.stop().await?;
    policy_api.delete(TEST, &Default::default()).await?;
    delete_namespace(&client, &ns).await
}

/// Grant ServiceAccount `host` of `ns` a ClusterRole with `rules`, bound cluster-wide.
async fn grant(client: &kube::Client, ns: &str, name: &str, rules: Value) -> anyhow::Result<()> {
    bind_cluster_role(client, name, rules, account_subject(ns, "host")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_the_host_cannot_list_is_named_on_the_policy_and_stalls_nothing()
-> anyhow::Result<()> {
    const TEST: &str = "safety-forbidden";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    // Everything the host needs for this policy, except reading ConfigMaps (its child kind).
    let role = format!("{ns}-host");
    grant(
        &client,
        &ns,
        &role,
        json!([
            {"apiGroups": ["wasmctrl.dev"], "resources": ["reconcilepolicies", "reconcilepolicies/status"], "verbs": ["get", "list", "watch", "patch"]},
            {"apiGroups": [TEST_GROUP], "resources": ["widgets", "widgets/status"], "verbs": ["get", "list", "watch", "patch"]},
            {"apiGroups": [TEST_GROUP], "resources": ["widgets/finalizers"], "verbs": ["update"]},
            {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        ]),
    )
    .await?;
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(
            config_maps_allowed(),
            json!({"children": [config_map("c", "x")]}),
        ),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns)
        .as_user(&format!("system:serviceaccount:{ns}:host"))
        .start()
        .await?;
    let policy_api = policies(&client);
    let forbidden = wait_for_object(&policy_api, TEST, "Ready=False, Forbidden", |p| {
        condition(p, "Ready").is_some_and(|c| c["reason"] == "Forbidden")
    })
    .await?;
    let message = condition(&forbidden, "Ready")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned();
    // The host checked its permissions before watching anything, and names exactly what
    // is missing.
    assert!(
        message.contains(&format!(
            "may not create, delete, get, list, patch, watch configmaps in namespace {ns}"
        )),
        "{message}"
    );
    assert!(
        !message.contains("widgets"),
        "only what is missing: {message}"
    );

    // Nothing of the policy runs: a parent is left as it is.
    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w", None)).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let untouched = get(&widgets, "w").await?.unwrap_or_default();
    assert!(reconciled(&untouched).is_none(), "{untouched}");
    // And shutdown does not wait on anything.
    let started = std::time::Instant::now();
    host.stop().await?;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "shutdown took {:?}",
        started.elapsed()
    );

    // Granted the missing permission, a new host converges.
    grant(
        &client,
        &ns,
        &format!("{role}-configmaps"),
        json!([{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]}]),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns)
        .as_user(&format!("system:serviceaccount:{ns}:host"))
        .start()
        .await?;
    wait_for_object(&widgets, "w", "w reconciled", |w| {
        reconciled(w).is_some_and(|c| c["status"] == "True")
    })
    .await?;
    wait_for_object(&policy_api, TEST, "Ready=True", |p| {
        condition(p, "Ready").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

fn finalizers(object: &Value) -> Vec<String> {
    object["metadata"]["finalizers"]
        .as_array()
        .map(|f| {
            f.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_finalizer_is_left_behind_when_a_policy_stops_finalizing_or_goes_away()
-> anyhow::Result<()> {
    const TEST: &str = "safety-finalizers";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let finalizing = |finalize: bool| {
        let mut spec = policy(config_maps_allowed(), json!({"behavior": "hold-finalizer"}));
        spec["finalize"] = json!(finalize);
        spec
    };
    apply_policy(&client, TEST, TEST, finalizing(true)).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    let policy_api = policies(&client);
    let parent_finalizer = format!("wasmctrl.dev/{TEST}");
    apply(&widgets, widget("kept", None)).await?;
    apply(&widgets, widget("doomed", None)).await?;
    for name in ["kept", "doomed"] {
        wait_for_object(&widgets, name, "the parent finalizer", |w| {
            finalizers(w).contains(&parent_finalizer)
        })
        .await?;
    }
    let held = get(&policy_api, TEST).await?.expect("exists");
    assert!(
        finalizers(&held).contains(&wasmctrl::controller::POLICY_FINALIZER.to_owned()),
        "a finalizing policy holds its own finalizer: {held}"
    );

    // The policy stops finalizing: its parents are let go (and none is deleted).
    apply_policy(&client, TEST, TEST, finalizing(false)).await?;
    for name in ["kept", "doomed"] {
        wait_for_object(&widgets, name, "the parent finalizer released", |w| {
            !finalizers(w).contains(&parent_finalizer)
        })
        .await?;
    }
    wait_for_object(&policy_api, TEST, "the policy finalizer dropped", |p| {
        finalizers(p).is_empty()
    })
    .await?;

    // Finalizing again, a parent being deleted waits on the plugin, which holds on ...
    apply_policy(&client, TEST, TEST, finalizing(true)).await?;
    wait_for_object(&widgets, "doomed", "the parent finalizer again", |w| {
        finalizers(w).contains(&parent_finalizer)
    })
    .await?;
    widgets.delete("doomed", &Default::default()).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        get(&widgets, "doomed").await?.is_some(),
        "the plugin holds it"
    );
    // ... until the policy is deleted: then nothing holds the parent any more.
    policy_api.delete(TEST, &Default::default()).await?;
    wait_gone(
        &widgets,
        "doomed",
        "the terminating parent released and gone",
    )
    .await?;
    wait_gone(&policy_api, TEST, "the policy gone").await?;
    let kept = get(&widgets, "kept").await?.expect("never deleted");
    assert!(finalizers(&kept).is_empty(), "{kept}");

    host.stop().await?;
    delete_namespace(&client, &ns).await
}

/// The scopes a policy says it may have put its finalizer on.
fn finalized_scopes(policy: &Value) -> Vec<(String, String)> {
    policy["status"]["finalizedScopes"]
        .as_array()
        .map(|scopes| {
            scopes
                .iter()
                .map(|s| {
                    let kind = s["kind"].as_str().unwrap_or_default().to_owned();
                    let ns = s["namespace"].as_str().unwrap_or_default().to_owned();
                    (kind, ns)
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finalizing_policy_moved_to_another_kind_or_namespace_releases_the_parents_it_left()
-> anyhow::Result<()> {
    const TEST: &str = "safety-finalizer-scopes";
    let (client, ns) = test_namespace(TEST).await?;
    let (_, other_ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    install_crd(&client, &test_crd(TEST_GROUP, "Gadget")).await?;
    let finalizing = |kind: &str, namespace: &str| {
        let mut spec = policy(config_maps_allowed(), json!({}));
        spec["parent"] =
            json!({"apiVersion": format!("{TEST_GROUP}/v1"), "kind": kind, "namespace": namespace});
        spec["finalize"] = json!(true);
        spec
    };
    let gadget = |name: &str| json!({"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Gadget", "metadata": {"name": name}, "spec": {}});
    apply_policy(&client, TEST, TEST, finalizing("Widget", &ns)).await?;
    // Over every namespace: the policy moves between two.
    let host = HostUnderTest::cluster_wide(TEST).start().await?;
    let widgets = widgets(&client, &ns);
    let gadgets = api(&client, &resource(TEST_GROUP, "v1", "Gadget"), &ns);
    let other_gadgets = api(&client, &resource(TEST_GROUP, "v1", "Gadget"), &other_ns);
    let policy_api = policies(&client);
    let parent_finalizer = format!("wasmctrl.dev/{TEST}");
    let held = |w: &Value| finalizers(w).contains(&parent_finalizer);
    for name in ["w1", "w2"] {
        apply(&widgets, widget(name, None)).await?;
        wait_for_object(&widgets, name, "the Widget finalizer", held).await?;
    }
    apply(&gadgets, gadget("g1")).await?;
    apply(&gadgets, gadget("g2")).await?;
    let recorded = get(&policy_api, TEST).await?.expect("exists");
    assert_eq!(
        finalized_scopes(&recorded),
        [("Widget".to_owned(), ns.clone())],
        "recorded before the first parent got the finalizer: {recorded}"
    );

    // Moved to another kind: the Widgets are let go, and deleting one completes.
    apply_policy(&client, TEST, TEST, finalizing("Gadget", &ns)).await?;
    for name in ["g1", "g2"] {
        wait_for_object(&gadgets, name, "the Gadget finalizer", held).await?;
    }
    for name in ["w1", "w2"] {
        wait_for_object(&widgets, name, "the Widget finalizer released", |w| {
            !held(w)
        })
        .await?;
    }
    widgets.delete("w1", &Default::default()).await?;
    wait_gone(&widgets, "w1", "the old kind's parent deleted").await?;
    wait_for_object(&policy_api, TEST, "only the Gadget scope recorded", |p| {
        finalized_scopes(p) == [("Gadget".to_owned(), ns.clone())]
    })
    .await?;
    // The new kind is finalized as before: through the plugin.
    gadgets.delete("g1", &Default::default()).await?;
    wait_gone(&gadgets, "g1", "the new kind's parent finalized").await?;

    // Moved to another namespace: g2 is let go, and its namespace can be deleted.
    apply(&other_gadgets, gadget("g3")).await?;
    apply_policy(&client, TEST, TEST, finalizing("Gadget", &other_ns)).await?;
    wait_for_object(
        &other_gadgets,
        "g3",
        "the finalizer in the new namespace",
        held,
    )
    .await?;
    wait_for_object(&gadgets, "g2", "the old namespace's parent released", |g| {
        !held(g)
    })
    .await?;
    wait_for_object(&policy_api, TEST, "only the new namespace recorded", |p| {
        finalized_scopes(p) == [("Gadget".to_owned(), other_ns.clone())]
    })
    .await?;
    delete_namespace(&client, &ns).await?;
    let namespaces = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone());
    eventually(
        "the old namespace deleted",
        Duration::from_secs(60),
        || async { Ok(namespaces.get_opt(&ns).await?.is_none()) },
    )
    .await?;

    // Deleted, the policy lets the rest go.
    policy_api.delete(TEST, &Default::default()).await?;
    wait_gone(&policy_api, TEST, "the policy gone").await?;
    let g3 = get(&other_gadgets, "g3").await?.expect("never deleted");
    assert!(!held(&g3), "{g3}");
    host.stop().await?;
    delete_namespace(&client, &other_ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_policy_for_the_same_parents_is_refused_until_the_first_goes() -> anyhow::Result<()>
{
    const TEST: &str = "safety-parent-kind";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let older = format!("{TEST}-older");
    let newer = format!("{TEST}-newer");
    let labelled = |value: &str| {
        policy(
            config_maps_allowed(),
            json!({"children": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "labels": {"by": value}}}]}),
        )
    };
    apply_policy(&client, TEST, &older, labelled("older")).await?;
    // Creation times have one-second resolution.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    apply_policy(&client, TEST, &newer, labelled("newer")).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let policy_api = policies(&client);
    let refused = wait_for_object(&policy_api, &newer, "ParentKindTaken", |p| {
        condition(p, "Ready").is_some_and(|c| c["reason"] == "ParentKindTaken")
    })
    .await?;
    let message = condition(&refused, "Ready")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains(&format!(
            "policy {older} already reconciles {TEST_GROUP}/v1 Widget"
        )),
        "{message}"
    );
    let widgets = widgets(&client, &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    apply(&widgets, widget("w", None)).await?;
    wait_for_object(&config_maps, "c", "the older policy's child", |c| {
        c["metadata"]["labels"]["by"] == "older"
    })
    .await?;
    // No fight: a while later the child is still the older policy's, written once.
    let first = get(&config_maps, "c").await?.expect("exists");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = get(&config_maps, "c").await?.expect("exists");
    assert_eq!(
        later["metadata"]["resourceVersion"],
        first["metadata"]["resourceVersion"]
    );

    // Two namespaces keep two policies apart: a policy for another namespace is not refused
    // (this host watches only the test's namespace, which is what it says instead).
    let elsewhere = format!("{TEST}-elsewhere");
    let mut other_namespace = labelled("elsewhere");
    other_namespace["parent"]["namespace"] = json!("some-other-namespace");
    apply_policy(&client, TEST, &elsewhere, other_namespace).await?;
    wait_for_object(
        &policy_api,
        &elsewhere,
        "the other namespace's policy checked",
        |p| condition(p, "Ready").is_some_and(|c| c["reason"] == "NamespaceNotWatched"),
    )
    .await?;

    // When the older policy goes, the newer one takes over.
    policy_api.delete(&older, &Default::default()).await?;
    wait_for_object(&policy_api, &newer, "the newer policy ready", |p| {
        condition(p, "Ready").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    wait_for_object(&config_maps, "c", "the newer policy's child", |c| {
        c["metadata"]["labels"]["by"] == "newer"
    })
    .await?;
    for name in [&newer, &elsewhere] {
        policy_api.delete(name, &Default::default()).await?;
    }
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

/// The `Ready` condition's reason and message of policy `name`, once its reason is `reason`.
async fn ready_because(
    policy_api: &kube::Api<DynamicObject>,
    name: &str,
    reason: &str,
) -> anyhow::Result<String> {
    let policy = wait_for_object(policy_api, name, &format!("{name}: {reason}"), |p| {
        condition(p, "Ready").is_some_and(|c| c["reason"] == reason)
    })
    .await?;
    Ok(condition(&policy, "Ready")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned())
}

/// Wait until policy `name` runs.
async fn ready(policy_api: &kube::Api<DynamicObject>, name: &str) -> anyhow::Result<()> {
    wait_for_object(policy_api, name, &format!("{name} ready"), |p| {
        condition(p, "Ready").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    Ok(())
}

/// A test-only kind served under two versions, `v1` (stored) and `v1beta1`.
fn two_version_crd(kind: &str) -> Value {
    let mut crd = test_crd(TEST_GROUP, kind);
    let mut beta = crd["spec"]["versions"][0].clone();
    beta["name"] = json!("v1beta1");
    beta["storage"] = json!(false);
    crd["spec"]["versions"]
        .as_array_mut()
        .expect("versions")
        .push(beta);
    crd
}

/// A policy of `by` (recorded as a label on the one ConfigMap `c` it desires) on `kind`.
fn labelled_policy(api_version: &str, kind: &str, by: &str) -> Value {
    json!({
        "parent": {"apiVersion": api_version, "kind": kind},
        "children": config_maps_allowed(),
        "plugin": {"source": file_source("misbehave_plugin"), "config": {"children": [
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "labels": {"by": by}}},
        ]}},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_for_another_version_of_a_held_parent_kind_is_refused_until_the_holder_goes()
-> anyhow::Result<()> {
    const TEST: &str = "safety-parent-version";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    install_crd(&client, &two_version_crd("Sprocket")).await?;
    let holder = format!("{TEST}-v1");
    let other = format!("{TEST}-v1beta1");
    let v1 = format!("{TEST_GROUP}/v1");
    let beta = format!("{TEST_GROUP}/v1beta1");
    // Both confined to the test's namespace: the same parents.
    apply_policy(
        &client,
        TEST,
        &holder,
        labelled_policy(&v1, "Sprocket", "v1"),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let policy_api = policies(&client);
    ready(&policy_api, &holder).await?;
    apply_policy(
        &client,
        TEST,
        &other,
        labelled_policy(&beta, "Sprocket", "v1beta1"),
    )
    .await?;
    let message = ready_because(&policy_api, &other, "ParentKindTaken").await?;
    assert!(
        message.contains(&format!(
            "policy {holder} already reconciles {v1} Sprocket in namespace {ns} (the same kind as {beta} Sprocket"
        )),
        "{message}"
    );

    let sprockets = api(&client, &resource(TEST_GROUP, "v1", "Sprocket"), &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    apply(
        &sprockets,
        json!({"apiVersion": v1, "kind": "Sprocket", "metadata": {"name": "s"}, "spec": {}}),
    )
    .await?;
    wait_for_object(&config_maps, "c", "the holder's child", |c| {
        c["metadata"]["labels"]["by"] == "v1"
    })
    .await?;
    // No fight: a while later the child is still the holder's, written once.
    let first = get(&config_maps, "c").await?.expect("exists");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = get(&config_maps, "c").await?.expect("exists");
    assert_eq!(
        later["metadata"]["resourceVersion"],
        first["metadata"]["resourceVersion"]
    );

    // When the holder goes, the refused policy starts and takes the parents over.
    policy_api.delete(&holder, &Default::default()).await?;
    ready(&policy_api, &other).await?;
    wait_for_object(&config_maps, "c", "the other policy's child", |c| {
        c["metadata"]["labels"]["by"] == "v1beta1"
    })
    .await?;
    policy_api.delete(&other, &Default::default()).await?;
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_policy_edited_onto_a_running_ones_parent_kind_is_refused_and_the_running_one_keeps_it()
-> anyhow::Result<()> {
    const TEST: &str = "safety-parent-edit";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    install_crd(&client, &test_crd(TEST_GROUP, "Gadget")).await?;
    let older = format!("{TEST}-older");
    let running = format!("{TEST}-running");
    let v1 = format!("{TEST_GROUP}/v1");
    apply_policy(
        &client,
        TEST,
        &older,
        labelled_policy(&v1, "Gadget", "older"),
    )
    .await?;
    // Creation times have one-second resolution.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // The newer policy runs for the Widgets, each with a child of its own.
    let own_children = policy(config_maps_allowed(), json!({"ownChild": true}));
    apply_policy(&client, TEST, &running, own_children).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let policy_api = policies(&client);
    ready(&policy_api, &older).await?;
    ready(&policy_api, &running).await?;
    let widgets = widgets(&client, &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    apply(&widgets, widget("w", Some(1))).await?;
    let own = wait_for_object(&config_maps, "w-own", "the running policy's child", |_| {
        true
    })
    .await?;

    // The older policy is edited onto the Widgets the newer one runs for (same namespace).
    apply_policy(
        &client,
        TEST,
        &older,
        labelled_policy(&v1, "Widget", "older"),
    )
    .await?;
    let message = ready_because(&policy_api, &older, "ParentKindTaken").await?;
    assert!(
        message.contains(&format!(
            "policy {running} already reconciles {v1} Widget in namespace {ns}"
        )),
        "{message}"
    );
    // The running policy keeps running and reconciling; the older one touches nothing.
    apply(&widgets, widget("w2", Some(2))).await?;
    let own2 = wait_for_object(
        &config_maps,
        "w2-own",
        "the running policy's new child",
        |_| true,
    )
    .await?;
    assert_eq!(
        own2["metadata"]["labels"]["wasmctrl.dev/policy"],
        running.as_str()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        get(&config_maps, "c").await?.is_none(),
        "the refused policy must not reconcile the Widgets"
    );
    let still = get(&config_maps, "w-own").await?.expect("kept");
    assert_eq!(
        still["metadata"]["resourceVersion"],
        own["metadata"]["resourceVersion"]
    );
    let status = get(&policy_api, &running).await?.expect("exists");
    assert_eq!(
        condition(&status, "Ready").map(|c| c["status"].clone()),
        Some(json!("True")),
        "{status}"
    );

    // Once the running policy is deleted, the refused one starts.
    policy_api.delete(&running, &Default::default()).await?;
    ready(&policy_api, &older).await?;
    wait_for_object(&config_maps, "c", "the older policy's child", |c| {
        c["metadata"]["labels"]["by"] == "older"
    })
    .await?;
    policy_api.delete(&older, &Default::default()).await?;
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_resource_listed_under_two_versions_is_refused_and_nothing_is_created_or_pruned()
-> anyhow::Result<()> {
    const TEST: &str = "safety-child-versions";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let widgets = widgets(&client, &ns);
    let hpas = api(
        &client,
        &resource("autoscaling", "v2", "HorizontalPodAutoscaler"),
        &ns,
    );
    let hpa = |name: &str| {
        json!({
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                "minReplicas": 1, "maxReplicas": 3,
            },
        })
    };
    let parent = apply(&widgets, widget("w", None)).await?;
    // A child the policy made before, no longer desired: a running policy would prune it.
    let mut earlier = hpa("earlier");
    earlier["metadata"]["labels"] =
        json!({"wasmctrl.dev/policy": TEST, "app.kubernetes.io/managed-by": "wasmctrl"});
    earlier["metadata"]["ownerReferences"] = json!([{
        "apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget", "name": "w",
        "uid": parent.metadata.uid, "controller": true, "blockOwnerDeletion": true,
    }]);
    let earlier = apply(&hpas, earlier).await?;
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(
            json!([
                {"apiVersion": "autoscaling/v1", "kind": "HorizontalPodAutoscaler"},
                {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler"},
            ]),
            json!({"children": [hpa("web")]}),
        ),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let policy_api = policies(&client);
    let message = ready_because(&policy_api, TEST, "DuplicateResource").await?;
    assert!(
        message.contains(
            "autoscaling/v1 HorizontalPodAutoscaler and autoscaling/v2 HorizontalPodAutoscaler"
        ) && message.contains("horizontalpodautoscalers.autoscaling"),
        "{message}"
    );
    // Nothing created, nothing pruned, the parent untouched.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(get(&hpas, "web").await?.is_none(), "nothing is created");
    // (Its status is the autoscaler controller's to write; the object is the same one.)
    let kept = get(&hpas, "earlier").await?.expect("nothing is pruned");
    assert_eq!(
        kept["metadata"]["uid"].as_str(),
        earlier.metadata.uid.as_deref()
    );
    assert!(kept["metadata"]["deletionTimestamp"].is_null(), "{kept}");
    let w = get(&widgets, "w").await?.expect("exists");
    assert!(reconciled(&w).is_none(), "{w}");

    host.stop().await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_whose_answer_the_host_would_refuse_counts_as_would_fail_and_costly_watches_are_flagged()
-> anyhow::Result<()> {
    const TEST: &str = "safety-shadow-invalid";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let mut spec = policy(
        config_maps_allowed(),
        json!({"children": [config_map("c", "x")]}),
    );
    // The candidate desires a Secret, which the policy does not allow.
    spec["plugin"]["candidate"] = json!({
        "source": file_source("misbehave_plugin"),
        "config": {"children": [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}]},
    });
    spec["related"] = json!([{"apiVersion": "v1", "kind": "ConfigMap"}]);
    apply_policy(&client, TEST, TEST, spec).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w", None)).await?;
    let policy_api = policies(&client);
    let counted = wait_for_object(&policy_api, TEST, "the shadow verdict", |p| {
        p["status"]["candidate"]["evaluated"] == 1
    })
    .await?;
    let candidate = &counted["status"]["candidate"];
    assert_eq!(candidate["wouldFail"], 1, "{candidate}");
    assert_eq!(candidate["wouldChange"], 0, "{candidate}");
    let detail = candidate["examples"][0]["detail"]
        .as_str()
        .unwrap_or_default();
    assert!(
        detail.contains("the host would refuse its answer") && detail.contains("v1 Secret"),
        "{detail}"
    );
    let narrowed = condition(&counted, "RelatedNarrowed")
        .cloned()
        .unwrap_or_default();
    assert_eq!(narrowed["reason"], "UnselectedRelatedKind", "{narrowed}");
    assert!(
        narrowed["message"]
            .as_str()
            .is_some_and(|m| m.contains("related v1 ConfigMap without a selector")),
        "{narrowed}"
    );
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_of_a_kind_removed_from_the_policy_are_kept_and_reported() -> anyhow::Result<()> {
    const TEST: &str = "safety-removed-kind";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v"}});
    let both =
        json!([{"apiVersion": "v1", "kind": "ConfigMap"}, {"apiVersion": "v1", "kind": "Secret"}]);
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(both, json!({"children": [config_map("c", "x"), secret]})),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    let secrets = api(&client, &resource("", "v1", "Secret"), &ns);
    apply(&widgets, widget("w", None)).await?;
    wait_for_object(&secrets, "s", "the Secret child", |_| true).await?;

    // Secret leaves spec.children: the existing Secret is kept, and the policy says so.
    let mut only_config_maps = policy(
        config_maps_allowed(),
        json!({"children": [config_map("c", "x")]}),
    );
    apply_policy(&client, TEST, TEST, only_config_maps.clone()).await?;
    let policy_api = policies(&client);
    let reported = wait_for_object(&policy_api, TEST, "ChildrenManaged=False", |p| {
        condition(p, "ChildrenManaged").is_some_and(|c| c["reason"] == "ChildKindRemoved")
    })
    .await?;
    let message = condition(&reported, "ChildrenManaged")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned();
    assert!(message.contains("1 v1 Secret"), "{message}");
    wait_for_object(&widgets, "w", "w reconciled without the Secret", |w| {
        reconciled(w).is_some_and(|c| c["status"] == "True")
    })
    .await?;
    assert!(get(&secrets, "s").await?.is_some(), "kept, not pruned");

    // Once the user deletes it, the next restart of the controller stops reporting it.
    secrets.delete("s", &Default::default()).await?;
    only_config_maps["resyncPeriodSeconds"] = json!(120);
    apply_policy(&client, TEST, TEST, only_config_maps).await?;
    wait_for_object(&policy_api, TEST, "ChildrenManaged gone", |p| {
        condition(p, "ChildrenManaged").is_none()
            && p["status"]["observedGeneration"] == p["metadata"]["generation"]
    })
    .await?;
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_the_plugin_stops_setting_is_removed_from_a_child_it_created() -> anyhow::Result<()>
{
    const TEST: &str = "safety-field-removal";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let with_data = |data: Value| {
        policy(
            config_maps_allowed(),
            json!({"children": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": data}]}),
        )
    };
    apply_policy(
        &client,
        TEST,
        TEST,
        with_data(json!({"k": "v", "extra": "x"})),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    apply(&widgets, widget("w", None)).await?;
    wait_for_object(&config_maps, "c", "the child created", |c| {
        c["data"]["extra"] == "x"
    })
    .await?;

    // The plugin drops a field and changes another: both show on the child.
    apply_policy(&client, TEST, TEST, with_data(json!({"k": "v2"}))).await?;
    let updated = wait_for_object(&config_maps, "c", "the child updated", |c| {
        c["data"]["k"] == "v2"
    })
    .await?;
    assert!(
        updated["data"].get("extra").is_none(),
        "a field the plugin no longer sets must go: {}",
        updated["data"]
    );
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

/// A loopback server that accepts connections and never answers.
fn hanging_server() -> anyhow::Result<std::net::SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    Ok(address)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_fetch_that_hangs_holds_up_neither_a_new_plugin_nor_shutdown() -> anyhow::Result<()>
{
    const TEST: &str = "safety-hanging-fetch";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let address = hanging_server()?;
    let digest = wasmctrl::plugin::Digest::of(&std::fs::read(wasmctrl_testenv::plugins::guest(
        "misbehave_plugin",
    ))?)
    .to_string();
    let mut hanging = policy(config_maps_allowed(), json!({}));
    hanging["plugin"] = json!({
        "source": {"http": {"url": format!("http://{address}/plugin.wasm")}},
        "digest": digest,
    });
    apply_policy(&client, TEST, TEST, hanging.clone()).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The server never answers (the download would wait 60 s per attempt); a new plugin
    // source is taken at once.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(config_maps_allowed(), json!({})),
    )
    .await?;
    let policy_api = policies(&client);
    wait_for_object(&policy_api, TEST, "Ready with the file plugin", |p| {
        condition(p, "Ready").is_some_and(|c| {
            c["status"] == "True" && c["observedGeneration"] == p["metadata"]["generation"]
        })
    })
    .await?;

    // Hanging again, the host still stops at once.
    apply_policy(&client, TEST, TEST, hanging).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = std::time::Instant::now();
    host.stop().await?;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "shutdown waited for the fetch: {:?}",
        started.elapsed()
    );
    policy_api.delete(TEST, &Default::default()).await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_kind_whose_crd_is_removed_is_named_on_the_policy() -> anyhow::Result<()> {
    const TEST: &str = "safety-crd-removed";
    // A kind of this test's own: removing its CRD must not disturb any other test.
    const DOOMED_GROUP: &str = "doomed.e2e.wasmctrl.dev";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    install_crd(&client, &test_crd(DOOMED_GROUP, "Doomed")).await?;
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(
            json!([{"apiVersion": format!("{DOOMED_GROUP}/v1"), "kind": "Doomed"}]),
            json!({}),
        ),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let policy_api = policies(&client);
    wait_for_object(&policy_api, TEST, "Ready", |p| {
        condition(p, "Ready").is_some_and(|c| c["status"] == "True")
    })
    .await?;

    crds_api(&client)
        .delete(&format!("doomeds.{DOOMED_GROUP}"), &Default::default())
        .await?;
    let reported = wait_for_object(&policy_api, TEST, "Ready=False, KindNotFound", |p| {
        condition(p, "Ready").is_some_and(|c| c["reason"] == "KindNotFound")
    })
    .await?;
    let message = condition(&reported, "Ready")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains(&format!("cannot watch {DOOMED_GROUP}/v1 Doomed")),
        "{message}"
    );
    let started = std::time::Instant::now();
    host.stop().await?;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    policy_api.delete(TEST, &Default::default()).await?;
    delete_namespace(&client, &ns).await
}

/// The managers that own `status.conditions` of `object`, with their operation.
fn condition_owners(object: &DynamicObject) -> Vec<(String, String)> {
    object
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|entry| {
            entry
                .fields_v1
                .as_ref()
                .is_some_and(|fields| fields.0["f:status"]["f:conditions"].is_object())
        })
        .map(|entry| {
            (
                entry.manager.clone().unwrap_or_default(),
                entry.operation.clone().unwrap_or_default(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_that_fails_then_succeeds_has_one_writer_of_its_conditions() -> anyhow::Result<()>
{
    const TEST: &str = "safety-status-writer";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    // A ConfigMap the plugin wants, made by hand first: the reconcile fails with a conflict.
    apply(&config_maps, config_map("taken", "user data")).await?;
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(
            config_maps_allowed(),
            json!({"children": [config_map("taken", "plugin data")]}),
        ),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w", None)).await?;
    failure_message(&widgets, "w", "ChildConflict").await?;
    let manager = format!("wasmctrl/{TEST}");
    let failed = widgets.get("w").await?;
    assert_eq!(
        condition_owners(&failed),
        [(manager.clone(), "Apply".to_owned())],
        "a failure is written by the policy's manager, by apply"
    );

    config_maps.delete("taken", &Default::default()).await?;
    wait_for_object(&widgets, "w", "w reconciled", |w| {
        reconciled(w).is_some_and(|c| c["status"] == "True")
    })
    .await?;
    let succeeded = widgets.get("w").await?;
    assert_eq!(
        condition_owners(&succeeded),
        [(manager, "Apply".to_owned())],
        "after a failure and a success, status.conditions has one owner"
    );
    let conditions = succeeded.data["status"]["conditions"]
        .as_array()
        .map(Vec::len)
        .unwrap_or_default();
    assert_eq!(
        conditions, 1,
        "one Reconciled condition: {:?}",
        succeeded.data["status"]
    );

    host.stop().await?;
    delete_namespace(&client, &ns).await
}

/// The names of the ConfigMaps in `ns` that start with `prefix`.
async fn config_maps_named(
    client: &kube::Client,
    ns: &str,
    prefix: &str,
) -> anyhow::Result<Vec<String>> {
    let list = api(client, &resource("", "v1", "ConfigMap"), ns)
        .list(&Default::default())
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .filter(|name| name.starts_with(prefix))
        .collect())
}

/// Ordinary pruning within the budget over time is not held: once every parent was
/// reconciled under the policy's plugin, a parent whose spec drops its children loses them
/// all. The same deletions made by a change (a new plugin config) are held, and rolling the
/// change back deletes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_whose_spec_shrinks_loses_its_children_but_a_change_that_would_is_held()
-> anyhow::Result<()> {
    const TEST: &str = "safety-steady-prune";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let guarded = |config: Value| {
        let mut spec = policy(config_maps_allowed(), config);
        // Half of the 16 children per 2 s; a change sees only b's 8 and may delete 4.
        spec["safety"] = json!({"maxPruneFraction": 0.5, "pruneFloor": 0, "pruneWindowSeconds": 2});
        spec
    };
    apply_policy(&client, TEST, TEST, guarded(json!({"specChildren": true}))).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    let with_items = |name: &str, count: usize| {
        let items: Vec<String> = (0..count).map(|i| format!("i{i}")).collect();
        json!({"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget",
            "metadata": {"name": name}, "spec": {"items": items}})
    };
    for name in ["a", "b"] {
        apply(&widgets, with_items(name, 8)).await?;
    }
    let policy_api = policies(&client);
    wasmctrl_testenv::cluster::eventually("16 children", Duration::from_secs(60), || async {
        Ok(config_maps_named(&client, &ns, "a-").await?.len() == 8
            && config_maps_named(&client, &ns, "b-").await?.len() == 8)
    })
    .await?;
    // The window the controller's start opened closes once both parents were reconciled (by
    // this host: the policy of an earlier run of this test may still hold such a status).
    wait_for_object(&policy_api, TEST, "the start's window closed", |p| {
        p["status"]["observedGeneration"] == p["metadata"]["generation"]
            && p["status"]["parentsReconciled"] == 2
            && p["status"]["pruneGuard"].is_null()
    })
    .await?;

    // a's spec drops all eight: deleted, half of the children within the period (once they
    // stood a period: children count only then).
    tokio::time::sleep(Duration::from_secs(3)).await;
    apply(&widgets, with_items("a", 0)).await?;
    wasmctrl_testenv::cluster::eventually(
        "a's children pruned",
        Duration::from_secs(30),
        || async { Ok(config_maps_named(&client, &ns, "a-").await?.is_empty()) },
    )
    .await?;
    assert_eq!(config_maps_named(&client, &ns, "b-").await?.len(), 8);
    let running = get(&policy_api, TEST).await?.expect("the policy");
    assert_eq!(
        condition(&running, "Ready").map(|c| c["reason"].clone()),
        Some(json!("Running")),
        "{running}"
    );

    // A change that answers no children: b's eight are held, and the policy says so.
    apply_policy(&client, TEST, TEST, guarded(json!({}))).await?;
    let held = wait_for_object(&policy_api, TEST, "PruneHeld", |p| {
        condition(p, "Ready").is_some_and(|c| c["reason"] == "PruneHeld")
    })
    .await?;
    let message = condition(&held, "Ready")
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned();
    assert!(
        message.contains("holding 8 deletion(s) across 1 parent(s)")
            && message.contains(&format!("{ns}/b → ConfigMap b-i0"))
            && message.contains("wasmctrl.dev/confirm-prune="),
        "{message}"
    );
    assert_eq!(held["status"]["pruneGuard"]["state"], "Held", "{held}");
    assert_eq!(config_maps_named(&client, &ns, "b-").await?.len(), 8);

    // Rolled back: the hold is gone and nothing was deleted.
    apply_policy(&client, TEST, TEST, guarded(json!({"specChildren": true}))).await?;
    wait_for_object(&policy_api, TEST, "the hold released", |p| {
        condition(p, "Ready").is_some_and(|c| c["reason"] == "Running")
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(config_maps_named(&client, &ns, "b-").await?.len(), 8);

    host.stop().await?;
    policy_api.delete(TEST, &Default::default()).await?;
    delete_namespace(&client, &ns).await
}

/// A plugin that turns on the children it made long after it was swapped in — at a resync,
/// with no change to the policy or the plugin — is held by the budget over time: at most
/// `max(floor, share × children)` go per `pruneWindowSeconds`, the rest wait for an admin,
/// whose confirmation (of that hold's own token) lets them go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_turns_on_its_children_long_after_its_swap_is_held() -> anyhow::Result<()> {
    const TEST: &str = "safety-late-prune";
    const COUNT: usize = 30;
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let spec = policy(
        config_maps_allowed(),
        json!({"ownChild": true, "dropLabelled": true}),
    );
    apply_policy(&client, TEST, TEST, spec).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    for i in 0..COUNT {
        apply(&widgets, widget(&format!("w-{i:02}"), Some(i as u64))).await?;
    }
    let policy_api = policies(&client);
    wait_for_object(&policy_api, TEST, "the start's window closed", |p| {
        p["status"]["observedGeneration"] == p["metadata"]["generation"]
            && p["status"]["parentsReconciled"] == COUNT as u64
            && p["status"]["pruneGuard"].is_null()
    })
    .await?;
    wasmctrl_testenv::cluster::eventually("every child", Duration::from_secs(30), || async {
        Ok(config_maps_named(&client, &ns, "w-").await?.len() == COUNT)
    })
    .await?;

    // Every parent labelled: the plugin now answers none of their children.
    for i in 0..COUNT {
        widgets
            .patch(
                &format!("w-{i:02}"),
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(json!({"metadata": {"labels": {"drop": "true"}}})),
            )
            .await?;
    }
    let held = wait_for_object(&policy_api, TEST, "PruneHeld", |p| {
        condition(p, "Ready").is_some_and(|c| c["reason"] == "PruneHeld")
            && p["status"]["pruneGuard"]["heldDeletions"]
                .as_u64()
                .unwrap_or(0)
                > 0
    })
    .await?;
    // Once every parent came round, each child is deleted or held.
    let settled = wait_for_object(&policy_api, TEST, "every deletion held or made", |p| {
        let window = &p["status"]["pruneGuard"];
        window["heldDeletions"].as_u64().unwrap_or(0)
            + window["recentlyDeleted"].as_u64().unwrap_or(0)
            == COUNT as u64
    })
    .await?;
    let window = settled["status"]["pruneGuard"].clone();
    let kept = config_maps_named(&client, &ns, "w-").await?.len();
    // max(floor 5, 20% of 30) per period.
    assert!(kept >= COUNT - 6, "only {kept} of {COUNT} kept: {held}");
    // 6, or the floor while the children are younger than the period (they count once
    // they stood one).
    assert!(
        window["recentlyAllowed"].as_u64().is_some_and(|n| n <= 6),
        "{window}"
    );
    assert_eq!(window["recentlyDeleted"], (COUNT - kept) as u64, "{window}");
    let since = window["since"].as_str().unwrap_or_default();
    assert!(since.contains("within 600s"), "{window}");

    // A value that is not this hold's token confirms nothing; the token does.
    let confirm =
        |value: &str| json!({"metadata": {"annotations": {"wasmctrl.dev/confirm-prune": value}}});
    let token = window["confirm"].as_str().unwrap_or_default().to_owned();
    policy_api
        .patch(
            TEST,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(confirm(&format!("{token}0"))),
        )
        .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(config_maps_named(&client, &ns, "w-").await?.len(), kept);
    // `wasmctrl prune confirm` sets the token the guard shows now.
    let wasmctrl::cli::Command::Prune(prune) =
        <wasmctrl::cli::Cli as clap::Parser>::try_parse_from([
            "wasmctrl", "prune", "confirm", TEST,
        ])?
        .command
    else {
        anyhow::bail!("not the prune command");
    };
    prune.run_with(&client).await?;
    let confirmed = get(&policy_api, TEST)
        .await?
        .ok_or_else(|| anyhow::anyhow!("the policy is gone"))?;
    assert_eq!(
        confirmed["metadata"]["annotations"]["wasmctrl.dev/confirm-prune"],
        token.as_str()
    );
    wasmctrl_testenv::cluster::eventually(
        "every child pruned",
        Duration::from_secs(60),
        || async { Ok(config_maps_named(&client, &ns, "w-").await?.is_empty()) },
    )
    .await?;

    host.stop().await?;
    policy_api.delete(TEST, &Default::default()).await?;
    delete_namespace(&client, &ns).await
}

/// `wasmctrl uninstall`, once the host is gone, leaves no finalizer behind: the parents',
/// the policy's and the team policy's are released and the policies deleted, so parents and
/// namespaces can go. While a host holds the leader Lease it refuses to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uninstall_leaves_no_finalizer_behind_and_waits_for_the_hosts_to_go() -> anyhow::Result<()>
{
    const TEST: &str = "safety-uninstall";
    let (client, ns) = test_namespace(TEST).await?;
    install_kinds(&client).await?;
    let mut spec = policy(config_maps_allowed(), json!({"ownChild": true}));
    spec["finalize"] = json!(true);
    apply_policy(&client, TEST, TEST, spec.clone()).await?;
    // A team's policy in the test's namespace (its account does not exist: it only needs
    // its finalizer).
    let mut team_spec = spec;
    team_spec["parent"] = json!({"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Gadget"});
    team_spec["plugin"] = json!({"source": {"oci": {"reference": "registry.example.com/p:1"}},
        "digest": format!("sha256:{}", "0".repeat(64))});
    team_spec["serviceAccount"] = json!({"namespace": ns, "name": "nobody"});
    let team = api(
        &client,
        &resource("wasmctrl.dev", "v1alpha1", "NamespacedReconcilePolicy"),
        &ns,
    );
    apply(
        &team,
        json!({"apiVersion": "wasmctrl.dev/v1alpha1", "kind": "NamespacedReconcilePolicy",
               "metadata": {"name": "team", "labels": {TEST_LABEL: TEST}}, "spec": team_spec}),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    for name in ["a", "b", "c"] {
        apply(&widgets, widget(name, Some(1))).await?;
        wait_for_object(&widgets, name, "the policy's finalizer", |w| {
            finalizers(w).contains(&format!("wasmctrl.dev/{TEST}"))
        })
        .await?;
    }
    let policy_api = policies(&client);
    wait_for_object(&policy_api, TEST, "the policy's own finalizer", |p| {
        finalizers(p).contains(&"wasmctrl.dev/release-parents".to_owned())
    })
    .await?;
    wait_for_object(&team, "team", "the team policy's finalizer", |p| {
        finalizers(p).contains(&"wasmctrl.dev/namespaced-policy".to_owned())
    })
    .await?;
    host.stop().await?;

    let uninstall = |lease: &str, more: &[&str]| {
        let mut args = vec![
            "wasmctrl".to_owned(),
            "uninstall".to_owned(),
            "--lease".to_owned(),
            format!("{ns}/{lease}"),
        ];
        args.extend(more.iter().map(|a| (*a).to_owned()));
        let client = client.clone();
        async move {
            let cli = <wasmctrl::cli::Cli as clap::Parser>::try_parse_from(args)?;
            let wasmctrl::cli::Command::Uninstall(command) = cli.command else {
                anyhow::bail!("not the uninstall command");
            };
            command.run_with(&client).await
        }
    };
    // A host that renewed its Lease just now: the uninstall waits for it to go.
    let leases = api(
        &client,
        &resource("coordination.k8s.io", "v1", "Lease"),
        &ns,
    );
    let now = k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string();
    apply(
        &leases,
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
               "metadata": {"name": "held"},
               "spec": {"holderIdentity": "replica-1", "leaseDurationSeconds": 15,
                        "renewTime": now, "acquireTime": now}}),
    )
    .await?;
    // The team's policy is chosen by its namespace's labels (the test's namespace is placed
    // with this test), as hosts place it.
    let selector = format!("{TEST_LABEL}={TEST}");
    let which = ["--selector", selector.as_str()];
    let unscoped = uninstall("held", &[])
        .await
        .expect_err("no --selector, no --all");
    assert!(format!("{unscoped:#}").contains("--all"), "{unscoped:#}");
    let refused = uninstall("held", &which)
        .await
        .expect_err("a host holds the Lease");
    assert!(
        format!("{refused:#}").contains("still holds"),
        "{refused:#}"
    );
    let unknown = uninstall("absent", &which)
        .await
        .expect_err("no Lease: whether a host runs is unknown");
    assert!(format!("{unknown:#}").contains("--force"), "{unknown:#}");
    assert!(
        finalizers(&get(&widgets, "a").await?.expect("a"))
            .contains(&format!("wasmctrl.dev/{TEST}"))
    );

    uninstall("absent", &["--selector", selector.as_str(), "--force"]).await?;
    for name in ["a", "b", "c"] {
        let widget = get(&widgets, name).await?.expect("the widget");
        assert!(
            !finalizers(&widget)
                .iter()
                .any(|f| f.starts_with("wasmctrl.dev/")),
            "{widget}"
        );
    }
    wasmctrl_testenv::cluster::eventually("the policies gone", Duration::from_secs(30), || async {
        Ok(get(&policy_api, TEST).await?.is_none()
            && get(&team, "team").await?.is_none()
            && get(&policy_api, &format!("{ns}.team")).await?.is_none())
    })
    .await?;
    // Nothing holds the parents any more: they go when deleted.
    widgets.delete("a", &Default::default()).await?;
    wasmctrl_testenv::cluster::eventually("a deleted", Duration::from_secs(30), || async {
        Ok(get(&widgets, "a").await?.is_none())
    })
    .await?;
    delete_namespace(&client, &ns).await
}
