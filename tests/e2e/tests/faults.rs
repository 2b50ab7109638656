//! Faults the host must come through with nothing lost: the API server killed and restarted
//! mid-convergence, watches forced to relist by an etcd compaction, the host itself
//! SIGKILLed and restarted, two hosts at once, a leader frozen past its lease while a standby
//! takes over, a plugin that traps while finalizing, a finalizing policy moved between two
//! parent kinds, hostile plugins under load beside a well-behaved policy, sharded
//! replicas killed, joined and frozen while they share the parents, and sharded replicas on
//! an API server that cannot narrow their watches, labelling their parents by shard.
//!
//! These run on a control plane of their own (they kill parts of it), one test at a time.
//! Each ends by checking the invariant: every parent converged, each desired child exists
//! exactly once with the right owner, nothing was deleted that should not have been, and a
//! resync afterwards writes nothing (the API server's audit log). Each prints how long
//! convergence took after its fault; RELIABILITY.md records those figures.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt as _;
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams};
use serde_json::{Value, json};
use wasmctrl_e2e::*;
use wasmctrl_testenv::cluster::{Binaries, ControlPlane, Lifetime, eventually};
use wasmctrl_testenv::repo_root;

/// Parents per fault.
const PARENTS: usize = 200;
/// How long convergence may take after a fault.
const CONVERGE: Duration = Duration::from_secs(120);
/// How soon after convergence the host must stop writing.
const QUIET: Duration = Duration::from_secs(20);
/// Environment of a re-executed test binary that runs a host process (see `host_process`).
const HOST_ENV: &str = "WASMCTRL_FAULT_HOST";
/// Environment of a re-executed test binary that runs `wasmctrl run` (see `replica_process`).
const REPLICA_ENV: &str = "WASMCTRL_FAULT_REPLICA";
/// The host's default leader election durations (controller-runtime's).
const LEASE_DURATION: Duration = Duration::from_secs(15);
const RENEW_DEADLINE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// The control plane these tests own, kept by a thread that lives as long as the process (its
// processes die with that thread), and one test at a time. Under `cargo xtask test` each test
// is a process of its own with a plane of its own, and the runner runs them alone
// (`.config/nextest.toml`); under plain `cargo test` they share one plane, one at a time.

enum Request {
    Kill(&'static str),
    Start(&'static str),
    /// Start a killed component with these arguments added, this once.
    StartWith(&'static str, Vec<String>),
    Compact,
}

struct Plane {
    kubeconfig: PathBuf,
    audit_log: PathBuf,
    requests: mpsc::Sender<(Request, mpsc::Sender<anyhow::Result<()>>)>,
}

impl Plane {
    fn get() -> &'static Plane {
        // RUST_LOG=... shows the hosts' logs when a fault needs explaining.
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_test_writer()
                .try_init();
        }
        static PLANE: std::sync::OnceLock<Plane> = std::sync::OnceLock::new();
        PLANE.get_or_init(|| Self::start().unwrap_or_else(|e| panic!("no fault plane: {e:#}")))
    }

    fn start() -> anyhow::Result<Plane> {
        let (ready_tx, ready_rx) = mpsc::channel();
        let (requests, incoming) = mpsc::channel::<(Request, mpsc::Sender<anyhow::Result<()>>)>();
        std::thread::Builder::new()
            .name("fault-plane-keeper".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.into()));
                        return;
                    }
                };
                let started = (|| {
                    wasmctrl_testenv::remove_dead_test_clusters();
                    let binaries = Binaries::build(&repo_root())?;
                    let dir =
                        repo_root().join(format!("target/cluster-faults-{}", std::process::id()));
                    let plane = runtime.block_on(ControlPlane::start(
                        &dir,
                        &binaries,
                        Lifetime::TiedToStarter,
                    ))?;
                    anyhow::Ok((binaries, plane))
                })();
                let (binaries, mut plane) = match started {
                    Ok(started) => started,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok((plane.kubeconfig.clone(), plane.audit_log.clone())));
                // Serve fault requests here, so restarted components are children of this
                // thread too. The loop ends with the process.
                for (request, reply) in incoming {
                    let result = runtime.block_on(async {
                        match request {
                            Request::Kill(name) => plane.kill_component(name).await,
                            Request::Start(name) => {
                                plane
                                    .start_component(name, &binaries, Lifetime::TiedToStarter)
                                    .await
                            }
                            Request::StartWith(name, extra) => {
                                plane
                                    .start_component_with(
                                        name,
                                        &binaries,
                                        Lifetime::TiedToStarter,
                                        &extra,
                                    )
                                    .await
                            }
                            Request::Compact => plane.compact_etcd().map(|revision| {
                                eprintln!("faults: etcd compacted at revision {revision}");
                            }),
                        }
                    });
                    let _ = reply.send(result);
                }
            })?;
        let (kubeconfig, audit_log) = ready_rx.recv().context("the keeper thread died")??;
        Ok(Plane {
            kubeconfig,
            audit_log,
            requests,
        })
    }

    /// [`Plane::ask`] from code that cannot await (a drop): blocks this thread for the
    /// answer.
    fn ask_blocking(&self, request: Request) -> anyhow::Result<()> {
        let (reply, answer) = mpsc::channel();
        self.requests
            .send((request, reply))
            .context("the keeper thread is gone")?;
        answer.recv().context("no answer from the keeper")?
    }

    async fn ask(&self, request: Request) -> anyhow::Result<()> {
        let (reply, answer) = mpsc::channel();
        self.requests
            .send((request, reply))
            .context("the keeper thread is gone")?;
        tokio::task::spawn_blocking(move || answer.recv().context("no answer from the keeper"))
            .await??
    }

    async fn client(&self) -> anyhow::Result<Client> {
        wasmctrl_testenv::cluster::admin_client(&self.kubeconfig).await
    }
}

/// One fault test at a time, when several share this process's plane (plain `cargo test`):
/// they disturb it.
async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

// ---------------------------------------------------------------------------------------
// Hosts: in this process, or as a process of its own that can be SIGKILLed.

/// The fault suite's host for `test`, talking through `client`: over the whole cluster (the
/// hostile policies' parents have namespaces of their own), with 16 plugin calls at once.
fn fault_host(test: &str, client: Client) -> HostBuilder {
    HostUnderTest::cluster_wide(test)
        .client(client)
        .max_concurrent_calls(16)
}

/// A fault test's host in this process.
async fn in_process_host(test: &str) -> anyhow::Result<HostUnderTest> {
    fault_host(test, Plane::get().client().await?).start().await
}

/// A fault test's host in a process of its own, which can be SIGKILLed: this test binary,
/// re-executed to run `host_process`.
fn host_process_for(test: &str) -> anyhow::Result<SelfProcess> {
    let spec = json!({"kubeconfig": Plane::get().kubeconfig, "test": test}).to_string();
    spawn_self("host_process", &[(HOST_ENV, spec.as_str())])
}

/// Not a test: the body of a host process for `host_process_for` (does nothing when run
/// alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as the host process of a fault test"]
async fn host_process() -> anyhow::Result<()> {
    let Ok(spec) = std::env::var(HOST_ENV) else {
        return Ok(());
    };
    let spec: Value = serde_json::from_str(&spec)?;
    let kubeconfig = PathBuf::from(spec["kubeconfig"].as_str().context("kubeconfig")?);
    let client = wasmctrl_testenv::cluster::admin_client(&kubeconfig).await?;
    let test = spec["test"].as_str().context("test")?;
    fault_host(test, client)
        .build()
        .await?
        .run(std::future::pending())
        .await
}

/// A replica of `wasmctrl run --leader-elect` for `test` in a process of its own, acting as
/// `identity` (impersonated, so the audit log tells replicas apart), its Lease in `ns`.
fn replica_process_for(
    test: &str,
    identity: &str,
    ns: &str,
    dir: &std::path::Path,
) -> anyhow::Result<SelfProcess> {
    replica_process_sharing(test, identity, ns, dir, &["--leader-elect"])
        .map(|(process, _)| process)
}

/// A replica of `wasmctrl run` for `test` in a process of its own, acting as `identity`,
/// sharing the work with the others as `sharing` says (`--leader-elect`, or `--shards N`),
/// its Leases in `ns`; with the address it serves its metrics on.
fn replica_process_sharing(
    test: &str,
    identity: &str,
    ns: &str,
    dir: &std::path::Path,
    sharing: &[&str],
) -> anyhow::Result<(SelfProcess, std::net::SocketAddr)> {
    let kubeconfig = impersonating_kubeconfig(&Plane::get().kubeconfig, identity, dir)?;
    let listen = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let args = [
        "wasmctrl",
        "--cache-dir",
        &dir.join("artifacts").to_string_lossy(),
        "run",
        "--kubeconfig",
        &kubeconfig.to_string_lossy(),
        "--plugin-dir",
        &wasmctrl_testenv::plugins::plugin_dir().to_string_lossy(),
        "--policy-selector",
        &format!("{TEST_LABEL}={test}"),
        "--insecure-listen",
        &listen.to_string(),
        "--max-concurrent-calls",
        "16",
        "--leader-elect-namespace",
        ns,
        "--leader-elect-identity",
        identity,
    ]
    .map(str::to_owned);
    let args: Vec<String> = args
        .into_iter()
        .chain(sharing.iter().map(|arg| (*arg).to_owned()))
        .collect();
    let command_line = serde_json::to_string(&args)?;
    let process = spawn_self("replica_process", &[(REPLICA_ENV, command_line.as_str())])?;
    Ok((process, listen))
}

/// Not a test: the body of a replica process for `replica_process_for` (does nothing when
/// run alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as a replica of a fault test"]
async fn replica_process() -> anyhow::Result<()> {
    use clap::Parser as _;
    let Ok(args) = std::env::var(REPLICA_ENV) else {
        return Ok(());
    };
    let args: Vec<String> = serde_json::from_str(&args)?;
    wasmctrl::cli::Cli::parse_from(args).run().await
}

// ---------------------------------------------------------------------------------------
// Parents, and the invariant every fault test ends with.

fn config_maps(client: &Client, ns: &str) -> Api<DynamicObject> {
    api(client, &resource("", "v1", "ConfigMap"), ns)
}

/// A policy that gives every Widget in `ns` a ConfigMap `<name>-own` holding its spec, with
/// a 2 s resync so that "a resync writes nothing" is tested within seconds.
fn widget_policy(ns: &str, config: Value) -> Value {
    json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget", "namespace": ns},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "plugin": {"source": file_source("misbehave_plugin"), "config": config},
        "resyncPeriodSeconds": 2,
        "maxConcurrentReconciles": 16,
    })
}

async fn setup(test: &str, config: Value) -> anyhow::Result<(Client, String)> {
    let client = Plane::get().client().await?;
    install_repo_crds(&client).await?;
    install_crd(&client, &test_crd(TEST_GROUP, "Widget")).await?;
    let ns = create_namespace(&client, test).await?;
    apply_policy(&client, test, test, widget_policy(&ns, config)).await?;
    // A user's own object in the namespace, which nothing may touch.
    apply(
        &config_maps(&client, &ns),
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "users-own"}, "data": {"k": "v"}}),
    )
    .await?;
    Ok((client, ns))
}

async fn create_namespace(client: &Client, test: &str) -> anyhow::Result<String> {
    let name = format!(
        "{test}-{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .subsec_nanos()
    );
    let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone());
    namespaces
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": name}}))?,
        )
        .await?;
    Ok(name)
}

/// Apply `count` Widgets `w-0…` with `size`, 16 at a time.
async fn apply_widgets(client: &Client, ns: &str, count: usize, size: u64) -> anyhow::Result<()> {
    let api = widgets(client, ns);
    let results: Vec<anyhow::Result<DynamicObject>> = futures::stream::iter((0..count).map(|i| {
        let api = api.clone();
        async move { apply(&api, widget(&format!("w-{i}"), Some(size))).await }
    }))
    .buffer_unordered(16)
    .collect()
    .await;
    results.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    Ok(())
}

/// Parents whose `Reconciled` condition is True for their current generation.
async fn reconciled_count(client: &Client, ns: &str) -> anyhow::Result<usize> {
    let list = widgets(client, ns).list(&ListParams::default()).await?;
    Ok(list
        .items
        .iter()
        .filter(|w| {
            let w = serde_json::to_value(w).unwrap_or_default();
            condition(&w, "Reconciled").is_some_and(|c| c["status"] == "True")
                && w["status"]["observedGeneration"] == w["metadata"]["generation"]
        })
        .count())
}

/// Wait until at least `count` parents are reconciled; how long it took.
async fn wait_reconciled(client: &Client, ns: &str, count: usize) -> anyhow::Result<Duration> {
    let started = Instant::now();
    eventually(&format!("{count} parents reconciled"), CONVERGE, || async {
        Ok(reconciled_count(client, ns).await? >= count)
    })
    .await?;
    Ok(started.elapsed())
}

/// Wait until every one of the `PARENTS` children holds `size`.
async fn wait_children_at(client: &Client, ns: &str, size: u64) -> anyhow::Result<()> {
    wait_children_of(client, ns, PARENTS, size).await
}

/// Wait until every one of the `count` parents' children holds `size`.
async fn wait_children_of(
    client: &Client,
    ns: &str,
    count: usize,
    size: u64,
) -> anyhow::Result<()> {
    let size = size.to_string();
    eventually(&format!("every child at size {size}"), CONVERGE, || async {
        let children = children_by_parent(client, ns).await?;
        Ok(children.len() == count
            && children
                .values()
                .all(|owned| owned.iter().all(|(_, c)| c["data"]["size"] == size)))
    })
    .await
}

/// The children of each parent, by uid: parent name → (child uid, child data).
async fn children_by_parent(
    client: &Client,
    ns: &str,
) -> anyhow::Result<BTreeMap<String, Vec<(String, Value)>>> {
    let parents = widgets(client, ns).list(&ListParams::default()).await?;
    let uid_to_name: BTreeMap<String, String> = parents
        .items
        .iter()
        .filter_map(|p| Some((p.metadata.uid.clone()?, p.metadata.name.clone()?)))
        .collect();
    let children = config_maps(client, ns)
        .list(&ListParams::default().labels("app.kubernetes.io/managed-by=wasmctrl"))
        .await?;
    let mut by_parent: BTreeMap<String, Vec<(String, Value)>> = BTreeMap::new();
    for child in children.items {
        let owner = child
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .and_then(|o| uid_to_name.get(&o.uid))
            .cloned()
            .unwrap_or_else(|| {
                format!(
                    "<no live parent for {}>",
                    child.metadata.name.clone().unwrap_or_default()
                )
            });
        by_parent.entry(owner).or_default().push((
            child.metadata.uid.clone().unwrap_or_default(),
            json!({"name": child.metadata.name, "data": child.data["data"]}),
        ));
    }
    Ok(by_parent)
}

/// The invariant: all `count` parents converged with `size`; each has exactly one child,
/// `<parent>-own`, controlled by it and holding its spec; `kept` children (uids taken
/// before the fault) were not deleted; the user's ConfigMap is untouched; and a resync
/// writes nothing.
async fn check_invariant(
    client: &Client,
    ns: &str,
    count: usize,
    size: u64,
    kept: &BTreeMap<String, Vec<(String, Value)>>,
) -> anyhow::Result<()> {
    assert_eq!(
        reconciled_count(client, ns).await?,
        count,
        "every parent converged"
    );
    let children = children_by_parent(client, ns).await?;
    assert_eq!(
        children.len(),
        count,
        "one entry per parent: {:?}",
        children
            .keys()
            .filter(|k| k.starts_with('<'))
            .collect::<Vec<_>>()
    );
    for (parent, owned) in &children {
        assert_eq!(owned.len(), 1, "{parent} has exactly one child: {owned:?}");
        let (uid, child) = &owned[0];
        assert_eq!(child["name"], format!("{parent}-own"), "{parent}");
        assert_eq!(child["data"]["size"], size.to_string(), "{parent}: {child}");
        if let Some(before) = kept.get(parent) {
            assert_eq!(
                &before[0].0, uid,
                "{parent}'s child was deleted and re-created"
            );
        }
    }
    let users = get(&config_maps(client, ns), "users-own")
        .await?
        .context("the user's ConfigMap was deleted")?;
    assert_eq!(users["data"]["k"], "v");
    assert!(users["metadata"]["ownerReferences"].is_null());

    // Once its watches have caught up after the fault (they retry within 5 s), a host whose
    // parents converged writes nothing: a quiet window of two resyncs (2 s each) must come
    // within QUIET.
    let started = Instant::now();
    let mut last = host_writes(ns)?;
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let now = host_writes(ns)?;
        if now.len() == last.len() {
            eprintln!(
                "faults: quiet (no write for 5 s) {:.1?} after convergence",
                started.elapsed().saturating_sub(Duration::from_secs(5))
            );
            return Ok(());
        }
        let new: Vec<String> = now.iter().skip(last.len()).cloned().collect();
        assert!(
            started.elapsed() < QUIET,
            "a converged resync still writes {QUIET:?} after convergence: {new:#?}"
        );
        last = now;
    }
}

/// Writes (not Events, nor a leader's renewals of its Lease) to objects in `ns` by the admin
/// user: the host, in these tests (replicas impersonate names of their own as that user).
fn host_writes(ns: &str) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(&Plane::get().audit_log)?;
    let marker = format!("/namespaces/{ns}/");
    Ok(text
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|e| {
            let uri = e["requestURI"].as_str().unwrap_or_default();
            e["stage"] == "ResponseComplete"
                && uri.contains(&marker)
                && !uri.contains("/events")
                && !uri.contains("/leases/")
                && matches!(
                    e["verb"].as_str().unwrap_or_default(),
                    "create" | "update" | "patch" | "delete"
                )
                && e["user"]["username"] == "admin"
        })
        .map(|e| format!("{} {}", e["verb"], e["requestURI"]))
        .collect())
}

fn report(fault: &str, figure: &str) {
    eprintln!("faults: {fault}: {figure}");
}

// ---------------------------------------------------------------------------------------
// The faults.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_killed_mid_convergence_loses_nothing() -> anyhow::Result<()> {
    const TEST: &str = "fault-apiserver";
    let _one = exclusive().await;
    let (client, ns) = setup(TEST, json!({"ownChild": true})).await?;
    let host = in_process_host(TEST).await?;
    apply_widgets(&client, &ns, PARENTS, 1).await?;
    wait_reconciled(&client, &ns, PARENTS / 4).await?;

    Plane::get().ask(Request::Kill("kube-apiserver")).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    Plane::get().ask(Request::Start("kube-apiserver")).await?;
    let client = Plane::get().client().await?;
    let took = wait_reconciled(&client, &ns, PARENTS).await?;
    report(
        "API server killed for 3 s at 25 % converged",
        &format!("all {PARENTS} converged {took:.1?} after it came back"),
    );
    check_invariant(&client, &ns, PARENTS, 1, &BTreeMap::new()).await?;
    host.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_forced_to_relist_by_compaction_lose_no_change() -> anyhow::Result<()> {
    const TEST: &str = "fault-compaction";
    let _one = exclusive().await;
    let (client, ns) = setup(TEST, json!({"ownChild": true})).await?;
    let host = in_process_host(TEST).await?;
    apply_widgets(&client, &ns, PARENTS, 1).await?;
    wait_reconciled(&client, &ns, PARENTS).await?;
    let kept = children_by_parent(&client, &ns).await?;

    // Changes land while the API server is down and etcd's history is compacted: the host's
    // watches resume from resourceVersions that no longer exist (410 Gone) and must relist.
    Plane::get().ask(Request::Kill("kube-apiserver")).await?;
    Plane::get().ask(Request::Compact).await?;
    Plane::get().ask(Request::Start("kube-apiserver")).await?;
    let client = Plane::get().client().await?;
    let started = Instant::now();
    apply_widgets(&client, &ns, PARENTS, 2).await?;
    Plane::get().ask(Request::Compact).await?;
    wait_children_at(&client, &ns, 2).await?;
    wait_reconciled(&client, &ns, PARENTS).await?;
    report(
        "etcd compacted while the API server was down, then during 200 changes",
        &format!("all changes converged in {:.1?}", started.elapsed()),
    );
    check_invariant(&client, &ns, PARENTS, 2, &kept).await?;
    host.stop().await?;
    Ok(())
}

/// Puts the API server back as it was, however the test ends (a failed assertion
/// included), so the next test sharing this plane finds it as it should.
struct RestoreApiServer;

impl Drop for RestoreApiServer {
    fn drop(&mut self) {
        for request in [
            Request::Kill("kube-apiserver"),
            Request::Start("kube-apiserver"),
        ] {
            if let Err(e) = Plane::get().ask_blocking(request) {
                eprintln!("faults: the API server could not be put back: {e:#}");
            }
        }
    }
}

/// Restart the API server with `argument` added, until what this returns is dropped.
async fn api_server_with(argument: &str) -> anyhow::Result<RestoreApiServer> {
    Plane::get().ask(Request::Kill("kube-apiserver")).await?;
    let restore = RestoreApiServer;
    Plane::get()
        .ask(Request::StartWith(
            "kube-apiserver",
            vec![argument.to_owned()],
        ))
        .await?;
    Ok(restore)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_without_streaming_lists_is_listed_page_by_page() -> anyhow::Result<()> {
    const TEST: &str = "fault-no-watch-list";
    let _one = exclusive().await;
    let (_, ns) = setup(TEST, json!({"ownChild": true})).await?;
    // An API server that refuses `sendInitialEvents` (422), as one with the gate off or from
    // before it does: every watch the host starts must list instead, or no cache ever syncs.
    let _restore = api_server_with("--feature-gates=WatchList=false").await?;
    let client = Plane::get().client().await?;
    let refusal = client
        .request_text(
            http::Request::get(format!(
                "/apis/{TEST_GROUP}/v1/namespaces/{ns}/widgets?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=1"
            ))
            .body(Vec::new())?,
        )
        .await;
    anyhow::ensure!(
        refusal
            .as_ref()
            .is_err_and(|e| e.to_string().contains("sendInitialEvents")),
        "the API server should refuse a streaming list: {refusal:?}"
    );
    let host = in_process_host(TEST).await?;
    apply_widgets(&client, &ns, 20, 1).await?;
    let took = wait_reconciled(&client, &ns, 20).await?;
    report(
        "an API server that refuses streaming lists",
        &format!("20 parents converged in {took:.1?}, every watch listing page by page"),
    );
    check_invariant(&client, &ns, 20, 1, &BTreeMap::new()).await?;
    host.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_sigkilled_mid_convergence_is_replaced_without_loss() -> anyhow::Result<()> {
    const TEST: &str = "fault-host-kill";
    let _one = exclusive().await;
    let (client, ns) = setup(TEST, json!({"ownChild": true})).await?;
    let first = host_process_for(TEST)?;
    apply_widgets(&client, &ns, PARENTS, 1).await?;
    wait_reconciled(&client, &ns, PARENTS / 4).await?;
    first.kill()?;
    let kept_before = children_by_parent(&client, &ns).await?;

    let started = Instant::now();
    let second = host_process_for(TEST)?;
    let took = wait_reconciled(&client, &ns, PARENTS).await?;
    report(
        "host SIGKILLed at 25 % converged",
        &format!(
            "a new host process converged all {PARENTS} in {took:.1?} ({:.1?} after start)",
            started.elapsed()
        ),
    );
    // Children made before the kill survive it.
    let kept: BTreeMap<_, _> = kept_before
        .into_iter()
        .filter(|(parent, _)| !parent.starts_with('<'))
        .collect();
    check_invariant(&client, &ns, PARENTS, 1, &kept).await?;
    second.kill()?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hosts_at_once_converge_without_fighting() -> anyhow::Result<()> {
    const TEST: &str = "fault-two-hosts";
    let _one = exclusive().await;
    let (client, ns) = setup(TEST, json!({"ownChild": true})).await?;
    let one = in_process_host(TEST).await?;
    let two = in_process_host(TEST).await?;
    apply_widgets(&client, &ns, PARENTS, 1).await?;
    let took = wait_reconciled(&client, &ns, PARENTS).await?;
    report(
        "two hosts, no leader election",
        &format!("all {PARENTS} converged in {took:.1?}; no child duplicated or flapping"),
    );
    // Both keep running through the no-write check: neither undoes the other.
    check_invariant(&client, &ns, PARENTS, 1, &BTreeMap::new()).await?;
    one.stop().await?;
    two.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_traps_while_finalizing_holds_parents_until_fixed() -> anyhow::Result<()> {
    const TEST: &str = "fault-finalizing";
    let _one = exclusive().await;
    let (client, ns) = setup(TEST, json!({"ownChild": true})).await?;
    let finalizing = |behavior: &str| {
        let mut spec = widget_policy(&ns, json!({"ownChild": true, "behavior": behavior}));
        spec["finalize"] = json!(true);
        spec
    };
    apply_policy(&client, TEST, TEST, finalizing("panic-finalizing")).await?;
    let host = in_process_host(TEST).await?;
    const N: usize = 50;
    apply_widgets(&client, &ns, N, 1).await?;
    wait_reconciled(&client, &ns, N).await?;
    let api = widgets(&client, &ns);
    for i in 0..N / 2 {
        api.delete(&format!("w-{i}"), &Default::default()).await?;
    }
    // The plugin traps on every finalizing call: the deleted parents stay, and say why.
    eventually("the finalizing failures reported", CONVERGE, || async {
        let failing = api
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|w| {
                let w = serde_json::to_value(w).unwrap_or_default();
                condition(&w, "Reconciled").is_some_and(|c| c["reason"] == "PluginFailed")
            })
            .count();
        Ok(failing == N / 2)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(api.list(&ListParams::default()).await?.items.len(), N);

    // Fixed: the deleted parents go, their children with them, the others stay converged.
    let started = Instant::now();
    apply_policy(&client, TEST, TEST, finalizing("")).await?;
    eventually("the deleted parents gone", CONVERGE, || async {
        Ok(api.list(&ListParams::default()).await?.items.len() == N / 2)
    })
    .await?;
    eventually("their children collected", CONVERGE, || async {
        Ok(children_by_parent(&client, &ns).await?.len() == N / 2)
    })
    .await?;
    report(
        "plugin trapping while finalizing 25 parents, then fixed",
        &format!(
            "all released and collected {:.1?} after the fix",
            started.elapsed()
        ),
    );
    check_invariant(&client, &ns, N / 2, 1, &BTreeMap::new()).await?;

    // Deleted while its parents hold finalizers, the policy lets them all go.
    // Only once the holding plugin serves: deleting sooner races the swap.
    let active_since = || async {
        let policy = policies(&client).get(TEST).await?;
        anyhow::Ok(policy.data["status"]["activeSince"].clone())
    };
    let before = active_since().await?;
    let plugin_holds = finalizing("hold-finalizer");
    apply_policy(&client, TEST, TEST, plugin_holds).await?;
    eventually("the holding plugin swapped in", CONVERGE, || async {
        Ok(active_since().await? != before)
    })
    .await?;
    for i in N / 2..N {
        api.delete(&format!("w-{i}"), &Default::default()).await?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        api.list(&ListParams::default()).await?.items.len(),
        N / 2,
        "held"
    );
    policies(&client).delete(TEST, &Default::default()).await?;
    eventually("every parent released", CONVERGE, || async {
        Ok(api.list(&ListParams::default()).await?.items.is_empty())
    })
    .await?;
    wait_gone(&policies(&client), TEST, "the policy gone").await?;
    host.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_plugins_under_load_do_not_stop_a_good_policy() -> anyhow::Result<()> {
    const TEST: &str = "fault-hostile";
    let _one = exclusive().await;
    let (client, ns) = setup(TEST, json!({"ownChild": true})).await?;
    let host = in_process_host(TEST).await?;
    apply_widgets(&client, &ns, PARENTS, 1).await?;
    wait_reconciled(&client, &ns, PARENTS).await?;
    // The baseline: 200 changes, alone.
    let started = Instant::now();
    apply_widgets(&client, &ns, PARENTS, 2).await?;
    wait_children_at(&client, &ns, 2).await?;
    wait_reconciled(&client, &ns, PARENTS).await?;
    let alone = started.elapsed();

    // Every hostile behaviour, 50 parents each, each in a namespace (and policy) of its own.
    // A log flood is cut off by the log budget and the answer still counts; the others fail.
    const HOSTILE: [(&str, bool); 7] = [
        ("loop", true),
        ("grow-memory", true),
        ("big-output", true),
        ("invalid-json", true),
        ("panic", true),
        ("exit", true),
        ("log-flood", false),
    ];
    let mut hostile = Vec::new();
    for (behavior, fails) in HOSTILE {
        let name = format!("{TEST}-{behavior}");
        let hostile_ns = create_namespace(&client, &name).await?;
        let mut spec = widget_policy(&hostile_ns, json!({"behavior": behavior, "ownChild": true}));
        spec["limits"] = json!({"timeoutMs": 1000});
        spec["maxConcurrentReconciles"] = json!(4);
        apply_policy(&client, TEST, &name, spec).await?;
        apply_widgets(&client, &hostile_ns, 50, 1).await?;
        hostile.push((name, hostile_ns, fails));
    }
    // Let them fail for a while, then the good policy's parents change under that load.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let started = Instant::now();
    apply_widgets(&client, &ns, PARENTS, 3).await?;
    wait_children_at(&client, &ns, 3).await?;
    wait_reconciled(&client, &ns, PARENTS).await?;
    let loaded = started.elapsed();
    report(
        "7 hostile plugins x 50 parents beside a good policy",
        &format!(
            "200 changes converged in {loaded:.1?}, against {alone:.1?} alone ({:.2}x)",
            loaded.as_secs_f64() / alone.as_secs_f64()
        ),
    );
    for (_, hostile_ns, fails) in &hostile {
        if *fails {
            assert_eq!(
                reconciled_count(&client, hostile_ns).await?,
                0,
                "no hostile parent converged in {hostile_ns}"
            );
            assert!(
                children_by_parent(&client, hostile_ns).await?.is_empty(),
                "a failing plugin created nothing in {hostile_ns}"
            );
        }
    }
    for (name, _, _) in &hostile {
        policies(&client).delete(name, &Default::default()).await?;
    }
    check_invariant(&client, &ns, PARENTS, 3, &BTreeMap::new()).await?;
    host.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_looping_policy_at_high_concurrency_barely_slows_another() -> anyhow::Result<()> {
    const TEST: &str = "fault-looping";
    let _one = exclusive().await;
    let (client, ns) = setup(TEST, json!({"ownChild": true})).await?;
    let host = in_process_host(TEST).await?;
    apply_widgets(&client, &ns, PARENTS, 1).await?;
    wait_reconciled(&client, &ns, PARENTS).await?;
    let round = |size: u64| {
        let client = client.clone();
        let ns = ns.clone();
        async move {
            let started = Instant::now();
            apply_widgets(&client, &ns, PARENTS, size).await?;
            wait_children_at(&client, &ns, size).await?;
            wait_reconciled(&client, &ns, PARENTS).await?;
            anyhow::Ok(started.elapsed())
        }
    };
    let alone = round(2).await?;

    // Policy A: a plugin that loops until its 1 s deadline, 50 parents, asking for 16 at once.
    let looping = format!("{TEST}-a");
    let looping_ns = create_namespace(&client, &looping).await?;
    let mut spec = widget_policy(&looping_ns, json!({"behavior": "loop"}));
    spec["limits"] = json!({"timeoutMs": 1000});
    apply_policy(&client, TEST, &looping, spec).await?;
    apply_widgets(&client, &looping_ns, 50, 1).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let beside = round(3).await?;
    report(
        "a looping plugin (50 parents, maxConcurrentReconciles 16, 1 s deadline) beside a good policy",
        &format!(
            "200 changes converged in {beside:.1?}, against {alone:.1?} alone ({:.2}x)",
            beside.as_secs_f64() / alone.as_secs_f64()
        ),
    );
    assert_eq!(reconciled_count(&client, &looping_ns).await?, 0);
    policies(&client)
        .delete(&looping, &Default::default())
        .await?;
    check_invariant(&client, &ns, PARENTS, 3, &BTreeMap::new()).await?;
    host.stop().await?;
    Ok(())
}

/// Every write `identity` sent (Events and its Lease included), as the audit log has them:
/// (when the API server received it, in ms since the epoch; verb; URI; response code).
fn writes_by(identity: &str) -> anyhow::Result<Vec<(i64, String, String, i64)>> {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    let text = std::fs::read_to_string(&Plane::get().audit_log)?;
    Ok(text
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|e| {
            e["stage"] == "ResponseComplete"
                && e["impersonatedUser"]["username"] == identity
                && matches!(
                    e["verb"].as_str().unwrap_or_default(),
                    "create" | "update" | "patch" | "delete" | "deletecollection"
                )
                // A self-review asks a question (a standby may ask it too): no write.
                && e["objectRef"]["resource"]
                    .as_str()
                    .is_none_or(|resource| !resource.starts_with("selfsubject"))
        })
        .filter_map(|e| {
            let received: MicroTime =
                serde_json::from_value(e["requestReceivedTimestamp"].clone()).ok()?;
            Some((
                received.0.as_millisecond(),
                e["verb"].as_str()?.to_owned(),
                e["requestURI"].as_str()?.to_owned(),
                e["responseStatus"]["code"].as_i64().unwrap_or_default(),
            ))
        })
        .collect())
}

async fn wait_for_holder(
    leases: &Api<k8s_openapi::api::coordination::v1::Lease>,
    identity: &str,
    within: Duration,
) -> anyhow::Result<()> {
    eventually(&format!("{identity} holds the lease"), within, || async {
        let holder = leases
            .get_opt("wasmctrl-leader")
            .await?
            .and_then(|lease| lease.spec)
            .and_then(|spec| spec.holder_identity);
        Ok(holder.as_deref() == Some(identity))
    })
    .await
}

fn now_ms() -> anyhow::Result<i64> {
    Ok(i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis(),
    )?)
}

/// How soon after a frozen process resumes a write that slipped past the fence would reach
/// the API server: one held inside the process goes out at once (for the failure's message).
const IN_FLIGHT_ARRIVAL_MS: i64 = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_frozen_past_its_lease_sends_nothing_new_once_resumed() -> anyhow::Result<()> {
    const TEST: &str = "fault-frozen-leader";
    const FROZEN: &str = "replica-frozen";
    const STANDBY: &str = "replica-standby";
    let _one = exclusive().await;
    let (client, ns) = setup(TEST, json!({"ownChild": true})).await?;
    let dir = tempfile::tempdir()?;
    let leases = Api::namespaced(client.clone(), &ns);
    let mut frozen = replica_process_for(TEST, FROZEN, &ns, dir.path())?;
    wait_for_holder(&leases, FROZEN, CONVERGE).await?;
    let standby = replica_process_for(TEST, STANDBY, &ns, dir.path())?;
    apply_widgets(&client, &ns, PARENTS, 1).await?;
    wait_reconciled(&client, &ns, PARENTS / 4).await?;

    // Frozen mid-convergence, its writes under way: its monotonic clock keeps running.
    frozen.signal(libc::SIGSTOP)?;
    let stopped_at = Instant::now();
    let stopped_at_ms = now_ms()?;
    wait_for_holder(&leases, STANDBY, LEASE_DURATION * 3).await?;
    let failover = stopped_at.elapsed();
    // Changes while it is frozen: its watches will deliver them the moment it resumes.
    apply_widgets(&client, &ns, PARENTS, 2).await?;
    tokio::time::sleep(
        (LEASE_DURATION + Duration::from_secs(10)).saturating_sub(stopped_at.elapsed()),
    )
    .await;
    frozen.signal(libc::SIGCONT)?;
    let resumed_at_ms = now_ms()?;
    let frozen_for = stopped_at.elapsed();
    // It finds its lead gone and stops.
    frozen.exit_within(CONVERGE).await?;
    wait_children_at(&client, &ns, 2).await?;
    let took = wait_reconciled(&client, &ns, PARENTS).await?;

    let writes = writes_by(FROZEN)?;
    let last_renewal = writes
        .iter()
        // Taking the lease (a create, 201) starts the lead as a renewal (an update, 200)
        // extends it: a replica frozen soon after it took the lease has renewed nothing yet.
        .filter(|(at, verb, uri, code)| {
            let renewed = (verb == "update" && *code == 200) || (verb == "create" && *code == 201);
            *at <= stopped_at_ms && renewed && uri.contains("/leases")
        })
        .map(|(at, ..)| *at)
        .max()
        .context("the frozen replica took or renewed its lease before it froze")?;
    let deadline = last_renewal + i64::try_from(RENEW_DEADLINE.as_millis())?;
    // None after the deadline: the gate refuses a write started after the resume, drops one
    // still waiting inside the client, and the fenced connection drops one handed to it but
    // not yet written. What the kernel held when it froze arrived while it was frozen (see
    // `leader/write_gate.rs`). A late write arriving right at the resume would be one that
    // slipped past the fence, and the failure counts those.
    let late: Vec<_> = writes.iter().filter(|(at, ..)| *at > deadline).collect();
    let at_resume = late
        .iter()
        .filter(|(at, ..)| *at <= resumed_at_ms + IN_FLIGHT_ARRIVAL_MS)
        .count();
    assert!(
        late.is_empty(),
        "the frozen leader wrote after its renew deadline ({at_resume} of them within {IN_FLIGHT_ARRIVAL_MS} ms of the resume, as one held inside the process would): {late:#?}"
    );
    assert!(
        writes
            .iter()
            .any(|(_, _, uri, _)| uri.contains("/configmaps")),
        "the frozen replica led (and wrote children) before it froze"
    );
    report(
        "leader SIGSTOPped at 25 % converged, resumed after the standby took over",
        &format!(
            "standby led {failover:.1?} after the freeze; frozen {frozen_for:.1?}, no write after its deadline; all {PARENTS} converged {took:.1?} after it resumed"
        ),
    );
    check_invariant(&client, &ns, PARENTS, 2, &BTreeMap::new()).await?;
    drop(standby);
    Ok(())
}

/// Widgets or Gadgets in `ns` that hold `finalizer`.
async fn holding(api: &Api<DynamicObject>, finalizer: &str) -> anyhow::Result<usize> {
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|p| {
            p.metadata
                .finalizers
                .iter()
                .flatten()
                .any(|f| f == finalizer)
        })
        .count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finalizing_policy_moved_between_two_parent_kinds_strands_nothing() -> anyhow::Result<()>
{
    const TEST: &str = "fault-finalizer-kinds";
    const GADGETS: usize = 20;
    let _one = exclusive().await;
    let (client, ns) = setup(TEST, json!({"ownChild": true})).await?;
    install_crd(&client, &test_crd(TEST_GROUP, "Gadget")).await?;
    let finalizing = |kind: &str| {
        let mut spec = widget_policy(&ns, json!({"ownChild": true}));
        spec["parent"]["kind"] = json!(kind);
        spec["finalize"] = json!(true);
        spec
    };
    apply_policy(&client, TEST, TEST, finalizing("Widget")).await?;
    let host = in_process_host(TEST).await?;
    apply_widgets(&client, &ns, PARENTS, 1).await?;
    wait_reconciled(&client, &ns, PARENTS).await?;
    let finalizer = format!("wasmctrl.dev/{TEST}");
    let widgets = widgets(&client, &ns);
    let gadgets = api(&client, &resource(TEST_GROUP, "v1", "Gadget"), &ns);
    eventually("every Widget finalized", CONVERGE, || async {
        Ok(holding(&widgets, &finalizer).await? == PARENTS)
    })
    .await?;
    let kept = children_by_parent(&client, &ns).await?;

    // Moved to Gadgets while all 200 Widgets hold its finalizer.
    let started = Instant::now();
    apply_policy(&client, TEST, TEST, finalizing("Gadget")).await?;
    for i in 0..GADGETS {
        let gadget = json!({"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Gadget", "metadata": {"name": format!("g-{i}")}, "spec": {"size": 1}});
        apply(&gadgets, gadget).await?;
    }
    eventually("every Widget released", CONVERGE, || async {
        Ok(holding(&widgets, &finalizer).await? == 0)
    })
    .await?;
    let released = started.elapsed();
    eventually("every Gadget finalized", CONVERGE, || async {
        Ok(holding(&gadgets, &finalizer).await? == GADGETS)
    })
    .await?;
    // Deleting parents of the old kind completes; their children are collected.
    const DELETED: usize = PARENTS / 4;
    for i in 0..DELETED {
        widgets
            .delete(&format!("w-{i}"), &Default::default())
            .await?;
    }
    eventually("the old kind's deleted parents gone", CONVERGE, || async {
        Ok(widgets.list(&ListParams::default()).await?.items.len() == PARENTS - DELETED)
    })
    .await?;
    // The new kind is finalized through the plugin, as before.
    for i in 0..GADGETS {
        gadgets
            .delete(&format!("g-{i}"), &Default::default())
            .await?;
    }
    eventually("every Gadget finalized and gone", CONVERGE, || async {
        Ok(gadgets.list(&ListParams::default()).await?.items.is_empty())
    })
    .await?;

    // Back to Widgets: the rest are finalized again, their children kept as they were.
    apply_policy(&client, TEST, TEST, finalizing("Widget")).await?;
    eventually(
        "the remaining Widgets finalized again",
        CONVERGE,
        || async { Ok(holding(&widgets, &finalizer).await? == PARENTS - DELETED) },
    )
    .await?;
    eventually(
        "the deleted parents' children collected",
        CONVERGE,
        || async {
            let children = children_by_parent(&client, &ns).await?;
            Ok(children.len() == PARENTS - DELETED && !children.keys().any(|k| k.starts_with('<')))
        },
    )
    .await?;
    report(
        "a finalizing policy moved from 200 Widgets to Gadgets and back",
        &format!(
            "every Widget released {released:.1?} after the edit; none stranded, none re-created"
        ),
    );
    check_invariant(&client, &ns, PARENTS - DELETED, 1, &kept).await?;
    let policy = policies(&client).get(TEST).await?;
    assert_eq!(
        policy.data["status"]["finalizedScopes"],
        json!([{"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Widget", "namespace": ns}])
    );
    host.stop().await?;
    Ok(())
}

/// The policy's `status.pruneGuard` (null in the steady state).
async fn prune_guard(client: &Client, policy: &str) -> anyhow::Result<Value> {
    let policy = policies(client).get(policy).await?;
    Ok(policy.data["status"]["pruneGuard"].clone())
}

/// Wait until the policy's prune guard is `Held`; its window.
async fn wait_held(client: &Client, policy: &str) -> anyhow::Result<Value> {
    eventually("the prune guard holding", CONVERGE, || async {
        let held = prune_guard(client, policy).await?["state"] == "Held";
        let ready = policies(client).get(policy).await?.data["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["reason"] == "PruneHeld");
        Ok(held && ready)
    })
    .await?;
    prune_guard(client, policy).await
}

/// Wait until the policy's prune guard window closed (every parent reconciled under the
/// last change).
async fn wait_steady(client: &Client, policy: &str) -> anyhow::Result<()> {
    eventually("the prune guard's window closed", CONVERGE, || async {
        Ok(prune_guard(client, policy).await?.is_null())
    })
    .await
}

/// Children of `ns`'s parents, by parent, leaving out the entry of children without a live
/// parent.
fn live(
    children: BTreeMap<String, Vec<(String, Value)>>,
) -> BTreeMap<String, Vec<(String, Value)>> {
    children
        .into_iter()
        .filter(|(parent, _)| !parent.starts_with('<'))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_to_a_plugin_that_answers_nothing_is_held_until_confirmed_or_rolled_back()
-> anyhow::Result<()> {
    const TEST: &str = "fault-prune-guard";
    const FLOOR: usize = 5;
    let _one = exclusive().await;
    let (client, ns) = setup(TEST, json!({"ownChild": true})).await?;
    let host = in_process_host(TEST).await?;
    apply_widgets(&client, &ns, PARENTS, 1).await?;
    wait_reconciled(&client, &ns, PARENTS).await?;
    wait_steady(&client, TEST).await?;
    let before = children_by_parent(&client, &ns).await?;
    assert_eq!(before.len(), PARENTS);

    // The bad swap: the same plugin, configured to answer no children.
    let started = Instant::now();
    apply_policy(&client, TEST, TEST, widget_policy(&ns, json!({}))).await?;
    let window = wait_held(&client, TEST).await?;
    let held_after = started.elapsed();
    // Let every parent come round under the bad plugin (2 s resync), then count.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let window = {
        let now = prune_guard(&client, TEST).await?;
        assert_eq!(now["confirm"], window["confirm"], "one window: {now}");
        now
    };
    let left = live(children_by_parent(&client, &ns).await?);
    let deleted = PARENTS - left.len();
    report(
        "a swap to a plugin answering no children, 200 parents",
        &format!(
            "held {held_after:.1?} after the swap with {deleted} of {PARENTS} children deleted (floor {FLOOR}); {} deletions held",
            window["heldDeletions"]
        ),
    );
    assert!(deleted <= FLOOR, "{deleted} deleted, beyond the floor");
    assert_eq!(window["deleted"], deleted as u64, "{window}");
    assert_eq!(
        window["heldDeletions"],
        (PARENTS - deleted) as u64,
        "{window}"
    );
    assert_eq!(
        window["examples"].as_array().map(Vec::len),
        Some(5),
        "{window}"
    );
    for (parent, owned) in &left {
        assert_eq!(
            before[parent][0].0, owned[0].0,
            "{parent}'s child was replaced while held"
        );
    }

    // Rolled back: the hold clears, nothing more is deleted, and the few deleted come back.
    apply_policy(
        &client,
        TEST,
        TEST,
        widget_policy(&ns, json!({"ownChild": true})),
    )
    .await?;
    wait_reconciled(&client, &ns, PARENTS).await?;
    eventually("every child back", CONVERGE, || async {
        Ok(live(children_by_parent(&client, &ns).await?).len() == PARENTS)
    })
    .await?;
    wait_steady(&client, TEST).await?;
    check_invariant(&client, &ns, PARENTS, 1, &left).await?;

    // The bad swap again, this time confirmed: the held deletions proceed.
    let kept = live(children_by_parent(&client, &ns).await?);
    apply_policy(&client, TEST, TEST, widget_policy(&ns, json!({}))).await?;
    wait_held(&client, TEST).await?;
    // A confirmation lets exactly what is held go: the admin confirms once every parent
    // came round and the hold names all that the change would delete.
    let accounted = |window: &Value| {
        window["heldDeletions"].as_u64().unwrap_or(0) + window["deleted"].as_u64().unwrap_or(0)
    };
    let started_waiting = Instant::now();
    let window = loop {
        let window = prune_guard(&client, TEST).await?;
        if accounted(&window) == PARENTS as u64 {
            break window;
        }
        anyhow::ensure!(
            started_waiting.elapsed() < CONVERGE,
            "not every deletion held or made: {window}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let token = window["confirm"].as_str().context("a confirmation token")?;
    let started = Instant::now();
    policies(&client)
        .patch(
            TEST,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"annotations": {
                "wasmctrl.dev/confirm-prune": token,
            }}})),
        )
        .await?;
    eventually("every child pruned", CONVERGE, || async {
        Ok(children_by_parent(&client, &ns).await?.is_empty())
    })
    .await?;
    report(
        "the same swap confirmed",
        &format!(
            "all {PARENTS} children pruned {:.1?} after the confirmation",
            started.elapsed()
        ),
    );
    wait_steady(&client, TEST).await?;
    let policy = policies(&client).get(TEST).await?;
    let ready = policy.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready")
        .cloned()
        .unwrap_or_default();
    assert_eq!(ready["reason"], "Running", "{ready}");
    assert_eq!(reconciled_count(&client, &ns).await?, PARENTS);
    assert_eq!(kept.len(), PARENTS);
    // Quiet afterwards: a resync of parents without children writes nothing.
    let mut last = host_writes(&ns)?;
    let quiet_from = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let now = host_writes(&ns)?;
        if now.len() == last.len() {
            break;
        }
        assert!(
            quiet_from.elapsed() < QUIET,
            "still writing {QUIET:?} after the prunes: {:#?}",
            &now[last.len()..]
        );
        last = now;
    }
    let users = get(&config_maps(&client, &ns), "users-own")
        .await?
        .context("the user's ConfigMap was deleted")?;
    assert_eq!(users["data"]["k"], "v");
    host.stop().await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Sharding: every replica reconciles its share.

/// Shards of the sharded replicas' set, and parents they share.
const SHARDS: u32 = 12;
const SHARDED_PARENTS: usize = 600;

/// Starts a replica of `wasmctrl run --shards SHARDS` for `test`, acting as the identity
/// given, its Leases in `ns`; killed when dropped (a failure half-way must not wait on a
/// stopped process).
fn sharded_replicas<'a>(
    test: &'a str,
    ns: &'a str,
    dir: &'a std::path::Path,
) -> impl Fn(&str) -> anyhow::Result<(SelfProcess, std::net::SocketAddr)> + 'a {
    move |identity| {
        let shards = SHARDS.to_string();
        replica_process_sharing(test, identity, ns, dir, &["--shards", &shards])
    }
}

/// Who holds each of the `SHARDS` shard Leases in `ns` (`None`: released or never taken).
async fn shard_holders(
    leases: &Api<k8s_openapi::api::coordination::v1::Lease>,
) -> anyhow::Result<BTreeMap<u32, Option<String>>> {
    let mut holders = BTreeMap::new();
    for shard in 0..SHARDS {
        let holder = leases
            .get_opt(&format!("wasmctrl-shard-{shard}"))
            .await?
            .and_then(|lease| lease.spec)
            .and_then(|spec| spec.holder_identity);
        holders.insert(shard, holder);
    }
    Ok(holders)
}

/// Wait until every shard is held, each of `replicas` holding `each`; how long it took.
async fn wait_shared(
    leases: &Api<k8s_openapi::api::coordination::v1::Lease>,
    replicas: &[&str],
    each: usize,
    within: Duration,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    eventually(
        &format!("{replicas:?} holding {each} shards each"),
        within,
        || async {
            let holders = shard_holders(leases).await?;
            Ok(replicas.iter().all(|replica| {
                holders
                    .values()
                    .filter(|holder| holder.as_deref() == Some(replica))
                    .count()
                    == each
            }) && holders.values().all(Option::is_some))
        },
    )
    .await?;
    Ok(started.elapsed())
}

/// Wait until every shard is held by one of `replicas` (those of any other were taken).
async fn wait_held_only_by(
    leases: &Api<k8s_openapi::api::coordination::v1::Lease>,
    replicas: &[&str],
    within: Duration,
) -> anyhow::Result<()> {
    eventually(
        &format!("every shard held by one of {replicas:?}"),
        within,
        || async {
            let holders = shard_holders(leases).await?;
            Ok(holders
                .values()
                .all(|holder| holder.as_deref().is_some_and(|h| replicas.contains(&h))))
        },
    )
    .await
}

/// Wait until each of `replicas` (its name, where it serves its metrics) caches the parents
/// of the shards it holds and their children, as its `wasmctrl_cached_objects` says, and
/// so none of another replica's shards: it watches per shard. Each Widget has one child.
async fn caches_hold_their_shards(
    client: &Client,
    ns: &str,
    leases: &Api<k8s_openapi::api::coordination::v1::Lease>,
    replicas: &[(&str, std::net::SocketAddr)],
) -> anyhow::Result<()> {
    let mut per_shard: BTreeMap<u32, usize> = BTreeMap::new();
    for widget in widgets(client, ns).list(&ListParams::default()).await? {
        let uid = widget.metadata.uid.unwrap_or_default();
        *per_shard
            .entry(wasmctrl::shards::shard_of(&uid, SHARDS))
            .or_default() += 1;
    }
    let last = std::sync::Mutex::new(Vec::new());
    let held = eventually(
        "each replica caching its own shards' objects only",
        Duration::from_secs(60),
        || async {
            let holders = shard_holders(leases).await?;
            let mut seen = Vec::new();
            for (replica, address) in replicas {
                let wanted: usize = holders
                    .iter()
                    .filter(|(_, holder)| holder.as_deref() == Some(*replica))
                    .map(|(shard, _)| per_shard.get(shard).copied().unwrap_or_default())
                    .sum();
                let (_, metrics) = http_get(*address, "/metrics").await?;
                let cached = |cache: &str| {
                    let label = format!("cache=\"{cache}\"");
                    metrics
                        .lines()
                        .filter(|line| line.starts_with("wasmctrl_cached_objects{"))
                        .find(|line| line.contains(&label))
                        .and_then(|line| line.rsplit(' ').next()?.parse::<usize>().ok())
                };
                seen.push((*replica, wanted, cached("parents"), cached("children")));
            }
            let done = seen.iter().all(|(_, wanted, parents, children)| {
                *parents == Some(*wanted) && *children == Some(*wanted)
            });
            *last.lock().expect("not poisoned") = seen;
            Ok(done)
        },
    )
    .await;
    held.map_err(|error| {
        let last = last.lock().expect("not poisoned");
        error.context(format!(
            "(replica, its shards' parents, cached parents, cached children): {last:?}"
        ))
    })
}

/// The parent a write of `uri` was for: a Widget's own (its status) or its child
/// `<parent>-own`.
fn parent_written(uri: &str) -> Option<String> {
    let path = uri.split('?').next()?;
    if let Some((_, rest)) = path.split_once("/widgets/") {
        return rest.split('/').next().map(str::to_owned);
    }
    let (_, rest) = path.split_once("/configmaps/")?;
    rest.strip_suffix("-own").map(str::to_owned)
}

/// The writes for parents (their status and children) each of `replicas` sent, by parent:
/// (when the API server received it, replica), in order.
fn writes_per_parent(replicas: &[&str]) -> anyhow::Result<BTreeMap<String, Vec<(i64, String)>>> {
    let mut per_parent: BTreeMap<String, Vec<(i64, String)>> = BTreeMap::new();
    for replica in replicas {
        for (at, _, uri, _) in writes_by(replica)? {
            if let Some(parent) = parent_written(&uri) {
                per_parent
                    .entry(parent)
                    .or_default()
                    .push((at, (*replica).to_owned()));
            }
        }
    }
    for writes in per_parent.values_mut() {
        writes.sort();
    }
    Ok(per_parent)
}

/// Parents written by two replicas in turns that interleave: once another replica took a
/// parent's shard and wrote for it, the one before never wrote for it again.
fn interleaved(per_parent: &BTreeMap<String, Vec<(i64, String)>>) -> Vec<String> {
    per_parent
        .iter()
        .filter(|(_, writes)| {
            let mut turns: Vec<&str> = Vec::new();
            for (_, replica) in writes.iter() {
                if turns.last() != Some(&replica.as_str()) {
                    turns.push(replica);
                }
            }
            let mut seen = std::collections::BTreeSet::new();
            !turns.iter().all(|replica| seen.insert(*replica))
        })
        .map(|(parent, writes)| format!("{parent}: {writes:?}"))
        .collect()
}

/// Wait until the policy's status counts all `SHARDED_PARENTS` as reconciled, summed over
/// its 12 shards, each held by one of `replicas` and counted by it.
async fn wait_counted_across_shards(
    client: &Client,
    policy: &str,
    replicas: &[&str],
) -> anyhow::Result<()> {
    let last = std::sync::Mutex::new(Value::Null);
    let counted = eventually(
        "the policy's status counting every shard",
        CONVERGE,
        || async {
            let status = policies(client).get(policy).await?.data["status"].clone();
            let shards = status["shards"].as_array().cloned().unwrap_or_default();
            let summed: u64 = shards
                .iter()
                .filter_map(|shard| shard["parentsReconciled"].as_u64())
                .sum();
            let held = shards.iter().all(|shard| {
                shard["holder"]
                    .as_str()
                    .is_some_and(|holder| replicas.contains(&holder))
            });
            let done = status["parentsReconciled"] == SHARDED_PARENTS as u64
                && status["parentsFailing"] == 0
                && shards.len() == SHARDS as usize
                && summed == SHARDED_PARENTS as u64
                && held;
            *last.lock().expect("not poisoned") = status;
            Ok(done)
        },
    )
    .await;
    counted.map_err(|error| {
        let last = last.lock().expect("not poisoned");
        error.context(format!("status: {last}"))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_replicas_share_the_work_and_survive_a_kill_a_join_and_a_freeze()
-> anyhow::Result<()> {
    const TEST: &str = "fault-shards";
    const REPLICAS: [&str; 4] = ["shard-a", "shard-b", "shard-c", "shard-d"];
    let [a, b, c, d] = REPLICAS;
    let _one = exclusive().await;
    let (client, ns) = setup(TEST, json!({"ownChild": true})).await?;
    // A slower resync than the other faults': 600 parents on three hosts and this machine's
    // two cores.
    let mut policy = widget_policy(&ns, json!({"ownChild": true}));
    policy["resyncPeriodSeconds"] = json!(10);
    apply_policy(&client, TEST, TEST, policy).await?;
    let dir = tempfile::tempdir()?;
    let leases = Api::namespaced(client.clone(), &ns);
    let replica = sharded_replicas(TEST, &ns, dir.path());

    // Three replicas hold 4 shards each, and each does its share of the work.
    let ((first, at_a), (mut second, at_b), (third, _)) = (replica(a)?, replica(b)?, replica(c)?);
    let settled = wait_shared(&leases, &[a, b, c], 4, CONVERGE).await?;
    apply_widgets(&client, &ns, SHARDED_PARENTS, 1).await?;
    let took = wait_reconciled(&client, &ns, SHARDED_PARENTS).await?;
    let per_parent = writes_per_parent(&REPLICAS)?;
    let share = |replica: &str| {
        per_parent
            .values()
            .filter(|writes| writes.iter().any(|(_, by)| by == replica))
            .count()
    };
    let shares: Vec<usize> = [a, b, c].iter().map(|replica| share(replica)).collect();
    report(
        "three sharded replicas, 12 shards",
        &format!(
            "4 shards each {settled:.1?} after start; {SHARDED_PARENTS} parents converged in {took:.1?}, written by a, b, c: {shares:?}"
        ),
    );
    for (replica, written) in [a, b, c].iter().zip(&shares) {
        assert!(
            *written * 5 >= SHARDED_PARENTS,
            "{replica} wrote for {written} of {SHARDED_PARENTS} parents, under 20 %"
        );
    }
    assert!(interleaved(&per_parent).is_empty(), "two writers at once");
    // The policy's status counts every shard's parents, each shard's from its holder.
    wait_counted_across_shards(&client, TEST, &[a, b, c]).await?;
    let kept = children_by_parent(&client, &ns).await?;

    // SIGKILL c: its shards are taken within a lease and 10 s, and its parents' changes
    // made meanwhile are reconciled.
    third.kill()?;
    let killed = Instant::now();
    apply_widgets(&client, &ns, SHARDED_PARENTS, 2).await?;
    wait_held_only_by(&leases, &[a, b], LEASE_DURATION + Duration::from_secs(10)).await?;
    let taken = killed.elapsed();
    wait_children_of(&client, &ns, SHARDED_PARENTS, 2).await?;
    wait_reconciled(&client, &ns, SHARDED_PARENTS).await?;
    report(
        "a sharded replica SIGKILLed",
        &format!(
            "its shards taken {taken:.1?} after the kill; every parent at its new size {:.1?} after it",
            killed.elapsed()
        ),
    );

    // d joins while every parent changes: 3 shards move to it, and no parent is written by
    // two replicas in turns that overlap.
    let joined = Instant::now();
    let (fourth, at_d) = replica(d)?;
    apply_widgets(&client, &ns, SHARDED_PARENTS, 3).await?;
    let rebalanced = wait_shared(&leases, &[a, b, d], 4, CONVERGE).await?;
    wait_children_of(&client, &ns, SHARDED_PARENTS, 3).await?;
    wait_reconciled(&client, &ns, SHARDED_PARENTS).await?;
    let interleaved_now = interleaved(&writes_per_parent(&REPLICAS)?);
    assert!(
        interleaved_now.is_empty(),
        "parents written by two replicas in overlapping turns: {interleaved_now:#?}"
    );
    // The shards that moved to d left a's and b's caches.
    caches_hold_their_shards(&client, &ns, &leases, &[(a, at_a), (b, at_b), (d, at_d)]).await?;
    report(
        "a fourth replica joined while every parent changed",
        &format!(
            "4 shards each {rebalanced:.1?} after it started; every parent converged {:.1?} after; no parent written by two replicas at once",
            joined.elapsed()
        ),
    );

    // b frozen past its lease: a and d take its shards; once resumed, b writes nothing for a
    // parent between its shards' deadlines and the first shard it claims again. (It may be
    // given back a shard it held before, so turns are not compared from here on.)
    second.signal(libc::SIGSTOP)?;
    let stopped_at = Instant::now();
    let stopped_at_ms = now_ms()?;
    wait_held_only_by(&leases, &[a, d], LEASE_DURATION * 3).await?;
    let failover = stopped_at.elapsed();
    apply_widgets(&client, &ns, SHARDED_PARENTS, 4).await?;
    tokio::time::sleep(
        (LEASE_DURATION + Duration::from_secs(10)).saturating_sub(stopped_at.elapsed()),
    )
    .await;
    second.signal(libc::SIGCONT)?;
    let resumed_at_ms = now_ms()?;
    wait_children_of(&client, &ns, SHARDED_PARENTS, 4).await?;
    wait_reconciled(&client, &ns, SHARDED_PARENTS).await?;
    wait_shared(&leases, &[a, b, d], 4, CONVERGE).await?;
    let writes = writes_by(b)?;
    let is_shard_lease = |uri: &str| uri.contains("/leases/wasmctrl-shard-");
    let last_renewal = writes
        .iter()
        .filter(|(at, verb, uri, code)| {
            *at <= stopped_at_ms
                && is_shard_lease(uri)
                && ((verb == "update" && *code == 200) || (verb == "create" && *code == 201))
        })
        .map(|(at, ..)| *at)
        .max()
        .context("b renewed its shards before it froze")?;
    let deadline = last_renewal + i64::try_from(RENEW_DEADLINE.as_millis())?;
    let claimed_again = writes
        .iter()
        .filter(|(at, verb, uri, code)| {
            *at >= resumed_at_ms && is_shard_lease(uri) && verb == "update" && *code == 200
        })
        .map(|(at, ..)| *at)
        .min()
        .context("b claimed shards again after it resumed")?;
    let late: Vec<_> = writes
        .iter()
        .filter(|(at, _, uri, _)| {
            *at > deadline && *at < claimed_again && parent_written(uri).is_some()
        })
        .collect();
    assert!(
        late.is_empty(),
        "the frozen replica wrote for parents after its shards' deadline: {late:#?}"
    );
    report(
        "a sharded replica SIGSTOPped past its lease",
        &format!(
            "its shards taken {failover:.1?} after the freeze; nothing written for a parent after its deadline; 4 shards each again after it resumed"
        ),
    );
    check_invariant(&client, &ns, SHARDED_PARENTS, 4, &kept).await?;
    wait_counted_across_shards(&client, TEST, &[a, b, d]).await?;
    drop((first, second, fourth));
    Ok(())
}

/// The parents (by name) each label write of `replicas` was for: a patch of a Widget itself,
/// not of its status (the fault suite's policy sets no finalizer).
fn label_writes(replicas: &[&str]) -> anyhow::Result<BTreeMap<String, usize>> {
    let mut per_parent = BTreeMap::new();
    for replica in replicas {
        for (_, verb, uri, code) in writes_by(replica)? {
            let path = uri.split('?').next().unwrap_or_default();
            let Some((_, name)) = path.split_once("/widgets/") else {
                continue;
            };
            if verb == "patch" && code == 200 && !name.contains('/') {
                *per_parent.entry(name.to_owned()).or_default() += 1;
            }
        }
    }
    Ok(per_parent)
}

/// The shard label of `widget` and the one its uid says it should carry.
fn shard_labels_of(widget: &DynamicObject) -> (Option<String>, String) {
    let uid = widget.metadata.uid.clone().unwrap_or_default();
    let label = widget
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get("wasmctrl.dev/uid-shard"))
        .cloned();
    let shard = wasmctrl::shards::shard_of(&uid, SHARDS);
    (label, format!("{shard}-of-{SHARDS}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_replicas_label_their_parents_once_where_the_api_server_cannot_narrow_watches()
-> anyhow::Result<()> {
    const TEST: &str = "fault-shard-labels";
    const REPLICAS: [&str; 2] = ["labels-a", "labels-b"];
    let [a, b] = REPLICAS;
    let _one = exclusive().await;
    let (_, ns) = setup(TEST, json!({"ownChild": true})).await?;
    let _restore = api_server_with("--feature-gates=ShardedListAndWatch=false").await?;
    let client = Plane::get().client().await?;
    anyhow::ensure!(
        !wasmctrl::shards::selector::narrows_by_shard(&client).await?,
        "the API server should not narrow lists by shard with its gate off"
    );
    // Parents made before sharding starts (as when it is turned on for a running set),
    // one of them already labelled for another shard count.
    apply_widgets(&client, &ns, PARENTS, 1).await?;
    widgets(&client, &ns)
        .patch(
            "w-0",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"metadata": {"labels": {"wasmctrl.dev/uid-shard": "0-of-4"}}}),
            ),
        )
        .await?;
    let dir = tempfile::tempdir()?;
    let leases = Api::namespaced(client.clone(), &ns);
    let replica = sharded_replicas(TEST, &ns, dir.path());
    let ((first, at_a), (second, at_b)) = (replica(a)?, replica(b)?);
    let started = Instant::now();
    wait_shared(&leases, &[a, b], 6, CONVERGE).await?;
    let took = wait_reconciled(&client, &ns, PARENTS).await?;

    // Every parent carries its uid's shard, written once, by one replica.
    let listed = widgets(&client, &ns).list(&ListParams::default()).await?;
    let wrong: Vec<_> = listed
        .items
        .iter()
        .map(|widget| (widget.metadata.name.clone(), shard_labels_of(widget)))
        .filter(|(_, (label, wanted))| label.as_ref() != Some(wanted))
        .collect();
    assert!(
        wrong.is_empty(),
        "parents not labelled with their shard: {wrong:?}"
    );
    let labelled = label_writes(&REPLICAS)?;
    let twice: Vec<_> = labelled
        .iter()
        .filter(|(_, writes)| **writes != 1)
        .collect();
    assert_eq!(labelled.len(), PARENTS, "parents labelled: {labelled:?}");
    assert!(
        twice.is_empty(),
        "parents labelled more than once: {twice:?}"
    );
    // Each replica caches its own shards' parents and children only.
    caches_hold_their_shards(&client, &ns, &leases, &[(a, at_a), (b, at_b)]).await?;
    report(
        "two sharded replicas, an API server that cannot narrow watches",
        &format!(
            "{PARENTS} parents labelled once each and converged {took:.1?} after the replicas started ({:.1?} in all)",
            started.elapsed()
        ),
    );

    // A parent labelled for another shard by hand, with a change to its spec, is put right
    // by the replica whose watch it lands in, and then reconciled by its own shard's holder;
    // one whose label is taken off is labelled again.
    let w1 = widgets(&client, &ns).get("w-1").await?;
    let (_, right) = shard_labels_of(&w1);
    let own: u32 = right.split('-').next().unwrap_or_default().parse()?;
    let other = format!("{}-of-{SHARDS}", (own + 1) % SHARDS);
    for (name, label) in [("w-1", json!(other)), ("w-2", Value::Null)] {
        let patch =
            json!({"metadata": {"labels": {"wasmctrl.dev/uid-shard": label}}, "spec": {"size": 2}});
        let params = kube::api::PatchParams::default();
        widgets(&client, &ns)
            .patch(name, &params, &kube::api::Patch::Merge(patch))
            .await?;
    }
    let child_at_2 = |name: &'static str| {
        let client = client.clone();
        let ns = ns.clone();
        async move {
            let children = children_by_parent(&client, &ns).await?;
            anyhow::Ok(
                children
                    .get(name)
                    .is_some_and(|owned| owned.iter().all(|(_, c)| c["data"]["size"] == "2")),
            )
        }
    };
    eventually(
        "w-1 and w-2 labelled again and reconciled",
        CONVERGE,
        || async {
            let w1 = widgets(&client, &ns).get("w-1").await?;
            let w2 = widgets(&client, &ns).get("w-2").await?;
            let put_right = |widget: &DynamicObject| {
                let (label, wanted) = shard_labels_of(widget);
                label == Some(wanted)
            };
            Ok(put_right(&w1)
                && put_right(&w2)
                && child_at_2("w-1").await?
                && child_at_2("w-2").await?)
        },
    )
    .await?;

    // Every parent changed: no label is written again, and every parent converges.
    let before = label_writes(&REPLICAS)?;
    apply_widgets(&client, &ns, PARENTS, 3).await?;
    wait_children_of(&client, &ns, PARENTS, 3).await?;
    wait_reconciled(&client, &ns, PARENTS).await?;
    check_invariant(&client, &ns, PARENTS, 3, &BTreeMap::new()).await?;
    let after = label_writes(&REPLICAS)?;
    assert_eq!(
        before, after,
        "labels written again after the parents changed"
    );
    let relabelled: usize = ["w-1", "w-2"].iter().map(|name| after[*name] - 1).sum();
    assert_eq!(
        relabelled, 2,
        "w-1 and w-2 each labelled once more: {after:?}"
    );
    drop((first, second));
    Ok(())
}
