//! A real local Kubernetes control plane for wasmctrl's tests and quickstart.
//!
//! - [`cluster`]: start, find and stop one (used by `cargo xtask cluster …`).
//! - [`TestEnv`]: what an end-to-end test asks for: a cluster (reused if one is running,
//!   started for the test run otherwise), a `kube::Client`, and a namespace of its own.
//!
//! Which cluster a test run uses, in order: `WASMCTRL_TEST_KUBECONFIG`; the cluster of
//! `cargo xtask cluster up` if it is running; else one started for this test process, which
//! the kernel stops when the process exits.

pub mod cluster;
pub mod container;
pub mod crds;
pub mod image;
mod pki;
pub mod plugins;
pub mod registry;
pub mod runner;
pub mod signing;
pub mod tools;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};

use cluster::{Binaries, ControlPlane, Lifetime};

/// The repository root: the workspace of the package cargo is running now (cargo sets
/// `CARGO_MANIFEST_DIR` for `cargo run`, `cargo xtask` and `cargo test`), else the one this
/// crate was built in. Asked at run time, because checkouts that share a target directory
/// share the built `xtask` binary, which must act on the checkout it is run from.
pub fn repo_root() -> PathBuf {
    let running = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .and_then(|dir| {
            dir.ancestors()
                .find(|d| d.join("Cargo.lock").is_file() && d.join("tests/testenv").is_dir())
                .map(Path::to_path_buf)
        });
    running.unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .canonicalize()
            .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
    })
}

/// Where `cargo xtask cluster up` and `cargo xtask up` keep their cluster: `target/cluster`,
/// or `WASMCTRL_CLUSTER_DIR` (a second cluster beside the first, as the quickstart's test
/// runs one).
pub fn default_cluster_dir() -> PathBuf {
    std::env::var_os("WASMCTRL_CLUSTER_DIR")
        .filter(|dir| !dir.is_empty())
        .map_or_else(|| repo_root().join("target/cluster"), PathBuf::from)
}

/// The cluster a test process uses.
#[derive(Debug)]
pub struct TestEnv {
    kubeconfig: PathBuf,
    bin_dir: Option<PathBuf>,
    audit_log: Option<PathBuf>,
}

impl TestEnv {
    /// The shared test cluster, started on first use if none is running.
    pub fn get() -> &'static TestEnv {
        static ENV: OnceLock<TestEnv> = OnceLock::new();
        cluster::ensure_crypto_provider();
        ENV.get_or_init(|| match Self::find_or_start() {
            Ok(env) => env,
            Err(e) => panic!("no test cluster: {e:#}"),
        })
    }

    fn find_or_start() -> anyhow::Result<Self> {
        if let Some(path) = std::env::var_os("WASMCTRL_TEST_KUBECONFIG").filter(|p| !p.is_empty()) {
            let kubeconfig = PathBuf::from(path);
            // When it is ours, the state file sits beside it and tells us more.
            let state = kubeconfig
                .parent()
                .map(ControlPlane::load)
                .transpose()?
                .flatten();
            return Ok(Self {
                kubeconfig,
                bin_dir: state.as_ref().map(|s| s.bin_dir.clone()),
                audit_log: state.map(|s| s.audit_log),
            });
        }
        if let Some(plane) = ControlPlane::load(&default_cluster_dir())?
            && plane.all_alive()
        {
            return Ok(Self::from_plane(plane));
        }
        Self::start_for_this_process()
    }

    fn from_plane(plane: ControlPlane) -> Self {
        Self {
            kubeconfig: plane.kubeconfig,
            bin_dir: Some(plane.bin_dir),
            audit_log: Some(plane.audit_log),
        }
    }

    /// Start a cluster from a thread that never exits, so the processes (tied to it with
    /// PDEATHSIG) live exactly as long as this test process.
    fn start_for_this_process() -> anyhow::Result<Self> {
        remove_dead_test_clusters();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("test-cluster-keeper".into())
            .spawn(move || {
                let started = (|| {
                    let binaries = Binaries::build(&repo_root())?;
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?;
                    let dir =
                        repo_root().join(format!("target/cluster-test-{}", std::process::id()));
                    runtime.block_on(ControlPlane::start(
                        &dir,
                        &binaries,
                        Lifetime::TiedToStarter,
                    ))
                })();
                let _ = tx.send(started);
                loop {
                    std::thread::park();
                }
            })?;
        let plane = rx.recv().context("the cluster keeper thread died")??;
        Ok(Self::from_plane(plane))
    }

    /// The admin kubeconfig.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The directory with `kubectl` and the other control plane binaries, if known.
    pub fn bin_dir(&self) -> Option<&Path> {
        self.bin_dir.as_deref()
    }

    /// The API server's audit log of writes, if this is a cluster we started.
    pub fn audit_log(&self) -> Option<&Path> {
        self.audit_log.as_deref()
    }

    /// An admin client, bound to the calling test's async runtime.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        cluster::admin_client(&self.kubeconfig).await
    }

    /// A fresh namespace named after `test` (plus a unique suffix), and an admin client.
    pub async fn namespace(&self, test: &str) -> anyhow::Result<(kube::Client, String)> {
        let client = self.client().await?;
        let suffix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .subsec_nanos();
        let prefix: String = test
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '-'
                }
            })
            .take(40)
            .collect();
        let name = format!("{}-{suffix:x}", prefix.trim_matches('-'));
        let namespace: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
        }))?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &namespace)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        Ok((client, name))
    }
}

/// Test processes that started their own cluster leave its state directory behind when they
/// exit (their processes die with them). Remove those whose processes are all gone: every
/// test binary that starts a cluster of its own calls this first, or the directories (about
/// 125 MB each) pile up in a checkout that is tested again and again.
pub fn remove_dead_test_clusters() {
    let Ok(entries) = std::fs::read_dir(repo_root().join("target")) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_test_cluster = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("cluster-test-") || n.starts_with("cluster-faults-"));
        if !is_test_cluster {
            continue;
        }
        let dead = match ControlPlane::load(&path) {
            Ok(Some(plane)) => plane.components.iter().all(|c| !cluster::is_alive(c.pid)),
            Ok(None) | Err(_) => true,
        };
        if dead {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}
