//! The plugin registry: the one place a policy's plugin spec becomes a loaded [`Plugin`].
//!
//! It owns everything between a source and a callable plugin — fetching ([`source`]),
//! digest checks, the engine's precompiled-artifact cache, and the plugins already loaded —
//! for the whole process. Loaded plugins are keyed by digest and limits, so:
//! - two policies running the same plugin share one loaded copy;
//! - a policy that pins a digest already loaded (or compiled on disk) gets it without a
//!   fetch: a rollback to any digest still on disk is a cache hit even when its source is
//!   gone;
//! - the swap and the policy controller ask the registry, not each other.
//!
//! The registry keeps a plugin alive while any policy serves it, plus the few most recently
//! obtained ones, so swapping back and forth is a pointer swap. It also bounds how many
//! plugins are fetched and compiled at once, for the whole process ([`load_budget`]).

mod address;
mod capped;
mod credentials;
mod load_budget;
mod oci_reader;
mod plugin_dirs;
mod source;
mod source_watch;
mod trust;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use kube::Client;

use crate::metrics::Metrics;
use crate::plugin::{self, Digest, Limits, Plugin, PluginEngine, WeakPlugin};
use crate::policy::{
    CandidateSpec, PluginSource, PolicyLimits, ReconcilePolicy, Signer, VerifySpec,
};
use crate::signing::{HostTrust, SignatureError, Verifier};
pub use credentials::HOSTS_ANNOTATION;
pub(crate) use oci_reader::{OciReader, RegistryAuth as ReaderAuth};
pub(crate) use source::oci_signatures;
pub use source::{MAX_PLUGIN_BYTES, Signatures, WASM_CONFIG_MEDIA_TYPE, WASM_LAYER_MEDIA_TYPE};
pub(crate) use source_watch::SourceWatch;
pub use trust::TrustRoots;
pub(crate) use trust::oci_client;

/// Plugins held after their last user let go, so a swap back to one is a pointer swap.
const RECENT_PLUGINS: usize = 8;

/// Why a plugin could not be obtained. [`LoadError::reason`] is the condition reason users
/// see on the policy (and the `result` label of `wasmctrl_plugin_loads_total`).
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The pinned digest is not a `sha256:` digest.
    #[error("{0}")]
    InvalidDigest(#[from] crate::plugin::InvalidDigest),
    /// The source is one this host refuses to read (credentials from another namespace, over
    /// plain HTTP to another machine, or for another host; a file outside the plugin
    /// directories; not exactly one source).
    #[error("{0:#}")]
    InvalidSource(anyhow::Error),
    /// The source could not be read (file, ConfigMap, HTTP, OCI).
    #[error("{0:#}")]
    SourceUnavailable(anyhow::Error),
    /// The bytes are not a plugin this host can run under these limits.
    #[error("{0}")]
    Plugin(#[from] plugin::LoadError),
    /// `spec.plugin.digest` names the registry manifest, not the component in it: the
    /// digest `oras push` prints, pasted where the component's belongs.
    #[error(
        "{field} is {manifest}, the digest of the artifact's manifest; it wants the component's own ({component}). Pin the component by that, or the manifest by oci.reference: REGISTRY/REPOSITORY@{manifest}"
    )]
    ManifestDigestPinned {
        /// The policy field that pins the digest.
        field: &'static str,
        /// The manifest's digest, as the policy has it.
        manifest: String,
        /// The digest of the component the manifest holds.
        component: Digest,
    },
    /// `verify` cannot be used: a key that is not a PEM public key, a pattern that is not a
    /// regular expression.
    #[error("{0:#}")]
    InvalidVerify(anyhow::Error),
    /// The plugin carries no signature, or none by whom `verify` names.
    #[error("{0}")]
    Signature(#[from] SignatureError),
    /// The component the source serves is not the one the policy pins.
    #[error(
        "{field} pins the component {pinned}, but the component {served_by} serves hashes to {actual}"
    )]
    ComponentDigestMismatch {
        /// The policy field that pins the digest.
        field: &'static str,
        /// The digest the policy pins.
        pinned: Digest,
        /// The digest of the bytes the source served.
        actual: Digest,
        /// The source, as the policy names it.
        served_by: String,
    },
}

impl LoadError {
    /// The condition reason: a user can act on each one differently.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::InvalidDigest(_) => "InvalidDigest",
            Self::InvalidSource(_) => "InvalidSource",
            Self::InvalidVerify(_) => "InvalidVerify",
            Self::Signature(error) => error.reason(),
            Self::SourceUnavailable(_) => "SourceUnavailable",
            Self::Plugin(plugin::LoadError::DigestMismatch { .. })
            | Self::ManifestDigestPinned { .. }
            | Self::ComponentDigestMismatch { .. } => "DigestMismatch",
            Self::Plugin(plugin::LoadError::ContractVersion { .. }) => "ContractVersionMismatch",
            Self::Plugin(plugin::LoadError::InvalidLimits(_)) => "InvalidLimits",
            Self::Plugin(plugin::LoadError::CompileLimitExceeded(_)) => "CompileLimitExceeded",
            Self::Plugin(_) => "InvalidPlugin",
        }
    }
}

/// Where an obtained plugin came from, cheapest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Already loaded in this process (for another policy, or before a swap).
    Loaded,
    /// Pinned by digest and taken from the precompiled-artifact cache: nothing fetched.
    Disk,
    /// Fetched from its source, then compiled or taken precompiled from the disk cache.
    Fetched,
}

/// A plugin the registry handed out.
#[derive(Debug, Clone)]
pub struct Obtained {
    /// The plugin, ready to call.
    pub plugin: Plugin,
    /// How it was obtained.
    pub origin: Origin,
    /// Who signed it, when signatures are required (`verify`).
    pub signers: Vec<Signer>,
}

/// What to obtain: a source, the digest it must have (if pinned), and the call limits.
#[derive(Debug, Clone)]
pub struct PluginRequest<'a> {
    /// Where the component's bytes are.
    pub source: &'a PluginSource,
    /// The pinned digest, as the policy spells it.
    pub digest: Option<&'a str>,
    /// The policy field `digest` comes from, for messages.
    pub digest_field: &'static str,
    /// What every call may consume.
    pub limits: Limits,
    /// Who must have signed it, besides whom the host requires.
    pub verify: Option<&'a VerifySpec>,
    /// Whom its fetch and compile count against (see [`crate::policy::namespaced::tenant`]).
    pub tenant: String,
}

impl<'a> PluginRequest<'a> {
    /// The plugin a policy serves with.
    pub fn active(policy: &'a ReconcilePolicy) -> Self {
        let spec = &policy.spec.plugin;
        Self {
            source: &spec.source,
            digest: spec.digest.as_deref(),
            digest_field: "spec.plugin.digest",
            limits: policy_limits(&policy.spec),
            verify: spec.verify.as_ref(),
            tenant: crate::policy::namespaced::tenant(policy),
        }
    }

    /// A policy's candidate plugin, under the policy's limits.
    pub fn candidate(policy: &'a ReconcilePolicy, candidate: &'a CandidateSpec) -> Self {
        Self {
            source: &candidate.source,
            digest: candidate.digest.as_deref(),
            digest_field: "spec.plugin.candidate.digest",
            limits: policy_limits(&policy.spec),
            verify: policy.spec.plugin.verify.as_ref(),
            tenant: crate::policy::namespaced::tenant(policy),
        }
    }
}

/// What the operator of the host decides about plugin sources and loads.
#[derive(Debug, Clone)]
pub struct RegistryOptions {
    /// The only namespace whose Secrets a source's `secretRef` may name; `None` refuses
    /// every `secretRef`.
    pub credentials_namespace: Option<String>,
    /// The directories `file` sources may be in; empty refuses every file source.
    pub plugin_dirs: Vec<PathBuf>,
    /// Plugins compiled at once, across all policies.
    pub max_concurrent_loads: usize,
    /// Plugins fetched at once, across all policies (one per tenant at a time).
    pub max_concurrent_fetches: usize,
    /// The certificate authorities TLS sources are checked against.
    pub trust: TrustRoots,
    /// The signatures every policy's plugins need, besides the policy's own `verify`.
    pub default_verify: Option<VerifySpec>,
    /// The keyless roots and transparency-log keys signatures are checked against.
    pub signing: HostTrust,
}

impl Default for RegistryOptions {
    fn default() -> Self {
        Self {
            credentials_namespace: None,
            plugin_dirs: Vec::new(),
            max_concurrent_loads: 2,
            max_concurrent_fetches: 4,
            trust: TrustRoots::default(),
            default_verify: None,
            signing: HostTrust::default(),
        }
    }
}

/// The process-wide plugin registry. Cheap to share behind an `Arc`.
pub struct PluginRegistry {
    client: Client,
    engine: PluginEngine,
    rules: source::SourceRules,
    budget: load_budget::LoadBudget,
    metrics: Arc<Metrics>,
    loaded: Mutex<Loaded>,
    default_verify: Option<VerifySpec>,
    signing: HostTrust,
    /// The signatures that verified for each policy's fetched digests, so that a digest served
    /// from memory or disk is verified against the policy as it is now, without a fetch.
    signatures: Mutex<KeptSignatures>,
}

#[derive(Default)]
struct Loaded {
    /// Every plugin some policy may still serve, by what makes two loads interchangeable.
    live: HashMap<(Digest, Limits), WeakPlugin>,
    /// The last few obtained, held strongly.
    recent: VecDeque<Plugin>,
}

impl PluginRegistry {
    /// A registry that reads cluster sources through `client` and loads with `engine`.
    pub fn new(
        client: Client,
        engine: PluginEngine,
        options: RegistryOptions,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            client,
            engine,
            rules: source::SourceRules {
                credentials_namespace: options.credentials_namespace,
                plugin_dirs: plugin_dirs::PluginDirs::new(options.plugin_dirs),
                trust: options.trust,
            },
            budget: load_budget::LoadBudget::new(
                options.max_concurrent_loads,
                options.max_concurrent_fetches,
            ),
            metrics,
            loaded: Mutex::default(),
            default_verify: options.default_verify,
            signing: options.signing,
            signatures: Mutex::default(),
        }
    }

    /// The plugin `request` names, for `policy` (which labels the load in the metrics).
    ///
    /// Cheapest first: a pinned digest already loaded, then a pinned digest precompiled on
    /// disk, then a fetch — after which a plugin with the same digest already loaded is
    /// shared rather than loaded twice.
    pub async fn obtain(
        &self,
        policy: &str,
        request: PluginRequest<'_>,
    ) -> Result<Obtained, LoadError> {
        let obtained = self.obtain_uncounted(policy, request).await;
        let result = obtained.as_ref().map_or_else(LoadError::reason, |_| "ok");
        self.metrics.plugin_loaded(policy, result);
        if let Ok(obtained) = &obtained {
            let info = obtained.plugin.info();
            tracing::debug!(policy, digest = %info.digest, origin = ?obtained.origin, from_cache = info.from_cache, load_time = ?info.load_time, "plugin obtained");
        }
        obtained
    }

    async fn obtain_uncounted(
        &self,
        policy: &str,
        request: PluginRequest<'_>,
    ) -> Result<Obtained, LoadError> {
        let checked = source::check(request.source, request.digest.is_some(), &self.rules)
            .map_err(LoadError::InvalidSource)?;
        // Credentials bound to another host refuse the source whatever the caches hold, as
        // the checks above do. A Secret that cannot be read (deleted, rotated away, the API
        // server unreachable) stops only a fetch: a pinned digest the host already holds sends
        // nothing anywhere, so a rollback to it works without the credentials.
        let authorized = match source::authorize(&self.client, checked).await {
            Ok(authorized) => Ok(authorized),
            Err(credentials::Refused::NotForHost(e)) => return Err(LoadError::InvalidSource(e)),
            Err(credentials::Refused::Unreadable(e)) => Err(LoadError::SourceUnavailable(e)),
        };
        let pinned = request.digest.map(str::parse::<Digest>).transpose()?;
        let verifiers = self.verifiers(request.verify).await?;
        let unreadable = |origin: Origin| {
            if let Err(error) = &authorized {
                tracing::info!(policy, ?origin, %error, "the source's credentials cannot be read; serving the pinned digest the host holds");
            }
        };
        // Why the signatures kept for a digest held were not accepted: the answer, unless a
        // fetch finds better ones.
        let mut refused = None;
        if let Some(digest) = pinned {
            match self.verify_kept(policy, &verifiers, &digest) {
                Ok(signers) => {
                    if let Some((plugin, origin)) = self.held(digest, request.limits).await? {
                        unreadable(origin);
                        return Ok(self.keep(plugin, origin, signers));
                    }
                }
                Err(error) => refused = error,
            }
        }
        let authorized = match authorized {
            Ok(authorized) => authorized,
            Err(error) => return Err(refused.map_or(error, LoadError::from)),
        };
        // A fetch permit (one per tenant) from the first byte until the bytes are compiling;
        // the compile takes its own.
        let fetch_permit = self
            .budget
            .fetch(&request.tenant, policy, &self.metrics)
            .await;
        let fetched = source::fetch(
            &self.client,
            authorized,
            &self.rules.trust,
            !verifiers.is_empty(),
        )
        .await;
        let source::Fetched {
            bytes,
            manifest_digest,
            signatures,
        } = match fetched {
            Ok(fetched) => fetched,
            Err(error) => {
                return Err(refused.map_or(LoadError::SourceUnavailable(error), LoadError::from));
            }
        };
        let digest = Digest::of(&bytes);
        check_fetched(&request, pinned, digest, manifest_digest)?;
        // The bytes are what the policy pins, if it pins any (checked above); signed as the
        // policy wants, before anything compiles them. Only signatures that verified are
        // kept, and for this policy alone: another policy's fetch of the same digest from a
        // source of its own (unsigned, or signed by others) replaces nothing of this one's.
        let signers = match signatures {
            Some(signatures) if !verifiers.is_empty() => {
                let signers = verify_all(&verifiers, &signatures, &digest)?;
                crate::lock(&self.signatures).keep(policy, digest, Arc::new(signatures));
                signers
            }
            _ => Vec::new(),
        };
        if let Some(plugin) = self.find(&digest, &request.limits) {
            return Ok(self.keep(plugin, Origin::Loaded, signers));
        }
        // The fetched bytes are let go of only once they are compiling, so the fetches'
        // bound holds the bytes waiting for a compile too (compiles never wait on fetches).
        let compile_permit = self
            .budget
            .compile(&request.tenant, policy, &self.metrics)
            .await;
        drop(fetch_permit);
        // The compile keeps its permit to its end, even when this load is given up (the
        // policy stopped or was edited): its child process runs on until then.
        let engine = self.engine.clone();
        let limits = request.limits;
        let compiling = tokio::spawn(async move {
            let _compile_permit = compile_permit;
            engine.load_async(bytes, pinned, limits).await
        });
        let plugin = compiling
            .await
            .map_err(|e| plugin::LoadError::Sandbox(format!("plugin load task failed: {e}")))??;
        Ok(self.keep(plugin, Origin::Fetched, signers))
    }

    /// Who signed `digest`, by the signatures kept from its last fetch, as `verifiers` want:
    /// no one needed without any. `Err(None)` when nothing is kept (the host must fetch
    /// them), `Err(Some(_))` when what is kept is not enough (a fetch may find more).
    fn verify_kept(
        &self,
        policy: &str,
        verifiers: &[Verifier],
        digest: &Digest,
    ) -> Result<Vec<Signer>, Option<SignatureError>> {
        if verifiers.is_empty() {
            return Ok(Vec::new());
        }
        let kept = crate::lock(&self.signatures).get(policy, digest);
        let kept = kept.ok_or(None)?;
        verify_all(verifiers, &kept, digest).map_err(Some)
    }

    /// The verifiers a load must satisfy: the host's default is a floor no policy lowers, and
    /// a policy's own `verify` is checked besides it, not instead.
    async fn verifiers(&self, verify: Option<&VerifySpec>) -> Result<Vec<Verifier>, LoadError> {
        let mut verifiers = Vec::new();
        for spec in self.default_verify.iter().chain(verify) {
            let spec = self
                .with_keys_from(spec)
                .await
                .map_err(LoadError::InvalidVerify)?;
            verifiers.push(
                Verifier::new(&spec, self.signing.clone()).map_err(LoadError::InvalidVerify)?,
            );
        }
        Ok(verifiers)
    }

    /// `spec` with the keys its `keysFrom` ConfigMaps hold added to `keys`.
    async fn with_keys_from(&self, spec: &VerifySpec) -> anyhow::Result<VerifySpec> {
        let mut resolved = spec.clone();
        for (i, from) in spec.keys_from.iter().enumerate() {
            let source = &from.config_map;
            let what = format!(
                "verify.keysFrom[{i}] (ConfigMap {}/{})",
                source.namespace, source.name
            );
            let config_map = kube::Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(
                self.client.clone(),
                &source.namespace,
            )
            .get(&source.name)
            .await
            .with_context(|| format!("reading {what}"))?;
            let keys: Vec<String> = config_map
                .data
                .unwrap_or_default()
                .into_values()
                .filter(|value| value.contains("-----BEGIN PUBLIC KEY-----"))
                .collect();
            anyhow::ensure!(!keys.is_empty(), "{what} holds no PEM public key");
            resolved.keys.extend(keys);
        }
        resolved.keys_from.clear();
        Ok(resolved)
    }

    /// The plugin `digest` under `limits` if this host holds it: loaded, or compiled on disk.
    async fn held(
        &self,
        digest: Digest,
        limits: Limits,
    ) -> Result<Option<(Plugin, Origin)>, LoadError> {
        if let Some(plugin) = self.find(&digest, &limits) {
            return Ok(Some((plugin, Origin::Loaded)));
        }
        let engine = self.engine.clone();
        let cached = tokio::task::spawn_blocking(move || engine.load_cached(&digest, limits))
            .await
            .map_err(|e| plugin::LoadError::Sandbox(format!("plugin load task failed: {e}")))?;
        Ok(cached?.map(|plugin| (plugin, Origin::Disk)))
    }

    /// A loaded plugin with this digest and limits, if one is still alive.
    fn find(&self, digest: &Digest, limits: &Limits) -> Option<Plugin> {
        let loaded = crate::lock(&self.loaded);
        loaded.live.get(&(*digest, *limits))?.upgrade()
    }

    /// Remember `plugin` as loaded and recently used, forgetting plugins nothing holds.
    fn keep(&self, plugin: Plugin, origin: Origin, signers: Vec<Signer>) -> Obtained {
        let mut loaded = crate::lock(&self.loaded);
        let key = (*plugin.digest(), *plugin.limits());
        loaded.recent.retain(|p| !p.same_as(&plugin));
        loaded.recent.push_front(plugin.clone());
        loaded.recent.truncate(RECENT_PLUGINS);
        loaded.live.retain(|_, weak| weak.upgrade().is_some());
        loaded.live.insert(key, plugin.downgrade());
        Obtained {
            plugin,
            origin,
            signers,
        }
    }

    /// A watch on the bytes behind `source`, for the swap.
    pub(crate) fn watch_source(&self, source: &PluginSource) -> SourceWatch {
        SourceWatch::start(&self.client, source)
    }
}

/// Who signed `digest`, once every one of `verifiers` accepts a signature of it.
fn verify_all(
    verifiers: &[Verifier],
    signatures: &Signatures,
    digest: &Digest,
) -> Result<Vec<Signer>, SignatureError> {
    let mut signers = Vec::new();
    for verifier in verifiers {
        signers.extend(verifier.verify(&signatures.found, digest, &signatures.looked)?);
    }
    signers.sort();
    signers.dedup();
    Ok(signers)
}

/// The fetched bytes hash to `digest`: refuse them unless they are what the policy pins
/// (naming a manifest digest pinned where the component's belongs).
fn check_fetched(
    request: &PluginRequest<'_>,
    pinned: Option<Digest>,
    digest: Digest,
    manifest_digest: Option<String>,
) -> Result<(), LoadError> {
    let Some(pinned) = pinned.filter(|pinned| *pinned != digest) else {
        return Ok(());
    };
    if let Some(manifest) = manifest_digest
        && pinned.to_string() == manifest
    {
        return Err(LoadError::ManifestDigestPinned {
            field: request.digest_field,
            manifest,
            component: digest,
        });
    }
    Err(LoadError::ComponentDigestMismatch {
        field: request.digest_field,
        pinned,
        actual: digest,
        served_by: request.source.to_string(),
    })
}

/// Signatures kept per policy and digest, at most [`KeptSignatures::MAX`] (the oldest go).
#[derive(Default)]
struct KeptSignatures {
    entries: VecDeque<((String, Digest), Arc<Signatures>)>,
}

impl KeptSignatures {
    /// Each entry holds at most a signature manifest's worth (32 signatures of 256 KiB).
    const MAX: usize = 64;

    fn get(&self, policy: &str, digest: &Digest) -> Option<Arc<Signatures>> {
        self.entries
            .iter()
            .find(|((p, d), _)| p == policy && d == digest)
            .map(|(_, signatures)| signatures.clone())
    }

    fn keep(&mut self, policy: &str, digest: Digest, signatures: Arc<Signatures>) {
        self.entries
            .retain(|((p, d), _)| !(p == policy && *d == digest));
        if self.entries.len() >= Self::MAX {
            self.entries.pop_front();
        }
        self.entries
            .push_back(((policy.to_owned(), digest), signatures));
    }
}

/// The call limits of a policy's plugins: its `limits`, and its webhooks' deadline
/// (`spec.admission.pluginTimeoutMs`), over the host's defaults.
pub fn policy_limits(spec: &crate::policy::ReconcilePolicySpec) -> Limits {
    let mut limits = limits(spec.limits.as_ref());
    if let Some(admission) = &spec.admission {
        limits.webhook_timeout = admission.plugin_timeout();
    }
    limits
}

/// The call limits a policy asks for, over the host's defaults.
pub fn limits(policy: Option<&PolicyLimits>) -> Limits {
    limits_over(Limits::default(), policy)
}

/// The call limits a policy asks for, over `limits`.
pub fn limits_over(mut limits: Limits, policy: Option<&PolicyLimits>) -> Limits {
    if let Some(policy) = policy {
        if let Some(ms) = policy.timeout_ms {
            limits.timeout = Duration::from_millis(u64::from(ms));
        }
        if let Some(mib) = policy.memory_mib {
            limits.memory_bytes = (mib as usize) << 20;
        }
        if let Some(kib) = policy.max_output_kib {
            limits.max_output_bytes = (kib as usize) << 10;
        }
        if let Some(n) = policy.max_children {
            limits.max_children = n as usize;
        }
    }
    limits
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::plugin::EngineOptions;
    use crate::policy::FileSource;

    /// A registry whose engine caches artifacts in `cache`. Its client points nowhere: these
    /// tests read file sources only.
    fn registry(cache: &Path) -> PluginRegistry {
        let options = RegistryOptions {
            plugin_dirs: vec![cache.parent().expect("a workspace").to_owned()],
            ..RegistryOptions::default()
        };
        registry_with(cache, options)
    }

    /// [`registry`] with `options` of the test's own.
    fn registry_with(cache: &Path, options: RegistryOptions) -> PluginRegistry {
        crate::ensure_crypto_provider();
        let config = kube::Config::new("http://127.0.0.1:9".parse().expect("a URI"));
        let client = Client::try_from(config).expect("a client needs no server");
        let engine = PluginEngine::new(EngineOptions {
            cache_dir: Some(cache.to_path_buf()),
            max_concurrent_calls: 4,
            ..EngineOptions::default()
        })
        .expect("engine");
        PluginRegistry::new(client, engine, options, Arc::new(Metrics::new()))
    }

    /// An HTTP source at `url` with the credentials of Secret `namespace`/`name`.
    fn http_with_secret(url: &str, namespace: &str, name: &str) -> PluginSource {
        PluginSource {
            file: None,
            config_map: None,
            http: Some(crate::policy::HttpSource {
                url: url.into(),
                secret_ref: Some(crate::policy::SecretRef {
                    namespace: namespace.into(),
                    name: name.into(),
                }),
            }),
            oci: None,
        }
    }

    fn file(path: &Path) -> PluginSource {
        PluginSource {
            file: Some(FileSource {
                path: path.display().to_string(),
            }),
            config_map: None,
            http: None,
            oci: None,
        }
    }

    fn request<'a>(
        source: &'a PluginSource,
        digest: Option<&'a str>,
        timeout_ms: u64,
    ) -> PluginRequest<'a> {
        PluginRequest {
            source,
            digest,
            digest_field: "spec.plugin.digest",
            limits: Limits {
                timeout: Duration::from_millis(timeout_ms),
                ..Limits::default()
            },
            verify: None,
            tenant: "policy/test".to_owned(),
        }
    }

    /// A temporary directory holding a copy of the MyApp plugin, and the artifact cache.
    fn workspace() -> (tempfile::TempDir, PluginSource, String) {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = wasmctrl_testenv::plugins::guest_bytes("myapp_plugin");
        let digest = Digest::of(&bytes).to_string();
        let path = dir.path().join("plugin.wasm");
        std::fs::write(&path, bytes).expect("write plugin");
        (dir, file(&path), digest)
    }

    #[tokio::test]
    async fn policies_naming_the_same_plugin_share_one_loaded_copy() {
        let (dir, source, _) = workspace();
        let registry = registry(&dir.path().join("cache"));
        let first = registry.obtain("a", request(&source, None, 500)).await;
        let first = first.expect("first load");
        assert_eq!(first.origin, Origin::Fetched);
        let second = registry.obtain("b", request(&source, None, 500)).await;
        let second = second.expect("second load");
        assert_eq!(second.origin, Origin::Loaded);
        assert!(first.plugin.same_as(&second.plugin));

        // Other limits make another plugin: every call of a plugin runs under its limits.
        let other = registry.obtain("c", request(&source, None, 900)).await;
        let other = other.expect("other limits");
        assert!(!other.plugin.same_as(&first.plugin));
        assert_eq!(other.plugin.limits().timeout, Duration::from_millis(900));
    }

    #[tokio::test]
    async fn a_pinned_digest_is_served_without_its_source_from_memory_then_from_disk() {
        let (dir, source, digest) = workspace();
        let cache = dir.path().join("cache");
        let loaded = {
            let registry = registry(&cache);
            let fetched = registry.obtain("a", request(&source, None, 500)).await;
            let fetched = fetched.expect("fetched");
            std::fs::remove_file(dir.path().join("plugin.wasm")).expect("remove source");

            let again = registry
                .obtain("a", request(&source, Some(&digest), 500))
                .await;
            let again = again.expect("pinned and loaded");
            assert_eq!(again.origin, Origin::Loaded);
            assert!(again.plugin.same_as(&fetched.plugin));
            fetched.plugin.info().digest
        };

        // A new process (a new registry and engine) over the same cache directory: the
        // artifact compiled from verified bytes is enough for a pinned digest.
        let registry = registry(&cache);
        let from_disk = registry
            .obtain("a", request(&source, Some(&digest), 500))
            .await;
        let from_disk = from_disk.expect("pinned and on disk");
        assert_eq!(from_disk.origin, Origin::Disk);
        assert_eq!(from_disk.plugin.info().digest, loaded);

        // Unpinned, the source must be read, and it is gone.
        let error = registry
            .obtain("a", request(&source, None, 500))
            .await
            .expect_err("no source");
        assert_eq!(error.reason(), "SourceUnavailable", "{error}");
    }

    #[tokio::test]
    async fn a_source_that_does_not_match_its_pinned_digest_is_refused() {
        let (dir, source, _) = workspace();
        let registry = registry(&dir.path().join("cache"));
        let wrong = Digest::of(b"something else").to_string();
        let error = registry
            .obtain("a", request(&source, Some(&wrong), 500))
            .await
            .expect_err("mismatch");
        assert_eq!(error.reason(), "DigestMismatch", "{error}");
        let message = error.to_string();
        assert!(
            message.starts_with(&format!("spec.plugin.digest pins the component {wrong}"))
                && message.contains(
                    &Digest::of(
                        &std::fs::read(dir.path().join("plugin.wasm")).expect("the plugin")
                    )
                    .to_string()
                ),
            "the message names the field, the pin and what the bytes hash to: {message}"
        );
        let error = registry
            .obtain("a", request(&source, Some("md5:abc"), 500))
            .await
            .expect_err("not a digest");
        assert_eq!(error.reason(), "InvalidDigest", "{error}");
    }

    #[tokio::test]
    async fn a_pinned_digest_the_host_holds_is_served_though_its_secret_cannot_be_read() {
        let (dir, file_source, digest) = workspace();
        let cache = dir.path().join("cache");
        let mut options = RegistryOptions {
            plugin_dirs: vec![dir.path().to_owned()],
            credentials_namespace: Some("wasmctrl".into()),
            ..RegistryOptions::default()
        };
        let first = registry_with(&cache, options.clone());
        let held = first
            .obtain("a", request(&file_source, Some(&digest), 500))
            .await
            .expect("loaded from the file");
        // The source of a rollback: its Secret can no longer be read (this registry's client
        // reaches no API server at all).
        let source = http_with_secret("https://plugins.example/p.wasm", "wasmctrl", "deleted");

        let loaded = first
            .obtain("a", request(&source, Some(&digest), 500))
            .await;
        assert_eq!(loaded.expect("held in memory").origin, Origin::Loaded);
        drop(held);

        // Another process (a restart) holds it only on disk.
        options.plugin_dirs.clear();
        let restarted = registry_with(&cache, options);
        let from_disk = restarted
            .obtain("a", request(&source, Some(&digest), 500))
            .await;
        assert_eq!(from_disk.expect("on disk").origin, Origin::Disk);

        // A digest the host does not hold must be fetched, and that needs the credentials.
        let other = Digest::of(b"not held").to_string();
        let error = restarted
            .obtain("a", request(&source, Some(&other), 500))
            .await
            .expect_err("nothing to serve without a fetch");
        assert_eq!(error.reason(), "SourceUnavailable", "{error}");
        assert!(
            error.to_string().contains("deleted"),
            "names the Secret: {error}"
        );
    }

    #[tokio::test]
    async fn signatures_are_checked_before_the_compile_and_again_for_a_digest_held() {
        use crate::signing::sign::SigningKey;
        let (dir, source, digest) = workspace();
        let registry = registry(&dir.path().join("cache"));
        let (ours, theirs) = (
            SigningKey::generate().unwrap(),
            SigningKey::generate().unwrap(),
        );
        let spec = |key: &SigningKey| VerifySpec {
            keys: vec![key.public_pem().expect("pem")],
            ..VerifySpec::default()
        };
        let (by_us, by_them) = (spec(&ours), spec(&theirs));
        let signed = |verify| PluginRequest {
            verify: Some(verify),
            ..request(&source, Some(&digest), 500)
        };

        // No signature beside the file: nothing is compiled.
        let error = registry
            .obtain("a", signed(&by_us))
            .await
            .expect_err("unsigned");
        assert_eq!(error.reason(), "SignatureMissing", "{error}");
        assert!(error.to_string().contains("plugin.wasm.sig"), "{error}");
        assert!(
            registry
                .find(
                    &digest.parse().unwrap(),
                    &request(&source, None, 500).limits
                )
                .is_none()
        );

        let bytes = std::fs::read(dir.path().join("plugin.wasm")).expect("plugin");
        let bundle = ours.sign_blob(&bytes, None).expect("signed");
        std::fs::write(
            dir.path().join("plugin.wasm.sig"),
            serde_json::to_vec(&bundle).expect("json"),
        )
        .expect("write signature");
        let loaded = registry
            .obtain("a", signed(&by_us))
            .await
            .expect("signed by us");
        assert_eq!(loaded.origin, Origin::Fetched);
        assert_eq!(loaded.signers[0].key, Some(ours.fingerprint().unwrap()));

        // Another policy fetching the same digest from a copy without its signature is
        // refused, and takes nothing from the first: its verified signatures stay kept.
        std::fs::remove_file(dir.path().join("plugin.wasm.sig")).expect("remove signature");
        let error = registry
            .obtain("b", signed(&by_us))
            .await
            .expect_err("an unsigned copy");
        assert_eq!(error.reason(), "SignatureMissing", "{error}");

        // Held in memory and the source gone: the kept signatures are checked again, against
        // the policy as it is now.
        std::fs::remove_file(dir.path().join("plugin.wasm")).expect("remove source");
        let again = registry
            .obtain("a", signed(&by_us))
            .await
            .expect("held, signed by us");
        assert_eq!(again.origin, Origin::Loaded);
        let error = registry
            .obtain("a", signed(&by_them))
            .await
            .expect_err("tightened");
        assert_eq!(error.reason(), "SignatureInvalid", "{error}");
        assert!(
            error.to_string().contains(&theirs.fingerprint().unwrap()),
            "{error}"
        );
        // Without verify the same digest is served as before.
        let plain = registry
            .obtain("a", request(&source, Some(&digest), 500))
            .await;
        assert_eq!(plain.expect("no verify").origin, Origin::Loaded);
    }

    #[tokio::test]
    async fn a_source_the_host_must_not_read_is_refused_even_when_its_digest_is_loaded() {
        let (dir, source, digest) = workspace();
        let registry = registry(&dir.path().join("cache"));
        let loaded = registry
            .obtain("a", request(&source, Some(&digest), 500))
            .await;
        let _held = loaded.expect("loaded from the file");
        let http = |url: &str| http_with_secret(url, "kube-system", "registry");
        for (url, says) in [
            ("https://plugins.example/p.wasm", "no credentials namespace"),
            ("http://plugins.example/p.wasm", "without TLS"),
        ] {
            let source = http(url);
            let error = registry
                .obtain("b", request(&source, Some(&digest), 500))
                .await
                .expect_err("refused");
            assert_eq!(error.reason(), "InvalidSource", "{error}");
            assert!(error.to_string().contains(says), "{error}");
        }
        // The same bytes, outside the plugin directories.
        let elsewhere = tempfile::tempdir().expect("tempdir");
        let copy = elsewhere.path().join("plugin.wasm");
        std::fs::copy(dir.path().join("plugin.wasm"), &copy).expect("copy");
        let outside = file(&copy);
        let error = registry
            .obtain("c", request(&outside, Some(&digest), 500))
            .await
            .expect_err("refused");
        assert_eq!(error.reason(), "InvalidSource", "{error}");
        assert!(
            error.to_string().contains("outside the directories"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_compile_waits_for_a_permit_while_others_compile() {
        use futures::FutureExt as _;
        let (dir, source, digest) = workspace();
        let registry = registry(&dir.path().join("cache"));
        let metrics = Metrics::new();
        let first = registry.budget.compile("x", "x", &metrics).await;
        let second = registry.budget.compile("y", "y", &metrics).await;

        let mut load = std::pin::pin!(registry.obtain("a", request(&source, None, 500)));
        // Polled until it can go no further: the compile needs a permit.
        for _ in 0..100 {
            assert!(
                (&mut load).now_or_never().is_none(),
                "loaded without a permit"
            );
            tokio::task::yield_now().await;
        }
        drop((first, second));
        let loaded = tokio::time::timeout(Duration::from_secs(60), load)
            .await
            .expect("the load proceeds once a permit is free")
            .expect("loaded");
        assert_eq!(loaded.origin, Origin::Fetched);

        // What is loaded already needs no permit.
        let _held = (
            registry.budget.compile("x", "x", &metrics).await,
            registry.budget.compile("y", "y", &metrics).await,
        );
        let again = registry
            .obtain("b", request(&source, Some(&digest), 500))
            .now_or_never()
            .expect("served at once")
            .expect("loaded");
        assert_eq!(again.origin, Origin::Loaded);
    }

    #[tokio::test]
    async fn the_registry_holds_only_the_recently_obtained_plugins_nobody_serves() {
        let (dir, source, digest) = workspace();
        let registry = registry(&dir.path().join("cache"));
        let first = registry.obtain("a", request(&source, None, 500)).await;
        let first_digest = first.expect("load").plugin.info().digest;
        assert_eq!(first_digest.to_string(), digest);
        // Nobody holds the plugin now, but it is among the recent ones.
        let again = registry
            .obtain("a", request(&source, Some(&digest), 500))
            .await;
        assert_eq!(again.expect("recent").origin, Origin::Loaded);

        // RECENT_PLUGINS other plugins (other limits) push it out; then a pinned digest is
        // served from the disk cache instead.
        for i in 0..RECENT_PLUGINS {
            let timeout = 501 + u64::try_from(i).expect("small");
            let other = registry.obtain("b", request(&source, None, timeout)).await;
            other.expect("other limits");
        }
        let evicted = registry
            .obtain("a", request(&source, Some(&digest), 500))
            .await;
        assert_eq!(evicted.expect("from disk").origin, Origin::Disk);
        let live = crate::lock(&registry.loaded).live.len();
        assert!(live <= RECENT_PLUGINS + 1, "{live} plugins kept alive");
    }
}
