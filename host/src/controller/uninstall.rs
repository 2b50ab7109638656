//! What `wasmctrl uninstall` does once the hosts are gone: let go of everything wasmctrl
//! holds in the cluster, in the order that frees it. Finalizers are the only thing a host
//! leaves that nothing else removes — on parents (a finalizing policy's), on
//! ReconcilePolicies (the one that waits for their parents' release), on
//! NamespacedReconcilePolicies (the one that waits for the policy made from them) — and each
//! would keep its object, and the object's namespace, Terminating for ever.
//!
//! So, in order: every policy's parents are released (in every scope the policy recorded),
//! then the policy's own finalizer; then the teams' policies' finalizers; then, unless asked
//! to keep them, the policies themselves. Children are left as they are: their owner
//! references delete them with their parents, as Kubernetes would without wasmctrl.

use anyhow::Context as _;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::core::DynamicObject;
use kube::{Api, Client, ResourceExt as _};

use crate::controller::namespaced_policies::FINALIZER as NAMESPACED_FINALIZER;
use crate::controller::policy_run::release;
use crate::policy::ReconcilePolicy;

/// What an uninstall did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Uninstalled {
    /// ReconcilePolicies whose parents and own finalizer were released.
    pub policies_released: usize,
    /// NamespacedReconcilePolicies whose finalizer was removed.
    pub team_policies_released: usize,
    /// Policies of either kind deleted.
    pub policies_deleted: usize,
}

/// Release every finalizer wasmctrl holds, then (unless `keep_policies`) delete the policies;
/// with a label `selector`, only for the policies (of both kinds) it selects. Run it as a
/// cluster admin, after the hosts are gone: a host still running would put its finalizers
/// back.
pub async fn uninstall(
    client: &Client,
    selector: Option<&str>,
    keep_policies: bool,
) -> anyhow::Result<Uninstalled> {
    let mut done = Uninstalled::default();
    let list_params = match selector {
        Some(selector) => ListParams::default().labels(selector),
        None => ListParams::default(),
    };
    let policies: Api<ReconcilePolicy> = Api::all(client.clone());
    let listed = match policies.list(&list_params).await {
        Ok(list) => list.items,
        // The CRD is gone: nothing of it is left.
        Err(kube::Error::Api(status)) if status.code == 404 => Vec::new(),
        Err(error) => return Err(error).context("listing ReconcilePolicies"),
    };
    for policy in &listed {
        release::retire(client, client, policy, None)
            .await
            .with_context(|| format!("releasing policy {}", policy.name_any()))?;
        done.policies_released += 1;
    }
    let team: Api<DynamicObject> =
        Api::all_with(client.clone(), &crate::policy::namespaced::api_resource());
    let team_listed = match team.list(&list_params).await {
        Ok(list) => list.items,
        Err(kube::Error::Api(status)) if status.code == 404 => Vec::new(),
        Err(error) => return Err(error).context("listing NamespacedReconcilePolicies"),
    };
    for source in &team_listed {
        let (Some(namespace), name) = (source.namespace(), source.name_any()) else {
            continue;
        };
        let Some(ops) = release::finalizer_patch(&source.metadata, NAMESPACED_FINALIZER, false)
        else {
            continue;
        };
        let patch: json_patch::Patch = serde_json::from_value(ops)?;
        let api: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            &namespace,
            &crate::policy::namespaced::api_resource(),
        );
        match api
            .patch(&name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => done.team_policies_released += 1,
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => {
                return Err(error).with_context(|| {
                    format!("releasing NamespacedReconcilePolicy {namespace}/{name}")
                });
            }
        }
    }
    if keep_policies {
        return Ok(done);
    }
    for source in &team_listed {
        let (Some(namespace), name) = (source.namespace(), source.name_any()) else {
            continue;
        };
        let api: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            &namespace,
            &crate::policy::namespaced::api_resource(),
        );
        done.policies_deleted += deleted(api.delete(&name, &DeleteParams::default()).await)
            .with_context(|| format!("deleting NamespacedReconcilePolicy {namespace}/{name}"))?;
    }
    for policy in &listed {
        let name = policy.name_any();
        done.policies_deleted += deleted(policies.delete(&name, &DeleteParams::default()).await)
            .with_context(|| format!("deleting ReconcilePolicy {name}"))?;
    }
    Ok(done)
}

/// 1 for a deletion, 0 for one already gone.
fn deleted<T>(result: Result<T, kube::Error>) -> Result<usize, kube::Error> {
    match result {
        Ok(_) => Ok(1),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(0),
        Err(error) => Err(error),
    }
}
