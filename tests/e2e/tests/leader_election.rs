//! Replicas of `wasmctrl run --leader-elect`, each a process of its own running the real
//! command line under an identity of its own: exactly one writes (the audit log says who),
//! a standby is ready and keeps quiet, SIGKILL on the leader hands over once the lease
//! expires, and SIGTERM hands over within about the retry period, exiting 0. A rollout in
//! progress when the leader is killed goes on from the same stage under the new leader.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use serde_json::{Value, json};
use wasmctrl_e2e::*;
use wasmctrl_testenv::TestEnv;
use wasmctrl_testenv::cluster::eventually;

const TEST: &str = "leader-election";
const LEASE: &str = "wasmctrl-leader";
/// The command line of a re-executed test binary that runs one replica (see `replica_process`).
const REPLICA_ENV: &str = "WASMCTRL_E2E_REPLICA";
/// controller-runtime's default lease duration, which the host defaults to.
const LEASE_DURATION: Duration = Duration::from_secs(15);

/// One replica: this test binary, re-executed to run `wasmctrl run` as `name` (killed when
/// dropped).
struct Replica {
    name: String,
    process: SelfProcess,
    address: SocketAddr,
}

impl Replica {
    /// A replica running the policies labelled for `test`.
    fn start(test: &str, name: &str, ns: &str, dir: &Path) -> anyhow::Result<Self> {
        let kubeconfig = impersonating_kubeconfig(TestEnv::get().kubeconfig(), name, dir)?;
        let address = free_loopback_port()?;
        let args = [
            "wasmctrl",
            "--cache-dir",
            &dir.join("artifacts").to_string_lossy(),
            "run",
            "--kubeconfig",
            &kubeconfig.to_string_lossy(),
            "--namespace",
            ns,
            "--credentials-namespace",
            ns,
            "--plugin-dir",
            &wasmctrl_testenv::plugins::plugin_dir().to_string_lossy(),
            "--policy-selector",
            &format!("{TEST_LABEL}={test}"),
            "--insecure-listen",
            &address.to_string(),
            "--leader-elect",
            "--leader-elect-namespace",
            ns,
            "--leader-elect-identity",
            name,
            "--backoff-base-ms",
            "500",
        ]
        .map(str::to_owned);
        let command_line = serde_json::to_string(&args)?;
        let process = spawn_self("replica_process", &[(REPLICA_ENV, command_line.as_str())])
            .context("starting a replica")?;
        Ok(Self {
            name: name.to_owned(),
            process,
            address,
        })
    }

    fn signal(&mut self, signal: libc::c_int) -> anyhow::Result<()> {
        self.process
            .signal(signal)
            .with_context(|| format!("signalling {}", self.name))
    }

    /// Wait for the process to end; its exit status.
    async fn wait(mut self, within: Duration) -> anyhow::Result<std::process::ExitStatus> {
        self.process
            .exit_within(within)
            .await
            .with_context(|| format!("waiting for {} to exit", self.name))
    }

    async fn metric(&self, series: &str) -> anyhow::Result<Option<f64>> {
        let (_, text) = http_get(self.address, "/metrics").await?;
        Ok(text.lines().find_map(|line| {
            line.strip_prefix(series)
                .and_then(|value| value.trim().parse().ok())
        }))
    }
}

/// Not a test: the body of a replica process (does nothing when run alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a replica of a leader election test"]
async fn replica_process() -> anyhow::Result<()> {
    use clap::Parser as _;
    let Ok(args) = std::env::var(REPLICA_ENV) else {
        return Ok(());
    };
    let args: Vec<String> = serde_json::from_str(&args)?;
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    wasmctrl::cli::Cli::parse_from(args).run().await
}

fn free_loopback_port() -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

async fn holder(leases: &Api<Lease>) -> anyhow::Result<Option<String>> {
    Ok(leases
        .get_opt(LEASE)
        .await?
        .and_then(|lease| lease.spec)
        .and_then(|spec| spec.holder_identity))
}

/// Wait until the Lease is held by one of `candidates`; which one.
async fn wait_for_holder(
    leases: &Api<Lease>,
    candidates: &[&str],
    within: Duration,
) -> anyhow::Result<String> {
    let started = Instant::now();
    loop {
        if let Some(holder) = holder(leases).await?
            && candidates.contains(&holder.as_str())
        {
            return Ok(holder);
        }
        anyhow::ensure!(
            started.elapsed() < within,
            "none of {candidates:?} took the lease within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Who wrote what in `ns` according to the audit log: (impersonated user, resource, verb).
fn writers(ns: &str) -> anyhow::Result<Vec<(String, String, String)>> {
    let log = TestEnv::get()
        .audit_log()
        .context("the test cluster keeps no audit log")?;
    let text = std::fs::read_to_string(log)?;
    Ok(text
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|entry| entry["objectRef"]["namespace"] == ns)
        .filter_map(|entry| {
            let user = entry["impersonatedUser"]["username"].as_str()?.to_owned();
            let resource = entry["objectRef"]["resource"].as_str()?.to_owned();
            let verb = entry["verb"].as_str()?.to_owned();
            Some((user, resource, verb))
        })
        .collect())
}

async fn wait_reconciled(
    widgets: &Api<kube::api::DynamicObject>,
    name: &str,
) -> anyhow::Result<()> {
    wait_for_object(widgets, name, &format!("{name} reconciled"), |w| {
        condition(w, "Reconciled").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_writes_and_a_standby_takes_over_on_kill_and_on_term() -> anyhow::Result<()> {
    let (client, ns) = widget_test(TEST, json!({"ownChild": true})).await?;
    let dir = tempfile::tempdir()?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let widgets = widgets(&client, &ns);

    let mut replicas = vec![
        Replica::start(TEST, "replica-a", &ns, dir.path())?,
        Replica::start(TEST, "replica-b", &ns, dir.path())?,
    ];
    let leader = wait_for_holder(&leases, &["replica-a", "replica-b"], ACT).await?;
    let leader_at = replicas
        .iter()
        .position(|r| r.name == leader)
        .context("the holder is a replica")?;
    let standby_at = 1 - leader_at;
    for replica in &replicas {
        eventually(&format!("{} ready", replica.name), ACT, || async {
            Ok(http_get(replica.address, "/readyz").await? == (200, "ok".into()))
        })
        .await?;
    }

    apply(&widgets, widget("w1", Some(1))).await?;
    wait_reconciled(&widgets, "w1").await?;
    let status = format!(r#"leader_election_master_status{{name="{LEASE}"}} "#);
    assert_eq!(replicas[leader_at].metric(&status).await?, Some(1.0));
    assert_eq!(replicas[standby_at].metric(&status).await?, Some(0.0));
    let reconciles =
        format!(r#"controller_runtime_reconcile_total{{controller="{TEST}",result="success"}} "#);
    // The status write that makes w1 Ready happens inside the reconcile; the count goes up when
    // the reconcile returns, a moment later.
    eventually("the leader counts its reconcile", ACT, || async {
        Ok(replicas[leader_at]
            .metric(&reconciles)
            .await?
            .unwrap_or(0.0)
            >= 1.0)
    })
    .await?;
    assert_eq!(
        replicas[standby_at].metric(&reconciles).await?,
        None,
        "a standby reconciles nothing"
    );
    // The standby saw w1 and its child too; what it queued does not stay counted.
    let depth = format!(r#"workqueue_depth{{name="{TEST}"}} "#);
    eventually("the standby's queue drains", ACT, || async {
        Ok(replicas[standby_at].metric(&depth).await? == Some(0.0))
    })
    .await?;
    let standby = replicas[standby_at].name.clone();
    let written = writers(&ns)?;
    assert!(
        written
            .iter()
            .any(|(user, resource, _)| *user == leader && resource == "configmaps"),
        "the leader wrote the child: {written:?}"
    );
    let by_standby: Vec<_> = written
        .iter()
        .filter(|(user, resource, _)| *user == standby && resource != "leases")
        .collect();
    assert!(by_standby.is_empty(), "the standby wrote {by_standby:?}");

    // Renewals while idle: the leader writes its Lease once per retry period.
    let idle_from = Instant::now();
    let before = writers(&ns)?;
    tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    let renewals = writers(&ns)?
        .iter()
        .filter(|(user, resource, verb)| {
            *user == leader && resource == "leases" && verb == "update"
        })
        .count()
        - before
            .iter()
            .filter(|(user, resource, verb)| {
                *user == leader && resource == "leases" && verb == "update"
            })
            .count();
    let lease_writes_per_minute = renewals as f64 * 60.0 / idle_from.elapsed().as_secs_f64();

    // SIGKILL: no release, so the standby takes over once the lease has expired; a change
    // made meanwhile is reconciled by the new leader.
    let killed_at = Instant::now();
    let mut killed = replicas.remove(leader_at);
    killed.signal(libc::SIGKILL)?;
    drop(killed);
    apply(&widgets, widget("w2", Some(1))).await?;
    wait_for_holder(&leases, &[&standby], LEASE_DURATION * 2).await?;
    let kill_failover = killed_at.elapsed();
    wait_reconciled(&widgets, "w2").await?;
    let kill_to_reconciled = killed_at.elapsed();

    // SIGTERM: the leader drains, releases the lease and exits 0; the new standby takes
    // over within its retry period, much sooner than the lease would expire.
    replicas.push(Replica::start(TEST, "replica-c", &ns, dir.path())?);
    let newcomer = &replicas[1];
    eventually("replica-c ready", ACT, || async {
        Ok(http_get(newcomer.address, "/readyz").await? == (200, "ok".into()))
    })
    .await?;
    let termed_at = Instant::now();
    let mut termed = replicas.remove(0);
    termed.signal(libc::SIGTERM)?;
    wait_for_holder(&leases, &["replica-c"], LEASE_DURATION).await?;
    let term_failover = termed_at.elapsed();
    let exit = termed.wait(ACT).await?;
    assert!(exit.success(), "a terminated leader exits 0, not {exit}");
    apply(&widgets, widget("w3", Some(1))).await?;
    wait_reconciled(&widgets, "w3").await?;

    eprintln!(
        "failover: SIGKILL → new holder {:.1} s (→ change reconciled {:.1} s); SIGTERM → new holder {:.1} s; leader's lease writes ≈ {lease_writes_per_minute:.0}/min",
        kill_failover.as_secs_f64(),
        kill_to_reconciled.as_secs_f64(),
        term_failover.as_secs_f64()
    );
    assert!(
        term_failover < LEASE_DURATION / 2,
        "a released lease is taken within the retry period, not at expiry ({term_failover:?})"
    );

    drop(replicas);
    policies(&client).delete(TEST, &Default::default()).await?;
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_that_takes_over_continues_the_rollout_where_the_leader_left_it()
-> anyhow::Result<()> {
    const TEST: &str = "leader-rollout";
    let (client, ns) = widget_test(TEST, json!({"ownChild": true})).await?;
    let dir = tempfile::tempdir()?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let widgets = widgets(&client, &ns);
    for i in 0..20 {
        apply(&widgets, widget(&format!("w-{i:02}"), Some(i))).await?;
    }
    let mut replicas = vec![
        Replica::start(TEST, "replica-a", &ns, dir.path())?,
        Replica::start(TEST, "replica-b", &ns, dir.path())?,
    ];
    let leader = wait_for_holder(&leases, &["replica-a", "replica-b"], ACT).await?;
    let standby = if leader == "replica-a" {
        "replica-b"
    } else {
        "replica-a"
    };
    for i in 0..20 {
        wait_reconciled(&widgets, &format!("w-{i:02}")).await?;
    }

    // A rollout that stops in its canary stage: the soak outlasts the handover.
    let with_rollout = |soak: u32| {
        json!({
            "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget"},
            "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
            "plugin": {
                "source": file_source("misbehave_plugin"), "config": {"ownChild": true},
                "candidate": {"source": file_source("misbehave_plugin"), "config": {"ownChild": true}},
                "rollout": {"stages": [
                    {"percent": 0},
                    {"percent": 10, "soakSeconds": soak},
                    {"percent": 100},
                ]},
            },
        })
    };
    apply_policy(&client, TEST, TEST, with_rollout(3600)).await?;
    let policy_api = policies(&client);
    let in_canary = wait_for_object(&policy_api, TEST, "the rollout in its canary stage", |p| {
        p["status"]["rollout"]["stageName"] == "canary 10%"
    })
    .await?;
    let before = in_canary["status"]["rollout"].clone();

    let at = replicas
        .iter()
        .position(|r| r.name == leader)
        .context("the holder is a replica")?;
    let mut killed = replicas.remove(at);
    killed.signal(libc::SIGKILL)?;
    drop(killed);
    wait_for_holder(&leases, &[standby], LEASE_DURATION * 2).await?;
    let new_leader = &replicas[0];
    let stage = format!(r#"wasmctrl_rollout_stage{{controller="{TEST}"}} "#);
    eventually("the new leader serves the canary share", ACT, || async {
        Ok(new_leader.metric(&stage).await? == Some(10.0))
    })
    .await?;
    // A few of its ticks later: the same stage, begun when it began, no transition added.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let after = get(&policy_api, TEST).await?.context("the policy")?["status"]["rollout"].clone();
    assert_eq!(after["stage"], before["stage"], "{after}");
    assert_eq!(after["stageSince"], before["stageSince"], "{after}");
    assert_eq!(after["history"], before["history"], "{after}");

    // The new leader carries it on: with the soak cut short, on to every parent, once.
    apply_policy(&client, TEST, TEST, with_rollout(0)).await?;
    let done = wait_for_object(&policy_api, TEST, "the rollout complete", |p| {
        p["status"]["rollout"]["phase"] == "Complete"
    })
    .await?;
    let results: Vec<&str> = done["status"]["rollout"]["history"]
        .as_array()
        .context("a history")?
        .iter()
        .rev()
        .filter_map(|t| t["result"].as_str())
        .collect();
    assert_eq!(
        results,
        ["Started", "Advanced", "Advanced", "Completed"],
        "{done}"
    );

    drop(replicas);
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}
