//! `wasmctrl run`: the operator host.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::controller::{Host, HostOptions};
use crate::plugin::{EngineOptions, PluginEngine};

/// Run the operator host against a cluster.
#[derive(Debug, Args)]
pub struct RunCommand {
    /// Kubeconfig to use; without it, `KUBECONFIG`, `~/.kube/config` or the in-cluster
    /// service account, in that order.
    #[arg(long, env = "WASMCTRL_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Kubeconfig context (default: the current context).
    #[arg(long, env = "WASMCTRL_CONTEXT")]
    context: Option<String>,
    /// Reconcile every parent at least this often (a policy's resyncPeriodSeconds wins).
    #[arg(long, env = "WASMCTRL_RESYNC_SECONDS", default_value_t = 300)]
    resync_seconds: u64,
    /// First retry delay after a failed reconcile, in milliseconds; doubles per failure.
    #[arg(long, env = "WASMCTRL_BACKOFF_BASE_MS", default_value_t = 1000)]
    backoff_base_ms: u64,
    /// Longest retry delay, in seconds.
    #[arg(long, env = "WASMCTRL_BACKOFF_MAX_SECONDS", default_value_t = 300)]
    backoff_max_seconds: u64,
    /// At most one Event per parent and reason in this many seconds.
    #[arg(long, env = "WASMCTRL_EVENT_INTERVAL_SECONDS", default_value_t = 60)]
    event_interval_seconds: u64,
    /// Watch parents, children and related objects in this namespace only (for a host
    /// installed with namespaced RBAC). Default: all namespaces.
    #[arg(long, env = "WASMCTRL_NAMESPACE")]
    namespace: Option<String>,
    /// Run only the ReconcilePolicies matching this label selector (e.g. `shard=a`).
    #[arg(long, env = "WASMCTRL_POLICY_SELECTOR")]
    policy_selector: Option<String>,
    /// Plugin calls that may run at once, across all policies.
    #[arg(long, env = "WASMCTRL_MAX_CONCURRENT_CALLS", default_value_t = 64)]
    max_concurrent_calls: u32,
    /// Bound on the precompiled-plugin cache on disk, in MiB (least recently used go first).
    #[arg(long, env = "WASMCTRL_CACHE_MAX_MIB", default_value_t = 1024)]
    cache_max_mib: u64,
    /// The one namespace whose Secrets a policy's `secretRef` may name (plugin registry
    /// credentials). Default: the namespace the host runs in (`POD_NAMESPACE`, or the service
    /// account's namespace in a pod); outside a cluster, none, so every `secretRef` is refused.
    #[arg(long, env = "WASMCTRL_CREDENTIALS_NAMESPACE")]
    credentials_namespace: Option<String>,
    /// Serve `/healthz`, `/readyz` and `/metrics` on this address; `off` serves none.
    #[arg(long, env = "WASMCTRL_LISTEN", default_value = "0.0.0.0:8080")]
    listen: String,
    /// The largest memory limit any policy may give its plugin, in MiB.
    #[arg(long, env = "WASMCTRL_MAX_PLUGIN_MEMORY_MIB", default_value_t = 512)]
    max_plugin_memory_mib: usize,
}

impl RunCommand {
    /// Connect, then run until SIGINT or SIGTERM.
    pub async fn run(self, cache_dir: Option<PathBuf>) -> anyhow::Result<()> {
        let client = self.client().await?;
        let version = client
            .apiserver_version()
            .await
            .context("reaching the API server")?;
        tracing::info!(server = %version.git_version, "connected to the API server");
        let engine = PluginEngine::new(EngineOptions {
            cache_dir,
            max_concurrent_calls: self.max_concurrent_calls,
            max_memory_bytes: self.max_plugin_memory_mib << 20,
            cache_max_bytes: self.cache_max_mib << 20,
        })
        .context("starting the plugin engine")?;
        let options = HostOptions {
            resync: Duration::from_secs(self.resync_seconds.max(1)),
            backoff_base: Duration::from_millis(self.backoff_base_ms.max(1)),
            backoff_max: Duration::from_secs(self.backoff_max_seconds.max(1)),
            event_interval: Duration::from_secs(self.event_interval_seconds),
            namespace: self.namespace,
            policy_selector: self.policy_selector,
            credentials_namespace: self.credentials_namespace.or_else(own_namespace),
        };
        let host = Host::new(client, engine, options);
        let listener = match self.listen.as_str() {
            "off" => None,
            address => Some(
                crate::server::bind(address.parse().with_context(|| {
                    format!("--listen {address:?} is not an address like 0.0.0.0:8080 (or `off`)")
                })?)
                .await?,
            ),
        };
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn({
            let stop = stop.clone();
            async move {
                shutdown_signal().await;
                stop.cancel();
            }
        });
        let server = {
            let (readiness, metrics) = (host.readiness(), host.metrics());
            let stop = stop.clone();
            async move {
                match listener {
                    Some(listener) => {
                        tracing::info!(address = ?listener.local_addr().ok(), "serving /healthz, /readyz and /metrics");
                        crate::server::serve(listener, readiness, metrics, stop.cancelled_owned())
                            .await
                    }
                    None => Ok(()),
                }
            }
        };
        tokio::try_join!(host.run(stop.clone().cancelled_owned()), server)?;
        Ok(())
    }

    async fn client(&self) -> anyhow::Result<kube::Client> {
        let config = match &self.kubeconfig {
            Some(path) => {
                let kubeconfig = Kubeconfig::read_from(path)
                    .with_context(|| format!("reading kubeconfig {}", path.display()))?;
                let options = KubeConfigOptions {
                    context: self.context.clone(),
                    ..KubeConfigOptions::default()
                };
                kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                    .await
                    .with_context(|| format!("loading kubeconfig {}", path.display()))?
            }
            None if self.context.is_some() => {
                let options = KubeConfigOptions {
                    context: self.context.clone(),
                    ..KubeConfigOptions::default()
                };
                kube::Config::from_kubeconfig(&options)
                    .await
                    .context("loading the kubeconfig")?
            }
            None => kube::Config::infer()
                .await
                .context("finding cluster credentials (kubeconfig or in-cluster)")?,
        };
        kube::Client::try_from(config).context("building the Kubernetes client")
    }
}

/// The namespace this host runs in, when it runs in a pod.
fn own_namespace() -> Option<String> {
    std::env::var("POD_NAMESPACE")
        .ok()
        .or_else(|| {
            std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace").ok()
        })
        .map(|namespace| namespace.trim().to_owned())
        .filter(|namespace| !namespace.is_empty())
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM (what Kubernetes sends a pod).
async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
    tracing::info!("shutdown requested");
}
