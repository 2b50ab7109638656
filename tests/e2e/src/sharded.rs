//! Hosts that share a test's parents in shards, in this process: each with a shard
//! coordinator of its own (its shard Leases in the test's namespace, under an identity of
//! its own) and a host writing by the shards the coordinator holds, as `wasmctrl run
//! --shards` runs them.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use wasmctrl::shards::{ShardConfig, ShardCoordinator, ShardOwnership};

use crate::HostUnderTest;

/// One host of a shard set, running until [`stop`](Self::stop)ped.
pub struct ShardedHost {
    /// The host itself (its metrics, its explain store).
    pub host: HostUnderTest,
    ownership: std::sync::Arc<ShardOwnership>,
    stop: CancellationToken,
    coordinator: tokio::task::JoinHandle<ShardCoordinator>,
}

impl ShardedHost {
    /// A host for `test`'s policies in `ns` as `identity`, one of a set of `count` shards,
    /// with the Leases' timing short (8 s lease, 5 s renew deadline, 1 s retry) so the tests
    /// see moves within seconds; `plugin_dir` where files may be read besides the built
    /// plugins.
    pub async fn start(
        client: &kube::Client,
        test: &str,
        ns: &str,
        plugin_dir: Option<&std::path::Path>,
        identity: &str,
        count: u32,
    ) -> anyhow::Result<Self> {
        let config = ShardConfig {
            lease: wasmctrl::leader::LeaseConfig {
                name: "wasmctrl".into(),
                namespace: ns.to_owned(),
                identity: identity.to_owned(),
                lease_duration: Duration::from_secs(8),
                renew_deadline: Duration::from_secs(5),
                retry_period: Duration::from_secs(1),
            },
            count,
        };
        let ownership = ShardOwnership::new(count);
        let stop = CancellationToken::new();
        let coordinator = tokio::spawn(
            ShardCoordinator::new(client.clone(), config, ownership.clone()).run(stop.clone()),
        );
        let mut builder = HostUnderTest::builder(test, ns).sharded(ownership.clone());
        if let Some(dir) = plugin_dir {
            builder = builder.plugin_dir(dir);
        }
        let host = builder.start().await?;
        Ok(Self {
            host,
            ownership,
            stop,
            coordinator,
        })
    }

    /// One host per identity of `identities`, all of one set of `count` shards (see
    /// [`start`](Self::start)).
    pub async fn start_each(
        client: &kube::Client,
        test: &str,
        ns: &str,
        plugin_dir: Option<&std::path::Path>,
        identities: &[&str],
        count: u32,
    ) -> anyhow::Result<Vec<Self>> {
        let mut hosts = Vec::new();
        for identity in identities {
            hosts.push(Self::start(client, test, ns, plugin_dir, identity, count).await?);
        }
        Ok(hosts)
    }

    /// [`stop`](Self::stop) each of `hosts`, one after another.
    pub async fn stop_each(hosts: Vec<Self>) -> anyhow::Result<()> {
        for host in hosts {
            host.stop().await?;
        }
        Ok(())
    }

    /// How many shards it holds now.
    pub fn shards_held(&self) -> usize {
        self.ownership.held().len()
    }

    /// Stop the host, then give its shards back as `wasmctrl run` does on SIGTERM.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.host.stop().await?;
        self.stop.cancel();
        self.coordinator.await?.release().await
    }
}
