//! What the host's operator sets once for every policy: timings, scope, credentials, plugin
//! sources and loads, where records go.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Host-wide defaults that a policy may override.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// How often every parent is reconciled when nothing changed.
    pub resync: Duration,
    /// First retry delay after a failed reconcile; doubles per consecutive failure.
    pub backoff_base: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
    /// At most one Event per parent and reason in this interval.
    pub event_interval: Duration,
    /// Watch parents, children and related objects in this namespace only (a host installed
    /// with namespaced RBAC); `None` watches the whole cluster.
    pub namespace: Option<String>,
    /// Run only the ReconcilePolicies matching this label selector, so several hosts can
    /// split the policies of one cluster between them.
    pub policy_selector: Option<String>,
    /// The only namespace whose Secrets a policy's `secretRef` may name; `None` refuses
    /// every `secretRef`. Editing policies is a privileged act, but it must not grant
    /// reading every Secret in the cluster.
    pub credentials_namespace: Option<String>,
    /// The directories `file` plugin sources may be in (symlinks followed); empty refuses
    /// every file source. A file source is read with the host's rights, so without this bound
    /// a policy could name the host's own token.
    pub plugin_dirs: Vec<PathBuf>,
    /// Plugins compiled at once, across all policies: each takes a compile's memory.
    pub max_concurrent_loads: usize,
    /// Plugins fetched at once, across all policies, one per tenant at a time: each may
    /// buffer up to the plugin size limit.
    pub max_concurrent_fetches: usize,
    /// What a team's NamespacedReconcilePolicy may ask for: memory per call, concurrency,
    /// and the hosts its sources may name.
    pub team_bounds: crate::policy::namespaced::TeamBounds,
    /// Where the records of reconciles go, for `wasmctrl explain` and replay.
    pub explain: Arc<crate::explain::Explain>,
    /// Refuse a policy that names no ServiceAccount to act as (`IdentityRequired`) instead
    /// of acting as the host for it.
    pub require_policy_identity: bool,
    /// The certificate authorities plugin sources over TLS are checked against.
    pub trust: crate::registry::TrustRoots,
    /// The signatures every policy's plugins need, besides its own `verify` (`--plugin-verify`).
    pub default_verify: Option<crate::policy::VerifySpec>,
    /// The keyless roots and transparency-log keys plugin signatures are checked against.
    pub signing: crate::signing::HostTrust,
    /// Bytes of related objects read by name that the host keeps, over all policies and
    /// kinds, so a read need not be repeated while the object is unchanged.
    pub related_cache_bytes: usize,
    /// After the stop signal, how long the host waits for its policies to stop (reconciles
    /// in flight finish, loads and writes complete) before it abandons what is left and
    /// returns; set it below the pod's termination grace period.
    pub drain_timeout: Duration,
}

impl Default for HostOptions {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(300),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            event_interval: Duration::from_secs(60),
            namespace: None,
            policy_selector: None,
            credentials_namespace: None,
            plugin_dirs: Vec::new(),
            max_concurrent_loads: crate::registry::RegistryOptions::default().max_concurrent_loads,
            max_concurrent_fetches: crate::registry::RegistryOptions::default()
                .max_concurrent_fetches,
            team_bounds: crate::policy::namespaced::TeamBounds::default(),
            explain: Arc::new(crate::explain::Explain::in_memory(
                crate::explain::ExplainOptions::default().bounds,
            )),
            require_policy_identity: false,
            trust: crate::registry::TrustRoots::default(),
            default_verify: None,
            signing: crate::signing::HostTrust::default(),
            related_cache_bytes: 64 << 20,
            drain_timeout: Duration::from_secs(30),
        }
    }
}
