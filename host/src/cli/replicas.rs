//! How the replicas of `wasmctrl run` share the work: one host alone, one elected leader
//! with warm standbys (`--leader-elect`, see `wasmctrl::leader`), or every replica
//! reconciling a share of the parents (`--shards`, see `wasmctrl::shards`). Both keep their
//! Leases in the host's namespace and take this replica's identity and the Lease timing
//! from the same flags.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::leader::{LeaderElector, Leadership, LeadershipLost, LeaseConfig};
use crate::metrics::Metrics;
use crate::shards::{ShardConfig, ShardCoordinator, ShardOwnership};

/// How long stopping the leader elector (or the shard coordinator) and releasing its Leases
/// may take together: an API server that does not answer must not keep the host from
/// exiting (the Leases then expire on their own).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// Leader election or sharding among replicas of the host.
#[derive(Debug, Args)]
pub(super) struct ReplicaArgs {
    /// Elect one leader among the replicas through a Lease; the others stand by with warm
    /// caches and write nothing.
    #[arg(long, env = "WASMCTRL_LEADER_ELECT")]
    leader_elect: bool,
    /// Share the parents among every replica instead: cut them into this many shards (1 to
    /// 64), each held by one replica at a time through a Lease `<shard-set>-shard-<i>`. Every
    /// replica reconciles the parents of the shards it holds; the holder of shard 0 also
    /// writes each policy's status and drives its rollouts. Replaces --leader-elect.
    #[arg(long, env = "WASMCTRL_SHARDS", conflicts_with = "leader_elect")]
    shards: Option<u32>,
    /// The name of the shard set: the prefix of its Leases. Replicas that share the parents
    /// name the same set.
    #[arg(long, env = "WASMCTRL_SHARD_SET", default_value = "wasmctrl")]
    shard_set: String,
    /// Name of the leader's Lease.
    #[arg(
        long,
        env = "WASMCTRL_LEADER_ELECT_LEASE_NAME",
        default_value = "wasmctrl-leader"
    )]
    leader_elect_lease_name: String,
    /// Namespace of the leader's or the shards' Leases. Default: the namespace the host
    /// runs in.
    #[arg(long, env = "WASMCTRL_LEADER_ELECT_NAMESPACE")]
    leader_elect_namespace: Option<String>,
    /// This replica's name in the Leases. Default: `POD_NAME`, else host name and a random
    /// suffix.
    #[arg(long, env = "WASMCTRL_LEADER_ELECT_IDENTITY")]
    leader_elect_identity: Option<String>,
    /// How long the others wait after a Lease last changed before taking it over, in
    /// seconds (the leader's, or a shard's).
    #[arg(
        long,
        env = "WASMCTRL_LEADER_ELECT_LEASE_DURATION_SECONDS",
        default_value_t = 15
    )]
    leader_elect_lease_duration_seconds: u64,
    /// How long the holder of a Lease tries to renew it before it stops writing under it,
    /// in seconds.
    #[arg(
        long,
        env = "WASMCTRL_LEADER_ELECT_RENEW_DEADLINE_SECONDS",
        default_value_t = 10
    )]
    leader_elect_renew_deadline_seconds: u64,
    /// How often Leases are renewed and looked at, in seconds.
    #[arg(
        long,
        env = "WASMCTRL_LEADER_ELECT_RETRY_PERIOD_SECONDS",
        default_value_t = 2
    )]
    leader_elect_retry_period_seconds: u64,
}

/// How this replica shares the work, as configured.
pub(super) enum Replicas {
    /// The only replica: it leads from the start.
    Alone,
    /// One of several, one of which leads.
    Elected(LeaseConfig),
    /// One of several, each holding some of the shards.
    Sharded(ShardConfig, Arc<ShardOwnership>),
}

/// How this replica shares the work, once started.
pub(super) enum Sharing {
    Alone,
    Elected(JoinHandle<Result<LeaderElector, LeadershipLost>>),
    Sharded(JoinHandle<ShardCoordinator>),
}

impl ReplicaArgs {
    /// What the flags ask for, the Leases in `own_namespace` (the host's, when it runs in a
    /// pod) unless a namespace is given; an invalid Lease timing or shard count is refused
    /// here.
    pub fn replicas(&self, own_namespace: Option<String>) -> anyhow::Result<Replicas> {
        if !self.leader_elect && self.shards.is_none() {
            return Ok(Replicas::Alone);
        }
        let flag = if self.leader_elect {
            "--leader-elect"
        } else {
            "--shards"
        };
        let namespace = self
            .leader_elect_namespace
            .clone()
            .or(own_namespace)
            .with_context(|| {
                format!("{flag} needs the Leases' namespace: run in a pod or pass --leader-elect-namespace")
            })?;
        let lease = |name: &str| LeaseConfig {
            name: name.to_owned(),
            namespace: namespace.clone(),
            identity: self
                .leader_elect_identity
                .clone()
                .unwrap_or_else(crate::leader::default_identity),
            lease_duration: Duration::from_secs(self.leader_elect_lease_duration_seconds),
            renew_deadline: Duration::from_secs(self.leader_elect_renew_deadline_seconds),
            retry_period: Duration::from_secs(self.leader_elect_retry_period_seconds),
        };
        match self.shards {
            Some(count) => {
                let config = ShardConfig {
                    lease: lease(&self.shard_set),
                    count,
                };
                config
                    .validate()
                    .map_err(|why| anyhow::anyhow!("--shards: {why}"))?;
                Ok(Replicas::Sharded(config, ShardOwnership::new(count)))
            }
            None => {
                let config = lease(&self.leader_elect_lease_name);
                config
                    .validate()
                    .map_err(|why| anyhow::anyhow!("leader election: {why}"))?;
                Ok(Replicas::Elected(config))
            }
        }
    }
}

impl Replicas {
    /// Whom the host writes as: a standby until elected, or by the shards it holds.
    pub fn leadership(&self) -> Arc<Leadership> {
        match self {
            Self::Alone => Leadership::always(),
            Self::Elected(_) => Leadership::standby(),
            Self::Sharded(_, ownership) => {
                let leadership = Leadership::always();
                leadership.shard_by(ownership.clone());
                leadership
            }
        }
    }

    /// Campaign for the lead or take part in the shard set until `until`. Losing the lead
    /// cancels `stop`, as controller-runtime does (the restart comes back as a standby);
    /// losing a shard only stops its writes.
    ///
    /// `clients` are the ungated client, which takes and releases Leases, and the gated
    /// one, which renews the leader's only while this replica still leads.
    pub fn start(
        self,
        clients: (kube::Client, kube::Client),
        leadership: &Arc<Leadership>,
        metrics: Arc<Metrics>,
        stop: &CancellationToken,
        until: &CancellationToken,
    ) -> Sharing {
        let (client, gated) = clients;
        let until = until.clone();
        match self {
            Self::Alone => Sharing::Alone,
            Self::Elected(lease) => {
                tracing::info!(lease = %lease.name, namespace = %lease.namespace, identity = %lease.identity, "campaigning for leadership");
                let name = lease.name.clone();
                let elector = LeaderElector::new(client, gated, lease, leadership.clone());
                tokio::spawn(report_leadership(leadership.clone(), metrics, name));
                let stop = stop.clone();
                Sharing::Elected(tokio::spawn(async move {
                    let result = elector.run(until).await;
                    if let Err(lost) = &result {
                        tracing::error!(error = %lost, "leadership lost; shutting down");
                        stop.cancel();
                    }
                    result
                }))
            }
            Self::Sharded(config, ownership) => {
                tracing::info!(set = %config.lease.name, namespace = %config.lease.namespace, identity = %config.lease.identity, shards = config.count, "sharing the parents");
                tokio::spawn(report_shards(
                    ownership.clone(),
                    metrics,
                    config.lease.name.clone(),
                ));
                let coordinator = ShardCoordinator::new(client, config, ownership);
                Sharing::Sharded(tokio::spawn(coordinator.run(until)))
            }
        }
    }
}

impl Sharing {
    /// Wait for the elector or coordinator to stop, then give its Leases up so another
    /// replica takes over at once; both within [`RELEASE_TIMEOUT`]. Call it after the last
    /// write: the gate must already be closed. An error means the lead was lost while
    /// running.
    pub async fn release(self) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + RELEASE_TIMEOUT;
        match self {
            Self::Alone => Ok(()),
            Self::Elected(mut election) => {
                let Ok(stopped) = tokio::time::timeout_at(deadline, &mut election).await else {
                    election.abort();
                    tracing::warn!(timeout = ?RELEASE_TIMEOUT, "the leader elector did not stop in time; a standby takes over when the lease expires");
                    return Ok(());
                };
                let mut elector = stopped.context("the leader election task failed")??;
                let released = tokio::time::timeout_at(deadline, elector.release()).await;
                warn_unreleased(released, "the leader lease", "a standby");
                Ok(())
            }
            Self::Sharded(mut coordination) => {
                let Ok(stopped) = tokio::time::timeout_at(deadline, &mut coordination).await else {
                    coordination.abort();
                    tracing::warn!(timeout = ?RELEASE_TIMEOUT, "the shard coordinator did not stop in time; the other replicas take its shards when their leases expire");
                    return Ok(());
                };
                let mut coordinator = stopped.context("the shard coordinator task failed")?;
                let released = tokio::time::timeout_at(deadline, coordinator.release()).await;
                warn_unreleased(released, "the shard leases", "the other replicas");
                Ok(())
            }
        }
    }
}

/// Log a release that failed or took too long: the Leases expire on their own.
fn warn_unreleased(
    released: Result<anyhow::Result<()>, tokio::time::error::Elapsed>,
    what: &str,
    others: &str,
) {
    match released {
        Ok(Ok(())) => {}
        Ok(Err(error)) => {
            tracing::warn!(error = %format!("{error:#}"), "could not release {what}; {others} take over when they expire");
        }
        Err(_) => {
            tracing::warn!(timeout = ?RELEASE_TIMEOUT, "releasing {what} took too long; {others} take over when they expire");
        }
    }
}

/// Keep `leader_election_master_status` in line with `leadership`; never completes.
async fn report_leadership(leadership: Arc<Leadership>, metrics: Arc<Metrics>, lease: String) {
    let mut changes = leadership.subscribe();
    loop {
        metrics.set_leader(&lease, *changes.borrow_and_update());
        if changes.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

/// Keep `wasmctrl_shards_held` in line with `ownership`; never completes.
async fn report_shards(ownership: Arc<ShardOwnership>, metrics: Arc<Metrics>, set: String) {
    let mut changes = ownership.subscribe();
    loop {
        let held = changes.borrow_and_update().len();
        metrics.set_shards_held(&set, held);
        if changes.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}
