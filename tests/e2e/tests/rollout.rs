//! Rollouts that run themselves (`spec.plugin.rollout`), against the real control plane: a
//! candidate that decides as the active plugin walks shadow → 10% → 50% → all with no edit,
//! and one that fails for a quarter of its canary parents is rolled back by the host, with
//! every parent back on the active plugin and nothing pruned. The gates a candidate cannot
//! game: the prune guard counts a whole rollout as one change, a candidate that would prune
//! past it is rolled back in shadow, and readiness is judged from the children's status.

use std::time::Duration;

use serde_json::{Value, json};
use wasmctrl::plugin::Digest;
use wasmctrl_e2e::*;

/// Parents per test.
const PARENTS: usize = 200;

/// How long a whole rollout may take: four stages, each re-reconciling every parent.
const ROLLOUT: Duration = Duration::from_secs(180);

/// The misbehave plugin with a custom section appended: it behaves exactly the same, but is
/// another component with a digest of its own, as a rebuilt plugin that changed nothing is.
fn rebuilt_misbehave(dir: &std::path::Path) -> anyhow::Result<(Value, String)> {
    let mut bytes = std::fs::read(wasmctrl_testenv::plugins::guest("misbehave_plugin"))?;
    let name = b"wasmctrl-e2e-rebuild";
    let mut section = vec![u8::try_from(name.len())?];
    section.extend_from_slice(name);
    section.extend_from_slice(b"rollout");
    bytes.push(0); // a custom section
    bytes.push(u8::try_from(section.len())?);
    bytes.extend(section);
    let path = dir.join("misbehave-rebuilt.wasm");
    std::fs::write(&path, &bytes)?;
    Ok((
        json!({"file": {"path": path.to_string_lossy()}}),
        Digest::of(&bytes).to_string(),
    ))
}

/// A test's namespace and admin client, the kinds installed, and a rebuilt misbehave plugin
/// to be the candidate: its directory (for the host's `--plugin-dir`), source and digest.
async fn prepare(
    test: &str,
) -> anyhow::Result<(kube::Client, String, tempfile::TempDir, Value, String)> {
    let (client, ns) = test_namespace(test).await?;
    install_repo_crds(&client).await?;
    install_crd(&client, &test_crd(TEST_GROUP, "Widget")).await?;
    let dir = tempfile::tempdir()?;
    let (rebuilt, digest) = rebuilt_misbehave(dir.path())?;
    Ok((client, ns, dir, rebuilt, digest))
}

fn policy_spec(candidate: Option<Value>, rollout: Option<Value>) -> Value {
    let mut spec = json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "maxConcurrentReconciles": 8,
        "plugin": {"source": file_source("misbehave_plugin"), "config": {"ownChild": true}},
    });
    if let Some(candidate) = candidate {
        spec["plugin"]["candidate"] = candidate;
    }
    if let Some(rollout) = rollout {
        spec["plugin"]["rollout"] = rollout;
    }
    spec
}

/// `PARENTS` Widgets, every fourth marked to fail under a plugin told to fail marked parents;
/// waits until the policy has reconciled them all.
async fn widgets_reconciled(
    client: &kube::Client,
    ns: &str,
    test: &str,
) -> anyhow::Result<kube::Api<kube::core::DynamicObject>> {
    let widgets = widgets(client, ns);
    for i in 0..PARENTS {
        let mut widget = widget(&format!("w-{i:03}"), Some(i as u64));
        widget["spec"]["fail"] = json!(i % 4 == 0);
        apply(&widgets, widget).await?;
    }
    wait_for_object_within(
        &policies(client),
        test,
        "every Widget reconciled",
        Duration::from_secs(90),
        |p| p["status"]["parentsReconciled"] == PARENTS as u64,
    )
    .await?;
    Ok(widgets)
}

/// The host's count of children it `operation` (applied, pruned) for the policy `test`.
fn child_operations(host: &HostUnderTest, test: &str, operation: &str) -> f64 {
    let controller = format!("controller=\"{test}\"");
    let operation = format!("operation=\"{operation}\"");
    host.metric_sum(
        "wasmctrl_child_operations_total",
        &[&controller, &operation],
    )
}

fn rollout_of(p: &Value) -> &Value {
    &p["status"]["rollout"]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_that_decides_the_same_walks_every_stage_by_itself() -> anyhow::Result<()> {
    const TEST: &str = "rollout-walk";
    let (client, ns, dir, rebuilt, digest) = prepare(TEST).await?;
    apply_policy(&client, TEST, TEST, policy_spec(None, None)).await?;
    let host = HostUnderTest::builder(TEST, &ns)
        .plugin_dir(dir.path())
        .start()
        .await?;
    let _widgets = widgets_reconciled(&client, &ns, TEST).await?;

    let stages = json!({"stages": [
        {"percent": 0},
        {"percent": 10, "soakSeconds": 2},
        {"percent": 50, "soakSeconds": 2},
        {"percent": 100},
    ]});
    let candidate = json!({"source": rebuilt, "digest": digest, "config": {"ownChild": true}});
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_spec(Some(candidate), Some(stages)),
    )
    .await?;
    let policy_api = policies(&client);
    let done = wait_for_object_within(&policy_api, TEST, "the rollout complete", ROLLOUT, |p| {
        rollout_of(p)["phase"] == "Complete"
            && p["status"]["parentsOnActiveDigest"] == PARENTS as u64
    })
    .await?;
    let rollout = rollout_of(&done);
    assert_eq!(rollout["digest"], digest.as_str());
    assert_eq!(rollout["percent"], 100);
    assert_eq!(done["status"]["activeDigest"], digest.as_str());
    let steps: Vec<(String, String)> = rollout["history"]
        .as_array()
        .expect("a history")
        .iter()
        .rev()
        .map(|t| {
            (
                t["result"].as_str().unwrap_or_default().to_owned(),
                t["stage"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let expected = [
        ("Started", "shadow"),
        ("Advanced", "canary 10%"),
        ("Advanced", "canary 50%"),
        ("Advanced", "all"),
        ("Completed", "all"),
    ]
    .map(|(r, s)| (r.to_owned(), s.to_owned()));
    assert_eq!(steps, expected, "{rollout}");
    // The candidate compared every parent in shadow first and found nothing to change.
    assert!(
        rollout["history"][3]["reason"].as_str().is_some_and(
            |r| r.contains("compared 200 of 200 shadowed, 0 would fail, 0 would change")
        ),
        "{rollout}"
    );

    let reasons = event_reasons(&client, "default", TEST).await?;
    for reason in ["RolloutStarted", "RolloutAdvanced", "RolloutCompleted"] {
        assert!(
            reasons.iter().any(|(_, r)| r == reason),
            "an Event {reason} on the policy: {reasons:?}"
        );
    }
    let metrics = host.metrics.encode();
    assert!(
        metrics.contains(&format!(
            "wasmctrl_rollout_stage{{controller=\"{TEST}\"}} 100"
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "wasmctrl_rollout_transitions_total{{controller=\"{TEST}\",result=\"completed\"}} 1"
        )),
        "{metrics}"
    );

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_failing_a_quarter_of_its_canary_parents_is_rolled_back_by_the_host()
-> anyhow::Result<()> {
    const TEST: &str = "rollout-back";
    let (client, ns, dir, rebuilt, digest) = prepare(TEST).await?;
    apply_policy(&client, TEST, TEST, policy_spec(None, None)).await?;
    let host = HostUnderTest::builder(TEST, &ns)
        .plugin_dir(dir.path())
        .start()
        .await?;
    let widgets = widgets_reconciled(&client, &ns, TEST).await?;
    let applied_before = child_operations(&host, TEST, "applied");

    // The candidate fails every marked parent. Its shadow failures are let through here, so
    // the canary's own failure rate is the gate that decides.
    let stages = json!({"stages": [
        {"percent": 10, "maxWouldFail": 1.0},
        {"percent": 100, "maxWouldFail": 1.0},
    ]});
    let candidate = json!({
        "source": rebuilt, "digest": digest,
        "config": {"ownChild": true, "failMarked": true},
    });
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_spec(Some(candidate), Some(stages)),
    )
    .await?;
    let policy_api = policies(&client);
    let rolled_back =
        wait_for_object_within(&policy_api, TEST, "the rollout rolled back", ROLLOUT, |p| {
            rollout_of(p)["phase"] == "RolledBack"
        })
        .await?;
    let rollout = rollout_of(&rolled_back);
    assert_eq!(rollout["stageName"], "canary 10%", "{rollout}");
    let message = rollout["message"].as_str().unwrap_or_default();
    assert!(message.contains("maxFailureRate"), "{message}");
    let examples = rollout["examples"].as_array().expect("examples");
    assert!(!examples.is_empty(), "{rollout}");
    for example in examples {
        let name = example.as_str().unwrap_or_default();
        let index: usize = name
            .strip_prefix(&format!("{ns}/w-"))
            .and_then(|i| i.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("an example not of this test: {name} in {rollout}"))?;
        assert_eq!(index % 4, 0, "only marked parents fail: {name}");
    }
    assert_eq!(rollout["history"][0]["result"], "RolledBack");

    // Every parent back on the active plugin, reconciled, its child kept.
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    for i in 0..PARENTS {
        let name = format!("w-{i:03}");
        wait_for_object(&widgets, &name, "the Widget reconciled again", |w| {
            condition(w, "Reconciled").is_some_and(|c| c["status"] == "True")
        })
        .await?;
        assert!(
            get(&config_maps, &format!("{name}-own")).await?.is_some(),
            "{name}'s child kept"
        );
    }
    wait_for_object(
        &policy_api,
        TEST,
        "every parent on the active plugin",
        |p| {
            p["status"]["parentsOnActiveDigest"] == PARENTS as u64
                && p["status"]["parentsFailing"] == 0
                && p["status"]["activeDigest"] != digest.as_str()
        },
    )
    .await?;
    // Neither the canary nor the rollback wrote a child: the parents the candidate decided
    // for got the children they had, the others were never touched.
    assert_eq!(child_operations(&host, TEST, "applied"), applied_before);
    assert_eq!(child_operations(&host, TEST, "pruned"), 0.0);
    let reasons = event_reasons(&client, "default", TEST).await?;
    assert!(
        reasons
            .iter()
            .any(|(t, r)| r == "RolledBack" && t == "Warning"),
        "{reasons:?}"
    );
    let metrics = host.metrics.encode();
    assert!(
        metrics.contains(&format!(
            "wasmctrl_rollout_stage{{controller=\"{TEST}\"}} -1"
        )),
        "{metrics}"
    );

    // The retry annotation starts the rolled-back candidate over, once per value: it walks
    // into the canary again, fails the same gate, and is rolled back a second time.
    let retry =
        |value: &str| json!({"metadata": {"annotations": {"wasmctrl.dev/retry-rollout": value}}});
    policy_api
        .patch(
            TEST,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(retry("1")),
        )
        .await?;
    let retried = wait_for_object_within(&policy_api, TEST, "the rollout retried", ROLLOUT, |p| {
        let rollout = rollout_of(p);
        rollout["retriedFor"] == "1" && rollout["phase"] != "RolledBack"
    })
    .await?;
    assert_eq!(rollout_of(&retried)["history"][0]["result"], "Started");
    let again = wait_for_object_within(&policy_api, TEST, "rolled back again", ROLLOUT, |p| {
        rollout_of(p)["phase"] == "RolledBack"
    })
    .await?;
    let results: Vec<&str> = rollout_of(&again)["history"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["result"].as_str())
        .collect();
    assert_eq!(
        results.iter().filter(|r| **r == "RolledBack").count(),
        2,
        "the history keeps both: {results:?}"
    );
    // The same value again starts nothing.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    let still = policy_api.get(TEST).await?;
    let still = serde_json::to_value(&still)?;
    assert_eq!(
        rollout_of(&still)["phase"],
        "RolledBack",
        "one retry per value"
    );
    assert!(
        event_reasons(&client, "default", TEST)
            .await?
            .iter()
            .any(|(_, r)| r == "RolloutRetried")
    );

    operated_with_commands(&client, &policy_api, TEST, &digest).await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}

/// `wasmctrl rollout …` / `wasmctrl prune …` as typed, through `client`: what it printed.
async fn rollout_cmd(client: &kube::Client, args: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["wasmctrl"];
    all.extend_from_slice(args);
    match <wasmctrl::cli::Cli as clap::Parser>::try_parse_from(all)?.command {
        wasmctrl::cli::Command::Rollout(command) => command.report_with(client).await,
        _ => anyhow::bail!("not a rollout command: {args:?}"),
    }
}

/// The rollout commands on policy `name`, whose rollout rolled the candidate `digest` back:
/// each makes exactly its documented change, and `status -o json` shows what the host wrote.
async fn operated_with_commands(
    client: &kube::Client,
    policy_api: &kube::Api<kube::core::DynamicObject>,
    name: &str,
    digest: &str,
) -> anyhow::Result<()> {
    let read = || async move { anyhow::Ok(serde_json::to_value(policy_api.get(name).await?)?) };
    let shown: Value = serde_json::from_str(
        &rollout_cmd(client, &["rollout", "status", name, "-o", "json"]).await?,
    )?;
    let policy = read().await?;
    assert_eq!(shown["rollout"]["phase"], "RolledBack", "{shown}");
    assert_eq!(
        shown["rollout"], policy["status"]["rollout"],
        "the status as written"
    );
    assert_eq!(shown["candidate"], policy["status"]["candidate"]);
    let yaml: Value = serde_yaml_ng::from_str(
        &rollout_cmd(client, &["rollout", "status", name, "-o", "yaml"]).await?,
    )?;
    assert_eq!(yaml["rollout"], shown["rollout"]);

    // A rolled-back candidate is promoted only by force; nothing changed by the refusal.
    let refused = rollout_cmd(client, &["rollout", "promote", name]).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| format!("{e:#}").contains("--force")),
        "{refused:?}"
    );
    assert_eq!(read().await?["spec"], policy["spec"]);

    // retry: a retry annotation no earlier retry used, and the host starts over.
    let said = rollout_cmd(client, &["rollout", "retry", name]).await?;
    assert!(said.contains("starts over"), "{said}");
    let retried = read().await?;
    let value = retried["metadata"]["annotations"]["wasmctrl.dev/retry-rollout"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(!value.is_empty() && value != "1", "a new value: {value:?}");
    assert_eq!(retried["spec"], policy["spec"], "retry changes no spec");
    wait_for_object_within(policy_api, name, "retried by the command", ROLLOUT, |p| {
        rollout_of(p)["retriedFor"] == value.as_str() && rollout_of(p)["phase"] != "RolledBack"
    })
    .await?;

    // pause and resume: spec.plugin.rollout.paused, and nothing else.
    rollout_cmd(client, &["rollout", "pause", name]).await?;
    let paused = read().await?;
    assert_eq!(paused["spec"]["plugin"]["rollout"]["paused"], true);
    let mut unpaused = paused["spec"].clone();
    unpaused["plugin"]["rollout"]
        .as_object_mut()
        .map(|r| r.remove("paused"));
    let mut before = policy["spec"].clone();
    before["plugin"]["rollout"]
        .as_object_mut()
        .map(|r| r.remove("paused"));
    assert_eq!(unpaused, before, "pause sets one field");
    let said = rollout_cmd(client, &["rollout", "pause", name]).await?;
    assert!(said.contains("nothing to change"), "{said}");
    rollout_cmd(client, &["rollout", "resume", name]).await?;
    assert_eq!(read().await?["spec"]["plugin"]["rollout"]["paused"], false);

    // abort: the candidate and its rollout go; the active plugin stays.
    rollout_cmd(client, &["rollout", "abort", name]).await?;
    let aborted = read().await?;
    assert!(
        aborted["spec"]["plugin"]["candidate"].is_null(),
        "{aborted}"
    );
    assert!(aborted["spec"]["plugin"]["rollout"].is_null(), "{aborted}");
    assert_eq!(
        aborted["spec"]["plugin"]["source"],
        policy["spec"]["plugin"]["source"]
    );

    // promote: the candidate (here with no rollout) becomes the active plugin. The rollout
    // rolled this very build back, so only by force.
    let mut with_candidate = aborted["spec"].clone();
    with_candidate["plugin"]["candidate"] = policy["spec"]["plugin"]["candidate"].clone();
    policy_api
        .patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": with_candidate})),
        )
        .await?;
    let said = rollout_cmd(client, &["rollout", "promote", name, "--force"]).await?;
    assert!(said.contains(digest), "{said}");
    let promoted = read().await?;
    let candidate = &policy["spec"]["plugin"]["candidate"];
    assert_eq!(promoted["spec"]["plugin"]["source"], candidate["source"]);
    assert_eq!(promoted["spec"]["plugin"]["digest"], digest);
    assert_eq!(promoted["spec"]["plugin"]["config"], candidate["config"]);
    assert!(promoted["spec"]["plugin"]["candidate"].is_null());
    wait_for_object_within(policy_api, name, "the candidate active", ROLLOUT, |p| {
        p["status"]["activeDigest"] == digest
    })
    .await?;
    let shown: Value = serde_json::from_str(
        &rollout_cmd(client, &["rollout", "status", name, "-o", "json"]).await?,
    )?;
    assert!(shown["candidate"].is_null(), "{shown}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_that_fails_recorded_cases_is_rolled_back_before_it_serves_any_parent()
-> anyhow::Result<()> {
    const TEST: &str = "rollout-replay";
    let (client, ns, dir, rebuilt, digest) = prepare(TEST).await?;
    apply_policy(&client, TEST, TEST, policy_spec(None, None)).await?;
    // Every reconcile of the active plugin is recorded as a case.
    let explain = wasmctrl::explain::Explain::new(&wasmctrl::explain::ExplainOptions {
        record: Some(wasmctrl::explain::RecordOptions {
            dir: dir.path().join("cases"),
            max_files: 1000,
            one_in: 1,
        }),
        ..Default::default()
    })?;
    let host = HostUnderTest::builder(TEST, &ns)
        .plugin_dir(dir.path())
        .explained(std::sync::Arc::new(explain))
        .start()
        .await?;
    widgets_reconciled(&client, &ns, TEST).await?;
    let applied_before = child_operations(&host, TEST, "applied");

    let rollout = json!({
        "stages": [{"percent": 50, "maxWouldFail": 1.0}, {"percent": 100, "maxWouldFail": 1.0}],
        "replay": {"recorded": true},
    });
    let candidate = |fail: bool| {
        json!({
            "source": rebuilt, "digest": digest,
            "config": {"ownChild": true, "failMarked": fail},
        })
    };
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_spec(Some(candidate(true)), Some(rollout.clone())),
    )
    .await?;
    let policy_api = policies(&client);
    let rolled_back =
        wait_for_object_within(&policy_api, TEST, "rolled back by replay", ROLLOUT, |p| {
            rollout_of(p)["phase"] == "RolledBack"
        })
        .await?;
    let state = rollout_of(&rolled_back);
    assert!(
        state["history"][0]["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("replay:")),
        "{state}"
    );
    assert!(state["replay"]["wouldFail"].as_u64() > Some(0), "{state}");
    assert!(
        state["replay"]["cases"].as_u64() >= Some(PARENTS as u64),
        "{state}"
    );
    assert!(
        !state["examples"].as_array().is_none_or(Vec::is_empty),
        "{state}"
    );
    assert_eq!(
        rolled_back["status"]["candidate"]["canaryParents"], 0,
        "the candidate served no parent"
    );
    assert_eq!(child_operations(&host, TEST, "applied"), applied_before);

    // The same digest, told not to fail, retried: the cases replay unchanged and it walks on.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_spec(Some(candidate(false)), Some(rollout)),
    )
    .await?;
    policy_api
        .patch(
            TEST,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"metadata": {"annotations": {"wasmctrl.dev/retry-rollout": "after-fix"}}}),
            ),
        )
        .await?;
    let done = wait_for_object_within(
        &policy_api,
        TEST,
        "the fixed candidate rolled out",
        ROLLOUT,
        |p| rollout_of(p)["phase"] == "Complete",
    )
    .await?;
    let state = rollout_of(&done);
    assert_eq!(state["replay"]["wouldFail"], 0, "{state}");
    assert!(
        state["history"]
            .as_array()
            .is_some_and(|h| h.iter().any(|t| t["result"] == "Replayed")),
        "{state}"
    );

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}

/// `count` Widgets, each with its own child; waits until the policy reconciled them all and
/// the prune guard's first window closed.
async fn few_widgets_reconciled(
    client: &kube::Client,
    ns: &str,
    test: &str,
    count: usize,
) -> anyhow::Result<kube::Api<kube::core::DynamicObject>> {
    let widgets = widgets(client, ns);
    for i in 0..count {
        apply(&widgets, widget(&format!("w-{i:03}"), Some(i as u64))).await?;
    }
    wait_for_object_within(
        &policies(client),
        test,
        "every Widget reconciled and the start's window closed",
        Duration::from_secs(90),
        |p| {
            p["status"]["parentsReconciled"] == count as u64
                && p["status"]["pruneGuard"].is_null()
                && p["status"]["observedGeneration"] == p["metadata"]["generation"]
        },
    )
    .await?;
    Ok(widgets)
}

/// The `-own` ConfigMaps left in `ns`.
async fn own_children(client: &kube::Client, ns: &str) -> anyhow::Result<usize> {
    let list = api(client, &resource("", "v1", "ConfigMap"), ns)
        .list(&Default::default())
        .await?;
    Ok(list
        .items
        .iter()
        .filter(|c| {
            c.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.ends_with("-own"))
        })
        .count())
}

/// A candidate that answers no children, walked through eight stages with no soak and its
/// shadow gates opened wide, deletes no more than one change may: the prune guard counts the
/// whole rollout as one change, so every stage does not bring a budget of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_that_empties_every_answer_is_held_by_the_prune_guard_through_every_stage()
-> anyhow::Result<()> {
    const TEST: &str = "rollout-empties";
    const COUNT: usize = 30;
    let (client, ns, dir, rebuilt, digest) = prepare(TEST).await?;
    apply_policy(&client, TEST, TEST, policy_spec(None, None)).await?;
    let host = HostUnderTest::builder(TEST, &ns)
        .plugin_dir(dir.path())
        .start()
        .await?;
    few_widgets_reconciled(&client, &ns, TEST, COUNT).await?;
    assert_eq!(own_children(&client, &ns).await?, COUNT);

    let open = json!({"maxWouldPrune": 1.0, "maxWouldChange": 1.0});
    let stages: Vec<Value> = [12, 25, 37, 50, 62, 75, 87, 100]
        .into_iter()
        .map(|percent| {
            let mut stage = open.clone();
            stage["percent"] = json!(percent);
            stage
        })
        .collect();
    let candidate = json!({"source": rebuilt, "digest": digest, "config": {}});
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_spec(Some(candidate), Some(json!({"stages": stages}))),
    )
    .await?;
    let policy_api = policies(&client);
    let held = wait_for_object_within(
        &policy_api,
        TEST,
        "the rollout complete, its prunes held",
        ROLLOUT,
        |p| {
            rollout_of(p)["phase"] == "Complete"
                && condition(p, "Ready").is_some_and(|c| c["reason"] == "PruneHeld")
        },
    )
    .await?;
    // Every parent comes round under the last stage: then every child is deleted or held.
    let settled = wait_for_object_within(
        &policy_api,
        TEST,
        "every deletion held or made",
        ROLLOUT,
        |p| {
            let window = &p["status"]["pruneGuard"];
            window["heldDeletions"].as_u64().unwrap_or(0) + window["deleted"].as_u64().unwrap_or(0)
                == COUNT as u64
        },
    )
    .await?;
    let window = &settled["status"]["pruneGuard"];
    let kept = own_children(&client, &ns).await?;
    // max(floor 5, 20% of 30) for the whole change.
    assert!(
        kept >= COUNT - 6,
        "only {kept} of {COUNT} children kept: {held}"
    );
    assert_eq!(window["state"], "Held", "{window}");
    assert_eq!(window["heldDeletions"], kept as u64, "{window}");

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}

/// By default a candidate whose shadow answers would prune more than the prune guard lets a
/// change is rolled back before it serves a parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_that_would_prune_past_the_guards_share_is_rolled_back_in_shadow()
-> anyhow::Result<()> {
    const TEST: &str = "rollout-would-prune";
    const COUNT: usize = 30;
    let (client, ns, dir, rebuilt, digest) = prepare(TEST).await?;
    apply_policy(&client, TEST, TEST, policy_spec(None, None)).await?;
    let host = HostUnderTest::builder(TEST, &ns)
        .plugin_dir(dir.path())
        .start()
        .await?;
    few_widgets_reconciled(&client, &ns, TEST, COUNT).await?;

    let stages = json!({"stages": [{"percent": 0, "maxWouldChange": 1.0}, {"percent": 100}]});
    let candidate = json!({"source": rebuilt, "digest": digest, "config": {}});
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_spec(Some(candidate), Some(stages)),
    )
    .await?;
    let policy_api = policies(&client);
    let rolled_back =
        wait_for_object_within(&policy_api, TEST, "the rollout rolled back", ROLLOUT, |p| {
            rollout_of(p)["phase"] == "RolledBack"
        })
        .await?;
    let rollout = rollout_of(&rolled_back);
    assert_eq!(rollout["stageName"], "shadow", "{rollout}");
    let message = rollout["message"].as_str().unwrap_or_default();
    assert!(message.contains("maxWouldPrune"), "{message}");
    assert_eq!(own_children(&client, &ns).await?, COUNT);

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}

/// A candidate that writes `Ready=True` on its parents while the Deployments it changed never
/// become available (their new pods fit no node) is rolled back at its stage's deadline: the
/// host judges readiness from the children's own status, which the plugin cannot write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_claiming_ready_while_its_deployments_never_become_available_is_rolled_back()
-> anyhow::Result<()> {
    const TEST: &str = "rollout-not-ready";
    const COUNT: usize = 10;
    let (client, ns, dir, rebuilt, digest) = prepare(TEST).await?;
    let with_deployments = |candidate: Option<Value>, rollout: Option<Value>| {
        let mut spec = policy_spec(candidate, rollout);
        spec["children"] = json!([{"apiVersion": "apps/v1", "kind": "Deployment"}]);
        spec["plugin"]["config"] = json!({"deployment": "registry.invalid/app:v1"});
        spec
    };
    apply_policy(&client, TEST, TEST, with_deployments(None, None)).await?;
    let host = HostUnderTest::builder(TEST, &ns)
        .plugin_dir(dir.path())
        .start()
        .await?;
    let widgets = widgets(&client, &ns);
    for i in 0..COUNT {
        apply(&widgets, widget(&format!("w-{i:03}"), Some(i as u64))).await?;
    }
    // The simulated node runs the active plugin's pods: its Deployments become available.
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    for i in 0..COUNT {
        let name = format!("w-{i:03}-app");
        wait_for_object_within(
            &deployments,
            &name,
            "the Deployment available",
            Duration::from_secs(90),
            |d| {
                d["status"]["availableReplicas"] == 1
                    && d["status"]["observedGeneration"] == d["metadata"]["generation"]
            },
        )
        .await?;
    }
    let policy_api = policies(&client);
    wait_for_object_within(
        &policy_api,
        TEST,
        "every Widget reconciled",
        Duration::from_secs(90),
        |p| p["status"]["parentsReconciled"] == COUNT as u64,
    )
    .await?;

    let stages = json!({"stages": [
        {"percent": 50, "maxWouldChange": 1.0, "progressDeadlineSeconds": 20},
        {"percent": 100},
    ]});
    let candidate = json!({"source": rebuilt, "digest": digest,
        "config": {"deployment": "registry.invalid/app:v2", "unschedulable": true, "claimReady": true}});
    apply_policy(
        &client,
        TEST,
        TEST,
        with_deployments(Some(candidate), Some(stages)),
    )
    .await?;
    let waiting = wait_for_object_within(
        &policy_api,
        TEST,
        "the canary waiting to be ready",
        ROLLOUT,
        |p| {
            rollout_of(p)["message"]
                .as_str()
                .is_some_and(|m| m.contains("to be ready"))
        },
    )
    .await?;
    let message = rollout_of(&waiting)["message"].as_str().unwrap_or_default();
    assert!(message.contains("Deployment"), "{message}");
    // A parent the candidate served claims Ready, and the stage waits all the same.
    let claimed = widgets
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter_map(|w| serde_json::to_value(w).ok())
        .any(|w| condition(&w, "Ready").is_some_and(|c| c["status"] == "True"));
    assert!(
        claimed,
        "the candidate wrote Ready=True on a parent it served"
    );
    let rolled_back =
        wait_for_object_within(&policy_api, TEST, "the rollout rolled back", ROLLOUT, |p| {
            rollout_of(p)["phase"] == "RolledBack"
        })
        .await?;
    let rollout = rollout_of(&rolled_back);
    let message = rollout["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("maxNotReady") && message.contains("after the stage began"),
        "{message}"
    );

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}

/// Shards of the sharded tests' hosts.
const SHARDS: u32 = 6;

/// The test's policy, served by three hosts a, b and c sharing `SHARDS` shards, and its
/// Widgets once every one is reconciled.
async fn sharded_hosts_reconciled(
    client: &kube::Client,
    test: &str,
    ns: &str,
    plugin_dir: &std::path::Path,
) -> anyhow::Result<(Vec<ShardedHost>, kube::Api<kube::core::DynamicObject>)> {
    apply_policy(client, test, test, policy_spec(None, None)).await?;
    let hosts =
        ShardedHost::start_each(client, test, ns, Some(plugin_dir), &["a", "b", "c"], SHARDS)
            .await?;
    let widgets = widgets_reconciled(client, ns, test).await?;
    Ok((hosts, widgets))
}

/// A sharded host's `wasmctrl_rollout_stage` for the policy `test`.
fn rollout_stage(host: &ShardedHost, test: &str) -> f64 {
    host.host.metric_sum(
        "wasmctrl_rollout_stage",
        &[&format!("controller=\"{test}\"")],
    )
}

/// Three hosts sharing the parents in shards: one rollout decision for all of them, made
/// by the holder of shard 0 over every shard's figures. A candidate that fails marked
/// parents is rolled back on every host (whichever host's shard those parents are in), and
/// started over with a candidate that decides as the active plugin, it walks every stage
/// with one history and serves every parent on every host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_over_sharded_hosts_is_decided_once_and_followed_by_every_host()
-> anyhow::Result<()> {
    const TEST: &str = "rollout-shards";
    let (client, ns, dir, rebuilt, digest) = prepare(TEST).await?;
    // Counted over the three hosts' shards.
    let (hosts, widgets) = sharded_hosts_reconciled(&client, TEST, &ns, dir.path()).await?;

    let failing = json!({"stages": [
        {"percent": 10, "maxWouldFail": 1.0},
        {"percent": 100, "maxWouldFail": 1.0},
    ]});
    let candidate = |config: Value| json!({"source": rebuilt, "digest": digest, "config": config});
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_spec(
            Some(candidate(json!({"ownChild": true, "failMarked": true}))),
            Some(failing),
        ),
    )
    .await?;
    let policy_api = policies(&client);
    let rolled_back =
        wait_for_object_within(&policy_api, TEST, "the rollout rolled back", ROLLOUT, |p| {
            rollout_of(p)["phase"] == "RolledBack"
        })
        .await?;
    let rollout = rollout_of(&rolled_back);
    assert_eq!(rollout["stageName"], "canary 10%", "{rollout}");
    let results: Vec<&str> = rollout["history"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["result"].as_str())
        .collect();
    assert_eq!(
        results,
        ["RolledBack", "Started"],
        "one decision: {rollout}"
    );
    for example in rollout["examples"].as_array().into_iter().flatten() {
        let name = example.as_str().unwrap_or_default();
        let index: usize = name
            .strip_prefix(&format!("{ns}/w-"))
            .and_then(|i| i.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("an example not of this test: {name}"))?;
        assert_eq!(index % 4, 0, "only marked parents fail: {name}");
    }
    wasmctrl_testenv::cluster::eventually(
        "every host stopped the candidate",
        Duration::from_secs(20),
        || async { Ok(hosts.iter().all(|h| rollout_stage(h, TEST) == -1.0)) },
    )
    .await?;
    for i in 0..PARENTS {
        wait_for_object(&widgets, &format!("w-{i:03}"), "reconciled again", |w| {
            condition(w, "Reconciled").is_some_and(|c| c["status"] == "True")
        })
        .await?;
    }

    // Started over with a candidate that fails nothing: every stage, one history.
    let walking = json!({"stages": [
        {"percent": 0},
        {"percent": 10, "soakSeconds": 2},
        {"percent": 100},
    ]});
    apply_policy(
        &client,
        TEST,
        TEST,
        policy_spec(Some(candidate(json!({"ownChild": true}))), Some(walking)),
    )
    .await?;
    policy_api
        .patch(
            TEST,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"metadata": {"annotations": {"wasmctrl.dev/retry-rollout": "1"}}}),
            ),
        )
        .await?;
    let done = wait_for_object_within(&policy_api, TEST, "the rollout complete", ROLLOUT, |p| {
        rollout_of(p)["phase"] == "Complete"
            && p["status"]["parentsOnActiveDigest"] == PARENTS as u64
    })
    .await?;
    let results: Vec<&str> = rollout_of(&done)["history"]
        .as_array()
        .into_iter()
        .flatten()
        .rev()
        .filter_map(|t| t["result"].as_str())
        .collect();
    assert_eq!(
        results,
        [
            "Started",
            "RolledBack",
            "Started",
            "Advanced",
            "Advanced",
            "Completed"
        ],
        "{done}"
    );
    assert_eq!(done["status"]["shards"].as_array().map(Vec::len), Some(6));
    wasmctrl_testenv::cluster::eventually(
        "every host serving the candidate to every parent",
        Duration::from_secs(20),
        || async { Ok(hosts.iter().all(|h| rollout_stage(h, TEST) == 100.0)) },
    )
    .await?;

    ShardedHost::stop_each(hosts).await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}

/// The children of `ns`'s Widgets that are still there.
async fn children_left(client: &kube::Client, ns: &str) -> anyhow::Result<usize> {
    let config_maps = api(client, &resource("", "v1", "ConfigMap"), ns);
    let listed = config_maps
        .list(&kube::api::ListParams::default().labels("app.kubernetes.io/managed-by=wasmctrl"))
        .await?;
    Ok(listed.items.len())
}

/// Three hosts sharing the parents in shards, each guarding its own parents' deletions: a
/// swap to a plugin that answers no children is held on each of them past its share, the
/// policy's status shows one held window over all of them, and its token, set once,
/// confirms every host's hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_held_on_several_sharded_hosts_is_confirmed_once_for_all() -> anyhow::Result<()> {
    const TEST: &str = "prune-shards";
    let (client, ns, dir, _, _) = prepare(TEST).await?;
    let (hosts, _widgets) = sharded_hosts_reconciled(&client, TEST, &ns, dir.path()).await?;
    wasmctrl_testenv::cluster::eventually("every child made", ROLLOUT, || async {
        Ok(children_left(&client, &ns).await? == PARENTS)
    })
    .await?;

    // The swap: the same plugin, told to answer no children.
    let mut empty = policy_spec(None, None);
    empty["plugin"]["config"] = json!({});
    apply_policy(&client, TEST, TEST, empty).await?;
    let policy_api = policies(&client);
    let accounted = |p: &Value| {
        let guard = &p["status"]["pruneGuard"];
        guard["heldDeletions"].as_u64().unwrap_or(0) + guard["deleted"].as_u64().unwrap_or(0)
    };
    let ready_reason = |p: &Value| condition(p, "Ready").map(|c| c["reason"].clone());
    let held = wait_for_object_within(
        &policy_api,
        TEST,
        "every host's hold in the status",
        ROLLOUT,
        |p| {
            p["status"]["pruneGuard"]["state"] == "Held"
                && accounted(p) == PARENTS as u64
                && ready_reason(p).is_some_and(|reason| reason == "PruneHeld")
        },
    )
    .await?;
    let guard = &held["status"]["pruneGuard"];
    let token = guard["confirm"].as_str().unwrap_or_default().to_owned();
    let holding = token.split(',').count();
    assert!(
        holding >= 2,
        "more than one host holds, each with a token in the list: {guard}"
    );
    let deleted = guard["deleted"].as_u64().unwrap_or(0);
    assert_eq!(
        children_left(&client, &ns).await?,
        PARENTS - deleted as usize,
        "only what each host's share allowed was deleted: {guard}"
    );
    let held_by: f64 = hosts
        .iter()
        .map(|h| {
            h.host
                .metric_sum("wasmctrl_prune_held", &[&format!("controller=\"{TEST}\"")])
        })
        .sum();
    assert_eq!(
        held_by,
        guard["heldDeletions"].as_f64().unwrap_or(-1.0),
        "{guard}"
    );

    // One confirmation, every host's held deletions.
    policy_api
        .patch(
            TEST,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"metadata": {"annotations": {"wasmctrl.dev/confirm-prune": token}}}),
            ),
        )
        .await?;
    wasmctrl_testenv::cluster::eventually("every child pruned", ROLLOUT, || async {
        Ok(children_left(&client, &ns).await? == 0)
    })
    .await?;
    wait_for_object_within(&policy_api, TEST, "no hold left", ROLLOUT, |p| {
        p["status"]["pruneGuard"]["state"] != "Held"
    })
    .await?;

    ShardedHost::stop_each(hosts).await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}
