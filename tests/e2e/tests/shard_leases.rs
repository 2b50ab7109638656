//! The shard Leases against a real API server: replicas (coordinators in this process, each
//! under an identity of its own) share twelve shards fairly, a joining replica gets shards
//! given back a few at a time, the shards of a replica that stopped renewing are taken once
//! their Leases expire, those of one that stopped gracefully within a few retry periods,
//! and those of one that died are taken by its successor under the same identity. Through all of it, no shard is ever held by two replicas at once by the clock
//! each one writes by.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, ResourceExt as _};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use wasmctrl::leader::LeaseConfig;
use wasmctrl::shards::{ShardConfig, ShardCoordinator, ShardOwnership};
use wasmctrl_e2e::*;
use wasmctrl_testenv::cluster::eventually;

const TEST: &str = "shard-leases";
const SHARDS: u32 = 12;
const LEASE_DURATION: Duration = Duration::from_secs(8);

/// One replica's coordinator, running until stopped or aborted.
struct Replica {
    ownership: Arc<ShardOwnership>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<ShardCoordinator>,
}

fn start(client: &kube::Client, ns: &str, identity: &str) -> Replica {
    start_with(client, ns, identity, SHARDS)
}

/// A replica of a set of `count` shards.
fn start_with(client: &kube::Client, ns: &str, identity: &str, count: u32) -> Replica {
    let config = ShardConfig {
        lease: LeaseConfig {
            name: "wasmctrl".into(),
            namespace: ns.to_owned(),
            identity: identity.to_owned(),
            lease_duration: LEASE_DURATION,
            renew_deadline: Duration::from_secs(5),
            retry_period: Duration::from_secs(1),
        },
        count,
    };
    assert!(config.validate().is_ok());
    let ownership = ShardOwnership::new(count);
    let coordinator = ShardCoordinator::new(client.clone(), config, ownership.clone());
    let stop = CancellationToken::new();
    let task = tokio::spawn(coordinator.run(stop.clone()));
    Replica {
        ownership,
        stop,
        task,
    }
}

/// Every replica ever started, sampled every 20 ms: the first few times a shard was held
/// by two of them at once.
#[derive(Default)]
struct Watch {
    overlaps: Vec<String>,
}

/// Every replica started, by name.
type Started = Arc<Mutex<Vec<(String, Arc<ShardOwnership>)>>>;

fn watch_holders(replicas: Started, seen: Arc<Mutex<Watch>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let now: Vec<(String, BTreeSet<u32>)> = replicas
                .lock()
                .expect("not poisoned")
                .iter()
                .map(|(name, ownership)| (name.clone(), ownership.held()))
                .collect();
            {
                let mut seen = seen.lock().expect("not poisoned");
                for shard in 0..SHARDS {
                    let holding: Vec<&String> = now
                        .iter()
                        .filter(|(_, held)| held.contains(&shard))
                        .map(|(name, _)| name)
                        .collect();
                    if holding.len() > 1 && seen.overlaps.len() < 10 {
                        seen.overlaps.push(format!("shard {shard}: {holding:?}"));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

/// How many shards each named replica holds now.
fn counts(replicas: &[(&str, &Replica)]) -> Vec<(String, usize)> {
    replicas
        .iter()
        .map(|(name, replica)| ((*name).to_owned(), replica.ownership.held().len()))
        .collect()
}

async fn wait_for_counts(
    what: &str,
    within: Duration,
    replicas: &[(&str, &Replica)],
    each: usize,
) -> anyhow::Result<()> {
    let result = eventually(what, within, || async {
        Ok(counts(replicas).iter().all(|(_, n)| *n == each))
    })
    .await;
    result.map_err(|error| error.context(format!("held: {:?}", counts(replicas))))
}

/// Each shard's holder now, of `replicas`.
fn holders(replicas: &[(&str, &Replica)]) -> BTreeMap<u32, String> {
    replicas
        .iter()
        .flat_map(|(name, replica)| {
            replica
                .ownership
                .held()
                .into_iter()
                .map(|shard| (shard, (*name).to_owned()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_the_shards_and_hand_them_over_without_overlap() -> anyhow::Result<()> {
    let (client, ns) = test_namespace(TEST).await?;
    let all = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::new(Mutex::new(Watch::default()));
    let watcher = watch_holders(all.clone(), seen.clone());
    let join = |name: &str| {
        let replica = start(&client, &ns, name);
        all.lock()
            .expect("not poisoned")
            .push((name.to_owned(), replica.ownership.clone()));
        replica
    };

    // Three replicas starting together: four shards each.
    let a = join("replica-a");
    let b = join("replica-b");
    let c = join("replica-c");
    wait_for_counts(
        "three replicas holding four shards each",
        Duration::from_secs(60),
        &[("a", &a), ("b", &b), ("c", &c)],
        4,
    )
    .await?;

    // c's process dies and a new one starts under the same identity: the Leases naming
    // "replica-c" are no longer renewed by anyone, so the new process takes them once they
    // expire, as it would another replica's (it does not count them as its own).
    c.task.abort();
    let c = join("replica-c");
    wait_for_counts(
        "c's shards taken again by its successor",
        LEASE_DURATION + Duration::from_secs(10),
        &[("a", &a), ("b", &b), ("c", &c)],
        4,
    )
    .await?;

    // A fourth joins: each of the three gives one back, and only those three shards move.
    let before = holders(&[("a", &a), ("b", &b), ("c", &c)]);
    let d = join("replica-d");
    wait_for_counts(
        "four replicas holding three shards each",
        Duration::from_secs(60),
        &[("a", &a), ("b", &b), ("c", &c), ("d", &d)],
        3,
    )
    .await?;
    let after = holders(&[("a", &a), ("b", &b), ("c", &c), ("d", &d)]);
    let moved = (0..SHARDS)
        .filter(|shard| before.get(shard) != after.get(shard))
        .count();
    assert_eq!(
        moved, 3,
        "shards moved when the fourth joined: {before:?} to {after:?}"
    );

    // d stops renewing without a word (its process killed): its three shards are taken
    // once their Leases expire, not before, and within the lease plus 10 s.
    d.task.abort();
    let killed = Instant::now();
    wait_for_counts(
        "d's shards taken by the three left",
        LEASE_DURATION + Duration::from_secs(10),
        &[("a", &a), ("b", &b), ("c", &c)],
        4,
    )
    .await?;
    let taken_after = killed.elapsed();
    // Taken a lease duration after the others last saw d renew, which was at most a retry
    // period (with its jitter) before it stopped.
    assert!(
        taken_after >= LEASE_DURATION - Duration::from_secs(2),
        "d's shards were taken {taken_after:?} after it stopped, before its renew deadline"
    );

    // c stops gracefully: it gives its shards back, and a and b take them within a few
    // retry periods rather than a lease.
    c.stop.cancel();
    let mut c_coordinator = c.task.await?;
    c_coordinator.release().await?;
    let released = Instant::now();
    wait_for_counts(
        "c's shards taken after it gave them back",
        LEASE_DURATION,
        &[("a", &a), ("b", &b)],
        6,
    )
    .await?;
    let taken_after = released.elapsed();
    assert!(
        taken_after < LEASE_DURATION - Duration::from_secs(2),
        "c's shards were taken {taken_after:?} after it gave them back"
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let names: Vec<String> = leases
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter_map(|lease| lease.metadata.name)
        .collect();
    assert_eq!(
        names.iter().filter(|n| n.contains("-member-")).count(),
        3,
        "c deleted its membership lease; a's, b's and d's remain: {names:?}"
    );
    assert_eq!(names.iter().filter(|n| n.contains("-shard-")).count(), 12);

    watcher.abort();
    let overlaps = std::mem::take(&mut seen.lock().expect("not poisoned").overlaps);
    assert!(
        overlaps.is_empty(),
        "shards held by two replicas at once: {overlaps:?}"
    );
    for replica in [a, b] {
        replica.stop.cancel();
        replica.task.await?.release().await?;
    }
    delete_namespace(&client, &ns).await
}

/// A sharded host reconciles the parents of the shards it holds and no others, takes up
/// the parents of a shard it gains, and writes nothing more for a shard it let go (its
/// ownership set by hand here, as the shard Leases above would set it). Its caches hold
/// the parents and children of the shards it holds, and none of another's: it watches
/// them per shard, as the test control plane narrows watches by shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_host_writes_only_for_the_parents_of_the_shards_it_holds() -> anyhow::Result<()> {
    const TEST: &str = "shard-writes";
    let (client, ns) = widget_test(TEST, serde_json::json!({"ownChild": true})).await?;
    let far = tokio::time::Instant::now() + Duration::from_secs(3600);
    let ownership = ShardOwnership::new(2);
    ownership.hold_until(0, far);
    let explain = std::sync::Arc::new(wasmctrl::explain::Explain::in_memory(
        wasmctrl::explain::Bounds {
            max_bytes: 8 << 20,
            per_parent: 10,
        },
    ));
    let host = HostUnderTest::builder(TEST, &ns)
        .sharded(ownership.clone())
        .explained(explain.clone())
        .start()
        .await?;
    let widgets = widgets(&client, &ns);
    // Widgets until each shard has at least two.
    let mut by_shard: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for i in 0.. {
        if by_shard.values().filter(|names| names.len() >= 2).count() == 2 {
            break;
        }
        let name = format!("w{i}");
        let created = apply(&widgets, widget(&name, Some(1))).await?;
        let uid = created.metadata.uid.unwrap_or_default();
        by_shard
            .entry(ownership.shard_of(&uid))
            .or_default()
            .push(name);
    }
    let reconciled_at = |w: &serde_json::Value| {
        condition(w, "Reconciled")
            .filter(|c| c["status"] == "True")
            .and_then(|_| w["status"]["observedGeneration"].as_i64())
    };
    for name in &by_shard[&0] {
        wait_for_object(
            &widgets,
            name,
            "a parent of the shard held reconciled",
            |w| reconciled_at(w).is_some(),
        )
        .await?;
    }
    // Each reconciled Widget has its one ConfigMap.
    let shard = |shard: u32| by_shard[&shard].len();
    caches_hold(&host, "shard 0's objects only", shard(0), shard(0)).await?;
    let config_maps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(client.clone(), &ns);
    // Whatever the host would have done for shard 1's parents, it has had time for.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for name in &by_shard[&1] {
        let widget = get(&widgets, name).await?.expect("exists");
        assert_eq!(
            reconciled_at(&widget),
            None,
            "{name} is shard 1's: {widget}"
        );
        let child = config_maps.get_opt(&format!("{name}-own")).await?;
        assert!(
            child.is_none(),
            "{name}'s child made by a host not holding shard 1"
        );
    }

    // Shard 1 gained: its parents are reconciled without any change to them.
    ownership.hold_until(1, far);
    for name in &by_shard[&1] {
        wait_for_object(
            &widgets,
            name,
            "a parent of the shard gained reconciled",
            |w| reconciled_at(w).is_some(),
        )
        .await?;
    }
    let both = shard(0) + shard(1);
    caches_hold(&host, "both shards' objects", both, both).await?;

    // Shard 0 let go: a change to its parents is no longer reconciled here, while one to
    // shard 1's still is.
    ownership.let_go(0);
    let changed = |name: &str| {
        let widgets = widgets.clone();
        let name = name.to_owned();
        async move {
            widgets
                .patch(
                    &name,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(serde_json::json!({"spec": {"size": 2}})),
                )
                .await
        }
    };
    let (kept, given) = (&by_shard[&1][0], &by_shard[&0][0]);
    caches_hold(&host, "shard 1's objects only", shard(1), shard(1)).await?;
    // The records of shard 0's reconciles went with it; shard 1's stay.
    let records = |name: &str| {
        let store = &explain.store;
        match store.lookup("Widget", Some(&ns), name, 10, &store.kinds_named("Widget")) {
            wasmctrl::explain::Lookup::Found { records } => records.len(),
            _ => 0,
        }
    };
    eventually(
        "shard 0's explain records dropped",
        Duration::from_secs(10),
        || async { Ok(by_shard[&0].iter().all(|name| records(name) == 0)) },
    )
    .await?;
    for name in &by_shard[&1] {
        assert!(records(name) > 0, "{name} (shard 1) kept its records");
    }
    changed(given).await?;
    changed(kept).await?;
    wait_for_object(
        &widgets,
        kept,
        "a change to a held shard's parent reconciled",
        |w| reconciled_at(w) == Some(2),
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let widget = get(&widgets, given).await?.expect("exists");
    assert_eq!(
        reconciled_at(&widget),
        Some(1),
        "{given} reconciled after its shard was let go: {widget}"
    );
    host.stop().await?;
    delete_namespace(&client, &ns).await
}

/// Wait until the host's caches hold `parents` parents and `children` children, as its
/// `wasmctrl_cached_objects` says (counted every few seconds).
async fn caches_hold(
    host: &HostUnderTest,
    what: &str,
    parents: usize,
    children: usize,
) -> anyhow::Result<()> {
    let cached = |cache: &str| {
        let label = format!("cache=\"{cache}\"");
        host.metric_sum("wasmctrl_cached_objects", &[label.as_str()]) as usize
    };
    let result = eventually(
        &format!("the caches to hold {what}"),
        Duration::from_secs(30),
        || async { Ok(cached("parents") == parents && cached("children") == children) },
    )
    .await;
    result.map_err(|error| {
        let (p, c) = (cached("parents"), cached("children"));
        error.context(format!(
            "cached: {p} parents, {c} children; wanted {parents}, {children}"
        ))
    })
}

/// Who may take a shard: the account the chart makes for a sharded release, in the
/// release's namespace, with the rules the chart gives it (it takes every shard, and leaves
/// the set when it stops). The same account in a namespace where it has no grant takes none
/// and writes no Lease there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_account_granted_the_shard_leases_takes_a_shard() -> anyhow::Result<()> {
    const COUNT: u32 = 4;
    let (admin, ns) = test_namespace("shard-leases-rbac").await?;
    let (_, elsewhere) = test_namespace("shard-leases-rbac-other").await?;
    let account = install_chart_rbac_with(
        &admin,
        "shards-rbac",
        &ns,
        &[
            "sharding.shards=4",
            "replicaCount=2",
            "createNamespace=false",
        ],
    )
    .await?;
    let as_account = kube::Client::try_from(service_account_config(&ns, &account).await?)?;

    let granted = start_with(&as_account, &ns, "granted", COUNT);
    let denied = start_with(&as_account, &elsewhere, "denied", COUNT);
    eventually(
        "the granted account holding every shard",
        LEASE_DURATION * 2,
        || async { Ok(granted.ownership.held().len() == COUNT as usize) },
    )
    .await?;
    // Rounds enough for the other to have claimed, had it been let.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(denied.ownership.held().is_empty(), "no grant, no shard");
    let written = Api::<Lease>::namespaced(admin.clone(), &elsewhere)
        .list(&Default::default())
        .await?;
    assert!(
        written.items.is_empty(),
        "no Lease written where the account has no grant: {:?}",
        written
            .items
            .iter()
            .map(|l| l.metadata.name.clone())
            .collect::<Vec<_>>()
    );

    // Stopping, it hands its shards back and deletes its membership Lease: the chart grants
    // that too.
    granted.stop.cancel();
    let mut coordinator = granted.task.await?;
    coordinator.release().await?;
    let leases = Api::<Lease>::namespaced(admin.clone(), &ns)
        .list(&Default::default())
        .await?;
    let names: Vec<String> = leases.items.iter().map(|l| l.name_any()).collect();
    assert!(
        !names.iter().any(|name| name.contains("-member-")),
        "the membership Lease was deleted: {names:?}"
    );
    assert!(
        leases.items.iter().all(|lease| lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_ref())
            .is_none()),
        "every shard handed back"
    );
    denied.stop.cancel();
    denied.task.abort();
    Ok(())
}

/// A rollout that changes the shard count: a replica of the new count claims nothing while
/// replicas of the old one hold their shards, and they, not counting it, give nothing back
/// to it; once they have stopped, it takes every shard of the new count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_shard_count_takes_over_only_once_the_old_replicas_are_gone() -> anyhow::Result<()> {
    let (client, ns) = test_namespace("shard-leases-count").await?;
    let a = start_with(&client, &ns, "old-a", 4);
    let b = start_with(&client, &ns, "old-b", 4);
    wait_for_counts(
        "two old replicas at 2 shards each",
        LEASE_DURATION * 2,
        &[("a", &a), ("b", &b)],
        2,
    )
    .await?;
    let new = start_with(&client, &ns, "new", 6);
    // Rounds enough (1 s each) for a rebalance, had the new replica counted.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        new.ownership.held().is_empty(),
        "claimed beside the old count"
    );
    assert_eq!(
        counts(&[("a", &a), ("b", &b)]),
        [("a".to_owned(), 2), ("b".to_owned(), 2)],
        "the old replicas gave nothing back"
    );

    for old in [a, b] {
        old.stop.cancel();
        let mut coordinator = old.task.await?;
        coordinator.release().await?;
    }
    eventually(
        "the new count's replica holding all 6",
        LEASE_DURATION * 2,
        || async { Ok(new.ownership.held().len() == 6) },
    )
    .await?;
    new.stop.cancel();
    new.task.await?.release().await?;
    Ok(())
}

/// A finalizing policy on three sharded hosts: the holder of shard 0 records the scope and
/// holds the policy's finalizer, and every host gives the parents of its own shards their
/// finalizer and reconciles them, then lets each deleted one go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finalizing_policy_on_sharded_hosts_finalizes_the_parents_of_every_shard()
-> anyhow::Result<()> {
    const TEST: &str = "shard-finalizers";
    const PARENTS: usize = 30;
    let (client, ns) = widget_test(TEST, json!({"ownChild": true})).await?;
    let spec = json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget", "namespace": ns},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "plugin": {"source": file_source("misbehave_plugin"), "config": {"ownChild": true}},
        "finalize": true,
    });
    apply_policy(&client, TEST, TEST, spec).await?;
    let hosts = ShardedHost::start_each(&client, TEST, &ns, None, &["a", "b", "c"], 6).await?;
    // Spread first, so that each host has parents of its own from the start.
    eventually("2 shards each", LEASE_DURATION * 3, || async {
        Ok(hosts.iter().all(|host| host.shards_held() == 2))
    })
    .await?;
    let widgets = widgets(&client, &ns);
    for i in 0..PARENTS {
        apply(&widgets, widget(&format!("w-{i:02}"), Some(1))).await?;
    }
    let finalizer = format!("wasmctrl.dev/{TEST}");
    eventually(
        "every Widget finalized and reconciled",
        Duration::from_secs(90),
        || async {
            let listed = widgets.list(&Default::default()).await?;
            Ok(listed.items.len() == PARENTS
                && listed.items.iter().all(|w| {
                    let w = serde_json::to_value(w).unwrap_or_default();
                    let holds = w["metadata"]["finalizers"]
                        .as_array()
                        .is_some_and(|f| f.iter().any(|f| f == finalizer.as_str()));
                    holds && condition(&w, "Reconciled").is_some_and(|c| c["status"] == "True")
                }))
        },
    )
    .await?;
    // Each host had parents of its own: it made their children.
    for host in &hosts {
        let applied = host.host.metric_sum(
            "wasmctrl_child_operations_total",
            &[&format!("controller=\"{TEST}\""), "operation=\"applied\""],
        );
        assert!(applied > 0.0, "every host made some parents' children");
    }
    for i in 0..PARENTS {
        widgets
            .delete(&format!("w-{i:02}"), &Default::default())
            .await?;
    }
    eventually(
        "every Widget let go and gone",
        Duration::from_secs(90),
        || async { Ok(widgets.list(&Default::default()).await?.items.is_empty()) },
    )
    .await?;
    // The policy goes while its hosts run, which let go of its finalizer: one left
    // terminating would be deleted under the next run of this test on the same cluster.
    policies(&client).delete(TEST, &Default::default()).await?;
    eventually("the policy gone", Duration::from_secs(60), || async {
        Ok(policies(&client).get_opt(TEST).await?.is_none())
    })
    .await?;
    ShardedHost::stop_each(hosts).await?;
    delete_namespace(&client, &ns).await?;
    Ok(())
}
