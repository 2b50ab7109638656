//! What every policy controller of one host shares: the client, the plugin registry, the
//! host's options, its metrics, readiness and leadership.

use std::sync::Arc;

use kube::Client;

use crate::controller::options::HostOptions;
use crate::registry::PluginRegistry;

/// What every policy controller shares.
pub(crate) struct Shared {
    pub client: Client,
    /// Where every policy gets its plugins.
    pub registry: Arc<PluginRegistry>,
    pub options: HostOptions,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub readiness: Arc<crate::health::Readiness>,
    /// Whether this replica may write; a standby watches and loads but writes nothing.
    pub leadership: Arc<crate::leader::Leadership>,
}
