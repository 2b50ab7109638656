//! Build, test and bench tasks.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context as _, bail};
use wasmctrl_testenv::cluster::{Binaries, ControlPlane, Lifetime};
use wasmctrl_testenv::repo_root;

pub fn cargo() -> Command {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command.current_dir(repo_root());
    wasmctrl_testenv::runner::without_cargos_package_variables(&mut command);
    command
}

pub fn run(what: &str, command: &mut Command) -> anyhow::Result<()> {
    eprintln!("xtask: {what}");
    let started = Instant::now();
    let status = command
        .status()
        .with_context(|| format!("starting: {what}"))?;
    // Each step's time, so a slow CI run says where its minutes went.
    eprintln!("xtask: {what}: {:.0}s", started.elapsed().as_secs_f64());
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// Do `step`, saying what it is and how long it took.
fn run_step(what: &str, step: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
    eprintln!("xtask: {what}");
    let started = Instant::now();
    let result = step();
    eprintln!("xtask: {what}: {:.0}s", started.elapsed().as_secs_f64());
    result.with_context(|| what.to_owned())
}

/// Make sure rustc can build for wasm32-wasip2: rustup if it can reach its server, else the
/// copy bundled in ../shared/toolchain.
pub fn setup() -> anyhow::Result<()> {
    let sysroot = String::from_utf8(
        Command::new("rustc")
            .args(["--print", "sysroot"])
            .output()
            .context("running rustc")?
            .stdout,
    )?;
    if PathBuf::from(sysroot.trim())
        .join("lib/rustlib/wasm32-wasip2/lib")
        .is_dir()
    {
        return Ok(());
    }
    let added = Command::new("rustup")
        .args(["target", "add", "wasm32-wasip2"])
        .status()
        .is_ok_and(|s| s.success());
    if added {
        return Ok(());
    }
    let bundled = repo_root().join("../shared/toolchain/wasm32-wasip2.sh");
    if bundled.exists() {
        return run(
            "installing the bundled wasm32-wasip2 target",
            Command::new("sh").arg(bundled),
        );
    }
    bail!("the wasm32-wasip2 target is missing and rustup could not install it")
}

/// Every plugin: the Rust ones, one cargo invocation each (building them together would
/// unify their features, and myapp-v2 needs MyApp's logic without MyApp's component export),
/// then the Python ones.
pub fn build_plugins() -> anyhow::Result<()> {
    setup()?;
    for plugin in wasmctrl_testenv::plugins::GUESTS {
        build_plugin(plugin)?;
    }
    eprintln!("xtask: building the Python plugins");
    wasmctrl_testenv::plugins::build_python_guests()
}

/// Only the Rust plugin crates named, each as [`build_plugin`] builds it. A name that is no
/// plugin of this repository is refused before anything is built.
pub fn build_named_plugins(plugins: &[String]) -> anyhow::Result<()> {
    let known = wasmctrl_testenv::plugins::GUESTS;
    if let Some(unknown) = plugins.iter().find(|name| !known.contains(&name.as_str())) {
        bail!(
            "{unknown} is not a plugin crate of this repository (they are: {})",
            known.join(", ")
        );
    }
    setup()?;
    for plugin in plugins {
        build_plugin(plugin)?;
    }
    Ok(())
}

/// One Rust plugin crate, as a component with the `plugin` profile (after [`setup`]).
pub fn build_plugin(plugin: &str) -> anyhow::Result<()> {
    run(
        &format!("building plugin {plugin}"),
        cargo().args([
            "build",
            "--target",
            "wasm32-wasip2",
            "--profile",
            "plugin",
            "-p",
            plugin,
        ]),
    )
}

pub fn crds() -> anyhow::Result<()> {
    run(
        "regenerating crds/",
        cargo()
            .env("WASMCTRL_BLESS", "1")
            .args(["test", "-p", "wasmctrl", "--test", "crds"]),
    )
}

pub fn reference() -> anyhow::Result<()> {
    run(
        "regenerating docs/reference/",
        cargo()
            .env("WASMCTRL_BLESS", "1")
            .args(["test", "-p", "wasmctrl", "--test", "reference"]),
    )
}

/// Build the image into target/image/wasmctrl (an OCI layout), push it if asked, and say
/// how big it is.
pub fn image(profile: &str, push: Option<&str>, insecure: bool) -> anyhow::Result<()> {
    let out = wasmctrl_testenv::repo_root().join("target/image/wasmctrl");
    let image = wasmctrl_testenv::image::build(profile, &out)?;
    println!(
        "image: {} ({:.1} MiB compressed) in {}",
        image.digest(),
        image.compressed_size() as f64 / f64::from(1 << 20),
        image.layout.display()
    );
    if let Some(reference) = push {
        let reference = with_default_tag(reference);
        let runtime = tokio::runtime::Runtime::new()?;
        let url = runtime.block_on(wasmctrl_testenv::image::push(&image, &reference, insecure))?;
        println!("image: pushed to {url}");
    }
    Ok(())
}

/// `reference`, tagged with the release's version when it names no tag or digest: the tag
/// the chart pulls by default (its `appVersion`), never an implicit `latest`.
fn with_default_tag(reference: &str) -> String {
    let name = reference.rsplit('/').next().unwrap_or(reference);
    if name.contains(':') || name.contains('@') {
        reference.to_owned()
    } else {
        format!("{reference}:{}", env!("CARGO_PKG_VERSION"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_push_without_a_tag_takes_the_charts_default_tag() {
        let version = env!("CARGO_PKG_VERSION");
        assert_eq!(
            with_default_tag("registry.example.com:5000/wasmctrl"),
            format!("registry.example.com:5000/wasmctrl:{version}")
        );
        assert_eq!(
            with_default_tag("r.example/wasmctrl:dev"),
            "r.example/wasmctrl:dev"
        );
        assert_eq!(
            with_default_tag("r.example/wasmctrl@sha256:abc"),
            "r.example/wasmctrl@sha256:abc"
        );
        let chart = std::fs::read_to_string(
            wasmctrl_testenv::repo_root().join("deploy/chart/wasmctrl/Chart.yaml"),
        )
        .expect("Chart.yaml");
        assert!(
            chart.contains(&format!("appVersion: \"{version}\"")),
            "the chart's appVersion is the workspace version {version}: {chart}"
        );
    }
}

/// Render the chart into deploy/manifests/ with the pinned helm (the test that keeps them
/// in sync, blessed).
pub fn manifests() -> anyhow::Result<()> {
    run(
        "regenerating deploy/manifests/",
        cargo().env("WASMCTRL_BLESS", "1").args([
            "test",
            "-p",
            "wasmctrl-e2e",
            "--test",
            "deploy",
            "the_chart_lints",
        ]),
    )
}

/// The whole suite. Starts one control plane for every end-to-end test binary to share, and
/// stops it at the end whatever happened.
pub fn test() -> anyhow::Result<()> {
    let started = Instant::now();
    setup()?;
    run(
        "checking formatting",
        cargo().args(["fmt", "--all", "--", "--check"]),
    )?;
    run(
        "linting",
        cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    build_plugins()?;
    // The Go-built tools tests use, built now (once per machine; minutes each the first time)
    // rather than inside a test, whose time limit would count the build.
    for tool in ["helm", "registry", "cosign"] {
        run_step(
            &format!("building {tool} (cached after the first time)"),
            || wasmctrl_testenv::tools::build(tool).map(drop),
        )?;
    }

    let binaries = Binaries::build(&repo_root())?;
    let dir = repo_root().join("target/cluster-ci");
    let runtime = tokio::runtime::Runtime::new()?;
    let plane_started = Instant::now();
    let plane = runtime
        .block_on(ControlPlane::start(
            &dir,
            &binaries,
            Lifetime::TiedToStarter,
        ))
        .context("starting the control plane for the tests")?;
    eprintln!(
        "xtask: control plane ready in {:.1}s at {}",
        plane_started.elapsed().as_secs_f64(),
        plane.server
    );
    let result = run_tests(&plane.kubeconfig);
    plane.stop();
    eprintln!(
        "xtask: test suite took {:.0}s",
        started.elapsed().as_secs_f64()
    );
    let totals = result?;
    // One closing line for the whole suite: cargo's own last line is that of whichever test
    // binary ran last, often a doc-test crate with nothing in it.
    println!(
        "tests: {} passed, {} failed, {} skipped",
        totals.passed, totals.failed, totals.ignored
    );
    if totals.failed > 0 || totals.passed == 0 {
        bail!("the test suite did not pass");
    }
    Ok(())
}

#[derive(Default)]
struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
}

/// Run every test of the workspace against the cluster of `kubeconfig`: nextest for the
/// tests (a process each, each under the time limit of `.config/nextest.toml`, every one run
/// even after a failure), then the doc tests, which nextest does not run. Their counts,
/// added up.
fn run_tests(kubeconfig: &std::path::Path) -> anyhow::Result<Totals> {
    use wasmctrl_testenv::runner;
    eprintln!("xtask: running the tests");
    let mut nextest = runner::nextest_run()?;
    nextest
        .env("WASMCTRL_TEST_KUBECONFIG", kubeconfig)
        .env(runner::PLUGINS_BUILT_ENV, "1")
        .args(["--workspace", "--no-fail-fast"]);
    let (summary, status) = runner::run_passing_through(&mut nextest, |_| {})?;
    // No summary: nextest could not run the tests at all (its message is above); the doc
    // tests still run, and the run fails.
    let summary = summary.unwrap_or_else(|| {
        eprintln!("xtask: cargo-nextest ran no tests ({status})");
        runner::Summary {
            failed: 1,
            ..runner::Summary::default()
        }
    });
    let mut totals = Totals {
        passed: summary.passed,
        failed: summary.failed + summary.timed_out,
        ignored: summary.skipped,
    };
    let doc = doc_tests(cargo().env("WASMCTRL_TEST_KUBECONFIG", kubeconfig).args([
        "test",
        "--workspace",
        "--doc",
        "--no-fail-fast",
    ]));
    // Both ran; a doc test run that failed to run at all counts as one failure.
    let doc = doc.unwrap_or_else(|error| {
        eprintln!("xtask: {error:#}");
        Totals {
            failed: 1,
            ..Totals::default()
        }
    });
    totals.passed += doc.passed;
    totals.failed += doc.failed;
    totals.ignored += doc.ignored;
    if !status.success() && totals.failed == 0 {
        bail!("cargo-nextest failed ({status}) with no test failed: see its messages above");
    }
    Ok(totals)
}

/// Run the doc tests with `cargo test --doc`, passing its output through, and add up its
/// `test result:` lines.
fn doc_tests(command: &mut Command) -> anyhow::Result<Totals> {
    use std::io::{BufRead as _, BufReader};
    eprintln!("xtask: running the doc tests");
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting cargo test --doc")?;
    let stdout = child.stdout.take().context("cargo test stdout")?;
    let mut totals = Totals::default();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        if let Some(result) = line.strip_prefix("test result: ") {
            let count = |word: &str| -> u64 {
                result
                    .split(';')
                    .find_map(|part| part.trim().strip_suffix(word))
                    .and_then(|n| n.trim().rsplit(' ').next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0)
            };
            totals.passed += count("passed");
            totals.failed += count("failed");
            totals.ignored += count("ignored");
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("cargo test --doc failed ({status})");
    }
    Ok(totals)
}

/// Which benchmarks `cargo xtask bench` runs.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchSet {
    /// Plugin call latency (criterion-style, pinned to one CPU).
    Plugin,
    /// Convergence of many MyApps against a real control plane.
    Convergence,
    /// Where the host's CPU goes during a convergence: `perf` samples of the host process
    /// from the first create to all reconciled, by reconcile stage (size from
    /// WASMCTRL_BENCH_SIZES, default 1000; data and `perf script` text in target/profile).
    Profile,
    /// Webhook latency as the API server sees it: a no-op webhook, the host with a no-op
    /// plugin, and MyApp's validator (creates from WASMCTRL_BENCH_CREATES, default 500).
    Webhooks,
    /// Ordered children: N Stacks (WASMCTRL_BENCH_STACKS, default 20), their time to ready
    /// against the sum of their steps.
    Ordered,
    /// The plugin calls, the convergence and the webhooks.
    All,
}

pub fn bench(which: BenchSet) -> anyhow::Result<()> {
    build_plugins()?;
    match which {
        BenchSet::Plugin => bench_plugin_calls(),
        BenchSet::Convergence => bench_convergence(&[]),
        BenchSet::Profile => {
            if Command::new("perf").arg("--version").output().is_err() {
                wasmctrl_testenv::tools::debian_package(
                    "linux-perf",
                    "perf, which samples the host's CPU",
                )?;
            }
            let dir = repo_root().join("target/profile");
            let sizes = std::env::var("WASMCTRL_BENCH_SIZES").unwrap_or_else(|_| "1000".into());
            // Walking frame pointers costs perf a fraction of what unwinding DWARF does (16
            // KiB of stack copied per sample), which at 10,000 parents slowed the profiled
            // run to a third of its speed. The build with them goes to a target directory of
            // its own, so the usual release build is not rebuilt either way; the plugins are
            // read from where `build_plugins` put them.
            let target = wasmctrl_testenv::plugins::target_dir();
            let frame_pointers = target.with_file_name(format!(
                "{}-frame-pointers",
                target
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or("target")
            ));
            bench_convergence(&[
                ("WASMCTRL_BENCH_PROFILE", dir.display().to_string()),
                ("WASMCTRL_BENCH_SIZES", sizes),
                ("WASMCTRL_BENCH_PHASES", "host".into()),
                ("WASMCTRL_BENCH_UNTIL", "reconciled".into()),
                ("WASMCTRL_BENCH_CALL_GRAPH", "fp".into()),
                (
                    wasmctrl_testenv::plugins::PLUGIN_DIR_ENV,
                    wasmctrl_testenv::plugins::plugin_dir()
                        .display()
                        .to_string(),
                ),
                (wasmctrl_testenv::runner::PLUGINS_BUILT_ENV, "1".into()),
                ("CARGO_TARGET_DIR", frame_pointers.display().to_string()),
                (
                    "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS",
                    "-C force-frame-pointers=yes".into(),
                ),
            ])
        }
        BenchSet::Webhooks => bench_webhooks(),
        BenchSet::Ordered => {
            Binaries::build(&repo_root())?;
            run(
                "benchmarking ordered children",
                cargo().args(["bench", "-p", "wasmctrl-e2e", "--bench", "ordered"]),
            )
        }
        BenchSet::All => {
            bench_plugin_calls()?;
            bench_convergence(&[])?;
            bench_webhooks()
        }
    }
}

/// The convergence bench, with `env` set. Not pinned: the host, the control plane and the
/// load generator share the machine, as they would in a small cluster. Each size gets a fresh
/// control plane.
fn bench_convergence(env: &[(&str, String)]) -> anyhow::Result<()> {
    Binaries::build(&repo_root())?;
    let mut command = cargo();
    command.args(["bench", "-p", "wasmctrl-e2e", "--bench", "convergence"]);
    for (name, value) in env {
        command.env(name, value);
    }
    run("benchmarking convergence", &mut command)
}

/// The webhook bench, on a control plane of its own.
fn bench_webhooks() -> anyhow::Result<()> {
    Binaries::build(&repo_root())?;
    run(
        "benchmarking webhooks",
        cargo().args(["bench", "-p", "wasmctrl-e2e", "--bench", "webhooks"]),
    )
}

/// The plugin-call benchmark runs pinned to one CPU (`taskset -c 1`, where taskset exists):
/// on this VM, threads that migrate between vCPUs make per-call latencies bimodal, and a
/// figure should not depend on where the scheduler happened to put a thread. Run the bench
/// binary directly for unpinned figures.
fn bench_plugin_calls() -> anyhow::Result<()> {
    let bench = ["bench", "-p", "wasmctrl-runtime", "--bench", "plugin_call"];
    run(
        "building the benchmark",
        cargo().args(bench).arg("--no-run"),
    )?;
    let pinned = Command::new("taskset").arg("-V").output().is_ok();
    if pinned {
        let cargo_bin = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        run(
            "benchmarking plugin calls (pinned to CPU 1)",
            Command::new("taskset")
                .args(["-c", "1"])
                .arg(cargo_bin)
                .args(bench)
                .current_dir(repo_root()),
        )
    } else {
        run("benchmarking plugin calls", cargo().args(bench))
    }
}
