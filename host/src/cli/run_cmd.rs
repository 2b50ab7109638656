//! `wasmctrl run`: the operator host.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use kube::config::{KubeConfigOptions, Kubeconfig};

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::controller::{Host, HostOptions, StopTimedOut};
use crate::explain::{Bounds, Explain, ExplainOptions, RecordOptions};
use crate::leader::Leadership;
use crate::plugin::{ChildCompiler, Compiler, EngineOptions, PluginEngine};
use crate::server::Access;
use crate::server::access::Reviewer;
use crate::server::tls::CertificateFiles;

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
    /// Run only the ReconcilePolicies matching this label selector (e.g. `shard=a`), and the
    /// NamespacedReconcilePolicies of the namespaces whose labels match it.
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
    /// A directory `file` plugin sources may be in (symlinks followed); repeat it, or
    /// separate directories with `:`. A file source anywhere else is refused. Default: the
    /// working directory when the host runs outside a cluster (unless that is `/`); none in
    /// a pod, so every file source is refused there.
    #[arg(
        long = "plugin-dir",
        env = "WASMCTRL_PLUGIN_DIRS",
        value_delimiter = ':'
    )]
    plugin_dirs: Vec<PathBuf>,
    /// Plugins compiled at once, across all policies; more wait their turn, the policy
    /// holding the fewest first. Each takes a compile (`--max-compile-memory-mib`), and only
    /// while it compiles: never while its bytes arrive.
    #[arg(long, env = "WASMCTRL_MAX_CONCURRENT_LOADS", default_value_t = crate::registry::RegistryOptions::default().max_concurrent_loads)]
    max_concurrent_loads: usize,
    /// The most memory per call (`spec.limits.memoryMib`) a team's NamespacedReconcilePolicy
    /// may ask for, in MiB; more is refused on the team's object (`OverTeamLimit`).
    #[arg(long, env = "WASMCTRL_NAMESPACED_MAX_MEMORY_MIB")]
    namespaced_max_memory_mib: Option<u32>,
    /// The most `spec.maxConcurrentReconciles` a team's NamespacedReconcilePolicy may ask
    /// for; more is refused on the team's object (`OverTeamLimit`).
    #[arg(long, env = "WASMCTRL_NAMESPACED_MAX_CONCURRENT_RECONCILES")]
    namespaced_max_concurrent_reconciles: Option<u32>,
    /// The registry and web hosts (`host[:port]`) a team's NamespacedReconcilePolicy may
    /// fetch its plugin from, comma-separated; others are refused on the team's object
    /// (`SourceHostNotAllowed`). Default: any host, which lets a team have the host make
    /// requests to any address it can reach.
    #[arg(long, env = "WASMCTRL_NAMESPACED_SOURCE_HOSTS", value_delimiter = ',')]
    namespaced_source_hosts: Option<Vec<String>>,
    /// Plugins fetched at once, across all policies, one at a time per team (a namespace's
    /// NamespacedReconcilePolicies) or cluster policy; more wait their turn. Each may buffer
    /// up to the plugin size limit (64 MiB).
    #[arg(long, env = "WASMCTRL_MAX_CONCURRENT_FETCHES", default_value_t = crate::registry::RegistryOptions::default().max_concurrent_fetches)]
    max_concurrent_fetches: usize,
    /// Memory for related objects read by name (`nameFrom`), kept while unchanged so they
    /// need not be read again, in MiB over all policies; 0 keeps none (each reconcile reads
    /// what its parent names).
    #[arg(long, env = "WASMCTRL_RELATED_CACHE_MIB", default_value_t = 64)]
    related_cache_mib: usize,
    /// A PEM file of certificate authorities to trust for plugin sources over TLS (an
    /// `https` URL, a registry), besides the Mozilla roots compiled into the binary: a
    /// registry behind a private CA. Read at start.
    #[arg(long, env = "WASMCTRL_EXTRA_CA_FILE", value_name = "PEM")]
    extra_ca_file: Option<PathBuf>,
    /// Require signatures of every policy's plugins: a YAML file of the shape of
    /// `spec.plugin.verify` (`keys`, `identities`, `annotations`). A policy's own `verify` is
    /// checked besides it, never instead, so no policy serves a plugin this does not accept.
    /// Read at start.
    #[arg(long, env = "WASMCTRL_PLUGIN_VERIFY", value_name = "YAML")]
    plugin_verify: Option<PathBuf>,
    /// A PEM file of the certificate authorities keyless signing certificates must chain to
    /// (a private Fulcio's roots, or any CA that issues code-signing certificates naming an
    /// email or URI). Without it, only keys verify. Read at start.
    #[arg(long, env = "WASMCTRL_KEYLESS_TRUST_ROOTS", value_name = "PEM")]
    keyless_trust_roots: Option<PathBuf>,
    /// A PEM file of the transparency log's (Rekor's) public keys. With it, every plugin
    /// signature must carry the log's signed entry (a Rekor bundle) recording it, and a
    /// keyless certificate must have been valid when the log entered it; without it, the
    /// log is not consulted and a keyless certificate must be valid at each verification.
    #[arg(long, env = "WASMCTRL_REKOR_PUBLIC_KEYS", value_name = "PEM")]
    rekor_public_keys: Option<PathBuf>,
    /// Run only policies that name the ServiceAccount they act as (`spec.serviceAccount`);
    /// refuse the rest with `Ready=False, IdentityRequired`. Without it, a policy that names
    /// none acts as the host itself.
    #[arg(long, env = "WASMCTRL_REQUIRE_POLICY_IDENTITY")]
    require_policy_identity: bool,
    /// Serve `/healthz`, `/readyz`, `/metrics` and `/explain` on this address over TLS;
    /// `/metrics` and `/explain` answer only callers whose bearer token the API server
    /// accepts and whose own RBAC allows what they ask. `off` serves none.
    #[arg(long, env = "WASMCTRL_LISTEN", default_value = "0.0.0.0:8443")]
    listen: String,
    /// Serve the same endpoints on this address over plain HTTP to anyone who reaches it,
    /// instead of `--listen`: for a host run on a developer's machine, never in a cluster.
    #[arg(long, env = "WASMCTRL_INSECURE_LISTEN", value_name = "ADDRESS", conflicts_with_all = ["listen", "tls_cert_file", "tls_key_file"])]
    insecure_listen: Option<SocketAddr>,
    /// The listener's certificate chain (PEM), e.g. `tls.crt` of a mounted Secret; re-read
    /// when it changes. Without it the host makes a self-signed certificate at start.
    #[arg(long, env = "WASMCTRL_TLS_CERT_FILE", requires = "tls_key_file")]
    tls_cert_file: Option<PathBuf>,
    /// The private key of `--tls-cert-file` (PEM).
    #[arg(long, env = "WASMCTRL_TLS_KEY_FILE", requires = "tls_cert_file")]
    tls_key_file: Option<PathBuf>,
    /// The largest memory limit any policy may give its plugin, in MiB.
    #[arg(long, env = "WASMCTRL_MAX_PLUGIN_MEMORY_MIB", default_value_t = 512)]
    max_plugin_memory_mib: usize,
    /// The memory all plugin calls in flight may reserve together, in MiB: each call
    /// reserves its plugin's memory limit before it starts and waits while the budget is
    /// spent (fairly between policies), and a plugin whose limit is above the budget is
    /// refused at load. Default: the container's memory limit less what the host and its
    /// compiles need (`--max-concurrent-loads` × `--max-compile-memory-mib`); outside a
    /// memory-limited cgroup, half the machine's memory, at most 4096.
    #[arg(long, env = "WASMCTRL_PLUGIN_MEMORY_BUDGET_MIB")]
    plugin_memory_budget_mib: Option<u64>,
    /// The most memory compiling one plugin may take, in MiB. Plugins are compiled in a
    /// child process of the host bounded by this, first in line for the OOM killer, so a
    /// plugin that is too big or too hard to compile fails its own load instead of taking
    /// the host down.
    #[arg(long, env = "WASMCTRL_MAX_COMPILE_MEMORY_MIB", default_value_t = ChildCompiler::default().max_memory_bytes >> 20)]
    max_compile_memory_mib: u64,
    /// The longest compiling one plugin may take, in seconds.
    #[arg(long, env = "WASMCTRL_MAX_COMPILE_SECONDS", default_value_t = ChildCompiler::default().timeout.as_secs())]
    max_compile_seconds: u64,
    /// On SIGTERM, wait at most this long for in-flight reconciles before exiting.
    #[arg(long, env = "WASMCTRL_SHUTDOWN_TIMEOUT_SECONDS", default_value_t = 30)]
    shutdown_timeout_seconds: u64,
    #[command(flatten)]
    replicas: super::replicas::ReplicaArgs,
    #[command(flatten)]
    webhooks: super::webhook_args::WebhookArgs,
    #[command(flatten)]
    explain: ExplainArgs,
}

/// What the host keeps of its reconciles, for `wasmctrl explain` and `plugin replay`.
#[derive(Debug, Args)]
struct ExplainArgs {
    /// Memory for the records `wasmctrl explain` reads, in MiB; 0 keeps none.
    #[arg(long, env = "WASMCTRL_EXPLAIN_MEMORY_MIB", default_value_t = 16)]
    explain_memory_mib: usize,
    /// Reconciles remembered per parent (only the newest keeps its request and answer); past
    /// this, ones that changed nothing make room first.
    #[arg(long, env = "WASMCTRL_EXPLAIN_HISTORY", default_value_t = 10)]
    explain_history: usize,
    /// Keep Secret values in records and recorded cases; by default they are redacted.
    #[arg(long, env = "WASMCTRL_EXPLAIN_SECRET_DATA")]
    explain_secret_data: bool,
    /// Record reconciles as case files in this directory, for `wasmctrl plugin replay`.
    #[arg(long, env = "WASMCTRL_RECORD_DIR")]
    record_dir: Option<PathBuf>,
    /// Case files kept in the record directory; the oldest are deleted.
    #[arg(long, env = "WASMCTRL_RECORD_MAX_FILES", default_value_t = 1000)]
    record_max_files: usize,
    /// Record one reconcile in this many.
    #[arg(long, env = "WASMCTRL_RECORD_ONE_IN", default_value_t = 1)]
    record_one_in: u64,
}

impl ExplainArgs {
    fn explain(&self) -> anyhow::Result<Explain> {
        Explain::new(&ExplainOptions {
            bounds: Bounds {
                max_bytes: self.explain_memory_mib << 20,
                per_parent: self.explain_history,
            },
            record: self.record_dir.clone().map(|dir| RecordOptions {
                dir,
                max_files: self.record_max_files,
                one_in: self.record_one_in,
            }),
            secret_data: self.explain_secret_data,
        })
        .context("--record-dir")
    }
}

impl RunCommand {
    /// Connect, then run until SIGINT or SIGTERM: start the host (campaigning for the lease
    /// when elected), serve health and metrics, and on a signal drain, stop writing, and
    /// release the lease — in that order.
    pub async fn run(self, cache_dir: Option<PathBuf>) -> anyhow::Result<()> {
        let replicas = self.replicas.replicas(own_namespace())?;
        let leadership = replicas.leadership();
        let (config, client, gated) = self.clients(&leadership).await?;
        let engine = self.engine(cache_dir)?;
        let listener = self.bind_listener(&client).await?;
        let drain = Duration::from_secs(self.shutdown_timeout_seconds);
        let webhooks = self.webhooks.bind(&client, own_namespace()).await?;
        let renewals = gated.clone();
        let mut host = Host::elected(gated, engine, self.host_options()?, leadership.clone())
            .impersonating_from(config);
        // The webhook listener answers until the host has stopped (its policies' answerers
        // go with them), so reviews sent while the pod drains still get an answer.
        let webhooks_stop = CancellationToken::new();
        let webhook_listener = match webhooks {
            Some((listener, hosting)) => {
                host = host.serving_webhooks(hosting);
                Some(listener.serve(host.metrics(), webhooks_stop.clone()))
            }
            None => None,
        };
        let stop = CancellationToken::new();
        tokio::spawn({
            let stop = stop.clone();
            async move {
                shutdown_signal().await;
                stop.cancel();
            }
        });
        let server = serve(listener, &host, &stop);
        // The elector (or the shard coordinator) keeps renewing while the host drains, and
        // stops only after the last write.
        let sharing_stop = CancellationToken::new();
        let sharing = replicas.start(
            (client, renewals),
            &leadership,
            host.metrics(),
            &stop,
            &sharing_stop,
        );
        // The host returns within `drain` of the signal, abandoning (and logging) what did
        // not stop in time; the listener gets as long to finish the requests it serves.
        let host = async {
            let result = match host.run(stop.clone().cancelled_owned()).await {
                Err(error) if error.is::<StopTimedOut>() => {
                    tracing::warn!(error = %error, "exiting without what did not stop");
                    Ok(())
                }
                result => result,
            };
            webhooks_stop.cancel();
            result
        };
        let server = async {
            let webhooks = async {
                match webhook_listener {
                    Some(listener) => listener.await,
                    None => Ok(()),
                }
            };
            tokio::try_join!(server, webhooks).map(|_| ())
        };
        let drained = async {
            stop.cancelled().await;
            tokio::time::sleep(drain + SERVER_GRACE).await;
        };
        let served = tokio::select! {
            result = async { tokio::try_join!(host, server) } => result.map(|_| ()),
            () = drained => {
                tracing::warn!(timeout = ?drain, "requests in flight did not finish in time; exiting without them");
                Ok(())
            }
        };
        // No write may follow the release of the Leases.
        leadership.stop_leading();
        sharing_stop.cancel();
        sharing.release().await?;
        served
    }

    /// The host's connection settings (policies' clients impersonate from them), the client
    /// the elector uses, and the one gated on `leadership` that everything the controllers
    /// write goes through.
    async fn clients(
        &self,
        leadership: &Arc<Leadership>,
    ) -> anyhow::Result<(kube::Config, kube::Client, kube::Client)> {
        let config = crate::identified(self.client_config().await?);
        let client =
            kube::Client::try_from(config.clone()).context("building the Kubernetes client")?;
        let gated = crate::leader::gated_client(config.clone(), leadership)
            .context("building the Kubernetes client")?;
        let version = client
            .apiserver_version()
            .await
            .context("reaching the API server")?;
        tracing::info!(
            server = %version.git_version,
            wasmctrl = env!("CARGO_PKG_VERSION"),
            plugin_contracts = ?crate::plugin::CONTRACT_VERSIONS,
            "connected to the API server"
        );
        Ok((config, client, gated))
    }

    fn engine(&self, cache_dir: Option<PathBuf>) -> anyhow::Result<PluginEngine> {
        let budget_mib = self.plugin_memory_budget_mib.unwrap_or_else(|| {
            let compiles = self.max_compile_memory_mib * self.max_concurrent_loads.max(1) as u64;
            let fetches = (crate::registry::MAX_PLUGIN_BYTES >> 20) as u64
                * self.max_concurrent_fetches.max(1) as u64;
            super::call_memory::default_budget_mib(compiles + fetches)
        });
        let budget_bytes = budget_mib
            .checked_mul(1 << 20)
            .and_then(|bytes| usize::try_from(bytes).ok())
            .context("--plugin-memory-budget-mib is too large")?;
        if budget_mib < self.max_plugin_memory_mib as u64 {
            tracing::warn!(
                budget_mib,
                max_plugin_memory_mib = self.max_plugin_memory_mib,
                "the memory budget for plugin calls is below the largest limit a policy may ask for; policies asking more than the budget are refused"
            );
        }
        tracing::info!(
            budget_mib,
            "plugin calls in flight reserve their memory limits from this budget"
        );
        PluginEngine::new(EngineOptions {
            cache_dir,
            max_concurrent_calls: self.max_concurrent_calls,
            max_memory_bytes: self.max_plugin_memory_mib << 20,
            memory_budget_bytes: Some(budget_bytes),
            cache_max_bytes: self.cache_max_mib << 20,
            compiler: Compiler::Child(ChildCompiler {
                max_memory_bytes: self.max_compile_memory_mib << 20,
                timeout: Duration::from_secs(self.max_compile_seconds.max(1)),
            }),
        })
        .context("starting the plugin engine")
    }

    fn host_options(&self) -> anyhow::Result<HostOptions> {
        if let Some(selector) = &self.policy_selector {
            crate::policy::placement::PolicySelector::parse(selector)
                .map_err(anyhow::Error::msg)
                .context("--policy-selector")?;
        }
        Ok(HostOptions {
            resync: Duration::from_secs(self.resync_seconds.max(1)),
            backoff_base: Duration::from_millis(self.backoff_base_ms.max(1)),
            backoff_max: Duration::from_secs(self.backoff_max_seconds.max(1)),
            event_interval: Duration::from_secs(self.event_interval_seconds),
            namespace: self.namespace.clone(),
            policy_selector: self.policy_selector.clone(),
            credentials_namespace: self.credentials_namespace.clone().or_else(own_namespace),
            plugin_dirs: self.plugin_dirs()?,
            max_concurrent_loads: self.max_concurrent_loads.max(1),
            max_concurrent_fetches: self.max_concurrent_fetches.max(1),
            team_bounds: crate::policy::namespaced::TeamBounds {
                max_memory_mib: self.namespaced_max_memory_mib,
                max_concurrent_reconciles: self.namespaced_max_concurrent_reconciles,
                source_hosts: self.namespaced_source_hosts.as_ref().map(|hosts| {
                    hosts
                        .iter()
                        .map(|h| h.trim().to_ascii_lowercase())
                        .filter(|h| !h.is_empty())
                        .collect()
                }),
            },
            explain: Arc::new(self.explain.explain()?),
            require_policy_identity: self.require_policy_identity,
            trust: match &self.extra_ca_file {
                Some(path) => crate::registry::TrustRoots::with_extra_file(path)?,
                None => crate::registry::TrustRoots::default(),
            },
            related_cache_bytes: self.related_cache_mib << 20,
            drain_timeout: Duration::from_secs(self.shutdown_timeout_seconds),
            default_verify: self.default_verify()?,
            signing: self.signing_trust()?,
        })
    }

    /// The `--plugin-verify` file, checked as a policy's `verify` would be.
    fn default_verify(&self) -> anyhow::Result<Option<crate::policy::VerifySpec>> {
        let Some(path) = &self.plugin_verify else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --plugin-verify {}", path.display()))?;
        let spec: crate::policy::VerifySpec = serde_yaml_ng::from_str(&text)
            .with_context(|| format!("--plugin-verify {}", path.display()))?;
        // keysFrom is read at each load; what is written here is checked now.
        if spec.keys_from.is_empty() || !spec.keys.is_empty() || !spec.identities.is_empty() {
            let written = crate::policy::VerifySpec {
                keys_from: Vec::new(),
                ..spec.clone()
            };
            crate::signing::Verifier::new(&written, self.signing_trust()?)
                .with_context(|| format!("--plugin-verify {}", path.display()))?;
        }
        Ok(Some(spec))
    }

    /// The keyless roots and Rekor keys, read once.
    fn signing_trust(&self) -> anyhow::Result<crate::signing::HostTrust> {
        let read = |path: &PathBuf, flag: &str| {
            std::fs::read(path).with_context(|| format!("reading {flag} {}", path.display()))
        };
        let keyless_roots = match &self.keyless_trust_roots {
            Some(path) => {
                crate::signing::KeylessRoots::from_pem(&read(path, "--keyless-trust-roots")?)
                    .with_context(|| format!("--keyless-trust-roots {}", path.display()))?
            }
            None => crate::signing::KeylessRoots::default(),
        };
        let rekor_keys = self
            .rekor_public_keys
            .as_ref()
            .map(|path| {
                crate::signing::RekorKeys::from_pem(&read(path, "--rekor-public-keys")?)
                    .with_context(|| format!("--rekor-public-keys {}", path.display()))
            })
            .transpose()?;
        Ok(crate::signing::HostTrust {
            keyless_roots,
            rekor_keys,
        })
    }

    /// The directories file sources may be in: those given, each of which must be a
    /// directory, or by default the working directory outside a pod. In a pod (and from `/`)
    /// the default is none: a file there is the image's, or a mounted Secret's.
    fn plugin_dirs(&self) -> anyhow::Result<Vec<PathBuf>> {
        for dir in &self.plugin_dirs {
            anyhow::ensure!(
                dir.is_dir(),
                "--plugin-dir {}: not a directory (or not readable)",
                dir.display()
            );
        }
        let dirs = if self.plugin_dirs.is_empty() {
            default_plugin_dirs(own_namespace().is_some(), std::env::current_dir().ok())
        } else {
            self.plugin_dirs.clone()
        };
        match dirs.as_slice() {
            [] => tracing::info!("no --plugin-dir: file plugin sources are refused"),
            dirs => tracing::info!(
                ?dirs,
                "file plugin sources are read from these directories only"
            ),
        }
        Ok(dirs)
    }

    /// The listener and who may read it, unless `--listen off`.
    async fn bind_listener(
        &self,
        client: &kube::Client,
    ) -> anyhow::Result<Option<(tokio::net::TcpListener, Access)>> {
        if let Some(address) = self.insecure_listen {
            return Ok(Some((crate::server::bind(address).await?, Access::Open)));
        }
        let address = match self.listen.as_str() {
            "off" => return Ok(None),
            address => address.parse().with_context(|| {
                format!("--listen {address:?} is not an address like 0.0.0.0:8443 (or `off`)")
            })?,
        };
        let files = self
            .tls_cert_file
            .clone()
            .zip(self.tls_key_file.clone())
            .map(|(certificate, key)| CertificateFiles { certificate, key });
        let names: Vec<String> = ["localhost".to_owned()]
            .into_iter()
            .chain(
                std::env::var("HOSTNAME")
                    .ok()
                    .filter(|name| !name.is_empty()),
            )
            .collect();
        let access = Access::Reviewed {
            reviewer: Arc::new(Reviewer::new(client.clone())),
            tls: crate::server::tls::server_config(files, &names)?,
        };
        Ok(Some((crate::server::bind(address).await?, access)))
    }

    async fn client_config(&self) -> anyhow::Result<kube::Config> {
        match &self.kubeconfig {
            Some(path) => {
                let kubeconfig = Kubeconfig::read_from(path)
                    .with_context(|| format!("reading kubeconfig {}", path.display()))?;
                let options = KubeConfigOptions {
                    context: self.context.clone(),
                    ..KubeConfigOptions::default()
                };
                kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                    .await
                    .with_context(|| format!("loading kubeconfig {}", path.display()))
            }
            None if self.context.is_some() => {
                let options = KubeConfigOptions {
                    context: self.context.clone(),
                    ..KubeConfigOptions::default()
                };
                kube::Config::from_kubeconfig(&options)
                    .await
                    .context("loading the kubeconfig")
            }
            None => kube::Config::infer()
                .await
                .context("finding cluster credentials (kubeconfig or in-cluster)"),
        }
    }
}

/// Serve `/healthz`, `/readyz`, `/metrics` and `/explain` on `listener` until `stop`.
fn serve(
    listener: Option<(tokio::net::TcpListener, Access)>,
    host: &Host,
    stop: &CancellationToken,
) -> impl Future<Output = anyhow::Result<()>> + use<> {
    let readiness = host.readiness();
    let metrics = host.metrics();
    let explain = host.explain();
    let stop = stop.clone();
    async move {
        let Some((listener, access)) = listener else {
            return Ok(());
        };
        let address = listener.local_addr().ok();
        match &access {
            Access::Open => tracing::warn!(
                ?address,
                "serving /healthz, /readyz, /metrics and /explain over plain HTTP to anyone who reaches this address (--insecure-listen)"
            ),
            Access::Reviewed { .. } => tracing::info!(
                ?address,
                "serving /healthz and /readyz, and to callers the API server vouches for /metrics and /explain, over TLS"
            ),
        }
        let endpoints = crate::server::Endpoints {
            readiness,
            metrics,
            explain,
            access,
        };
        crate::server::serve(listener, endpoints, stop.cancelled_owned()).await
    }
}

/// How long the listener may take, beyond the host's drain time, to finish its requests.
const SERVER_GRACE: Duration = Duration::from_secs(2);

/// Where file sources may be when no `--plugin-dir` is given: the working directory of a
/// host run by hand (where `cargo xtask build-plugins` leaves plugins under `target/`), and
/// nowhere in a pod or from `/`, where that would be every file of the image.
fn default_plugin_dirs(in_pod: bool, working_dir: Option<PathBuf>) -> Vec<PathBuf> {
    match working_dir {
        Some(dir) if !in_pod && dir.parent().is_some() => vec![dir],
        _ => Vec::new(),
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

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn run_command(args: &[&str]) -> RunCommand {
        let cli = crate::cli::Cli::try_parse_from(["wasmctrl", "run"].iter().chain(args))
            .expect("valid arguments");
        match cli.command {
            crate::cli::Command::Run(run) => *run,
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn plugin_dirs_are_repeated_or_colon_separated_and_must_exist() {
        let (a, b) = (
            tempfile::tempdir().expect("tempdir"),
            tempfile::tempdir().expect("tempdir"),
        );
        let (a, b) = (a.path().to_owned(), b.path().to_owned());
        let joined = format!("{}:{}", a.display(), b.display());
        let run = run_command(&[
            "--plugin-dir",
            &joined,
            "--plugin-dir",
            &a.display().to_string(),
        ]);
        assert_eq!(
            run.plugin_dirs().expect("directories"),
            vec![a.clone(), b, a.clone()]
        );

        let missing = a.join("missing").display().to_string();
        let error = run_command(&["--plugin-dir", &missing]).plugin_dirs();
        assert!(
            error.is_err_and(|e| e.to_string().contains("not a directory")),
            "a missing directory is refused at start"
        );
    }

    #[test]
    fn by_default_files_are_read_from_the_working_directory_only_outside_a_pod() {
        let here = PathBuf::from("/home/dev/wasmctrl");
        assert_eq!(
            default_plugin_dirs(false, Some(here.clone())),
            vec![here.clone()]
        );
        assert!(default_plugin_dirs(true, Some(here)).is_empty(), "in a pod");
        assert!(
            default_plugin_dirs(false, Some(PathBuf::from("/"))).is_empty(),
            "from /"
        );
        assert!(default_plugin_dirs(false, None).is_empty());
    }

    #[tokio::test]
    async fn shards_replace_leader_election_and_their_count_is_checked() {
        use super::super::replicas::Replicas;
        let namespace = ["--leader-elect-namespace", "ops"];
        let replicas = |args: &[&str]| run_command(args).replicas.replicas(None);
        assert!(matches!(replicas(&[]), Ok(Replicas::Alone)));
        assert!(matches!(
            replicas(&[&["--leader-elect"][..], &namespace].concat()),
            Ok(Replicas::Elected(_))
        ));
        match replicas(&[&["--shards", "12", "--shard-set", "team-a"][..], &namespace].concat()) {
            Ok(Replicas::Sharded(config, ownership)) => {
                assert_eq!((config.count, ownership.count()), (12, 12));
                assert_eq!(config.lease.name, "team-a");
                assert_eq!(config.lease.namespace, "ops");
                // The Leases' timing is the leader election's.
                assert_eq!(config.lease.lease_duration, Duration::from_secs(15));
            }
            _ => panic!("--shards 12 shards"),
        }
        for (count, why) in [("0", "between 1 and 64"), ("65", "between 1 and 64")] {
            let refused = replicas(&[&["--shards", count][..], &namespace].concat());
            let said = refused.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(said.contains(why), "--shards {count}: {said}");
        }
        let both =
            crate::cli::Cli::try_parse_from(["wasmctrl", "run", "--shards", "4", "--leader-elect"]);
        assert!(both.is_err(), "--shards replaces --leader-elect");
    }

    #[test]
    fn two_plugins_load_at_once_by_default_and_never_none() {
        let loads = |args: &[&str]| {
            let options = run_command(args).host_options().expect("options");
            options.max_concurrent_loads
        };
        assert_eq!(loads(&[]), 2);
        assert_eq!(loads(&["--max-concurrent-loads", "5"]), 5);
        assert_eq!(loads(&["--max-concurrent-loads", "0"]), 1);
    }
}
