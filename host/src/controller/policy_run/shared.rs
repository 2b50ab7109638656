//! What every policy controller of one host shares: the client, the plugin registry, the
//! host's options, its metrics, readiness and leadership.

use std::sync::Arc;

use kube::Client;

use crate::controller::cache::read_cache::ReadBudget;
use crate::controller::options::HostOptions;
use crate::controller::policy_run::identity::Identities;
use crate::registry::PluginRegistry;

/// What every policy controller shares.
pub(crate) struct Shared {
    /// The host's own client: policies and their status, leader election.
    pub client: Client,
    /// The clients policies act through.
    pub identities: Identities,
    /// Where every policy gets its plugins.
    pub registry: Arc<PluginRegistry>,
    pub options: HostOptions,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub readiness: Arc<crate::health::Readiness>,
    /// Whether this replica may write; a standby watches and loads but writes nothing.
    pub leadership: Arc<crate::leader::Leadership>,
    /// What every policy's caches of related objects read by name may keep together.
    pub related_budget: Arc<ReadBudget>,
    /// The watches of related kinds policies share.
    pub watches: Arc<crate::controller::policy_run::shared_watches::HostWatches>,
    /// Every task a stop waits for, and where each stands.
    pub activity: Arc<crate::controller::stopping::Activity>,
    /// The webhook listener this host serves policies' webhooks on, if it serves any.
    pub webhooks: Option<Arc<crate::admission::hosting::Hosting>>,
    /// Whether the API server narrows lists and watches by shard, once asked (see
    /// [`crate::shards::selector::narrows_by_shard`]).
    pub narrows_by_shard: tokio::sync::OnceCell<bool>,
    /// Set once the host is stopping for good (not a policy's restart).
    pub shutting_down: std::sync::atomic::AtomicBool,
}
