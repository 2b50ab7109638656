//! Scale-out: N MyApps reconciled by one, two or three replicas of the host, each a
//! `wasmctrl run` of its own; more than one share the work by shard (`--shards 12`), each
//! watching only its shards (by uid, as the test control plane narrows watches by shard). Per replica count: the time to all reconciled, each replica's peak RSS, CPU
//! and what its caches hold, the API server's CPU, and the writes per parent.
//!
//! Run with `WASMCTRL_BENCH_HOSTS=1,2,3 WASMCTRL_BENCH_SIZES=10000 cargo xtask bench
//! convergence`; each size and replica count gets a fresh control plane. With
//! `WASMCTRL_BENCH_SHARD_WATCHES=label` its API server runs with `ShardedListAndWatch` off, so
//! the replicas watch their parents by the shard label they stamp on each.

use super::*;

/// Env var that turns this binary into a `wasmctrl` process: its arguments, as JSON.
pub(super) const CLI_MODE: &str = "WASMCTRL_BENCH_CLI";
/// The shards replicas share: 12 divides evenly among 1, 2, 3, 4 and 6.
const SHARDS: u32 = 12;

/// One replica count's run on its own control plane.
pub(super) struct ScaleOutRun {
    n: usize,
    hosts: usize,
    reconciled: Duration,
    /// Per replica: peak RSS (MiB), CPU seconds to all reconciled, parents and children
    /// cached once all were reconciled.
    replicas: Vec<ReplicaFigures>,
    /// From the first create to all reconciled.
    cpu: Cpu,
    writes: BTreeMap<String, usize>,
}

struct ReplicaFigures {
    peak_rss_mib: f64,
    cpu: f64,
    parents: f64,
    children: f64,
}

/// Run the `wasmctrl` command line `args` (JSON), as the binary would.
pub(super) fn run_cli(args: &str) -> anyhow::Result<()> {
    use clap::Parser as _;
    let args: Vec<String> = serde_json::from_str(args).context(CLI_MODE)?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(wasmctrl::cli::Cli::parse_from(args).run())
}

/// The replica counts asked for (`WASMCTRL_BENCH_HOSTS`), if any.
pub(super) fn counts_from_env() -> anyhow::Result<Option<Vec<usize>>> {
    let Ok(hosts) = std::env::var("WASMCTRL_BENCH_HOSTS") else {
        return Ok(None);
    };
    let counts = hosts
        .split(',')
        .map(|h| h.trim().parse().context("WASMCTRL_BENCH_HOSTS"))
        .collect::<anyhow::Result<Vec<usize>>>()?;
    if counts.iter().any(|&h| h == 0 || h > SHARDS as usize) {
        bail!("WASMCTRL_BENCH_HOSTS: each count from 1 to {SHARDS}");
    }
    Ok(Some(counts))
}

/// Whether the parents are to be watched by the shard label (`WASMCTRL_BENCH_SHARD_WATCHES`:
/// `uid`, the default, or `label`).
pub(super) fn by_label_from_env() -> anyhow::Result<bool> {
    super::env_choice(
        "WASMCTRL_BENCH_SHARD_WATCHES",
        &[("uid", false), ("label", true)],
    )
}

/// Restart `plane`'s API server with its sharded lists and watches off.
pub(super) async fn without_sharded_watches(
    plane: &mut ControlPlane,
    binaries: &Binaries,
) -> anyhow::Result<()> {
    plane.kill_component("kube-apiserver").await?;
    let gate_off = ["--feature-gates=ShardedListAndWatch=false".to_owned()];
    plane
        .start_component_with(
            "kube-apiserver",
            binaries,
            Lifetime::TiedToStarter,
            &gate_off,
        )
        .await
}

/// `n` MyApps created at once and reconciled by `hosts` replicas.
pub(super) async fn phase(
    n: usize,
    hosts: usize,
    plane: &ControlPlane,
    plugin: &Path,
) -> anyhow::Result<ScaleOutRun> {
    let run = format!("n{n}-h{hosts}");
    let (client, ns) =
        host_namespace(plane, &run, &format!("bench-scale-{n}-{hosts}"), plugin).await?;
    let replicas = (0..hosts)
        .map(|i| spawn_replica(&ns, &run, plane, i, hosts))
        .collect::<anyhow::Result<Vec<_>>>()?;
    wait_policy_ready(&client, "bench").await?;
    if hosts > 1 {
        wait_shards_shared(&client, &ns, hosts).await?;
    }
    let audit_before = audit_lines(&plane.audit_log)?;
    let pids: Vec<u32> = replicas.iter().map(|(process, _)| process.id()).collect();
    let probe = CpuProbe::new(plane, pids[0]);
    let myapps = myapps(&client, &ns);
    let watch = tokio::spawn(watch_progress(
        myapps.clone(),
        n,
        probe.clone(),
        Until::Reconciled,
        reconciled_by_host,
    ));
    let cpu_of = |pid: &u32| process_cpu_seconds(*pid).unwrap_or(f64::NAN);
    let cpu_before = probe.read();
    let replicas_before: Vec<f64> = pids.iter().map(cpu_of).collect();
    let started = Instant::now();
    create_myapps(&myapps, n).await?;
    let (reconciled_at, _, cpu_at) = watch.await??;
    let replicas_cpu: Vec<f64> = pids
        .iter()
        .zip(&replicas_before)
        .map(|(pid, before)| cpu_of(pid) - before)
        .collect();
    // Let the last echoes settle, and the caches' gauges be counted (every 5 s).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let writes = count_writes(&plane.audit_log, audit_before, &ns)?;
    let mut figures = Vec::new();
    for ((_, listen), (pid, cpu)) in replicas.iter().zip(pids.iter().zip(replicas_cpu)) {
        let (_, metrics) = http_get(*listen, "/metrics").await?;
        let cached = |cache: &str| {
            metrics
                .lines()
                .filter(|l| l.starts_with("wasmctrl_cached_objects{"))
                .filter(|l| l.contains(&format!("cache=\"{cache}\"")))
                .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
                .sum::<f64>()
        };
        figures.push(ReplicaFigures {
            peak_rss_mib: memory_mib(*pid, "VmHWM").unwrap_or(f64::NAN),
            cpu,
            parents: cached("parents"),
            children: cached("children"),
        });
    }
    drop(replicas);
    Ok(ScaleOutRun {
        n,
        hosts,
        reconciled: reconciled_at.duration_since(started),
        replicas: figures,
        cpu: cpu_at.since(cpu_before),
        writes,
    })
}

/// Replica `index` of `hosts`, a `wasmctrl run` in a process of its own (this binary, re-
/// executed) serving its metrics at the returned address; stopped when dropped. More than
/// one share the work by shard, their Leases in `ns`.
fn spawn_replica(
    ns: &str,
    run: &str,
    plane: &ControlPlane,
    index: usize,
    hosts: usize,
) -> anyhow::Result<(SelfProcess, std::net::SocketAddr)> {
    let listen = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let mut args: Vec<String> = [
        "wasmctrl",
        "--cache-dir",
        &artifact_cache().to_string_lossy(),
        "run",
        "--kubeconfig",
        &plane.kubeconfig.to_string_lossy(),
        "--namespace",
        ns,
        "--policy-selector",
        &format!("{SELECTOR_LABEL}={run}"),
        "--plugin-dir",
        &wasmctrl_testenv::plugins::plugin_dir().to_string_lossy(),
        "--insecure-listen",
        &listen.to_string(),
    ]
    .map(str::to_owned)
    .into();
    if hosts > 1 {
        let shards = SHARDS.to_string();
        let identity = format!("host-{index}");
        args.extend(
            [
                "--shards",
                &shards,
                "--leader-elect-namespace",
                ns,
                "--leader-elect-identity",
                &identity,
            ]
            .map(str::to_owned),
        );
    }
    let process = SelfProcess::spawn(
        std::process::Command::new(std::env::current_exe()?)
            .env(CLI_MODE, serde_json::to_string(&args)?)
            .env("WASMCTRL_LOG", "warn")
            .envs(host_env()?),
    )
    .context("starting a replica")?
    .stop_on_drop_with(libc::SIGTERM);
    Ok((process, listen))
}

/// Wait until every shard Lease in `ns` is held and each of the `hosts` replicas holds its
/// fair share.
async fn wait_shards_shared(client: &Client, ns: &str, hosts: usize) -> anyhow::Result<()> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), ns);
    wasmctrl_testenv::cluster::eventually(
        "the replicas to share the shards",
        Duration::from_secs(120),
        || async {
            let mut held: BTreeMap<String, usize> = BTreeMap::new();
            for lease in leases.list(&Default::default()).await? {
                if !lease.name_any().contains("-shard-") {
                    continue;
                }
                if let Some(holder) = lease.spec.and_then(|spec| spec.holder_identity) {
                    *held.entry(holder).or_default() += 1;
                }
            }
            let total: usize = held.values().sum();
            let fair = SHARDS as usize / hosts;
            Ok(total == SHARDS as usize
                && held.len() == hosts
                && held
                    .values()
                    .all(|&count| count == fair || count == fair + 1))
        },
    )
    .await
}

/// The figures for BENCHMARKS.md, one row per replica count.
pub(super) fn print_table(runs: &[ScaleOutRun]) {
    println!(
        "\n| MyApps | replicas | all reconciled | rate against 1 replica | peak RSS per replica | parents / children cached per replica | CPU per replica | API server CPU | writes per parent (and Leases) |"
    );
    println!("|---:|---:|---:|---:|---|---|---|---:|---|");
    for run in runs {
        let single = runs
            .iter()
            .find(|r| r.n == run.n && r.hosts == 1)
            .map(|r| r.reconciled.as_secs_f64());
        let rate = single.map_or_else(
            || "—".to_owned(),
            |single| format!("{:.2}×", single / run.reconciled.as_secs_f64()),
        );
        let each = |figure: &dyn Fn(&ReplicaFigures) -> String| {
            run.replicas
                .iter()
                .map(figure)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let of = |what: &str| -> usize {
            run.writes
                .iter()
                .filter(|(write, _)| write.contains(what))
                .map(|(_, count)| count)
                .sum()
        };
        // The bench's own creates are not the hosts' writes.
        let leases = of("leases");
        let parents_writes = run.writes.values().sum::<usize>() - leases - of("create myapps");
        println!(
            "| {} | {} | {:.1} s | {rate} | {} MiB | {} | {} s | {:.1} s | {:.2} ({leases} Lease writes) |",
            run.n,
            run.hosts,
            run.reconciled.as_secs_f64(),
            each(&|r| format!("{:.0}", r.peak_rss_mib)),
            each(&|r| format!("{:.0} / {:.0}", r.parents, r.children)),
            each(&|r| format!("{:.1}", r.cpu)),
            run.cpu.apiserver,
            parents_writes as f64 / run.n as f64,
        );
        println!("  writes: {}", write_list(&run.writes));
    }
}
