//! What `wasmctrl uninstall` does once the hosts are gone: let go of everything wasmctrl
//! holds in the cluster, in the order that frees it. Finalizers are the only thing a host
//! leaves that nothing else removes — on parents (a finalizing policy's), on
//! ReconcilePolicies (the one that waits for their parents' release), on
//! NamespacedReconcilePolicies (the one that waits for the policy made from them) — and each
//! would keep its object, and the object's namespace, Terminating for ever.
//!
//! So, in order: every policy's parent CRD's conversion is put back (when its plugin served
//! it), every policy's parents are released (in every scope the policy recorded), then the
//! policy's own finalizers; then the teams' policies' finalizers; then, unless asked
//! to keep them, the policies themselves. Children are left as they are: their owner
//! references delete them with their parents, as Kubernetes would without wasmctrl.

use std::collections::BTreeSet;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Namespace;
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
    /// What could not be done, one line each: the rest was done all the same.
    pub failed: Vec<String>,
}

/// The conversion of `policy`'s parent CRD put back as it was before the policy, and the
/// policy's finalizer that waits for it removed; refused while an object is stored at a
/// version only the policy's plugin can read it from (with no host left to convert, the
/// objects would be unreadable at the other versions): `wasmctrl migrate` first.
async fn put_back_conversion(client: &Client, policy: &ReconcilePolicy) -> anyhow::Result<()> {
    use crate::admission::crd_conversion::CrdConversion;
    use crate::controller::labels::CONVERSION_FINALIZER;
    let name = policy.name_any();
    if let Some(converted) = policy.status.as_ref().and_then(|s| s.conversion.as_ref()) {
        CrdConversion::new(client, &converted.crd)
            .restore(&name, None)
            .await
            .map_err(|error| anyhow::anyhow!("its CRD's conversion: {error}"))?;
    }
    release::set_finalizer_of_policy(
        client,
        &name,
        policy.metadata.uid.as_deref(),
        CONVERSION_FINALIZER,
        false,
    )
    .await
}

/// Release every finalizer wasmctrl holds, then (unless `keep_policies`) delete the policies:
/// all of them, or with a label `selector`, the ReconcilePolicies it selects and the team
/// policies of the namespaces it selects (team policies are placed by their namespace's
/// labels, as hosts place them). Run it as a cluster admin, after the hosts are gone: a host
/// still running would put its finalizers back. A policy that cannot be released is named in
/// [`Uninstalled::failed`] and kept; the others go on.
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
    let mut released = Vec::new();
    for policy in &listed {
        if let Err(error) = put_back_conversion(client, policy).await {
            done.failed
                .push(format!("ReconcilePolicy {}: {error:#}", policy.name_any()));
            continue;
        }
        match release::release_all(client, client, policy, None).await {
            Ok(()) => {
                done.policies_released += 1;
                released.push(policy);
            }
            Err(error) => done
                .failed
                .push(format!("ReconcilePolicy {}: {error:#}", policy.name_any())),
        }
    }
    let namespaces = match selector {
        None => None,
        Some(selector) => Some(
            Api::<Namespace>::all(client.clone())
                .list_metadata(&ListParams::default().labels(selector))
                .await
                .context("listing the namespaces the selector places")?
                .items
                .into_iter()
                .map(|n| n.name_any())
                .collect::<BTreeSet<_>>(),
        ),
    };
    let team: Api<DynamicObject> =
        Api::all_with(client.clone(), &crate::policy::namespaced::api_resource());
    let team_listed: Vec<DynamicObject> = match team.list(&ListParams::default()).await {
        Ok(list) => list.items,
        Err(kube::Error::Api(status)) if status.code == 404 => Vec::new(),
        Err(error) => return Err(error).context("listing NamespacedReconcilePolicies"),
    }
    .into_iter()
    .filter(|source| {
        namespaces.as_ref().is_none_or(|selected| {
            source
                .namespace()
                .is_some_and(|namespace| selected.contains(&namespace))
        })
    })
    .collect();
    let mut team_released = Vec::new();
    for source in &team_listed {
        let (Some(namespace), name) = (source.namespace(), source.name_any()) else {
            continue;
        };
        match release_team_policy(client, source, &namespace, &name).await {
            Ok(()) => {
                done.team_policies_released += 1;
                team_released.push((namespace, name));
            }
            Err(error) => done.failed.push(format!(
                "NamespacedReconcilePolicy {namespace}/{name}: {error:#}"
            )),
        }
    }
    if keep_policies {
        return Ok(done);
    }
    for (namespace, name) in &team_released {
        let api: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            namespace,
            &crate::policy::namespaced::api_resource(),
        );
        match deleted(api.delete(name, &DeleteParams::default()).await) {
            Ok(n) => done.policies_deleted += n,
            Err(error) => done.failed.push(format!(
                "deleting NamespacedReconcilePolicy {namespace}/{name}: {error}"
            )),
        }
    }
    for policy in released {
        let name = policy.name_any();
        match deleted(policies.delete(&name, &DeleteParams::default()).await) {
            Ok(n) => done.policies_deleted += n,
            Err(error) => done
                .failed
                .push(format!("deleting ReconcilePolicy {name}: {error}")),
        }
    }
    Ok(done)
}

/// Remove the host's finalizer from a team's policy.
async fn release_team_policy(
    client: &Client,
    source: &DynamicObject,
    namespace: &str,
    name: &str,
) -> anyhow::Result<()> {
    let Some(ops) = release::finalizer_patch(&source.metadata, NAMESPACED_FINALIZER, false) else {
        return Ok(());
    };
    let patch: json_patch::Patch = serde_json::from_value(ops)?;
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        namespace,
        &crate::policy::namespaced::api_resource(),
    );
    match api
        .patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// 1 for a deletion, 0 for one already gone.
fn deleted<T>(result: Result<T, kube::Error>) -> Result<usize, kube::Error> {
    match result {
        Ok(_) => Ok(1),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(0),
        Err(error) => Err(error),
    }
}
