//! Ordered children on a fresh local control plane (etcd, kube-apiserver, controller-manager,
//! scheduler, a kwok node): N Stacks (the Stack example plugin: a database StatefulSet and
//! its Service, a migration Job after them, the app's Deployment after the Job) created at
//! once, and, from one watch per kind, when each step of each Stack began and ended:
//!
//! - the database: StatefulSet created → ready (its pod run by kwok, seen by its controller);
//! - the migration: Job created → complete;
//! - the app: Deployment created → available.
//!
//! A Stack's time to ready (its create to its app available) is the sum of those steps plus
//! the host's hand-offs: create → database applied, database ready → Job applied, Job
//! complete → app applied. The hand-offs are what ordering costs; the steps are the cluster's.
//!
//! Run with `cargo xtask bench ordered` (`WASMCTRL_BENCH_STACKS`, default 20).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DynamicObject, PostParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use wasmctrl_e2e::{HostUnderTest, TEST_GROUP, TEST_LABEL, api, apply, resource, test_crd};
use wasmctrl_testenv::cluster::admin_client;

wasmctrl::host_allocator!();

const NAMESPACE: &str = "bench-stacks";
const TEST: &str = "bench-ordered";

fn main() -> std::process::ExitCode {
    wasmctrl_e2e::bench::main(|| {
        let stacks = wasmctrl_e2e::bench::count_from_env("WASMCTRL_BENCH_STACKS", 20)?;
        wasmctrl_e2e::bench::on_fresh_control_plane("ordered", |dir| async move {
            measure(&dir, stacks).await
        })
    })
}

/// When each step of one Stack was seen to begin and end, from its create.
#[derive(Default, Debug)]
struct Seen {
    created: Option<Instant>,
    database_created: Option<Instant>,
    database_ready: Option<Instant>,
    job_created: Option<Instant>,
    job_complete: Option<Instant>,
    app_created: Option<Instant>,
    app_ready: Option<Instant>,
}

impl Seen {
    fn done(&self) -> bool {
        self.app_ready.is_some()
    }

    /// Time to ready, sum of the steps and the three hand-offs, in seconds.
    fn figures(&self) -> Option<Figures> {
        let between = |a: Option<Instant>, b: Option<Instant>| {
            Some(b?.saturating_duration_since(a?).as_secs_f64())
        };
        let steps = between(self.database_created, self.database_ready)?
            + between(self.job_created, self.job_complete)?
            + between(self.app_created, self.app_ready)?;
        let hand_offs = [
            between(self.created, self.database_created)?,
            between(self.database_ready, self.job_created)?,
            between(self.job_complete, self.app_created)?,
        ];
        Some(Figures {
            to_ready: between(self.created, self.app_ready)?,
            steps,
            hand_offs,
        })
    }
}

/// One Stack's figures, in seconds.
struct Figures {
    to_ready: f64,
    steps: f64,
    hand_offs: [f64; 3],
}

fn condition_true(object: &Value, type_: &str) -> bool {
    object["status"]["conditions"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["type"] == type_ && c["status"] == "True")
    })
}

/// Record what `object` (of `kind`) shows about its Stack.
fn note(seen: &mut HashMap<String, Seen>, kind: &str, object: &Value, now: Instant) {
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    let Some((stack, _)) = name.rsplit_once('-') else {
        return;
    };
    let entry = seen.entry(stack.to_owned()).or_default();
    let status = &object["status"];
    let (created, ready, is_ready) = match kind {
        "StatefulSet" => (
            &mut entry.database_created,
            &mut entry.database_ready,
            status["readyReplicas"].as_u64() >= Some(1)
                && status["observedGeneration"] == object["metadata"]["generation"],
        ),
        "Job" => (
            &mut entry.job_created,
            &mut entry.job_complete,
            condition_true(object, "Complete"),
        ),
        "Deployment" => (
            &mut entry.app_created,
            &mut entry.app_ready,
            status["availableReplicas"].as_u64() >= Some(1),
        ),
        _ => return,
    };
    created.get_or_insert(now);
    if is_ready {
        ready.get_or_insert(now);
    }
}

async fn measure(dir: &std::path::Path, stacks: usize) -> anyhow::Result<String> {
    wasmctrl::ensure_crypto_provider();
    let client = admin_client(&dir.join("kubeconfig")).await?;
    wasmctrl_testenv::crds::install_repo_crds(&client).await?;
    wasmctrl_testenv::crds::install_crd(&client, &test_crd(TEST_GROUP, "Stack")).await?;
    let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await?;
    let plugin = wasmctrl_testenv::plugins::guest("stack_plugin");
    let policy = json!({
        "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
        "metadata": {"name": TEST, "labels": {TEST_LABEL: TEST}},
        "spec": {
            "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Stack", "namespace": NAMESPACE},
            "children": [
                {"apiVersion": "apps/v1", "kind": "StatefulSet"},
                {"apiVersion": "v1", "kind": "Service"},
                {"apiVersion": "batch/v1", "kind": "Job"},
                {"apiVersion": "apps/v1", "kind": "Deployment"},
            ],
            "plugin": {"source": {"file": {"path": plugin.to_string_lossy()}}},
            "maxConcurrentReconciles": 16,
        },
    });
    apply(
        &api(
            &client,
            &resource("wasmctrl.dev", "v1alpha1", "ReconcilePolicy"),
            "",
        ),
        policy,
    )
    .await?;
    let host = HostUnderTest::builder(TEST, NAMESPACE)
        .client(client.clone())
        .start()
        .await?;

    let kinds = [
        ("StatefulSet", resource("apps", "v1", "StatefulSet")),
        ("Job", resource("batch", "v1", "Job")),
        ("Deployment", resource("apps", "v1", "Deployment")),
    ];
    let mut events = futures::stream::select_all(kinds.iter().map(|(kind, resource)| {
        let kind = *kind;
        watcher(
            api(&client, resource, NAMESPACE),
            watcher::Config::default(),
        )
        .filter_map(move |event| async move {
            match event {
                Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) => {
                    Some((kind, serde_json::to_value(object).ok()?))
                }
                _ => None,
            }
        })
        .boxed()
    }));
    let stacks_api: Api<DynamicObject> =
        api(&client, &resource(TEST_GROUP, "v1", "Stack"), NAMESPACE);
    let mut seen: HashMap<String, Seen> = HashMap::new();
    let started = Instant::now();
    for i in 0..stacks {
        let name = format!("s{i}");
        let stack = json!({
            "apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Stack", "metadata": {"name": name},
            "spec": {"app": {"image": "shop:1"}, "database": {"image": "postgres:17"},
                     "migration": {"image": "shop-migrate:1"}},
        });
        seen.entry(name).or_default().created = Some(Instant::now());
        apply(&stacks_api, stack).await?;
    }
    tokio::time::timeout(Duration::from_secs(600), async {
        while seen.values().filter(|s| s.done()).count() < stacks {
            let Some((kind, object)) = events.next().await else {
                anyhow::bail!("the watches ended");
            };
            note(&mut seen, kind, &object, Instant::now());
        }
        Ok(())
    })
    .await
    .context("every Stack ready")??;
    let all = started.elapsed();
    host.stop().await?;
    report(&seen, stacks, all)
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let at = ((values.len() as f64 - 1.0) * p).round() as usize;
    values.get(at).copied().unwrap_or(f64::NAN)
}

fn report(seen: &HashMap<String, Seen>, stacks: usize, all: Duration) -> anyhow::Result<String> {
    let figures: Vec<_> = seen.values().filter_map(Seen::figures).collect();
    anyhow::ensure!(
        figures.len() == stacks,
        "figures for {} of {stacks} Stacks",
        figures.len()
    );
    let column = |pick: &dyn Fn(&Figures) -> f64| {
        let mut values: Vec<f64> = figures.iter().map(pick).collect();
        (percentile(&mut values, 0.5), percentile(&mut values, 0.9))
    };
    let rows = [
        (
            "time to ready (create → app available)",
            column(&|f| f.to_ready),
        ),
        (
            "sum of the steps (database, migration, app)",
            column(&|f| f.steps),
        ),
        (
            "hand-offs in all (time to ready − steps)",
            column(&|f| f.to_ready - f.steps),
        ),
        ("create → database applied", column(&|f| f.hand_offs[0])),
        (
            "database ready → migration applied",
            column(&|f| f.hand_offs[1]),
        ),
        (
            "migration complete → app applied",
            column(&|f| f.hand_offs[2]),
        ),
    ];
    let mut out = format!(
        "{stacks} Stacks created at once, all ready in {:.1} s\n\n| per Stack | p50 | p90 |\n|---|---|---|\n",
        all.as_secs_f64()
    );
    for (what, (p50, p90)) in rows {
        out.push_str(&format!("| {what} | {p50:.2} s | {p90:.2} s |\n"));
    }
    Ok(out)
}
