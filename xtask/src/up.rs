//! `cargo xtask up`: the whole thing on one machine. Builds the MyApp plugin and the host,
//! starts the local control plane (or reuses a running `cluster up`), installs the CRDs, the
//! MyApp ReconcilePolicy and sample MyApps, and runs the host in the foreground. Ctrl-C stops
//! the host and, if this command started it, the control plane.
//!
//! It builds only what the quickstart runs — not the test plugins, and not the Python MyApp
//! (which would need Python and componentize-py) — so a first run asks for no more than the
//! README's requirements.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use wasmctrl_testenv::cluster::{Binaries, ControlPlane, Lifetime};
use wasmctrl_testenv::{default_cluster_dir, plugins, repo_root};

use crate::tasks;

/// The example policy's plugin path, relative to the repository root.
const EXAMPLE_PLUGIN_PATH: &str = "target/wasm32-wasip2/plugin/myapp_plugin.wasm";

/// The one plugin the quickstart runs.
const EXAMPLE_PLUGIN: &str = "myapp-plugin";

pub fn up() -> anyhow::Result<()> {
    tasks::setup()?;
    tasks::build_plugin(EXAMPLE_PLUGIN)?;
    tasks::run(
        "building the host",
        tasks::cargo().args(["build", "-p", "wasmctrl"]),
    )?;
    let host_bin = plugins::target_dir().join("debug/wasmctrl");

    let dir = default_cluster_dir();
    let runtime = tokio::runtime::Runtime::new()?;
    let (plane, started_here) = match ControlPlane::load(&dir)? {
        Some(plane) if plane.all_alive() => {
            eprintln!("xtask: reusing the running cluster at {}", plane.server);
            (plane, false)
        }
        _ => {
            let binaries = Binaries::build(&repo_root())?;
            let started = Instant::now();
            let plane =
                runtime.block_on(ControlPlane::start(&dir, &binaries, Lifetime::Detached))?;
            eprintln!(
                "xtask: cluster ready in {:.1}s at {}",
                started.elapsed().as_secs_f64(),
                plane.server
            );
            (plane, true)
        }
    };
    let result = install_and_run(&runtime, &plane, &host_bin);
    if started_here {
        plane.stop();
        eprintln!("xtask: cluster stopped");
    }
    result
}

fn install_and_run(
    runtime: &tokio::runtime::Runtime,
    plane: &ControlPlane,
    host_bin: &Path,
) -> anyhow::Result<()> {
    let root = repo_root();
    let kubectl = |args: &[&str]| {
        let mut command = Command::new(plane.bin_dir.join("kubectl"));
        command
            .arg("--kubeconfig")
            .arg(&plane.kubeconfig)
            .args(args)
            .current_dir(&root);
        command
    };
    tasks::run(
        "installing the CRDs",
        &mut kubectl(&["apply", "--server-side", "-f", "crds/"]),
    )?;
    tasks::run(
        "waiting for the CRDs",
        &mut kubectl(&[
            "wait",
            "--for",
            "condition=established",
            "--timeout=60s",
            "-f",
            "crds/",
        ]),
    )?;

    // The example policy names the plugin relative to the repository; give the host the
    // absolute path of the component just built (wherever CARGO_TARGET_DIR puts it).
    let policy = std::fs::read_to_string(root.join("plugins/myapp/examples/policy.yaml"))?;
    let plugin = plugins::guest_path("myapp_plugin");
    let policy = policy.replace(EXAMPLE_PLUGIN_PATH, &plugin.to_string_lossy());
    // The policy acts as its own ServiceAccount: create it with exactly the rules the
    // policy needs, as `wasmctrl rbac` prints them.
    let rbac = Command::new(host_bin)
        .args([
            "rbac",
            "crds/myapp.yaml",
            "plugins/myapp/examples/policy.yaml",
        ])
        .current_dir(&root)
        .output()
        .context("running wasmctrl rbac")?;
    anyhow::ensure!(
        rbac.status.success(),
        "wasmctrl rbac failed: {}",
        String::from_utf8_lossy(&rbac.stderr)
    );
    apply_stdin(
        kubectl(&["apply", "-f", "-"]),
        &String::from_utf8_lossy(&rbac.stdout),
    )
    .context("applying the MyApp policy's ServiceAccount and rules")?;
    apply_stdin(kubectl(&["apply", "-f", "-"]), &policy).context("applying the MyApp policy")?;
    tasks::run(
        "creating sample MyApps",
        &mut kubectl(&["apply", "-f", "plugins/myapp/examples/myapps.yaml"]),
    )?;

    eprintln!(
        "\nwasmctrl is starting. In another terminal:\n\n  export KUBECONFIG={kubeconfig}\n  export PATH={bin}:$PATH\n  kubectl get myapps          # READY shows 3/3 and 2/2 within seconds\n  kubectl get reconcilepolicies\n  kubectl patch myapp web --type merge -p '{{\"spec\":{{\"replicas\":5}}}}'\n\nCtrl-C stops the host, then the control plane if this command started it.\n",
        kubeconfig = plane.kubeconfig.display(),
        bin = plane.bin_dir.display(),
    );

    runtime.block_on(async {
        let mut host = tokio::process::Command::new(host_bin)
            .arg("run")
            .arg("--kubeconfig")
            .arg(&plane.kubeconfig)
            // A workstation: health, metrics and explain on loopback only, in clear text and
            // without checking who asks.
            .args(["--insecure-listen", "127.0.0.1:8080"])
            // The example policy's file source is where cargo built it, which may be
            // outside the repository (CARGO_TARGET_DIR).
            .arg("--plugin-dir")
            .arg(plugins::plugin_dir())
            .current_dir(&root)
            .env(
                "WASMCTRL_LOG",
                std::env::var("WASMCTRL_LOG").unwrap_or_else(|_| "info,kube=warn".into()),
            )
            .spawn()
            .with_context(|| format!("starting {}", host_bin.display()))?;
        tokio::select! {
            status = host.wait() => {
                let status = status?;
                if !status.success() {
                    bail!("the host exited with {status}");
                }
            }
            _ = tokio::signal::ctrl_c() => {
                // The terminal sent the host the same Ctrl-C; give it time to finish
                // its in-flight reconciles.
                if tokio::time::timeout(Duration::from_secs(15), host.wait()).await.is_err() {
                    host.kill().await?;
                }
            }
        }
        Ok(())
    })
}

fn apply_stdin(mut command: Command, input: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut child = command.stdin(Stdio::piped()).spawn()?;
    child
        .stdin
        .take()
        .context("kubectl stdin")?
        .write_all(input.as_bytes())?;
    let status = child.wait()?;
    if !status.success() {
        bail!("kubectl apply failed ({status})");
    }
    Ok(())
}
