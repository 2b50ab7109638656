//! Letting go of parents. A policy that finalizes holds `wasmctrl.dev/<policy>` on each of
//! its parents; if the policy went away (or stopped finalizing) and left those behind, the
//! parents — and their namespaces — would stay Terminating for ever. So a finalizing policy
//! itself carries [`POLICY_FINALIZER`], and the host releases every parent before letting the
//! policy go; a policy that stops finalizing is released when its controller restarts.

use anyhow::Context as _;
use kube::api::{ListParams, Patch, PatchParams};
use kube::core::DynamicObject;
use kube::{Api, Client, ResourceExt as _};
use serde_json::json;

use crate::controller::kinds::{self, ResolvedKind};
use crate::controller::labels::{
    POLICY_FINALIZER, POLICY_LABEL, parent_finalizer, policy_label_value,
};
use crate::policy::ReconcilePolicy;

/// Remove `finalizer` from every parent of `parent` kind (in `namespace`, if the host is
/// restricted to one). Each removal tests the parent's uid and the finalizer's position, so
/// it never edits a different object or a list that changed meanwhile (a conflict is an
/// error, and the caller tries again). Returns how many parents were released.
pub(crate) async fn release_parents(
    client: &Client,
    parent: &ResolvedKind,
    namespace: Option<&str>,
    finalizer: &str,
) -> anyhow::Result<usize> {
    let api: Api<DynamicObject> = match namespace.filter(|_| parent.namespaced) {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, &*parent.resource),
        None => Api::all_with(client.clone(), &*parent.resource),
    };
    let parents = api
        .list(&ListParams::default())
        .await
        .with_context(|| format!("listing {} to release finalizers", parent.resource.kind))?;
    let mut released = 0;
    for object in parents.items {
        let Some(index) = object.finalizers().iter().position(|f| f == finalizer) else {
            continue;
        };
        let name = object.name_any();
        let api: Api<DynamicObject> = match &object.metadata.namespace {
            Some(namespace) => Api::namespaced_with(client.clone(), namespace, &*parent.resource),
            None => Api::all_with(client.clone(), &*parent.resource),
        };
        let path = format!("/metadata/finalizers/{index}");
        let patch: json_patch::Patch = serde_json::from_value(json!([
            {"op": "test", "path": "/metadata/uid", "value": object.metadata.uid},
            {"op": "test", "path": path, "value": finalizer},
            {"op": "remove", "path": path},
        ]))?;
        match api
            .patch(&name, &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
        {
            Ok(_) => released += 1,
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => {
                return Err(error).with_context(|| {
                    format!(
                        "removing finalizer {finalizer} from {} {name}",
                        parent.resource.kind
                    )
                });
            }
        }
    }
    Ok(released)
}

/// Add or remove [`POLICY_FINALIZER`] on the policy named `name` with `uid`, if it is not
/// already so. Works from a fresh read and tests its resourceVersion, so a concurrent change
/// to the finalizer list is a conflict (and a retry), never a lost finalizer.
pub(crate) async fn set_policy_finalizer(
    client: &Client,
    name: &str,
    uid: Option<&str>,
    present: bool,
) -> anyhow::Result<()> {
    let api = Api::<ReconcilePolicy>::all(client.clone());
    let Some(policy) = api
        .get_opt(name)
        .await
        .with_context(|| format!("reading policy {name}"))?
    else {
        return Ok(());
    };
    if policy.metadata.uid.as_deref() != uid {
        return Ok(());
    }
    let finalizers = policy.finalizers();
    let index = finalizers.iter().position(|f| f == POLICY_FINALIZER);
    let guard = json!({"op": "test", "path": "/metadata/resourceVersion", "value": policy.metadata.resource_version});
    let ops = match (present, index) {
        (true, Some(_)) | (false, None) => return Ok(()),
        (true, None) if finalizers.is_empty() => json!([
            guard,
            {"op": "add", "path": "/metadata/finalizers", "value": [POLICY_FINALIZER]},
        ]),
        (true, None) => json!([
            guard,
            {"op": "add", "path": "/metadata/finalizers/-", "value": POLICY_FINALIZER},
        ]),
        (false, Some(index)) => json!([
            guard,
            {"op": "remove", "path": format!("/metadata/finalizers/{index}")},
        ]),
    };
    let patch: json_patch::Patch = serde_json::from_value(ops)?;
    match api
        .patch(name, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(error) => {
            Err(error).with_context(|| format!("updating the finalizers of policy {name}"))
        }
    }
}

/// Release every parent of a policy that is being deleted (through `acting`, the client the
/// policy acts through), then let the policy go (as the host, through `host`). `namespace`
/// is the host's own restriction, if any; the policy's `spec.parent.namespace` narrows it.
pub(crate) async fn retire(
    host: &Client,
    acting: &Client,
    policy: &ReconcilePolicy,
    namespace: Option<&str>,
) -> anyhow::Result<()> {
    if !policy.finalizers().iter().any(|f| f == POLICY_FINALIZER) {
        return Ok(());
    }
    let name = policy.name_any();
    let label = policy_label_value(&name);
    let namespace = policy.spec.parent.namespace.as_deref().or(namespace);
    match kinds::resolve(acting, &policy.spec.parent.kind_ref()).await {
        Ok(parent) => {
            let released =
                release_parents(acting, &parent, namespace, &parent_finalizer(&label)).await?;
            tracing::info!(policy = %name, released, "policy deleted; its parents' finalizers released");
        }
        // No parent kind, no parents holding anything.
        Err(kinds::KindError::NotFound { .. }) => {}
        Err(error) => return Err(error.into()),
    }
    set_policy_finalizer(host, &name, policy.metadata.uid.as_deref(), false).await
}

/// Children of kinds that left `spec.children`: which of those kinds still have objects
/// labelled for this policy, and how many. The host keeps such children rather than
/// deleting them (a kind removed by mistake must not cost data), and says so on the policy.
pub(crate) async fn unmanaged_children(
    client: &Client,
    kinds: &[crate::policy::KindRef],
    namespace: Option<&str>,
    policy_label: &str,
) -> anyhow::Result<Vec<(crate::policy::KindRef, usize)>> {
    let selector = format!("{}={policy_label}", POLICY_LABEL);
    let mut found = Vec::new();
    for kind in kinds {
        let resolved = match kinds::resolve(client, kind).await {
            Ok(resolved) => resolved,
            // A kind no longer served has no objects left to worry about.
            Err(kinds::KindError::NotFound { .. }) => continue,
            Err(error) => return Err(error.into()),
        };
        let api: Api<DynamicObject> = match namespace.filter(|_| resolved.namespaced) {
            Some(namespace) => Api::namespaced_with(client.clone(), namespace, &*resolved.resource),
            None => Api::all_with(client.clone(), &*resolved.resource),
        };
        let count = api
            .list_metadata(&ListParams::default().labels(&selector))
            .await
            .with_context(|| {
                format!(
                    "listing {} {} children left behind",
                    kind.api_version, kind.kind
                )
            })?
            .items
            .len();
        if count > 0 {
            found.push((kind.clone(), count));
        }
    }
    Ok(found)
}

/// Bring the finalizers in line with `spec.finalize`: a finalizing policy carries
/// [`POLICY_FINALIZER`] (written as the host, through `host`); one that stopped finalizing
/// releases its parents (through `acting`, the client the policy acts through), then drops
/// it.
pub(crate) async fn sync_finalizers(
    host: &Client,
    acting: &Client,
    policy: &ReconcilePolicy,
    parent: &ResolvedKind,
    namespace: Option<&str>,
) -> anyhow::Result<()> {
    let name = policy.name_any();
    let uid = policy.metadata.uid.as_deref();
    if policy.spec.finalize {
        return set_policy_finalizer(host, &name, uid, true).await;
    }
    if !policy.finalizers().iter().any(|f| f == POLICY_FINALIZER) {
        return Ok(());
    }
    let label = policy_label_value(&name);
    let released = release_parents(acting, parent, namespace, &parent_finalizer(&label)).await?;
    tracing::info!(policy = %name, released, "policy no longer finalizes; parents released");
    set_policy_finalizer(host, &name, uid, false).await
}
