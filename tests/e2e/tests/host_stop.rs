//! A stopping host returns within its drain time whatever its policies are doing, and says
//! what it abandoned: a plugin fetch hanging mid-body, a compile in progress, a load waiting
//! for a permit, a reconcile inside a slow plugin call, and (on a standby) writes that wait
//! for leadership.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use wasmctrl_e2e::*;
use wasmctrl_testenv::cluster::eventually;
use wasmctrl_testenv::crds::{install_crd, install_repo_crds};

/// The API group of this test's kinds, one per state a policy is held in.
const GROUP: &str = "stop.e2e.wasmctrl.dev";
/// The drain time of the hosts here.
const DRAIN: Duration = Duration::from_secs(5);
/// What `Host::run` may take beyond it: the aborted tasks' grace and the harness's own.
const RETURN_SLACK: Duration = Duration::from_secs(2);

fn policy_for(kind: &str, source: Value, digest: Option<&str>, config: Value) -> Value {
    let mut plugin = json!({"source": source, "config": config});
    if let Some(digest) = digest {
        plugin["digest"] = json!(digest);
    }
    json!({
        "parent": {"apiVersion": format!("{GROUP}/v1"), "kind": kind},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "plugin": plugin,
        "limits": {"timeoutMs": 60000},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_returns_within_its_drain_time_whatever_its_policies_are_doing() -> anyhow::Result<()>
{
    const TEST: &str = "stop-held";
    const STANDBY: &str = "stop-held-standby";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    for kind in ["Calling", "Fetching", "Compiling", "Waiting", "Standing"] {
        install_crd(&client, &test_crd(GROUP, kind)).await?;
    }
    let parent = |kind: &str| json!({"apiVersion": format!("{GROUP}/v1"), "kind": kind, "metadata": {"name": "p"}, "spec": {}});
    let parents = |kind: &str| api(&client, &resource(GROUP, "v1", kind), &ns);

    // A host that compiles every plugin afresh, one at a time.
    let host = HostUnderTest::builder(TEST, &ns)
        .without_disk_cache()
        .max_concurrent_loads(1)
        .drain_timeout(DRAIN)
        .start()
        .await?;

    // A reconcile inside a plugin call that loops until its 60 s deadline.
    apply(&parents("Calling"), parent("Calling")).await?;
    apply_policy(
        &client,
        TEST,
        "stop-calling",
        policy_for(
            "Calling",
            file_source("misbehave_plugin"),
            None,
            json!({"behavior": "loop"}),
        ),
    )
    .await?;
    eventually(
        "the slow plugin call in flight",
        Duration::from_secs(60),
        || async {
            Ok(host.metrics.encode().lines().any(|l| {
                l.starts_with("controller_runtime_active_workers")
                    && l.contains("stop-calling")
                    && !l.ends_with(" 0")
            }))
        },
    )
    .await?;

    // A fetch that hangs mid-body, holding its policy's fetch permit.
    let dripping = dripping_server(None)?;
    let never_served = wasmctrl::plugin::Digest::of(b"never served").to_string();
    apply_policy(
        &client,
        TEST,
        "stop-fetching",
        policy_for(
            "Fetching",
            json!({"http": {"url": format!("http://{}/plugin.wasm", dripping.address)}}),
            Some(&never_served),
            json!({}),
        ),
    )
    .await?;
    eventually("the fetch under way", Duration::from_secs(30), || async {
        Ok(dripping
            .connections
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0)
    })
    .await?;

    // A compile in progress (the Python plugin, 19 MB), holding the only compile permit.
    apply_policy(
        &client,
        TEST,
        "stop-compiling",
        policy_for("Compiling", file_source("myapp_py"), None, json!({})),
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // A load waiting for the compile permit (a plugin no policy has loaded).
    apply_policy(
        &client,
        TEST,
        "stop-waiting",
        policy_for("Waiting", file_source("myapp_v2_plugin"), None, json!({})),
    )
    .await?;
    eventually(
        "a load waiting for a permit",
        Duration::from_secs(30),
        || async { Ok(host.metric("wasmctrl_plugin_loads_waiting") >= 1.0) },
    )
    .await?;

    // A standby, whose policy runs and whose writes wait for a leadership that never comes.
    apply(&parents("Standing"), parent("Standing")).await?;
    apply_policy(
        &client,
        STANDBY,
        "stop-standing",
        json!({
            "parent": {"apiVersion": format!("{GROUP}/v1"), "kind": "Standing", "namespace": ns},
            "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
            "plugin": {"source": file_source("misbehave_plugin")},
            "finalize": true,
        }),
    )
    .await?;
    let standby = HostUnderTest::builder(STANDBY, &ns)
        .standby()
        .drain_timeout(DRAIN)
        .start()
        .await?;
    eventually(
        "the standby running its policy",
        Duration::from_secs(60),
        || async {
            Ok(standby
                .activity
                .still_running()
                .iter()
                .any(|t| t.contains("stop-standing") && t.ends_with(": running")))
        },
    )
    .await?;

    let held = host.activity.still_running();
    let started = Instant::now();
    let (stopped, standby_stopped) = tokio::join!(host.stop(), standby.stop());
    let took = started.elapsed();
    eprintln!("stop: both hosts returned {took:?} after the stop signal (drain {DRAIN:?})");
    assert!(
        took <= DRAIN + RETURN_SLACK,
        "the hosts took {took:?} to stop; held: {held:?}"
    );
    // The standby had nothing in flight: it stops cleanly.
    standby_stopped?;
    // The looping call outlasts the drain: abandoned, and named.
    let abandoned = format!("{:#}", stopped.expect_err("the slow call is abandoned"));
    assert!(
        abandoned.contains("policy \"stop-calling\": finishing its reconciles in flight"),
        "{abandoned}"
    );
    for stopped_at_once in ["stop-fetching", "stop-compiling", "stop-waiting"] {
        assert!(
            !abandoned.contains(stopped_at_once),
            "{stopped_at_once} should have stopped at once: {abandoned}"
        );
    }

    let policy_api = policies(&client);
    for name in [
        "stop-calling",
        "stop-fetching",
        "stop-compiling",
        "stop-waiting",
        "stop-standing",
    ] {
        policy_api.delete(name, &Default::default()).await?;
    }
    delete_namespace(&client, &ns).await
}
