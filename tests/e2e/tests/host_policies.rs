//! The host's guarantees with plugins that fail, overreach or hold finalizers, and with
//! several policies: a failure changes nothing, a refused answer changes nothing, finalizers
//! wait for the plugin, and policies start, stop and wait for their kinds independently.
//!
//! These use the `misbehave` test plugin, which desires exactly the children its config lists.

use std::time::Duration;

use serde_json::{Value, json};
use wasmctrl_e2e::*;

fn policy_for(kind: &str, children: Value, config: Value) -> Value {
    json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": kind},
        "children": children,
        "plugin": {"source": file_source("misbehave_plugin"), "config": config},
    })
}

fn config_map(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"k": "v"}})
}

/// Gadget `name`: a second test-only kind, for a second policy beside the Widgets'.
fn gadget(name: &str) -> Value {
    json!({"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Gadget", "metadata": {"name": name}, "spec": {}})
}

fn reconciled(object: &Value) -> Option<&str> {
    condition(object, "Reconciled").and_then(|c| c["status"].as_str())
}

async fn install_test_kinds(client: &kube::Client) -> anyhow::Result<()> {
    install_repo_crds(client).await?;
    install_crd(client, &test_crd(TEST_GROUP, "Widget")).await?;
    install_crd(client, &test_crd(TEST_GROUP, "Gadget")).await
}

/// The attempt number and retry delay in a `Reconciled=False` message.
fn attempt_and_delay(message: &str) -> Option<(u32, f64)> {
    let rest = &message[message.rfind("(attempt ")? + "(attempt ".len()..];
    let (attempt, rest) = rest.split_once(", next retry in ")?;
    let delay = rest.strip_suffix("s)")?;
    Some((attempt.parse().ok()?, delay.parse().ok()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_plugin_changes_nothing_backs_off_and_recovers() -> anyhow::Result<()> {
    const TEST: &str = "policy-failing-plugin";
    let (client, ns) = test_namespace(TEST).await?;
    install_test_kinds(&client).await?;
    let children = json!([{"apiVersion": "v1", "kind": "ConfigMap"}]);
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_for(
            "Widget",
            children.clone(),
            json!({"children": [config_map("keep")]}),
        ),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);

    apply(&widgets, widget("w", None)).await?;
    wait_for_object(&widgets, "w", "w reconciled", |w| {
        reconciled(w) == Some("True")
    })
    .await?;
    let kept = wait_for_object(&config_maps, "keep", "child keep", |_| true).await?;

    // The plugin now panics, and would prune `keep` if it could.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_for(
            "Widget",
            children.clone(),
            json!({"behavior": "panic", "children": []}),
        ),
    )
    .await?;
    let failed = wait_for_object(&widgets, "w", "w to report the panic at attempt 3", |w| {
        condition(w, "Reconciled")
            .and_then(|c| c["message"].as_str())
            .and_then(attempt_and_delay)
            .is_some_and(|(attempt, _)| attempt >= 3)
    })
    .await?;
    let reconciled_condition = condition(&failed, "Reconciled").expect("present");
    assert_eq!(reconciled_condition["status"], "False");
    assert_eq!(reconciled_condition["reason"], "PluginFailed");
    let message = reconciled_condition["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("deliberate panic while reconciling w"),
        "{message}"
    );
    // Retries back off: base 0.5 s, doubling per attempt.
    let (attempt, delay) = attempt_and_delay(message).expect("parsed");
    assert_eq!(delay, 0.5 * f64::from(1u32 << (attempt - 1)), "{message}");
    let still = get(&config_maps, "keep")
        .await?
        .expect("a failing plugin must not prune");
    assert_eq!(
        still["metadata"]["resourceVersion"],
        kept["metadata"]["resourceVersion"]
    );
    assert_eq!(
        failed["status"]["parent"], "w",
        "the last good status is kept"
    );
    let events = event_reasons(&client, &ns, "w").await?;
    assert!(
        events.contains(&("Warning".into(), "PluginFailed".into())),
        "{events:?}"
    );

    // A plugin that reports an error is the same story with its own reason.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_for("Widget", children.clone(), json!({"behavior": "error"})),
    )
    .await?;
    wait_for_object(&widgets, "w", "w to report the plugin's error", |w| {
        condition(w, "Reconciled").is_some_and(|c| {
            c["reason"] == "PluginReportedError"
                && c["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("backend for w unavailable"))
        })
    })
    .await?;
    assert!(get(&config_maps, "keep").await?.is_some());

    // Fixed: the parent recovers, and only now is the no-longer-desired child pruned.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_for("Widget", children, json!({"children": []})),
    )
    .await?;
    wait_for_object(&widgets, "w", "w recovered", |w| {
        reconciled(w) == Some("True")
    })
    .await?;
    wait_gone(&config_maps, "keep", "keep pruned after recovery").await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_the_policy_does_not_allow_are_refused_and_nothing_is_created()
-> anyhow::Result<()> {
    const TEST: &str = "policy-refusals";
    let (client, ns) = test_namespace(TEST).await?;
    install_test_kinds(&client).await?;
    // Namespaces are allowed by kind, but a namespaced parent may not own one.
    let children = json!([{"apiVersion": "v1", "kind": "ConfigMap"}, {"apiVersion": "v1", "kind": "Namespace"}]);
    let widgets = widgets(&client, &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    apply(&widgets, widget("w", None)).await?;

    let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "stolen"}});
    let mut elsewhere = config_map("elsewhere");
    elsewhere["metadata"]["namespace"] = json!("kube-system");
    let namespace = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": format!("{ns}-escape")}});
    let cases = [
        (secret, "Secret, which the policy does not allow"),
        (elsewhere, "children must be in their parent's namespace"),
        (
            namespace.clone(),
            "children must share their parent's scope",
        ),
    ];
    for (i, (bad, expected)) in cases.into_iter().enumerate() {
        // Each answer also holds a valid ConfigMap: refusing means none of it is applied.
        let config = json!({"children": [config_map("valid"), bad]});
        apply_policy(
            &client,
            TEST,
            TEST,
            policy_for("Widget", children.clone(), config),
        )
        .await?;
        let refused = wait_for_object(&widgets, "w", &format!("refusal {i}"), |w| {
            condition(w, "Reconciled").is_some_and(|c| {
                c["reason"] == "InvalidChildren"
                    && c["message"].as_str().is_some_and(|m| m.contains(expected))
            })
        })
        .await?;
        assert_eq!(reconciled(&refused), Some("False"));
    }
    assert!(
        get(&config_maps, "valid").await?.is_none(),
        "nothing from a refused answer is applied"
    );
    let kube_system = api(&client, &resource("", "v1", "ConfigMap"), "kube-system");
    assert!(get(&kube_system, "elsewhere").await?.is_none());
    let namespaces: kube::Api<kube::api::DynamicObject> =
        kube::Api::all_with(client.clone(), &resource("", "v1", "Namespace"));
    assert!(get(&namespaces, &format!("{ns}-escape")).await?.is_none());
    let secrets = api(&client, &resource("", "v1", "Secret"), &ns);
    assert!(get(&secrets, "stolen").await?.is_none());
    let events = event_reasons(&client, &ns, "w").await?;
    assert!(
        events.contains(&("Warning".into(), "InvalidChildren".into())),
        "{events:?}"
    );

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finalizer_is_released_only_when_the_plugin_says_finalized() -> anyhow::Result<()> {
    const TEST: &str = "policy-finalize";
    let (client, ns) = test_namespace(TEST).await?;
    install_test_kinds(&client).await?;
    let children = json!([{"apiVersion": "v1", "kind": "ConfigMap"}]);
    let spec = |behavior: &str| {
        let mut spec = policy_for(
            "Widget",
            children.clone(),
            json!({"behavior": behavior, "children": [config_map("owned")]}),
        );
        spec["finalize"] = json!(true);
        spec
    };
    apply_policy(&client, TEST, TEST, spec("hold-finalizer")).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let finalizer = format!("wasmctrl.dev/{TEST}");

    apply(&widgets, widget("w", None)).await?;
    wait_for_object(&widgets, "w", "the finalizer to be added", |w| {
        w["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| f.contains(&json!(finalizer)))
    })
    .await?;
    wait_for_object(&config_maps, "owned", "child owned", |_| true).await?;

    // Deleted while the plugin holds on: the parent stays, marked for deletion.
    widgets.delete("w", &Default::default()).await?;
    wait_for_object(&widgets, "w", "w marked for deletion", |w| {
        w["metadata"]["deletionTimestamp"].is_string()
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        get(&widgets, "w").await?.is_some(),
        "the finalizer must hold until the plugin is done"
    );
    let events = event_reasons(&client, &ns, "w").await?;
    assert!(
        events.contains(&("Normal".into(), "Finalizing".into())),
        "the finalize path ran: {events:?}"
    );

    // The plugin finishes: the finalizer goes, the parent goes, its children are collected.
    apply_policy(&client, TEST, TEST, spec("")).await?;
    wait_gone(&widgets, "w", "w deleted after finalizing").await?;
    wait_collected(&config_maps, "owned", "child garbage-collected").await?;

    // A finalizing policy is let go by a running host (it holds a finalizer of its own).
    policies(&client).delete(TEST, &Default::default()).await?;
    wait_gone(&policies(&client), TEST, "the policy deleted").await?;
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_run_side_by_side_and_stop_alone() -> anyhow::Result<()> {
    const TEST: &str = "policy-side-by-side";
    let (client, ns) = test_namespace(TEST).await?;
    install_test_kinds(&client).await?;
    let (widget_policy, gadget_policy) = (format!("{TEST}-widgets"), format!("{TEST}-gadgets"));
    apply_policy(
        &client,
        TEST,
        &widget_policy,
        policy_for("Widget", json!([]), json!({})),
    )
    .await?;
    apply_policy(
        &client,
        TEST,
        &gadget_policy,
        policy_for("Gadget", json!([]), json!({})),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    let gadgets = api(&client, &resource(TEST_GROUP, "v1", "Gadget"), &ns);
    let echoed = |o: &Value| o["status"]["parent"] == o["metadata"]["name"];

    apply(&widgets, widget("w1", None)).await?;
    apply(&gadgets, gadget("g1")).await?;
    wait_for_object(&widgets, "w1", "w1 reconciled", echoed).await?;
    wait_for_object(&gadgets, "g1", "g1 reconciled", echoed).await?;

    policies(&client)
        .delete(&widget_policy, &Default::default())
        .await?;
    // Gadgets keep being reconciled; new Widgets no longer are.
    apply(&gadgets, gadget("g2")).await?;
    wait_for_object(
        &gadgets,
        "g2",
        "g2 reconciled after the widget policy went",
        echoed,
    )
    .await?;
    apply(&widgets, widget("w2", None)).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let w2 = get(&widgets, "w2").await?.expect("exists");
    assert!(
        w2["status"].is_null(),
        "no controller may touch Widgets now: {w2}"
    );

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client)
        .delete(&gadget_policy, &Default::default())
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_waits_for_its_crd_and_reports_plugin_problems() -> anyhow::Result<()> {
    const TEST: &str = "policy-late-crd";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    // A group no earlier run has installed, so the kind really does not exist yet.
    let group = format!("{ns}.late.wasmctrl.dev");
    let spec = json!({
        "parent": {"apiVersion": format!("{group}/v1"), "kind": "Sprocket"},
        "plugin": {"source": file_source("misbehave_plugin")},
    });
    apply_policy(&client, TEST, TEST, spec).await?;
    let bad_digest = format!("{TEST}-bad-digest");
    apply_policy(&client, TEST, &bad_digest, json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
        "plugin": {"source": file_source("misbehave_plugin"), "digest": format!("sha256:{}", "0".repeat(64))},
    }))
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let policy_api = policies(&client);

    let waiting = wait_for_object(&policy_api, TEST, "Ready=False, KindNotFound", |p| {
        condition(p, "Ready")
            .is_some_and(|c| c["status"] == "False" && c["reason"] == "KindNotFound")
    })
    .await?;
    assert!(
        condition(&waiting, "Ready")
            .and_then(|c| c["message"].as_str())
            .is_some_and(|m| m.contains("Sprocket")),
        "{waiting}"
    );
    let refused = wait_for_object(
        &policy_api,
        &bad_digest,
        "PluginLoaded=False, DigestMismatch",
        |p| {
            condition(p, "PluginLoaded")
                .is_some_and(|c| c["status"] == "False" && c["reason"] == "DigestMismatch")
        },
    )
    .await?;
    assert_eq!(
        condition(&refused, "Ready").map(|c| c["status"].clone()),
        Some(json!("False"))
    );

    let crd = test_crd(&group, "Sprocket");
    install_crd(&client, &crd).await?;
    let ready = wait_for_object(&policy_api, TEST, "Ready=True once the CRD exists", |p| {
        condition(p, "Ready").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    assert_eq!(
        condition(&ready, "PluginLoaded").map(|c| c["status"].clone()),
        Some(json!("True"))
    );
    assert!(
        ready["status"]["activeDigest"]
            .as_str()
            .is_some_and(|d| d.starts_with("sha256:"))
    );
    let sprockets = api(&client, &resource(&group, "v1", "Sprocket"), &ns);
    apply(&sprockets, json!({"apiVersion": format!("{group}/v1"), "kind": "Sprocket", "metadata": {"name": "s"}, "spec": {}})).await?;
    wait_for_object(&sprockets, "s", "s reconciled", |s| {
        s["status"]["parent"] == "s"
    })
    .await?;
    wait_for_object(
        &policy_api,
        TEST,
        "the policy to count one reconciled parent",
        |p| p["status"]["parentsReconciled"] == 1 && p["status"]["parentsFailing"] == 0,
    )
    .await?;
    // A deleted parent leaves the counts at the next report (every 5 s), not only at the
    // sweep the host makes once a minute when no parent went.
    sprockets.delete("s", &Default::default()).await?;
    wait_for_object_within(
        &policy_api,
        TEST,
        "the deleted parent no longer counted",
        Duration::from_secs(15),
        |p| p["status"]["parentsReconciled"] == 0,
    )
    .await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    policy_api.delete(&bad_digest, &Default::default()).await?;
    let name = crd["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    crds_api(&client).delete(&name, &Default::default()).await?;
    Ok(())
}

/// A reconcile that only the host's own writes brought asks the plugin nothing, and a change
/// someone else makes meanwhile is never missed. Each Widget has two ConfigMaps, `-own`
/// (its spec as data) and `-x` (from `spec.items`), and a status counting the children the
/// plugin saw. The policy's resync is an hour away: only events can bring anything about.
///
/// First, quiet Widgets: each is asked exactly twice, on create and once both its children
/// are in the cache (so its status counts them), and never on the events of its own writes
/// alone. Then each
/// new Widget gets a change the moment its `-own` ConfigMap appears, while the host is
/// still writing `-x` and the status: a new `spec.size` (under the host's status write,
/// which lands after it), or a hand-edit of `-own`. Each change is carried out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_writes_coming_back_ask_the_plugin_nothing_and_a_change_meanwhile_is_never_missed()
-> anyhow::Result<()> {
    use futures::StreamExt as _;
    use kube::api::{Patch, PatchParams};
    use kube::runtime::WatchStreamExt as _;

    const TEST: &str = "policy-own-writes";
    const QUIET: usize = 12;
    const MEDDLED: usize = 16;
    let (client, ns) = test_namespace(TEST).await?;
    install_test_kinds(&client).await?;
    let mut spec = policy_for(
        "Widget",
        json!([{"apiVersion": "v1", "kind": "ConfigMap"}]),
        json!({"ownChild": true, "specChildren": true}),
    );
    spec["resyncPeriodSeconds"] = json!(3600);
    apply_policy(&client, TEST, TEST, spec).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let widget = |name: &str| {
        json!({"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget", "metadata": {"name": name},
               "spec": {"size": 1, "items": ["x"]}})
    };
    let both_children = |w: &Value| w["status"]["children"] == 2;

    let quiet: Vec<String> = (0..QUIET).map(|i| format!("quiet-{i}")).collect();
    futures::future::try_join_all(quiet.iter().map(|name| apply(&widgets, widget(name)))).await?;
    for name in &quiet {
        wait_for_object(
            &widgets,
            name,
            &format!("Widget {name} showing both children"),
            both_children,
        )
        .await?;
    }
    let calls = labelled_metric(
        &host,
        "wasmctrl_plugin_calls_total",
        &[("controller", TEST), ("outcome", "ok")],
    );
    assert_eq!(
        calls,
        2.0 * QUIET as f64,
        "each quiet Widget is asked on create and once its children are in the cache"
    );

    // Even Widgets get a new size, odd ones a hand-edited `-own`.
    let index = |name: &str| -> usize { name.trim_start_matches("meddled-").parse().unwrap_or(0) };
    let meddler = {
        let (widgets, config_maps) = (widgets.clone(), config_maps.clone());
        tokio::spawn(async move {
            let mut seen = std::collections::HashSet::new();
            let config = kube::runtime::watcher::Config::default()
                .labels(&format!("wasmctrl.dev/policy={TEST}"));
            let events = kube::runtime::watcher(config_maps.clone(), config).applied_objects();
            let mut events = std::pin::pin!(events);
            while seen.len() < MEDDLED {
                let Some(config_map) = events.next().await.transpose()? else {
                    anyhow::bail!("the ConfigMaps' watch ended");
                };
                let name = config_map.metadata.name.clone().unwrap_or_default();
                let Some(widget) = name
                    .strip_suffix("-own")
                    .filter(|w| w.starts_with("meddled-"))
                else {
                    continue;
                };
                if !seen.insert(widget.to_owned()) {
                    continue;
                }
                let params = PatchParams::default();
                if index(widget) % 2 == 0 {
                    let patch = Patch::Merge(json!({"spec": {"size": 2}}));
                    widgets.patch(widget, &params, &patch).await?;
                } else {
                    let patch = Patch::Merge(json!({"data": {"size": "99"}}));
                    config_maps.patch(&name, &params, &patch).await?;
                }
            }
            anyhow::Ok(())
        })
    };
    let meddled: Vec<String> = (0..MEDDLED).map(|i| format!("meddled-{i}")).collect();
    futures::future::try_join_all(meddled.iter().map(|name| apply(&widgets, widget(name)))).await?;
    tokio::time::timeout(ACT, meddler).await???;
    for name in &meddled {
        let size = if index(name) % 2 == 0 { "2" } else { "1" };
        wait_for_object(
            &config_maps,
            &format!("{name}-own"),
            &format!("{name}-own at size {size}"),
            |c| c["data"]["size"] == size,
        )
        .await?;
        wait_for_object(
            &widgets,
            name,
            &format!("Widget {name} reconciled at its generation"),
            |w| {
                both_children(w)
                    && w["status"]["observedGeneration"] == w["metadata"]["generation"]
                    && reconciled(w) == Some("True")
            },
        )
        .await?;
    }

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}

/// The sum of the host's series `name` with (at least) the labels `labels`: 0 if none.
fn labelled_metric(host: &HostUnderTest, name: &str, labels: &[(&str, &str)]) -> f64 {
    host.metrics
        .encode()
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .filter(|line| {
            labels
                .iter()
                .all(|(label, value)| line.contains(&format!("{label}=\"{value}\"")))
        })
        .filter_map(|line| line.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .fold(0.0, |sum, value| sum + value)
}

/// The echo of the host's own finalizer write changes a parent's metadata, so it brings a
/// second reconcile; for a plugin that wants no children, nothing else changed, and that
/// reconcile asks it nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_echo_of_the_host_s_own_finalizer_write_asks_the_plugin_nothing() -> anyhow::Result<()>
{
    const TEST: &str = "policy-own-finalizer";
    const WIDGETS: usize = 8;
    let (client, ns) = test_namespace(TEST).await?;
    install_test_kinds(&client).await?;
    let mut spec = policy_for(
        "Widget",
        json!([{"apiVersion": "v1", "kind": "ConfigMap"}]),
        json!({}),
    );
    spec["finalize"] = json!(true);
    spec["resyncPeriodSeconds"] = json!(3600);
    apply_policy(&client, TEST, TEST, spec).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    let names: Vec<String> = (0..WIDGETS).map(|i| format!("w-{i}")).collect();
    futures::future::try_join_all(names.iter().map(|name| apply(&widgets, widget(name, None))))
        .await?;
    for name in &names {
        wait_for_object(&widgets, name, &format!("Widget {name} reconciled"), |w| {
            reconciled(w) == Some("True")
                && w["metadata"]["finalizers"]
                    .as_array()
                    .is_some_and(|f| !f.is_empty())
        })
        .await?;
    }
    let series = |name| labelled_metric(&host, name, &[("controller", TEST)]);
    wasmctrl_testenv::cluster::eventually("every Widget's second reconcile", ACT, || async {
        Ok(series("controller_runtime_reconcile_total") >= 2.0 * WIDGETS as f64)
    })
    .await?;
    let unchanged = series("wasmctrl_reconciles_unchanged_total");
    assert!(
        unchanged >= 1.0,
        "the finalizer's echo should find nothing changed (reconciles {}, plugin calls {})",
        series("controller_runtime_reconcile_total"),
        series("wasmctrl_plugin_calls_total"),
    );
    assert_eq!(
        series("wasmctrl_plugin_calls_total") + unchanged,
        series("controller_runtime_reconcile_total"),
        "a reconcile either asks the plugin or finds nothing changed"
    );

    for name in &names {
        widgets.delete(name, &Default::default()).await?;
    }
    for name in &names {
        wait_gone(&widgets, name, &format!("Widget {name} finalized and gone")).await?;
    }
    // A finalizing policy holds a finalizer of its own, which its host lets go: deleted
    // after the host stopped, it would stay, and the next run's policy of the same name
    // would be a terminating one.
    policies(&client).delete(TEST, &Default::default()).await?;
    wait_gone(&policies(&client), TEST, "the policy released and gone").await?;
    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    Ok(())
}

/// The resync comes from one timer per policy, not a requeue per parent: once settled, every
/// parent is reconciled again once per period though nothing changed, each such reconcile
/// asks the plugin (its last decision is older than half the period), and none is asked
/// much more often.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_parent_is_resynced_once_per_period_though_nothing_changed() -> anyhow::Result<()> {
    const TEST: &str = "policy-resync";
    const WIDGETS: usize = 20;
    const PERIOD_SECONDS: u64 = 3;
    const PERIODS: u64 = 5;
    let (client, ns) = test_namespace(TEST).await?;
    install_test_kinds(&client).await?;
    let mut spec = policy_for(
        "Widget",
        json!([{"apiVersion": "v1", "kind": "ConfigMap"}]),
        json!({"ownChild": true}),
    );
    spec["resyncPeriodSeconds"] = json!(PERIOD_SECONDS);
    apply_policy(&client, TEST, TEST, spec).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    let names: Vec<String> = (0..WIDGETS).map(|i| format!("w-{i:02}")).collect();
    futures::future::try_join_all(
        names
            .iter()
            .map(|name| apply(&widgets, widget(name, Some(1)))),
    )
    .await?;
    for name in &names {
        wait_for_object(&widgets, name, &format!("{name} reconciled"), |w| {
            reconciled(w) == Some("True") && w["status"]["children"] == 1
        })
        .await?;
    }
    let records = |name: &str| -> Vec<String> {
        let kinds = host.explain.store.kinds_named("Widget");
        match host
            .explain
            .store
            .lookup("Widget", Some(&ns), name, 50, &kinds)
        {
            wasmctrl::explain::Lookup::Found { records } => records,
            _ => Vec::new(),
        }
    };
    let calls = || {
        labelled_metric(
            &host,
            "wasmctrl_plugin_calls_total",
            &[("controller", TEST), ("outcome", "ok")],
        )
    };
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let versions = |api: &kube::Api<kube::api::DynamicObject>| {
        let api = api.clone();
        async move {
            let list = api.list(&Default::default()).await?;
            anyhow::Ok(
                list.items
                    .into_iter()
                    .map(|c| (c.metadata.name, c.metadata.resource_version))
                    .collect::<std::collections::BTreeMap<_, _>>(),
            )
        }
    };
    let children_before = versions(&config_maps).await?;
    let before: Vec<Vec<String>> = names.iter().map(|name| records(name)).collect();
    let calls_before = calls();
    tokio::time::sleep(Duration::from_secs(PERIOD_SECONDS * PERIODS)).await;
    let calls_during = calls() - calls_before;

    // Each parent's point in the period was passed PERIODS times; a reconcile at the edges of
    // the window may fall either side of it.
    for (name, before) in names.iter().zip(&before) {
        let new = records(name)
            .into_iter()
            .filter(|record| !before.contains(record))
            .count();
        assert!(
            (PERIODS - 1..=PERIODS + 1).contains(&(new as u64)),
            "{name} was reconciled {new} times in {PERIODS} resync periods"
        );
    }
    let per_parent = calls_during / WIDGETS as f64;
    assert!(
        (PERIODS as f64 - 1.0..=PERIODS as f64 + 1.0).contains(&per_parent),
        "{per_parent} plugin calls per parent in {PERIODS} resync periods"
    );
    // Nothing changed, so the resyncs wrote nothing.
    assert_eq!(versions(&config_maps).await?, children_before);

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}
