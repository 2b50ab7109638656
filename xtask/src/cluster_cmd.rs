//! `cargo xtask cluster up | down | status | env`.

use std::time::Instant;

use anyhow::Context as _;
use clap::Subcommand;
use wasmctrl_testenv::cluster::{Binaries, ControlPlane, Lifetime, is_alive, memory_mib};
use wasmctrl_testenv::{default_cluster_dir, repo_root};

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Build the binaries if needed and start the control plane (no-op if it is running).
    Up,
    /// Stop every process and remove the cluster's state.
    Down,
    /// Show what runs where.
    Status,
    /// Print shell exports for kubectl: `eval "$(cargo xtask cluster env)"`.
    Env,
}

pub fn run(command: ClusterCommand) -> anyhow::Result<()> {
    let dir = default_cluster_dir();
    match command {
        ClusterCommand::Up => {
            if let Some(plane) = ControlPlane::load(&dir)?
                && plane.all_alive()
            {
                eprintln!("cluster: already running at {}", plane.server);
                print_env(&plane);
                return Ok(());
            }
            let binaries = Binaries::build(&repo_root())?;
            let started = Instant::now();
            let plane = tokio::runtime::Runtime::new()?.block_on(ControlPlane::start(
                &dir,
                &binaries,
                Lifetime::Detached,
            ))?;
            eprintln!(
                "cluster: ready in {:.1}s at {}",
                started.elapsed().as_secs_f64(),
                plane.server
            );
            print_env(&plane);
        }
        ClusterCommand::Down => match ControlPlane::load(&dir)? {
            Some(plane) => {
                plane.stop();
                eprintln!("cluster: stopped and removed {}", dir.display());
            }
            None => {
                let _ = std::fs::remove_dir_all(&dir);
                eprintln!("cluster: nothing running");
            }
        },
        ClusterCommand::Status => {
            let plane =
                ControlPlane::load(&dir)?.context("no cluster (run `cargo xtask cluster up`)")?;
            println!("server:     {}", plane.server);
            println!("kubeconfig: {}", plane.kubeconfig.display());
            for c in &plane.components {
                let rss = memory_mib(c.pid, "VmRSS")
                    .map(|m| format!("{m:.0} MiB"))
                    .unwrap_or_default();
                println!(
                    "{:<24} pid {:<8} port {:<6} {:<8} {:>8}  log {}",
                    c.name,
                    c.pid,
                    c.port,
                    if is_alive(c.pid) { "running" } else { "DEAD" },
                    rss,
                    c.log.display()
                );
            }
        }
        ClusterCommand::Env => {
            let plane =
                ControlPlane::load(&dir)?.context("no cluster (run `cargo xtask cluster up`)")?;
            print_env(&plane);
        }
    }
    Ok(())
}

fn print_env(plane: &ControlPlane) {
    println!("export KUBECONFIG={}", plane.kubeconfig.display());
    println!("export PATH={}:$PATH", plane.bin_dir.display());
}
