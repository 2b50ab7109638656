//! `wasmctrl uninstall`: release what wasmctrl holds once its hosts are gone (see
//! `controller::uninstall`).

use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use k8s_openapi::api::coordination::v1::Lease;
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
    /// Only the policies (of both kinds) with these labels, e.g. `shard=a` for the policies
    /// of the hosts started with that `--policy-selector`.
    #[arg(long)]
    selector: Option<String>,
    /// Go on even though the Lease says a host is running.
    #[arg(long)]
    force: bool,
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
        if !self.force
            && let Some(holder) = self.running_host(&client).await?
        {
            bail!(
                "host {holder} still holds the Lease {}: uninstall the chart (or stop the hosts) first, or pass --force",
                self.lease
            );
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
        Ok(())
    }

    /// Who holds the Lease, if anyone renewed it within its duration.
    async fn running_host(&self, client: &kube::Client) -> anyhow::Result<Option<String>> {
        let (namespace, name) = self
            .lease
            .split_once('/')
            .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
            .with_context(|| format!("--lease {:?} is not NAMESPACE/NAME", self.lease))?;
        let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
        let Some(lease) = leases
            .get_opt(name)
            .await
            .with_context(|| format!("reading Lease {}", self.lease))?
        else {
            return Ok(None);
        };
        let Some(spec) = lease.spec else {
            return Ok(None);
        };
        let (Some(holder), Some(renewed)) = (spec.holder_identity, spec.renew_time) else {
            return Ok(None);
        };
        let duration = Duration::from_secs(
            u64::try_from(spec.lease_duration_seconds.unwrap_or(15)).unwrap_or(15),
        );
        let age = jiff::Timestamp::now()
            .duration_since(renewed.0)
            .unsigned_abs();
        Ok((!holder.is_empty() && age < duration).then_some(holder))
    }
}
