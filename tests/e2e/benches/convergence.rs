//! Convergence benchmark: N MyApps created at once, reconciled by a wasmctrl host; then the
//! same first-pass writes from a plain client. Each phase runs on a fresh local control plane.
//!
//! Reports, per size: time until every MyApp is reconciled (children applied, status written
//! with `observedGeneration` and `Reconciled=True`), time until every MyApp is `Ready` (its
//! Deployment's pod is ready, which also measures the controller-manager, scheduler and kwok),
//! the writes the host issued (from the API server's audit log, which never rotates), the
//! host's peak RSS and its RSS every second, and the CPU seconds of kube-apiserver, etcd and
//! the client up to all-reconciled (is the API server the limit, or the client?). The
//! baseline is a plain kube client issuing the first pass of the same writes (apply
//! Deployment, apply Service, apply status, the plugin's Events) with the same concurrency,
//! timed by the same watch of the MyApps as the host (to every status seen written); the
//! ratio (baseline time / host time) says what the host's watches, caches, queue and plugin
//! calls cost. The baseline writes each MyApp as its create returns, while the rest are still
//! being created, as the host meets them; `WASMCTRL_BENCH_BASELINE=after-creates` writes them
//! once all are created, and `as-created,after-creates` runs both (see [`Timeline`]).
//! `WASMCTRL_BENCH_CLUSTER=api-only` stops the controller-manager, the scheduler and kwok before
//! each phase's first create, so that the phases compare the clients alone (see [`Cluster`]).
//!
//! Once every MyApp is Ready (or the cluster is quiet), it swaps the plugin to v2 and back
//! (the rollout: the last Deployment rebuilt, and its rate against the all-reconciled rate),
//! then stops the host and starts a new one on the converged cluster: the time to its caches
//! synced, to the last parent checked, and the writes it made (none should be needed).
//!
//! It also reads the memory the host's explain records hold (`wasmctrl_explain_records_bytes`,
//! bounded by `--explain-memory-mib`, 16 MiB by default) once every MyApp is Ready.
//!
//! Run with `cargo xtask bench convergence` (sizes: `WASMCTRL_BENCH_SIZES=1000,5000`; repeats
//! alternating which phase goes first: `WASMCTRL_BENCH_REPEAT=2`; the host's explain memory:
//! `WASMCTRL_BENCH_EXPLAIN_MIB`, default 32, 0 keeps no records; stop at all reconciled,
//! without waiting for the pods, swapping or restarting: `WASMCTRL_BENCH_UNTIL=reconciled`;
//! swap and restart without waiting for the pods: `WASMCTRL_BENCH_UNTIL=quiet`, which stops
//! the controller-manager, scheduler and kwok once all are reconciled, so that the cluster
//! goes quiet in seconds instead of the hour 10,000 pods take on two cores; the host alone,
//! without the baseline: `WASMCTRL_BENCH_PHASES=host`; extra environment for the host alone,
//! e.g. a heap profiler's `LD_PRELOAD`, or `WASMCTRL_MAX_CONCURRENT_CALLS`, which the host
//! reads as `wasmctrl run` does: `WASMCTRL_BENCH_HOST_ENV`; a Go CPU profile of
//! kube-apiserver over each phase's first seconds: `WASMCTRL_BENCH_APISERVER_PROFILE=dir`, see
//! [`profile_apiserver`]). The host runs in a child process (this binary, re-executed) so its
//! RSS is its own. With `WASMCTRL_BENCH_HOSTS=1,2,3`, it measures scale-out instead: see
//! [`scale_out`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::{StreamExt as _, TryStreamExt as _};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Client, ResourceExt as _};
use serde_json::{Value, json};
use wasmctrl_e2e::{SelfProcess, myapp, myapps};
use wasmctrl_testenv::cluster::{
    Audit, Binaries, ControlPlane, Lifetime, admin_client, admin_config, memory_mib,
};

// The host's allocator, as in the `wasmctrl` binary: the host under test runs in this
// process's re-executed copy.
wasmctrl::host_allocator!();

#[path = "convergence/scale_out.rs"]
mod scale_out;

/// Concurrency of the host's policy and of the baseline client.
const CONCURRENCY: u32 = 16;
/// Env var that turns this binary into the host under test: `namespace|selector|kubeconfig`.
const HOST_MODE: &str = "WASMCTRL_BENCH_HOST";
const SELECTOR_LABEL: &str = "bench.wasmctrl.dev/run";
/// Env var giving the host under test its listener address, for `/metrics`.
const HOST_LISTEN: &str = "WASMCTRL_BENCH_LISTEN";

fn main() -> std::process::ExitCode {
    // The host under test compiles its plugins in a child of this executable.
    wasmctrl_e2e::bench::main(bench)
}

fn bench() -> anyhow::Result<()> {
    if let Ok(spec) = std::env::var(HOST_MODE) {
        return run_host(&spec);
    }
    if let Ok(args) = std::env::var(scale_out::CLI_MODE) {
        return scale_out::run_cli(&args);
    }
    // `cargo bench` passes `--bench`; anything else is a filter we do not support.
    let sizes: Vec<usize> = std::env::var("WASMCTRL_BENCH_SIZES")
        .unwrap_or_else(|_| "1000,5000".into())
        .split(',')
        .map(|s| s.trim().parse().context("WASMCTRL_BENCH_SIZES"))
        .collect::<anyhow::Result<_>>()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let binaries = Binaries::build(&wasmctrl_testenv::repo_root())?;
    let plugin = wasmctrl_testenv::plugins::guest("myapp_plugin");
    let repeats: usize = std::env::var("WASMCTRL_BENCH_REPEAT")
        .unwrap_or_else(|_| "1".into())
        .parse()
        .context("WASMCTRL_BENCH_REPEAT")?;
    // `host` alone skips the baseline: for looking into the host (its memory, a profile)
    // without paying for the comparison.
    let timelines = match std::env::var("WASMCTRL_BENCH_PHASES").as_deref() {
        Err(_) | Ok("host,baseline") => Timeline::from_env()?,
        Ok("host") => Vec::new(),
        Ok(other) => bail!("WASMCTRL_BENCH_PHASES must be host or host,baseline, not {other}"),
    };
    if let Some(counts) = scale_out::counts_from_env()? {
        if Cluster::from_env()? == Cluster::ApiOnly {
            bail!("WASMCTRL_BENCH_CLUSTER=api-only is not offered with WASMCTRL_BENCH_HOSTS");
        }
        let by_label = scale_out::by_label_from_env()?;
        let mut runs = Vec::new();
        for &n in &sizes {
            for &hosts in &counts {
                let name = format!("{n}-scale-{hosts}");
                let (dir, mut plane) = fresh_plane(&runtime, &binaries, &name, Audit::Writes)?;
                if by_label {
                    runtime.block_on(scale_out::without_sharded_watches(&mut plane, &binaries))?;
                }
                let run = runtime.block_on(scale_out::phase(n, hosts, &plane, &plugin));
                plane.stop();
                let _ = std::fs::remove_dir_all(&dir);
                runs.push(run?);
            }
        }
        scale_out::print_table(&runs);
        return Ok(());
    }
    if Cluster::from_env()? == Cluster::ApiOnly && Until::from_env()? == Until::Ready {
        bail!(
            "WASMCTRL_BENCH_CLUSTER=api-only makes no pods: set WASMCTRL_BENCH_UNTIL to reconciled or quiet"
        );
    }
    let mut rows = Vec::new();
    for repeat in 0..repeats {
        for &n in &sizes {
            // Host and baselines each on a fresh control plane, the order reversed on every
            // other repeat, so none inherits another's objects, and each phase takes each place.
            // Logging reads too, so the host's and the baseline's requests are counted.
            let fresh = |phase: &str| {
                fresh_plane(
                    &runtime,
                    &binaries,
                    &format!("{n}-{phase}"),
                    Audit::Everything,
                )
            };
            let host_first = repeat % 2 == 0;
            let mut host = None;
            let mut baselines = Vec::new();
            // `None` is the host's phase.
            let mut order: Vec<Option<Timeline>> = std::iter::once(None)
                .chain(timelines.iter().copied().map(Some))
                .collect();
            if !host_first {
                order.reverse();
            }
            for phase in order {
                let (dir, plane) = fresh(phase.map_or("host", Timeline::name))?;
                let result = match phase {
                    None => runtime
                        .block_on(host_phase(n, &plane, &plugin))
                        .map(|h| host = Some(h)),
                    Some(timeline) => runtime
                        .block_on(baseline_phase(n, &plane, timeline))
                        .map(|b| baselines.push(b)),
                };
                plane.stop();
                let _ = std::fs::remove_dir_all(&dir);
                result?;
            }
            let Some(host) = host else {
                bail!("the host phase of size {n} did not run");
            };
            rows.push(Row {
                n,
                host_first,
                host,
                baselines,
            });
        }
    }
    print_table(&rows);
    print_restarts(&rows);
    Ok(())
}

/// A control plane of its own for one phase (`name`), in a directory emptied first.
fn fresh_plane(
    runtime: &tokio::runtime::Runtime,
    binaries: &Binaries,
    name: &str,
    audit: Audit,
) -> anyhow::Result<(PathBuf, ControlPlane)> {
    let dir = wasmctrl_testenv::plugins::target_dir().join(format!("cluster-bench-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    let plane = runtime.block_on(ControlPlane::start_auditing(
        &dir,
        binaries,
        Lifetime::TiedToStarter,
        audit,
    ))?;
    Ok((dir, plane))
}

struct Row {
    n: usize,
    /// Whether the host phase ran first.
    host_first: bool,
    host: HostRun,
    /// One per timeline of `WASMCTRL_BENCH_BASELINE`; none with `WASMCTRL_BENCH_PHASES=host`.
    baselines: Vec<BaselineRun>,
}

/// The host's run on its own control plane.
struct HostRun {
    reconciled: Duration,
    /// Unless the run stopped at all reconciled (`WASMCTRL_BENCH_UNTIL=reconciled`).
    ready: Option<Duration>,
    writes: BTreeMap<String, usize>,
    peak_rss_mib: f64,
    /// The host's RSS (MiB) sampled every second from the first create to all Ready.
    rss: Vec<(Duration, f64)>,
    /// CPU seconds from the first create to all reconciled.
    cpu: Cpu,
    /// Reconciles and plugin calls until all reconciled.
    counts: ReconcileCounts,
    /// The host's API requests until all reconciled, by verb.
    requests: BTreeMap<String, usize>,
    /// Memory and count of the explain records once all were Ready.
    explain: (f64, u64),
    /// What the plugin instance pool kept resident then (MiB).
    pool_mib: f64,
    /// After all Ready, unless the run stopped at all reconciled.
    swaps: Option<[Swap; 2]>,
    /// After the swaps, unless the run stopped at all reconciled.
    restart: Option<Restart>,
}

/// A new host started on the converged cluster (after the swaps).
struct Restart {
    /// From its start to its caches synced (`/readyz`).
    synced: Duration,
    /// From its start to the last parent checked.
    checked: Duration,
    reconciles: u64,
    /// Should be empty: a converged cluster needs no writes.
    writes: BTreeMap<String, usize>,
    peak_rss_mib: f64,
}

/// The plain client's run on its own control plane.
struct BaselineRun {
    timeline: Timeline,
    elapsed: Duration,
    writes: usize,
    /// Its API requests besides creating the MyApps, by verb.
    requests: BTreeMap<String, usize>,
    cpu: Cpu,
}

/// The host's reconciles until all were reconciled, from its metrics.
#[derive(Default, Clone, Copy)]
struct ReconcileCounts {
    reconciles: f64,
    plugin_calls: f64,
    /// Reconciles that found nothing but the host's own writes changed, and asked nothing.
    unchanged: f64,
    /// Reconciles that found someone else's change while the creates of the last decision
    /// were on their way, and asked nothing yet.
    awaiting: f64,
    /// Parents that settled after a change, the plugin calls that took, and how many of
    /// them took at most two.
    converged: f64,
    calls_to_converge: f64,
    converged_in_two: f64,
}

impl ReconcileCounts {
    fn read(metrics: &str) -> Self {
        const CONVERGE: &str = "wasmctrl_plugin_calls_to_converge";
        Self {
            reconciles: metric_sum(metrics, "controller_runtime_reconcile_total{"),
            plugin_calls: metric_sum(metrics, "wasmctrl_plugin_calls_total{"),
            unchanged: metric_sum(metrics, "wasmctrl_reconciles_unchanged_total{"),
            awaiting: metric_sum(metrics, "wasmctrl_reconciles_awaiting_creates_total{"),
            converged: metric_sum(metrics, &format!("{CONVERGE}_count{{")),
            calls_to_converge: metric_sum(metrics, &format!("{CONVERGE}_sum{{")),
            converged_in_two: metrics
                .lines()
                .filter(|l| {
                    l.starts_with(&format!("{CONVERGE}_bucket{{")) && l.contains("le=\"2.0\"")
                })
                .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
                .sum(),
        }
    }

    /// The plugin calls parents took to converge: the mean, and the share within two.
    fn calls_to_converge_figure(&self) -> String {
        if self.converged == 0.0 {
            return "—".to_owned();
        }
        format!(
            "{:.2} ({:.1} % in ≤ 2)",
            self.calls_to_converge / self.converged,
            100.0 * self.converged_in_two / self.converged
        )
    }
}

/// CPU seconds spent by the API server, etcd and the client (the host, or the baseline's
/// process) over one phase: whether the API server or the client is the bottleneck.
#[derive(Default, Clone, Copy)]
struct Cpu {
    apiserver: f64,
    etcd: f64,
    client: f64,
    /// The rest of the control plane: controller-manager, scheduler, kwok.
    others: f64,
    /// This process: the creates of the MyApps and the progress watch, in every phase; in the
    /// baseline's it is the client too.
    bench: f64,
    /// Every process on the machine (`/proc/stat`): how close the phase came to the cores.
    machine: f64,
}

/// One hot swap: from the policy update to the policy reporting the new digest, and to the
/// first and the last parent reconciled by it.
struct Swap {
    active: Duration,
    first: Duration,
    last: Duration,
    /// The host's writes from the policy update until it was quiet again.
    writes: BTreeMap<String, usize>,
    /// The host's peak RSS since it started, once quiet after the swap (MiB).
    peak_rss_mib: f64,
    /// What the plugin instance pool kept resident then (MiB).
    pool_mib: f64,
}

/// A host phase's client and namespace on `plane`: the repository's CRDs installed, the
/// namespace `name` made, the policy of `run` with `plugin` applied, and no plugin artifact
/// left cached from an earlier phase.
async fn host_namespace(
    plane: &ControlPlane,
    run: &str,
    name: &str,
    plugin: &Path,
) -> anyhow::Result<(Client, String)> {
    let client = admin_client(&plane.kubeconfig).await?;
    wasmctrl_testenv::crds::install_repo_crds(&client).await?;
    let ns = create_namespace(&client, name).await?;
    apply_policy(&client, run, plugin).await?;
    let _ = std::fs::remove_dir_all(artifact_cache());
    Ok((client, ns))
}

async fn host_phase(n: usize, plane: &ControlPlane, plugin: &Path) -> anyhow::Result<HostRun> {
    let run = format!("n{n}");
    // The host, in its own process.
    let (client, host_ns) = host_namespace(plane, &run, &format!("bench-host-{n}"), plugin).await?;
    let (host, listen) = spawn_host(&host_ns, &run, plane)?;
    let host_pid = host.id();
    wait_policy_ready(&client, "bench").await?;
    let audit_before = audit_lines(&plane.audit_log)?;

    let myapps = myapps(&client, &host_ns);
    let probe = CpuProbe::new(plane, host_pid);
    let until = Until::from_env()?;
    let watch = tokio::spawn(watch_progress(
        myapps.clone(),
        n,
        probe.clone(),
        until,
        reconciled_by_host,
    ));
    let (stop_sampling, sampling) = tokio::sync::oneshot::channel::<()>();
    let sampler = tokio::spawn(sample_rss(host_pid, sampling));
    // A CPU profile of the host alone, from the first create to all reconciled, when asked
    // (`cargo xtask bench profile`).
    let profiler = match std::env::var_os(wasmctrl_e2e::profile::PROFILE_DIR_ENV) {
        Some(dir) => Some(wasmctrl_e2e::profile::Profiler::start(
            host_pid,
            Path::new(&dir),
            &run,
        )?),
        None => None,
    };
    let cluster = Cluster::from_env()?;
    cluster.settle(plane).await?;
    let cpu_before = probe.read();
    let apiserver_profile = profile_apiserver(&client, "host", n);
    let started = Instant::now();
    create_myapps(&myapps, n).await?;
    let (reconciled_at, ready_at, cpu_at_reconciled) = watch.await??;
    if let Some(profile) = apiserver_profile {
        profile.await??;
    }
    let (_, metrics) = http_get(listen, "/metrics").await?;
    let counts = ReconcileCounts::read(&metrics);
    let requests = count_requests(&plane.audit_log, audit_before, |event| {
        agent(event).starts_with(wasmctrl::USER_AGENT)
    })?;
    if let Some(profiler) = profiler {
        print_profile(
            n,
            profiler.finish()?,
            &metrics,
            cpu_at_reconciled.client - cpu_before.client,
        );
    }
    let _ = stop_sampling.send(());
    let rss = sampler.await?;
    let reconciled = reconciled_at.duration_since(started);
    let ready = ready_at.map(|at| at.duration_since(started));
    // Let the last echoes settle before counting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let peak_rss_mib = memory_mib(host_pid, "VmHWM").unwrap_or(f64::NAN);
    let (_, metrics) = http_get(listen, "/metrics").await?;
    let explain = explain_store(&metrics)?;
    let pool_mib = pool_resident_mib(&metrics)?;
    let writes = count_writes(&plane.audit_log, audit_before, &host_ns)?;
    let settled = match until {
        Until::Ready => true,
        Until::Reconciled => false,
        Until::Quiet => {
            // Nothing moves the Deployments' status any more: the cluster goes quiet once
            // the host has caught up with the last changes.
            if cluster == Cluster::Whole {
                stop_pod_makers(plane).await?;
            }
            true
        }
    };

    // Hot swap to v2 (compiled now: the host's artifact cache started empty), then back to
    // v1 (its precompiled artifact is on disk since the host started); once the host is
    // quiet, so the swaps do not compete with the first rollout.
    let swaps = if settled {
        wait_quiet(listen).await?;
        let v2 = wasmctrl_testenv::plugins::guest("myapp_v2_plugin");
        let deployments = Api::<DynamicObject>::namespaced_with(
            client.clone(),
            &host_ns,
            &ApiResource::from_gvk(&GroupVersionKind::gvk("apps", "v1", "Deployment")),
        );
        // A swap, with the writes it caused and the host's peak so far, once quiet again.
        let swap = async |plugin: &Path, to_v2: bool| -> anyhow::Result<Swap> {
            let audit = audit_lines(&plane.audit_log)?;
            let mut swap = measure_swap(&client, &run, plugin, &deployments, n, to_v2).await?;
            wait_quiet(listen).await?;
            swap.writes = count_writes(&plane.audit_log, audit, &host_ns)?;
            swap.peak_rss_mib = memory_mib(host_pid, "VmHWM").unwrap_or(f64::NAN);
            swap.pool_mib = pool_resident_mib(&http_get(listen, "/metrics").await?.1)?;
            Ok(swap)
        };
        Some([swap(&v2, true).await?, swap(plugin, false).await?])
    } else {
        None
    };
    // A restart of the converged host, once it is quiet after the swaps.
    let restart = if settled {
        wait_quiet(listen).await?;
        drop(host);
        Some(measure_restart(&host_ns, &run, plane, n).await?)
    } else {
        drop(host);
        None
    };
    Ok(HostRun {
        reconciled,
        ready,
        writes,
        peak_rss_mib,
        rss,
        cpu: cpu_at_reconciled.since(cpu_before),
        counts,
        requests,
        explain,
        pool_mib,
        swaps,
        restart,
    })
}

/// Start the host under test in its own process (this binary, re-executed), serving
/// `/readyz` and `/metrics` at the returned address; stopped (SIGTERM, then waited for) when
/// dropped, so a phase that fails half-way leaves no host running.
fn spawn_host(
    host_ns: &str,
    run: &str,
    plane: &ControlPlane,
) -> anyhow::Result<(SelfProcess, std::net::SocketAddr)> {
    let listen = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let host = SelfProcess::spawn(
        std::process::Command::new(std::env::current_exe()?)
            .env(HOST_LISTEN, listen.to_string())
            .env(
                HOST_MODE,
                format!(
                    "{host_ns}|{SELECTOR_LABEL}={run}|{}",
                    plane.kubeconfig.display()
                ),
            )
            .env("WASMCTRL_LOG", "warn")
            .envs(host_env()?),
    )
    .context("starting the host")?
    .stop_on_drop_with(libc::SIGTERM);
    Ok((host, listen))
}

/// Start a new host on the converged cluster and time it: to its caches synced (`/readyz`
/// answers 200) and to the last parent checked (at least `n` reconciles finished, none
/// running and none waiting). Counts the writes it made, which should be none.
async fn measure_restart(
    host_ns: &str,
    run: &str,
    plane: &ControlPlane,
    n: usize,
) -> anyhow::Result<Restart> {
    let audit_before = audit_lines(&plane.audit_log)?;
    let started = Instant::now();
    let (host, listen) = spawn_host(host_ns, run, plane)?;
    let deadline = started + Duration::from_secs(600);
    let mut synced = None;
    let checked = loop {
        if Instant::now() > deadline {
            bail!("the restarted host did not check every parent in 10 minutes");
        }
        if synced.is_none()
            && http_get(listen, "/readyz")
                .await
                .is_ok_and(|(code, _)| code == 200)
        {
            synced = Some(started.elapsed());
        }
        if synced.is_some() {
            let progress = HostProgress::read(listen).await?;
            if progress.reconciles >= n as f64 && progress.idle() {
                break started.elapsed();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let reconciles = HostProgress::read(listen).await?.reconciles as u64;
    // Writes answered later than the last check would still be the restart's.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let peak_rss_mib = memory_mib(host.id(), "VmHWM").unwrap_or(f64::NAN);
    drop(host);
    let writes = count_writes(&plane.audit_log, audit_before, host_ns)?;
    Ok(Restart {
        synced: synced.unwrap_or_default(),
        checked,
        reconciles,
        writes,
        peak_rss_mib,
    })
}

/// The host's work so far, from its `/metrics`.
struct HostProgress {
    /// Reconciles finished, any result.
    reconciles: f64,
    active: f64,
    waiting: f64,
}

impl HostProgress {
    async fn read(address: std::net::SocketAddr) -> anyhow::Result<Self> {
        let (_, text) = http_get(address, "/metrics").await?;
        Ok(Self {
            reconciles: metric_sum(&text, "controller_runtime_reconcile_total{"),
            active: metric_sum(&text, "controller_runtime_active_workers{"),
            waiting: metric_sum(&text, "workqueue_depth{"),
        })
    }

    fn idle(&self) -> bool {
        self.active == 0.0 && self.waiting == 0.0
    }
}

/// Wait until the host has been idle, with no reconcile finished, for five seconds: the
/// controller-manager's echoes of the last writes (Deployment status, ReplicaSets) are over.
async fn wait_quiet(address: std::net::SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30 * 60);
    let mut last = HostProgress::read(address).await?.reconciles;
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < Duration::from_secs(5) {
        if Instant::now() > deadline {
            bail!("the host was still reconciling after 30 minutes");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let progress = HostProgress::read(address).await?;
        if progress.reconciles != last || !progress.idle() {
            last = progress.reconciles;
            quiet_since = Instant::now();
        }
    }
    Ok(())
}

/// The baseline: the same first-pass writes from a plain client.
async fn baseline_phase(
    n: usize,
    plane: &ControlPlane,
    timeline: Timeline,
) -> anyhow::Result<BaselineRun> {
    let client = admin_client(&plane.kubeconfig).await?;
    wasmctrl_testenv::crds::install_repo_crds(&client).await?;
    let base_ns = create_namespace(&client, &format!("bench-base-{n}")).await?;
    let base_myapps = myapps(&client, &base_ns);
    let audit_before = audit_lines(&plane.audit_log)?;
    let probe = CpuProbe::new(plane, std::process::id());
    // Timed as the host is: by the same watch, to every status seen written.
    let watch = tokio::spawn(watch_progress(
        base_myapps.clone(),
        n,
        probe.clone(),
        Until::Reconciled,
        written_for_generation,
    ));
    Cluster::from_env()?.settle(plane).await?;
    let cpu_before = probe.read();
    let apiserver_profile = profile_apiserver(&client, &format!("baseline-{}", timeline.name()), n);
    let started = Instant::now();
    match timeline {
        Timeline::AsCreated => {
            // The creates run on their own, as they do beside the host; each MyApp's writes
            // start as its create returns.
            let (created_tx, created_rx) = futures::channel::mpsc::unbounded();
            let creating = async {
                create_myapps_each(&base_myapps, n, |app| {
                    // The writes end only once every MyApp came through or failed.
                    let _ = created_tx.unbounded_send(app);
                })
                .await?;
                drop(created_tx);
                Ok::<_, anyhow::Error>(())
            };
            tokio::try_join!(creating, baseline_writes(&client, &base_ns, created_rx))?;
        }
        Timeline::AfterCreates => {
            let mut created = Vec::with_capacity(n);
            create_myapps_each(&base_myapps, n, |app| created.push(app)).await?;
            baseline_writes(&client, &base_ns, futures::stream::iter(created)).await?;
        }
    }
    let (written_at, _, cpu_at_written) = watch.await??;
    let elapsed = written_at.duration_since(started);
    let cpu = cpu_at_written.since(cpu_before);
    if let Some(profile) = apiserver_profile {
        profile.await??;
    }
    let writes = count_writes(&plane.audit_log, audit_before, &base_ns)?
        .iter()
        .filter(|(k, _)| !k.starts_with("create myapps"))
        .map(|(_, v)| v)
        .sum();
    // This process's requests; the control plane's components are told by their agents.
    let marker = format!("/namespaces/{base_ns}/");
    let requests = count_requests(&plane.audit_log, audit_before, |event| {
        let uri = event["requestURI"].as_str().unwrap_or_default();
        uri.contains(&marker)
            && !control_plane_agent(agent(event))
            && !(event["verb"] == "create" && uri.contains("/myapps"))
    })?;
    Ok(BaselineRun {
        timeline,
        elapsed,
        writes,
        requests,
        cpu,
    })
}

/// With `WASMCTRL_BENCH_APISERVER_PROFILE=dir`, a Go CPU profile of kube-apiserver over the
/// first `WASMCTRL_BENCH_APISERVER_PROFILE_SECONDS` (default 15) of a phase, from its
/// `/debug/pprof/profile` endpoint, saved as `dir/<phase>-<n>.pb.gz` for
/// `go tool pprof -top`: where the API server's CPU goes for the host's pass and for the plain
/// client's. Keep the seconds within the shorter phase.
fn profile_apiserver(
    client: &Client,
    phase: &str,
    n: usize,
) -> Option<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let dir = PathBuf::from(std::env::var_os("WASMCTRL_BENCH_APISERVER_PROFILE")?);
    let seconds: u64 = std::env::var("WASMCTRL_BENCH_APISERVER_PROFILE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    let client = client.clone();
    let path = dir.join(format!("{phase}-{n}.pb.gz"));
    let phase = phase.to_owned();
    Some(tokio::spawn(async move {
        use futures::AsyncReadExt as _;
        let request = http::Request::get(format!("/debug/pprof/profile?seconds={seconds}"))
            .body(Vec::new())?;
        let mut body = Vec::new();
        client
            .request_stream(request)
            .await
            .context("kube-apiserver's CPU profile")?
            .read_to_end(&mut body)
            .await?;
        std::fs::create_dir_all(&dir)?;
        std::fs::write(&path, body).with_context(|| format!("writing {}", path.display()))?;
        eprintln!(
            "kube-apiserver CPU profile of the {phase} phase at {n}: {}",
            path.display()
        );
        Ok(())
    }))
}

/// Extra environment for the host process alone, from `WASMCTRL_BENCH_HOST_ENV`
/// (space-separated `NAME=value` pairs): an allocator setting, or a heap profiler's
/// `LD_PRELOAD`, without it reaching the baseline or this process.
fn host_env() -> anyhow::Result<Vec<(String, String)>> {
    let Ok(pairs) = std::env::var("WASMCTRL_BENCH_HOST_ENV") else {
        return Ok(Vec::new());
    };
    pairs
        .split_whitespace()
        .map(|pair| {
            pair.split_once('=')
                .map(|(name, value)| (name.to_owned(), value.to_owned()))
                .with_context(|| format!("WASMCTRL_BENCH_HOST_ENV: {pair} is not NAME=value"))
        })
        .collect()
}

/// The host's RSS every second until `stop` fires.
async fn sample_rss(
    pid: u32,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Vec<(Duration, f64)> {
    let started = Instant::now();
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Some(rss) = memory_mib(pid, "VmRSS") {
                    samples.push((started.elapsed(), rss));
                }
            }
            _ = &mut stop => return samples,
        }
    }
}

/// The processes whose CPU time a phase reports.
#[derive(Clone)]
struct CpuProbe {
    apiserver: Option<u32>,
    etcd: Option<u32>,
    client: u32,
    others: Vec<u32>,
}

impl CpuProbe {
    fn new(plane: &ControlPlane, client: u32) -> Self {
        let pid = |name: &str| {
            plane
                .components
                .iter()
                .find(|c| c.name == name)
                .map(|c| c.pid)
        };
        Self {
            apiserver: pid("kube-apiserver"),
            etcd: pid("etcd"),
            client,
            others: plane
                .components
                .iter()
                .filter(|c| c.name != "kube-apiserver" && c.name != "etcd")
                .map(|c| c.pid)
                .collect(),
        }
    }

    /// CPU seconds used so far by each.
    fn read(&self) -> Cpu {
        let of = |pid: Option<u32>| pid.and_then(process_cpu_seconds).unwrap_or(f64::NAN);
        Cpu {
            apiserver: of(self.apiserver),
            etcd: of(self.etcd),
            client: of(Some(self.client)),
            // A stopped component (`WASMCTRL_BENCH_CLUSTER=api-only`) is never reaped: its
            // `/proc` entry stays, with the CPU it used, so a phase counts none of it.
            others: self.others.iter().map(|pid| of(Some(*pid))).sum(),
            bench: of(Some(std::process::id())),
            machine: machine_cpu_seconds().unwrap_or(f64::NAN),
        }
    }
}

/// Busy CPU seconds of the whole machine (every state but idle and iowait), from
/// `/proc/stat`.
fn machine_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<f64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .map(|field| field.parse().unwrap_or(0.0))
        .collect();
    let busy: f64 = fields
        .iter()
        .enumerate()
        .filter(|(index, _)| *index != 3 && *index != 4)
        .map(|(_, ticks)| ticks)
        .sum();
    Some(busy / ticks_per_second())
}

impl Cpu {
    fn since(self, before: Self) -> Self {
        Self {
            apiserver: self.apiserver - before.apiserver,
            etcd: self.etcd - before.etcd,
            client: self.client - before.client,
            others: self.others - before.others,
            bench: self.bench - before.bench,
            machine: self.machine - before.machine,
        }
    }
}

/// User plus system CPU seconds of a process (its threads included), from `/proc/PID/stat`.
fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at state, field 3; utime
    // and stime are fields 14 and 15.
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / ticks_per_second())
}

/// The clock ticks `/proc` counts CPU time in.
fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    #[allow(unsafe_code)]
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    per_second
}

/// The host's explain records: MiB held and how many, from its `/metrics` text.
fn explain_store(text: &str) -> anyhow::Result<(f64, u64)> {
    Ok((
        metric_value(text, "wasmctrl_explain_records_bytes")? / f64::from(1 << 20),
        metric_value(text, "wasmctrl_explain_records")? as u64,
    ))
}

/// What the host's plugin instance pool keeps resident between calls (MiB), from its
/// `/metrics` text.
fn pool_resident_mib(text: &str) -> anyhow::Result<f64> {
    Ok(metric_value(text, "wasmctrl_plugin_pool_resident_bytes")? / f64::from(1 << 20))
}

/// The value of an unlabelled series.
fn metric_value(text: &str, series: &str) -> anyhow::Result<f64> {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .with_context(|| format!("{series} missing from the host's metrics"))
}

/// The sum of every series of one metric (`name{` for labelled series).
fn metric_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        // An empty sum is -0.0.
        .fold(0.0, |sum, value| sum + value)
}

/// A GET to the host's listener: the status code and the body.
async fn http_get(address: std::net::SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: host\r\n\r\n").as_bytes())
        .await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status line in the answer to GET {path}"))?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Ok((code, body.to_owned()))
}

async fn create_namespace(client: &Client, name: &str) -> anyhow::Result<String> {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns = serde_json::from_value(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}),
    )?;
    namespaces.create(&PostParams::default(), &ns).await?;
    Ok(name.to_owned())
}

async fn apply_policy(client: &Client, run: &str, plugin: &Path) -> anyhow::Result<()> {
    let policies: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "wasmctrl.dev",
            "v1alpha1",
            "ReconcilePolicy",
        )),
    );
    let policy = json!({
        "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
        "metadata": {"name": "bench", "labels": {SELECTOR_LABEL: run}},
        "spec": {
            "parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
            "children": [{"apiVersion": "apps/v1", "kind": "Deployment"}, {"apiVersion": "v1", "kind": "Service"}],
            "plugin": {"source": {"file": {"path": plugin.to_string_lossy()}}},
            "maxConcurrentReconciles": CONCURRENCY,
        },
    });
    policies
        .patch(
            "bench",
            &PatchParams::apply("bench").force(),
            &Patch::Apply(&policy),
        )
        .await?;
    Ok(())
}

async fn wait_policy_ready(client: &Client, name: &str) -> anyhow::Result<()> {
    let policies: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "wasmctrl.dev",
            "v1alpha1",
            "ReconcilePolicy",
        )),
    );
    wasmctrl_testenv::cluster::eventually(
        "the bench policy to be ready",
        Duration::from_secs(60),
        || {
            let policies = policies.clone();
            async move {
                let policy = serde_json::to_value(policies.get(name).await?)?;
                Ok(policy["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                }))
            }
        },
    )
    .await
}

/// Create `n` MyApps with 32 requests in flight.
async fn create_myapps(api: &Api<DynamicObject>, n: usize) -> anyhow::Result<()> {
    create_myapps_each(api, n, |_| {}).await
}

/// [`create_myapps`], handing each MyApp created (name and uid) to `created` as its create
/// returns.
async fn create_myapps_each(
    api: &Api<DynamicObject>,
    n: usize,
    mut created: impl FnMut((String, String)),
) -> anyhow::Result<()> {
    let mut creates = futures::stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            async move {
                let app: DynamicObject =
                    serde_json::from_value(myapp(&format!("app-{i:05}"), 1, "nginx:1.27", None))?;
                let created = api.create(&PostParams::default(), &app).await?;
                Ok::<_, anyhow::Error>((
                    created.name_any(),
                    created.metadata.uid.unwrap_or_default(),
                ))
            }
        })
        .buffer_unordered(32);
    while let Some(app) = creates.try_next().await? {
        created(app);
    }
    Ok(())
}

/// How far a host phase goes, `WASMCTRL_BENCH_UNTIL`.
#[derive(Clone, Copy, PartialEq)]
enum Until {
    /// Every MyApp Ready (its pod too), then the swaps and the restart: the default.
    Ready,
    /// Every MyApp reconciled, and stop.
    Reconciled,
    /// Every MyApp reconciled; then the controller-manager, scheduler and kwok are stopped
    /// and, once the host is quiet, the swaps and the restart.
    Quiet,
}

impl Until {
    fn from_env() -> anyhow::Result<Self> {
        env_choice(
            "WASMCTRL_BENCH_UNTIL",
            &[
                ("ready", Self::Ready),
                ("reconciled", Self::Reconciled),
                ("quiet", Self::Quiet),
            ],
        )
    }
}

/// The environment variable `var`, one of `choices` by name; the first when `var` is unset.
fn env_choice<T: Copy>(var: &str, choices: &[(&str, T)]) -> anyhow::Result<T> {
    match std::env::var(var) {
        Err(_) => choices
            .first()
            .map(|&(_, value)| value)
            .with_context(|| format!("{var} offers no choice")),
        Ok(name) => choice(var, choices, &name),
    }
}

/// The one of `choices` named `name`, given as `var`.
fn choice<T: Copy>(var: &str, choices: &[(&str, T)], name: &str) -> anyhow::Result<T> {
    let name = name.trim();
    match choices.iter().find(|&&(choice, _)| choice == name) {
        Some(&(_, value)) => Ok(value),
        None => {
            let names: Vec<&str> = choices.iter().map(|&(choice, _)| choice).collect();
            bail!("{var} must be one of {}, not {name}", names.join(", "))
        }
    }
}

/// What runs beside the API server during a phase, `WASMCTRL_BENCH_CLUSTER`.
#[derive(Clone, Copy, PartialEq)]
enum Cluster {
    /// The controller-manager, the scheduler and kwok too (`whole`, the default): each
    /// Deployment gets its ReplicaSet and pod while the phase runs, as in a cluster, and on
    /// two cores that work competes with the phase's own, in an amount that varies with when
    /// it lands.
    Whole,
    /// Those three are stopped before the first create (`api-only`): etcd and the API server
    /// serve the phase's client alone, so the phases compare what the clients cost. No
    /// Deployment's status moves, so the host is not asked to react to one.
    ApiOnly,
}

impl Cluster {
    fn from_env() -> anyhow::Result<Self> {
        env_choice(
            "WASMCTRL_BENCH_CLUSTER",
            &[("whole", Self::Whole), ("api-only", Self::ApiOnly)],
        )
    }

    /// Ready `plane` for a phase's first create.
    async fn settle(self, plane: &ControlPlane) -> anyhow::Result<()> {
        match self {
            Self::Whole => Ok(()),
            Self::ApiOnly => stop_pod_makers(plane).await,
        }
    }
}

/// Stop what turns Deployments into pods and moves their status: the controller-manager,
/// the scheduler and kwok.
async fn stop_pod_makers(plane: &ControlPlane) -> anyhow::Result<()> {
    for component in ["kwok", "kube-scheduler", "kube-controller-manager"] {
        plane.kill_component(component).await?;
    }
    Ok(())
}

/// When the plain client writes a MyApp's first pass, `WASMCTRL_BENCH_BASELINE` (a list, each
/// its own phase on its own control plane; `as-created` by default).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Timeline {
    /// As its create returns, while the rest are still being created: the host's timeline,
    /// which meets each MyApp through its watch as it is created. The controller-manager,
    /// the scheduler and kwok start on the first Deployments within seconds, as they do for
    /// the host's.
    AsCreated,
    /// Once every MyApp is created: the first Deployment comes only after the last create, so
    /// the controller-manager, the scheduler and kwok start on them later in the phase.
    AfterCreates,
}

impl Timeline {
    fn from_env() -> anyhow::Result<Vec<Self>> {
        const VAR: &str = "WASMCTRL_BENCH_BASELINE";
        let choices = [Self::AsCreated, Self::AfterCreates].map(|t| (t.name(), t));
        match std::env::var(VAR) {
            Err(_) => Ok(vec![Self::AsCreated]),
            Ok(list) => list
                .split(',')
                .map(|name| choice(VAR, &choices, name))
                .collect(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::AsCreated => "as-created",
            Self::AfterCreates => "after-creates",
        }
    }
}

/// A MyApp the host reconciled: its status written for its generation, `Reconciled=True`.
fn reconciled_by_host(app: &Value) -> bool {
    written_for_generation(app) && condition_true(app, "Reconciled")
}

/// Whether `app`'s condition `type_` is `True`.
fn condition_true(app: &Value, type_: &str) -> bool {
    wasmctrl_e2e::condition(app, type_).is_some_and(|c| c["status"] == "True")
}

/// A MyApp whose status was written for its generation (the baseline's last write).
fn written_for_generation(app: &Value) -> bool {
    app["status"]["observedGeneration"] == app["metadata"]["generation"]
}

/// When every MyApp is `done` and (with `Until::Ready`) when every one is Ready, and the CPU
/// `probe` read at the first. Both phases are timed by this watch, so both pay for it.
async fn watch_progress(
    api: Api<DynamicObject>,
    n: usize,
    probe: CpuProbe,
    until: Until,
    done: fn(&Value) -> bool,
) -> anyhow::Result<(Instant, Option<Instant>, Cpu)> {
    let until_ready = until == Until::Ready;
    let mut state: HashMap<String, (bool, bool)> = HashMap::new();
    let mut reconciled_at = None;
    let mut cpu_at_reconciled = None;
    let stream = watcher(api, watcher::Config::default()).applied_objects();
    let mut stream = std::pin::pin!(stream);
    // 10,000 pods take the controller-manager and kwok most of an hour on two cores.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90 * 60);
    loop {
        let next = tokio::time::timeout_at(deadline, stream.try_next()).await;
        let seen = state.len();
        let app = match next {
            Ok(Ok(Some(app))) => app,
            Ok(Ok(None)) => bail!("the watch ended; {seen} of {n} seen"),
            Ok(Err(error)) => bail!("the watch failed: {error}; {seen} of {n} seen"),
            Err(_) => bail!("timed out; {seen} of {n} seen"),
        };
        let value = serde_json::to_value(&app)?;
        let reconciled = done(&value);
        state.insert(
            app.name_any(),
            (reconciled, reconciled && condition_true(&value, "Ready")),
        );
        if reconciled_at.is_none() && state.len() == n && state.values().all(|s| s.0) {
            let at = Instant::now();
            reconciled_at = Some(at);
            let cpu = probe.read();
            cpu_at_reconciled = Some(cpu);
            if !until_ready {
                return Ok((at, None, cpu));
            }
        }
        if state.len() == n && state.values().all(|s| s.1) {
            let ready_at = Instant::now();
            let cpu = cpu_at_reconciled.unwrap_or_else(|| probe.read());
            return Ok((reconciled_at.unwrap_or(ready_at), Some(ready_at), cpu));
        }
    }
}

/// For each MyApp: apply the Deployment and Service its plugin desires (computed natively by
/// the same reconciler) and its status, with `CONCURRENCY` MyApps in flight.
async fn baseline_writes(
    client: &Client,
    ns: &str,
    apps: impl futures::Stream<Item = (String, String)>,
) -> anyhow::Result<()> {
    let deployments = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::from_gvk(&GroupVersionKind::gvk("apps", "v1", "Deployment")),
    );
    let services = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::from_gvk(&GroupVersionKind::gvk("", "v1", "Service")),
    );
    let myapps = myapps(client, ns);
    let params = Arc::new(PatchParams::apply("baseline").force());
    // The plugin's Events are writes the host makes for it; the baseline makes them too, the
    // same way (events.k8s.io, through a kube recorder per Event, as the host does).
    let reporter = kube::runtime::events::Reporter {
        controller: "baseline".into(),
        instance: None,
    };
    apps.map(|(name, uid)| {
            let (deployments, services, myapps, params, reporter) = (deployments.clone(), services.clone(), myapps.clone(), params.clone(), reporter.clone());
            async move {
                // The MyApp as created, as the API server serves it.
                let mut parent = myapp(&name, 1, "nginx:1.27", None);
                parent["metadata"] = json!({"name": name, "namespace": ns, "uid": uid, "generation": 1});
                let response = wasmctrl_plugin_sdk::testing::TestRequest::new(&parent)
                    .reconcile::<myapp_plugin::MyAppReconciler>()
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                let owner = json!([{"apiVersion": "example.com/v1", "kind": "MyApp", "name": name, "uid": uid, "controller": true, "blockOwnerDeletion": true}]);
                for mut child in response.children_json().iter().map(|c| serde_json::from_str::<Value>(c)).collect::<Result<Vec<_>, _>>()? {
                    child["metadata"]["ownerReferences"] = owner.clone();
                    let api = if child["kind"] == "Deployment" { &deployments } else { &services };
                    api.patch(&name, &params, &Patch::Apply(&child)).await?;
                }
                let mut status: Value = response.status_json().map(serde_json::from_str).transpose()?.unwrap_or_default();
                status["observedGeneration"] = json!(1);
                let body = json!({"apiVersion": "example.com/v1", "kind": "MyApp", "metadata": {"name": name}, "status": status});
                myapps.patch_status(&name, &params, &Patch::Apply(&body)).await?;
                let reference = k8s_openapi::api::core::v1::ObjectReference {
                    api_version: Some("example.com/v1".into()),
                    kind: Some("MyApp".into()),
                    name: Some(name.clone()),
                    namespace: Some(ns.to_owned()),
                    uid: Some(uid.clone()),
                    ..Default::default()
                };
                for event in response.events() {
                    let type_ = match event.kind {
                        wasmctrl_plugin_sdk::EventType::Warning => kube::runtime::events::EventType::Warning,
                        _ => kube::runtime::events::EventType::Normal,
                    };
                    let event = kube::runtime::events::Event {
                        type_,
                        reason: event.reason.clone(),
                        note: Some(event.message.clone()),
                        action: "Reconcile".into(),
                        secondary: None,
                    };
                    kube::runtime::events::Recorder::new(client.clone(), reporter.clone())
                        .publish(&event, &reference)
                        .await?;
                }
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(CONCURRENCY as usize)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

fn artifact_cache() -> PathBuf {
    std::env::temp_dir().join("wasmctrl-bench-artifacts")
}

/// Swap the policy to `plugin` and time the rollout: the policy reporting the new digest, and
/// the first and last Deployment rebuilt by it (`myapp-v2` labels what it builds, so `to_v2`
/// says whether the label must appear or go).
async fn measure_swap(
    client: &Client,
    run: &str,
    plugin: &Path,
    deployments: &Api<DynamicObject>,
    n: usize,
    to_v2: bool,
) -> anyhow::Result<Swap> {
    let digest = wasmctrl::plugin::Digest::of(&std::fs::read(plugin)?).to_string();
    let watch = {
        let deployments = deployments.clone();
        tokio::spawn(async move {
            let mut reached: HashMap<String, Instant> = HashMap::new();
            let mut stream =
                std::pin::pin!(watcher(deployments, watcher::Config::default()).applied_objects());
            while let Some(deployment) = stream.try_next().await? {
                let labelled = deployment
                    .labels()
                    .get("example.com/plugin-version")
                    .is_some_and(|v| v == "v2");
                if labelled == to_v2 {
                    reached
                        .entry(deployment.name_any())
                        .or_insert_with(Instant::now);
                    if reached.len() == n {
                        break;
                    }
                }
            }
            let first = reached.values().min().copied();
            let last = reached.values().max().copied();
            Ok::<_, anyhow::Error>((first, last))
        })
    };
    let policies: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "wasmctrl.dev",
            "v1alpha1",
            "ReconcilePolicy",
        )),
    );
    let started = Instant::now();
    apply_policy(client, run, plugin).await?;
    let mut active = None;
    while active.is_none() {
        let policy = serde_json::to_value(policies.get("bench").await?)?;
        if policy["status"]["activeDigest"] == digest.as_str() {
            active = Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (first, last) = tokio::time::timeout(Duration::from_secs(600), watch).await???;
    let since = |t: Option<Instant>| t.map_or(Duration::ZERO, |t| t.duration_since(started));
    Ok(Swap {
        active: active.unwrap_or_default(),
        first: since(first),
        last: since(last),
        writes: BTreeMap::new(),
        peak_rss_mib: f64::NAN,
        pool_mib: f64::NAN,
    })
}

fn audit_lines(path: &Path) -> anyhow::Result<usize> {
    Ok(std::fs::read_to_string(path)
        .map(|t| t.lines().count())
        .unwrap_or(0))
}

/// Writes in `namespace` logged after line `skip`, by verb and resource.
fn count_writes(
    path: &Path,
    skip: usize,
    namespace: &str,
) -> anyhow::Result<BTreeMap<String, usize>> {
    let text = std::fs::read_to_string(path)?;
    let marker = format!("/namespaces/{namespace}/");
    let mut counts = BTreeMap::new();
    for event in text
        .lines()
        .skip(skip)
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
    {
        let uri = event["requestURI"].as_str().unwrap_or_default();
        let verb = event["verb"].as_str().unwrap_or_default();
        if event["stage"] != "ResponseComplete"
            || !uri.contains(&marker)
            || event["user"]["username"] != "admin"
        {
            continue;
        }
        if !matches!(verb, "create" | "update" | "patch" | "delete") {
            continue;
        }
        // The control plane's own components share the admin identity here; their writes
        // (pods, bindings, their Events) are not the host's.
        if control_plane_agent(agent(&event)) {
            continue;
        }
        let path = uri.split('?').next().unwrap_or_default();
        let rest = &path[path.find(&marker).unwrap_or(0) + marker.len()..];
        let mut parts = rest.split('/');
        let resource = parts.next().unwrap_or_default();
        let sub = parts.nth(1).map(|s| format!("/{s}")).unwrap_or_default();
        *counts.entry(format!("{verb} {resource}{sub}")).or_insert(0) += 1;
    }
    Ok(counts)
}

/// A request's user agent, as the audit log has it.
fn agent(event: &Value) -> &str {
    event["userAgent"].as_str().unwrap_or_default()
}

/// Whether `agent` is one of the control plane's own components (which share the admin
/// identity here).
fn control_plane_agent(agent: &str) -> bool {
    ["kube-controller-manager", "kube-scheduler", "kwok"]
        .iter()
        .any(|component| agent.contains(component))
}

/// The requests logged after line `skip` that `counted` accepts, by verb: each once (a watch
/// when it started, anything else when it completed). Needs a control plane that logs reads
/// ([`Audit::Everything`]).
fn count_requests(
    path: &Path,
    skip: usize,
    counted: impl Fn(&Value) -> bool,
) -> anyhow::Result<BTreeMap<String, usize>> {
    let text = std::fs::read_to_string(path)?;
    let mut counts = BTreeMap::new();
    for event in text
        .lines()
        .skip(skip)
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
    {
        let verb = event["verb"].as_str().unwrap_or_default();
        let once = if verb == "watch" {
            "ResponseStarted"
        } else {
            "ResponseComplete"
        };
        if event["stage"] == once && counted(&event) {
            *counts.entry(verb.to_owned()).or_insert(0) += 1;
        }
    }
    Ok(counts)
}

/// Where the host's CPU went until all `n` were reconciled: the stage table for
/// BENCHMARKS.md, and how much of the host's CPU (from /proc) the samples cover.
fn print_profile(
    n: usize,
    samples: Vec<wasmctrl_e2e::profile::Sample>,
    metrics: &str,
    host_cpu: f64,
) {
    use wasmctrl_e2e::profile::{by_stage, table};
    let reconciles = metric_sum(metrics, "controller_runtime_reconcile_total{") as u64;
    let plugin_calls = metric_sum(metrics, "wasmctrl_plugin_calls_total{") as u64;
    let totals = by_stage(&samples);
    let sampled: u64 = totals.values().sum();
    println!(
        "\nHost CPU by stage, {n} MyApps, first create to all reconciled: {} samples, {:.1} s sampled of {host_cpu:.1} s the host used ({:.0} %); {reconciles} reconciles, {plugin_calls} plugin calls\n",
        samples.len(),
        sampled as f64 / 1e9,
        100.0 * sampled as f64 / 1e9 / host_cpu.max(f64::EPSILON),
    );
    println!("{}", table(&totals, 1.0, reconciles, plugin_calls));
}

/// One figure per baseline the row ran, joined into one cell; "(not run)" without any.
fn each_baseline(row: &Row, figure: impl Fn(&BaselineRun) -> String) -> String {
    if row.baselines.is_empty() {
        return "(not run)".to_owned();
    }
    row.baselines
        .iter()
        .map(figure)
        .collect::<Vec<_>>()
        .join("; ")
}

fn print_table(rows: &[Row]) {
    println!(
        "\n| MyApps | order | host: all reconciled | host: all Ready | host writes | host peak RSS | explain records held | plugin pool resident | baseline (same first-pass writes, plain client) | ratio (baseline time / host time) |"
    );
    println!("|---:|---|---:|---:|---|---:|---:|---:|---:|---:|");
    for row in rows {
        let host = &row.host;
        let baseline = each_baseline(row, |base| {
            format!(
                "{:.1} s ({} writes, {})",
                base.elapsed.as_secs_f64(),
                base.writes,
                base.timeline.name()
            )
        });
        let ratio = each_baseline(row, |base| {
            format!(
                "{:.2}× ({})",
                base.elapsed.as_secs_f64() / host.reconciled.as_secs_f64(),
                base.timeline.name()
            )
        });
        let mut writes = host.writes.clone();
        writes.retain(|k, _| !k.starts_with("create myapps"));
        println!(
            "| {} | {} | {:.1} s | {} | {} | {:.0} MiB | {:.1} MiB ({} records) | {:.1} MiB | {baseline} | {ratio} |",
            row.n,
            match (row.baselines.is_empty(), row.host_first) {
                (true, _) => "host",
                (false, true) => "host first",
                (false, false) => "host last",
            },
            host.reconciled.as_secs_f64(),
            host.ready.map_or_else(
                || "(not waited for)".to_owned(),
                |r| format!("{:.1} s", r.as_secs_f64())
            ),
            write_list(&writes),
            host.peak_rss_mib,
            host.explain.0,
            host.explain.1,
            host.pool_mib,
        );
    }
    println!(
        "\n| MyApps | phase | wall | kube-apiserver CPU | etcd CPU | client CPU (host or baseline) | bench process CPU (creates, watch; the baseline's is its client) | controller-manager, scheduler, kwok CPU | machine busy |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        let baselines = row.baselines.iter().map(|base| {
            (
                format!("baseline, {}", base.timeline.name()),
                base.elapsed,
                base.cpu,
            )
        });
        for (phase, wall, cpu) in std::iter::once((
            "host, to all reconciled".to_owned(),
            row.host.reconciled,
            row.host.cpu,
        ))
        .chain(baselines)
        {
            let wall = wall.as_secs_f64();
            let share = |seconds: f64| format!("{seconds:.1} s ({:.2} cores)", seconds / wall);
            println!(
                "| {} | {phase} | {wall:.1} s | {} | {} | {} | {} | {} | {} |",
                row.n,
                share(cpu.apiserver),
                share(cpu.etcd),
                share(cpu.client),
                share(cpu.bench),
                share(cpu.others),
                share(cpu.machine)
            );
        }
    }
    println!(
        "\n| MyApps | reconciles per MyApp | plugin calls per MyApp | unchanged / awaiting creates (no call) per MyApp | plugin calls to converge: mean (share in ≤ 2) | host API requests per MyApp | baseline API requests per MyApp | client CPU per MyApp: host / baseline, the baseline less its creates and watch (the host phase's bench process) (host per reconcile) |"
    );
    println!("|---:|---:|---:|---:|---:|---|---|---:|");
    for row in rows {
        let n = row.n as f64;
        let counts = &row.host.counts;
        let per = |requests: &BTreeMap<String, usize>| {
            let total: usize = requests.values().sum();
            format!("{:.2} ({})", total as f64 / n, write_list(requests))
        };
        let baseline = each_baseline(row, |base| {
            format!("{} ({})", per(&base.requests), base.timeline.name())
        });
        let cpu = each_baseline(row, |base| {
            // The baseline's process also creates the MyApps and watches them, which the host
            // phase's bench process does beside the host: take that out to compare writers.
            format!(
                "{:.2} ms / {:.2} ms, {:.2} ms less creates and watch ({:.2} ms) ({})",
                1e3 * row.host.cpu.client / n,
                1e3 * base.cpu.client / n,
                1e3 * (base.cpu.client - row.host.cpu.bench) / n,
                1e3 * row.host.cpu.client / counts.reconciles.max(1.0),
                base.timeline.name()
            )
        });
        println!(
            "| {} | {:.2} | {:.2} | {:.2} / {:.2} | {} | {} | {baseline} | {cpu} |",
            row.n,
            counts.reconciles / n,
            counts.plugin_calls / n,
            counts.unchanged / n,
            counts.awaiting / n,
            counts.calls_to_converge_figure(),
            per(&row.host.requests),
        );
    }
    println!(
        "\nHost RSS over time (MiB, every 10 s from the first create to all Ready, or reconciled):"
    );
    for row in rows {
        let series: Vec<String> = row
            .host
            .rss
            .iter()
            .step_by(10)
            .map(|(at, mib)| format!("{:.0}s {mib:.0}", at.as_secs_f64()))
            .collect();
        println!("- {}: {}", row.n, series.join(", "));
    }
    println!(
        "\n| MyApps | swap | policy reports the new digest | first parent on it | last parent on it | rollout rate (all-reconciled rate) | host writes until quiet | host peak RSS so far | plugin pool resident |"
    );
    println!("|---:|---|---:|---:|---:|---:|---|---:|---:|");
    for row in rows {
        for (what, swap) in ["v1 → v2 (compiled)", "v2 → v1 (artifact cache hit)"]
            .iter()
            .zip(row.host.swaps.iter().flatten())
        {
            println!(
                "| {} | {what} | {:.2} s | {:.2} s | {:.1} s | {:.0}/s ({:.0}/s) | {} | {:.0} MiB | {:.1} MiB |",
                row.n,
                swap.active.as_secs_f64(),
                swap.first.as_secs_f64(),
                swap.last.as_secs_f64(),
                row.n as f64 / swap.last.as_secs_f64(),
                row.n as f64 / row.host.reconciled.as_secs_f64(),
                write_list(&swap.writes),
                swap.peak_rss_mib,
                swap.pool_mib,
            );
        }
    }
}

fn print_restarts(rows: &[Row]) {
    println!(
        "\n| MyApps | restart: caches synced | last parent checked | reconciles | writes | new host's peak RSS |"
    );
    println!("|---:|---:|---:|---:|---|---:|");
    for row in rows {
        let Some(restart) = &row.host.restart else {
            continue;
        };
        println!(
            "| {} | {:.1} s | {:.1} s | {} | {} | {:.0} MiB |",
            row.n,
            restart.synced.as_secs_f64(),
            restart.checked.as_secs_f64(),
            restart.reconciles,
            write_list(&restart.writes),
            restart.peak_rss_mib,
        );
    }
}

/// Writes by verb and resource, for a table cell: "2000 patch deployments, …", or "0".
fn write_list(writes: &BTreeMap<String, usize>) -> String {
    if writes.is_empty() {
        return "0".to_owned();
    }
    let list: Vec<String> = writes.iter().map(|(k, v)| format!("{v} {k}")).collect();
    list.join(", ")
}

/// Host mode: run a wasmctrl host until SIGTERM.
fn run_host(spec: &str) -> anyhow::Result<()> {
    let mut parts = spec.splitn(3, '|');
    let (Some(namespace), Some(selector), Some(kubeconfig)) =
        (parts.next(), parts.next(), parts.next())
    else {
        bail!("{HOST_MODE} must be namespace|selector|kubeconfig");
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        // Named as `wasmctrl run` names itself, so its requests can be counted.
        let config = wasmctrl::identified(admin_config(&PathBuf::from(kubeconfig)).await?);
        let client = Client::try_from(config)?;
        // As `wasmctrl run` reads it, so a run can try another value through
        // `WASMCTRL_BENCH_HOST_ENV`.
        let engine_defaults = wasmctrl::plugin::EngineOptions::default();
        let max_concurrent_calls = match std::env::var("WASMCTRL_MAX_CONCURRENT_CALLS") {
            Ok(calls) => calls.parse().context("WASMCTRL_MAX_CONCURRENT_CALLS")?,
            Err(_) => engine_defaults.max_concurrent_calls,
        };
        let engine = wasmctrl::plugin::PluginEngine::new(wasmctrl::plugin::EngineOptions {
            cache_dir: Some(artifact_cache()),
            max_concurrent_calls,
            // As `wasmctrl run` compiles, with its defaults.
            compiler: wasmctrl::plugin::Compiler::Child(wasmctrl::plugin::ChildCompiler::default()),
            ..engine_defaults
        })?;
        let defaults = wasmctrl::explain::ExplainOptions::default();
        let explain_mib: usize = match std::env::var("WASMCTRL_BENCH_EXPLAIN_MIB") {
            Ok(mib) => mib.parse().context("WASMCTRL_BENCH_EXPLAIN_MIB")?,
            Err(_) => defaults.bounds.max_bytes >> 20,
        };
        let options = wasmctrl::controller::HostOptions {
            namespace: Some(namespace.to_owned()),
            policy_selector: Some(selector.to_owned()),
            // The bench's policies name the built plugins.
            plugin_dirs: vec![wasmctrl_testenv::plugins::plugin_dir()],
            explain: Arc::new(wasmctrl::explain::Explain::in_memory(
                wasmctrl::explain::Bounds {
                    max_bytes: explain_mib << 20,
                    ..defaults.bounds
                },
            )),
            ..Default::default()
        };
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let host = wasmctrl::controller::Host::new(client, engine, options);
        let listen = std::env::var(HOST_LISTEN).context(HOST_LISTEN)?;
        let listener = wasmctrl::server::bind(listen.parse()?).await?;
        let endpoints = wasmctrl::server::Endpoints {
            readiness: host.readiness(),
            metrics: host.metrics(),
            explain: host.explain(),
            access: wasmctrl::server::Access::Open,
        };
        tokio::spawn(wasmctrl::server::serve(
            listener,
            endpoints,
            std::future::pending(),
        ));
        host.run(async move {
            term.recv().await;
        })
        .await
    })
}
