//! The wasmctrl host under test, running in the test process, and the one builder every test
//! makes it with.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kube::Client;
use tokio::task::JoinHandle;
use wasmctrl::controller::{Host, HostOptions};
use wasmctrl::explain::Explain;
use wasmctrl::plugin::{EngineOptions, PluginEngine};
use wasmctrl_testenv::TestEnv;

use crate::TEST_LABEL;

/// How long a test's host may take to stop: its drain time (see
/// [`HostBuilder::drain_timeout`]), which `Host::run` keeps, plus this.
const STOP_MARGIN: Duration = Duration::from_secs(5);

/// A wasmctrl host running in this test process, running only the policies labelled for
/// its test; made with [`HostUnderTest::builder`] (or [`HostUnderTest::cluster_wide`]).
/// Dropped without [`stop`](Self::stop), it is aborted.
pub struct HostUnderTest {
    /// The host's metrics, read by tests that count reconciles.
    pub metrics: Arc<wasmctrl::metrics::Metrics>,
    /// The host's readiness, for tests of `/readyz`.
    pub readiness: Arc<wasmctrl::health::Readiness>,
    /// The records of its reconciles, for tests of `explain`.
    pub explain: Arc<Explain>,
    /// What the host runs and where each task stands, named when a stop hangs.
    pub activity: Arc<wasmctrl::controller::Activity>,
    drain: Duration,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl HostUnderTest {
    /// Serve the host's endpoints with `access` on all interfaces (the API server's pod proxy
    /// will not dial loopback) until the returned sender fires or is dropped.
    pub async fn serve(
        &self,
        access: wasmctrl::server::Access,
    ) -> anyhow::Result<(std::net::SocketAddr, tokio::sync::oneshot::Sender<()>)> {
        let listener = wasmctrl::server::bind("0.0.0.0:0".parse()?).await?;
        let address = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let endpoints = wasmctrl::server::Endpoints {
            readiness: self.readiness.clone(),
            metrics: self.metrics.clone(),
            explain: self.explain.clone(),
            access,
        };
        tokio::spawn(wasmctrl::server::serve(listener, endpoints, async move {
            let _ = stopped.await;
        }));
        Ok((address, stop))
    }

    /// The value of the host's metric `name` (a series without labels), or 0.
    pub fn metric(&self, name: &str) -> f64 {
        self.metrics
            .encode()
            .lines()
            .find_map(|line| line.strip_prefix(&format!("{name} ")))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// The sum of every series of the labelled metric `name` whose labels include each of
    /// `labels` (each `key="value"`), or 0.
    pub fn metric_sum(&self, name: &str, labels: &[&str]) -> f64 {
        metric_sum(&self.metrics, name, labels)
    }

    /// A host for `test`, confined to `namespace`: it runs only the policies labelled
    /// `TEST_LABEL=test`, watches only `namespace`, takes plugin credentials only from it, and
    /// records an Event at most every 30 s per parent and reason. Unless the builder is told
    /// otherwise, it acts as the test cluster's admin, keeps precompiled plugins in the
    /// suite's disk cache, reads file sources from the built plugins' directory only, lets 8
    /// plugin calls run at once, and keeps its reconciles' records as a host does by default.
    pub fn builder(test: &str, namespace: &str) -> HostBuilder {
        HostBuilder {
            namespace: Some(namespace.to_owned()),
            event_interval: Some(Duration::from_secs(30)),
            ..HostBuilder::new(test)
        }
    }

    /// A host for `test` over the whole cluster, as `wasmctrl run` without `--namespace`: it
    /// watches every namespace, refuses every `secretRef`, and keeps the host's default Event
    /// interval; otherwise as [`builder`](Self::builder) makes it. For the fault suite, whose
    /// parents are spread over namespaces of their own on a cluster that runs one test at a
    /// time.
    pub fn cluster_wide(test: &str) -> HostBuilder {
        HostBuilder::new(test)
    }

    /// Stop gracefully and wait for every controller to finish: an error, naming what was
    /// still running, if the host abandoned tasks at the end of its drain time or did not
    /// return within it.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let limit = self.drain + STOP_MARGIN;
        match tokio::time::timeout(limit, &mut self.task).await {
            Ok(joined) => joined
                .context("host task panicked")?
                .context("the host did not stop cleanly"),
            Err(_) => anyhow::bail!(
                "the host did not return within {limit:?} of its stop signal; still running: {}",
                self.activity.still_running().join("; ")
            ),
        }
    }
}

impl Drop for HostUnderTest {
    fn drop(&mut self) {
        self.task.abort();
        self.activity.abort_all();
    }
}

/// How the host under test talks to the cluster.
enum Credentials {
    /// As the test cluster's admin.
    Admin,
    /// As this user, impersonated by the admin.
    Impersonating(String),
    /// With a token of this ServiceAccount (namespace, name), as a host in a pod is: its
    /// impersonation of policies' accounts is then checked against the account's own RBAC.
    ServiceAccountToken(String, String),
    /// Through this client.
    Client(Client),
}

/// What a test chooses about its host, from [`HostUnderTest::builder`] or
/// [`HostUnderTest::cluster_wide`]; [`start`](Self::start) runs it.
#[must_use = "a host runs only once started"]
pub struct HostBuilder {
    test: String,
    /// The only namespace watched and the only one credentials come from; `None`: every
    /// namespace, and no credentials.
    namespace: Option<String>,
    /// `None`: the host's default.
    event_interval: Option<Duration>,
    credentials: Credentials,
    disk_cache: bool,
    /// `--plugin-dir`: where file sources may be.
    plugin_dirs: Vec<PathBuf>,
    max_concurrent_calls: u32,
    /// `--max-plugin-memory-mib`, in bytes.
    max_plugin_memory: usize,
    /// `--plugin-memory-budget-mib`, in bytes; `None`: no budget.
    call_memory_budget: Option<usize>,
    explain: Option<Arc<Explain>>,
    require_policy_identity: bool,
    signing: wasmctrl::signing::HostTrust,
    drain_timeout: Duration,
    /// `None`: the host's default.
    max_concurrent_loads: Option<usize>,
    /// A standby that never leads: it watches and loads, but writes nothing.
    standby: bool,
    shards: Option<std::sync::Arc<wasmctrl::shards::ShardOwnership>>,
    /// What teams' NamespacedReconcilePolicies may ask for.
    team_bounds: wasmctrl::policy::namespaced::TeamBounds,
    default_verify: Option<wasmctrl::policy::VerifySpec>,
    /// The webhook listener policies serve their webhooks through.
    webhooks: Option<wasmctrl::admission::hosting::Hosting>,
}

impl HostBuilder {
    fn new(test: &str) -> Self {
        Self {
            test: test.to_owned(),
            namespace: None,
            event_interval: None,
            credentials: Credentials::Admin,
            disk_cache: true,
            plugin_dirs: vec![wasmctrl_testenv::plugins::plugin_dir()],
            max_concurrent_calls: 8,
            max_plugin_memory: 128 << 20,
            call_memory_budget: None,
            explain: None,
            require_policy_identity: false,
            signing: wasmctrl::signing::HostTrust::default(),
            drain_timeout: Duration::from_secs(15),
            max_concurrent_loads: None,
            standby: false,
            shards: None,
            team_bounds: wasmctrl::policy::namespaced::TeamBounds::default(),
            default_verify: None,
            webhooks: None,
        }
    }

    /// Serve policies' webhooks (`spec.admission`) through `hosting`'s listener.
    pub fn webhooks(mut self, hosting: wasmctrl::admission::hosting::Hosting) -> Self {
        self.webhooks = Some(hosting);
        self
    }

    /// Let up to `loads` plugins be fetched and compiled at once, as
    /// `--max-concurrent-loads` does.
    pub fn max_concurrent_loads(mut self, loads: usize) -> Self {
        self.max_concurrent_loads = Some(loads);
        self
    }

    /// A replica that stands by and never leads: it watches and loads plugins, and every
    /// write waits for a leadership that never comes.
    pub fn standby(mut self) -> Self {
        self.standby = true;
        self
    }

    /// A sharded replica: it reconciles, and writes for, only the parents of the shards
    /// `shards` holds (which the test sets by hand, standing in for the shard Leases).
    pub fn sharded(mut self, shards: std::sync::Arc<wasmctrl::shards::ShardOwnership>) -> Self {
        self.shards = Some(shards);
        self
    }

    /// How long the host may take to stop after its stop signal (default 15 s, shorter
    /// than a host's own default so a stuck stop fails its test soon).
    pub fn drain_timeout(mut self, drain: Duration) -> Self {
        self.drain_timeout = drain;
        self
    }

    /// Check plugin signatures against these keyless roots and log keys, as
    /// `--keyless-trust-roots` and `--rekor-public-keys` do.
    pub fn signing(mut self, trust: wasmctrl::signing::HostTrust) -> Self {
        self.signing = trust;
        self
    }

    /// Require every plugin to be signed as `verify` says, as `--plugin-verify` does.
    pub fn plugin_verify(mut self, verify: wasmctrl::policy::VerifySpec) -> Self {
        self.default_verify = Some(verify);
        self
    }

    /// Refuse policies that name no ServiceAccount, as `--require-policy-identity` does.
    pub fn require_policy_identity(mut self) -> Self {
        self.require_policy_identity = true;
        self
    }

    /// Talk to the cluster with a token of ServiceAccount `namespace/name` (no
    /// impersonation by the admin), so that what the host may do, and whom it may act as,
    /// is exactly what RBAC grants that account.
    pub fn as_service_account(mut self, namespace: &str, name: &str) -> Self {
        self.credentials = Credentials::ServiceAccountToken(namespace.to_owned(), name.to_owned());
        self
    }

    /// Keep the records of its reconciles in `explain`.
    pub fn explained(mut self, explain: Arc<Explain>) -> Self {
        self.explain = Some(explain);
        self
    }

    /// No precompiled artifacts on disk, so a pinned digest the host has not loaded itself is
    /// always fetched from its source (for tests of the sources), and every plugin is
    /// compiled afresh.
    pub fn without_disk_cache(mut self) -> Self {
        self.disk_cache = false;
        self
    }

    /// Let file sources be read from `dir` too (a test's own plugin files), as
    /// `--plugin-dir` does.
    pub fn plugin_dir(mut self, dir: &std::path::Path) -> Self {
        self.plugin_dirs.push(dir.to_owned());
        self
    }

    /// Make every request as `user` (e.g. `system:serviceaccount:NS:NAME`), impersonated by
    /// the admin, so the host has exactly the permissions RBAC grants that user.
    pub fn as_user(mut self, user: &str) -> Self {
        self.credentials = Credentials::Impersonating(user.to_owned());
        self
    }

    /// Talk to the cluster through `client` (for a control plane other than the suite's).
    pub fn client(mut self, client: Client) -> Self {
        self.credentials = Credentials::Client(client);
        self
    }

    /// Bound what teams' NamespacedReconcilePolicies may ask for, as
    /// `--namespaced-max-memory-mib`, `--namespaced-max-concurrent-reconciles` and
    /// `--namespaced-source-hosts` do.
    pub fn team_bounds(mut self, bounds: wasmctrl::policy::namespaced::TeamBounds) -> Self {
        self.team_bounds = bounds;
        self
    }

    /// Let up to `calls` plugin calls run at once.
    pub fn max_concurrent_calls(mut self, calls: u32) -> Self {
        self.max_concurrent_calls = calls;
        self
    }

    /// Let a policy give its plugin up to `max_mib` of memory, and the calls in flight
    /// reserve up to `budget_mib` together, as `--max-plugin-memory-mib` and
    /// `--plugin-memory-budget-mib` do.
    pub fn call_memory(mut self, max_mib: usize, budget_mib: usize) -> Self {
        self.max_plugin_memory = max_mib << 20;
        self.call_memory_budget = Some(budget_mib << 20);
        self
    }

    /// The host, not yet running (for a process of its own that runs it until killed).
    pub async fn build(self) -> anyhow::Result<Host> {
        wasmctrl::ensure_crypto_provider();
        let webhooks = self.webhooks;
        let serving = |host: Host| match webhooks {
            Some(hosting) => host.serving_webhooks(hosting),
            None => host,
        };
        let engine = PluginEngine::new(EngineOptions {
            cache_dir: self.disk_cache.then(disk_cache),
            max_concurrent_calls: self.max_concurrent_calls,
            max_memory_bytes: self.max_plugin_memory,
            memory_budget_bytes: self.call_memory_budget,
            ..EngineOptions::default()
        })?;
        let defaults = HostOptions::default();
        let options = HostOptions {
            namespace: self.namespace.clone(),
            policy_selector: Some(format!("{TEST_LABEL}={}", self.test)),
            backoff_base: Duration::from_millis(500),
            backoff_max: Duration::from_secs(8),
            event_interval: self.event_interval.unwrap_or(defaults.event_interval),
            credentials_namespace: self.namespace,
            plugin_dirs: self.plugin_dirs,
            explain: self.explain.unwrap_or(defaults.explain),
            require_policy_identity: self.require_policy_identity,
            signing: self.signing,
            drain_timeout: self.drain_timeout,
            max_concurrent_loads: self
                .max_concurrent_loads
                .unwrap_or(defaults.max_concurrent_loads),
            team_bounds: self.team_bounds,
            default_verify: self.default_verify,
            ..defaults
        };
        let leadership = if self.standby {
            wasmctrl::leader::Leadership::standby()
        } else {
            wasmctrl::leader::Leadership::always()
        };
        if let Some(shards) = self.shards {
            leadership.shard_by(shards);
        }
        // Policies that name a ServiceAccount are impersonated from the host's own settings.
        let config = match self.credentials {
            Credentials::Admin => admin_config().await?,
            Credentials::Impersonating(user) => {
                let mut config = admin_config().await?;
                config.auth_info.impersonate = Some(user);
                config
            }
            Credentials::ServiceAccountToken(namespace, name) => {
                service_account_config(&namespace, &name).await?
            }
            Credentials::Client(client) => {
                return Ok(serving(Host::elected(client, engine, options, leadership)));
            }
        };
        // Gated as `wasmctrl run` gates it: reads and writes over pools of their own.
        let client = wasmctrl::leader::gated_client(config.clone(), &leadership)?;
        Ok(serving(
            Host::elected(client, engine, options, leadership).impersonating_from(config),
        ))
    }

    /// Start the host on a task of this test's runtime.
    pub async fn start(self) -> anyhow::Result<HostUnderTest> {
        capture_logs();
        let drain = self.drain_timeout;
        let host = self.build().await?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let metrics = host.metrics();
        let readiness = host.readiness();
        let explain = host.explain();
        let activity = host.activity();
        let task = tokio::spawn(host.run(async {
            let _ = stopped.await;
        }));
        Ok(HostUnderTest {
            metrics,
            readiness,
            explain,
            activity,
            drain,
            stop: Some(stop),
            task,
        })
    }
}

/// The sum of every series of the labelled metric `name` in `metrics` whose labels include
/// each of `labels` (each `key="value"`), or 0.
pub fn metric_sum(metrics: &wasmctrl::metrics::Metrics, name: &str, labels: &[&str]) -> f64 {
    let series = format!("{name}{{");
    metrics
        .encode()
        .lines()
        .filter(|line| line.starts_with(&series))
        .filter(|line| labels.iter().all(|label| line.contains(label)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The hosts' logs go to the test's captured output, which the runner prints when the test
/// fails: `WASMCTRL_TEST_LOG` filters them (default: the host's info and above).
fn capture_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("WASMCTRL_TEST_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("wasmctrl=info,warn"));
    // A test that set up its own subscriber keeps it.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// Where every host of the suite keeps its precompiled plugins, unless told not to.
fn disk_cache() -> PathBuf {
    std::env::temp_dir().join("wasmctrl-e2e-artifacts")
}

/// A client that acts as `user` (e.g. a team member, `team-a-user`), impersonated by the
/// admin: it may do exactly what RBAC grants that user.
pub async fn client_as(user: &str) -> anyhow::Result<Client> {
    let mut config = admin_config().await?;
    config.auth_info.impersonate = Some(user.to_owned());
    Ok(Client::try_from(config)?)
}

/// The test cluster's admin connection settings.
async fn admin_config() -> anyhow::Result<kube::Config> {
    let kubeconfig = kube::config::Kubeconfig::read_from(TestEnv::get().kubeconfig())?;
    Ok(kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?)
}

/// Connection settings that authenticate as ServiceAccount `namespace/name` with a token
/// the API server issues for it (TokenRequest), as a pod's mounted token does.
pub async fn service_account_config(namespace: &str, name: &str) -> anyhow::Result<kube::Config> {
    let token = service_account_token(namespace, name).await?;
    let mut config = admin_config().await?;
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.into()),
        ..kube::config::AuthInfo::default()
    };
    Ok(config)
}

/// A bearer token for ServiceAccount `namespace/name`, valid for an hour.
pub async fn service_account_token(namespace: &str, name: &str) -> anyhow::Result<String> {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    let admin = TestEnv::get().client().await?;
    let accounts: kube::Api<ServiceAccount> = kube::Api::namespaced(admin, namespace);
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    accounts
        .create_token_request(name, &kube::api::PostParams::default(), &request)
        .await
        .with_context(|| format!("requesting a token for ServiceAccount {namespace}/{name}"))?
        .status
        .and_then(|status| status.token)
        .context("the TokenRequest has no token")
}
