//! The wasmctrl host under test, running in the test process.

use std::time::Duration;

use anyhow::Context as _;
use kube::Client;
use tokio::task::JoinHandle;
use wasmctrl::controller::{Host, HostOptions};
use wasmctrl::plugin::{EngineOptions, PluginEngine};
use wasmctrl_testenv::TestEnv;

use crate::TEST_LABEL;

/// A wasmctrl host running in this test process, watching only `namespace` and only the
/// policies labelled for this test.
pub struct HostUnderTest {
    /// The host's metrics, read by tests that count reconciles.
    pub metrics: std::sync::Arc<wasmctrl::metrics::Metrics>,
    /// The host's readiness, for tests of `/readyz`.
    pub readiness: std::sync::Arc<wasmctrl::health::Readiness>,
    /// The records of its reconciles, for tests of `explain`.
    pub explain: std::sync::Arc<wasmctrl::explain::Explain>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl HostUnderTest {
    /// A host as the admin, with precompiled artifacts kept on disk.
    pub async fn start(test: &str, namespace: &str) -> anyhow::Result<Self> {
        let cache = std::env::temp_dir().join("wasmctrl-e2e-artifacts");
        Self::start_with(TestEnv::get().client().await?, test, namespace, Some(cache)).await
    }

    /// A host that keeps the records of its reconciles in `explain`.
    pub async fn start_explained(
        test: &str,
        namespace: &str,
        explain: std::sync::Arc<wasmctrl::explain::Explain>,
    ) -> anyhow::Result<Self> {
        let cache = std::env::temp_dir().join("wasmctrl-e2e-artifacts");
        let client = TestEnv::get().client().await?;
        Self::start_with_explain(client, test, namespace, Some(cache), explain).await
    }

    /// A host with no precompiled artifacts on disk, so a pinned digest it has not loaded
    /// itself is always fetched from its source (for tests of the sources).
    pub async fn start_without_disk_cache(test: &str, namespace: &str) -> anyhow::Result<Self> {
        Self::start_with(TestEnv::get().client().await?, test, namespace, None).await
    }

    /// A host whose every request is made as `user` (e.g. a ServiceAccount), so it has
    /// exactly the permissions RBAC grants that user.
    pub async fn start_as(test: &str, namespace: &str, user: &str) -> anyhow::Result<Self> {
        let cache = std::env::temp_dir().join("wasmctrl-e2e-artifacts");
        Self::start_with(
            impersonating_client(user).await?,
            test,
            namespace,
            Some(cache),
        )
        .await
    }

    async fn start_with(
        client: Client,
        test: &str,
        namespace: &str,
        cache_dir: Option<std::path::PathBuf>,
    ) -> anyhow::Result<Self> {
        let explain = HostOptions::default().explain;
        Self::start_with_explain(client, test, namespace, cache_dir, explain).await
    }

    async fn start_with_explain(
        client: Client,
        test: &str,
        namespace: &str,
        cache_dir: Option<std::path::PathBuf>,
        explain: std::sync::Arc<wasmctrl::explain::Explain>,
    ) -> anyhow::Result<Self> {
        let engine = PluginEngine::new(EngineOptions {
            cache_dir,
            max_concurrent_calls: 8,
            max_memory_bytes: 128 << 20,
            ..EngineOptions::default()
        })?;
        let options = HostOptions {
            namespace: Some(namespace.to_owned()),
            policy_selector: Some(format!("{TEST_LABEL}={test}")),
            backoff_base: Duration::from_millis(500),
            backoff_max: Duration::from_secs(8),
            event_interval: Duration::from_secs(30),
            credentials_namespace: Some(namespace.to_owned()),
            explain,
            ..HostOptions::default()
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let host = Host::new(client, engine, options);
        let metrics = host.metrics();
        let readiness = host.readiness();
        let explain = host.explain();
        let task = tokio::spawn(host.run(async {
            let _ = stopped.await;
        }));
        Ok(Self {
            metrics,
            readiness,
            explain,
            stop: Some(stop),
            task,
        })
    }

    /// Stop gracefully and wait for every controller to finish.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task).await.context("host task panicked")?
    }
}

impl Drop for HostUnderTest {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A client that acts as `user` through impersonation by the admin credentials.
pub async fn impersonating_client(user: &str) -> anyhow::Result<Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(TestEnv::get().kubeconfig())?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.auth_info.impersonate = Some(user.to_owned());
    Ok(Client::try_from(config)?)
}
