//! `wasmctrl uninstall`: release what wasmctrl holds once its hosts are gone (see
//! `controller::uninstall`).

use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use kube::Api;

/// Release every finalizer wasmctrl holds (parents', ReconcilePolicies',
/// NamespacedReconcilePolicies') and delete the policies. Run it after the hosts are gone
/// (`helm uninstall`): a running host would put its finalizers back.
#[derive(Debug, Args)]
pub struct UninstallCommand {
    /// The leader election Lease (NAMESPACE/NAME) of the hosts: while a host holds it, the
    /// uninstall refuses to start.
    #[arg(long, default_value = "wasmctrl/wasmctrl-leader")]
    lease: String,
    /// Release the finalizers but keep the policies.
    #[arg(long)]
    keep_policies: bool,
    /// Only the ReconcilePolicies with these labels, and the team policies of the namespaces
    /// with them: the policies of the hosts started with this `--policy-selector` (`shard=a`).
    #[arg(long, conflicts_with = "all")]
    selector: Option<String>,
    /// Every policy in the cluster (of every wasmctrl installation in it).
    #[arg(long)]
    all: bool,
    /// Go on even though the Lease says a host is running, or cannot be found.
    #[arg(long)]
    force: bool,
}

/// What the hosts' Lease says.
enum Lease {
    /// Renewed just now by this holder.
    Held(String),
    /// There, but no host renews it.
    Free,
    /// Not there: under another name, or no leader election.
    Absent,
}

impl UninstallCommand {
    /// Check no host leads, release, delete, and say what was done.
    pub async fn run(self) -> anyhow::Result<()> {
        let client = kube::Client::try_default()
            .await
            .context("connecting to the cluster")?;
        self.run_with(&client).await
    }

    /// [`Self::run`] through `client`.
    pub async fn run_with(self, client: &kube::Client) -> anyhow::Result<()> {
        let client = client.clone();
        if self.selector.is_none() && !self.all {
            bail!(
                "say which policies: --selector LABELS (those of one set of hosts) or --all (every policy in the cluster)"
            );
        }
        if !self.force {
            match self.running_host(&client).await? {
                Lease::Held(holder) => bail!(
                    "host {holder} still holds the Lease {}: uninstall the chart (`helm uninstall --wait`) or stop the hosts first, or pass --force",
                    self.lease
                ),
                Lease::Absent => bail!(
                    "no Lease {} was found, so whether a host still runs is unknown: pass --lease NAMESPACE/NAME for your release (`<release namespace>/<leaderElection.leaseName>`), or --force if no host runs",
                    self.lease
                ),
                Lease::Free => {}
            }
        }
        let done = crate::controller::uninstall::uninstall(
            &client,
            self.selector.as_deref(),
            self.keep_policies,
        )
        .await?;
        println!(
            "released {} ReconcilePolicies (and their parents) and {} NamespacedReconcilePolicies; deleted {} policies",
            done.policies_released, done.team_policies_released, done.policies_deleted
        );
        if !done.failed.is_empty() {
            bail!(
                "not everything could be released (run again once fixed):\n{}",
                done.failed.join("\n")
            );
        }
        Ok(())
    }

    /// Whether a host holds the Lease: renewed within its duration (or stamped in the future,
    /// which a skewed clock can do).
    async fn running_host(&self, client: &kube::Client) -> anyhow::Result<Lease> {
        let (namespace, name) = super::input::namespace_and_name("--lease", &self.lease)?;
        let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
            Api::namespaced(client.clone(), namespace);
        let Some(lease) = leases
            .get_opt(name)
            .await
            .with_context(|| format!("reading Lease {}", self.lease))?
        else {
            return Ok(Lease::Absent);
        };
        let Some(spec) = lease.spec else {
            return Ok(Lease::Free);
        };
        let (Some(holder), Some(renewed)) = (spec.holder_identity, spec.renew_time) else {
            return Ok(Lease::Free);
        };
        let duration = Duration::from_secs(
            u64::try_from(spec.lease_duration_seconds.unwrap_or(15)).unwrap_or(15),
        );
        let age = jiff::Timestamp::now().duration_since(renewed.0);
        let running = age.is_negative() || age.unsigned_abs() < duration;
        Ok(if !holder.is_empty() && running {
            Lease::Held(holder)
        } else {
            Lease::Free
        })
    }
}
