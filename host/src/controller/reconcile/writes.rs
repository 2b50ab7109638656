//! Every cluster write of one reconcile: create or update each child (only objects this
//! parent controls), prune what is no longer desired, write the parent's status (after a
//! success or a failure, by one writer), and add or remove the parent's finalizer. Each says
//! what it did, for the reconcile's record. Every write is bound to the uid it was decided
//! for, so a replaced object is never written by mistake.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions, PropagationPolicy};
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client, ResourceExt as _};
use serde_json::{Value, json};

use crate::controller::cache::cached::CachedObject;
use crate::controller::cache::field_ownership::applied_status;
use crate::controller::labels::DESIRED_HASH_ANNOTATION;
use crate::controller::reconcile::children::{self, DesiredChild};
use crate::controller::reconcile::context::PolicyContext;
use crate::controller::reconcile::decisions::OwnWrites;
use crate::controller::reconcile::error::ReconcileError;
use crate::controller::reconcile::lean_writes;
use crate::controller::reconcile::parent::ParentIdentity;
use crate::controller::reconcile::prune_guard::Admission;
use crate::controller::reconcile::status::{self, Outcome};
use crate::metrics::ChildOperation;

/// Most changed fields a child's record lists.
const CHANGED_FIELDS_SHOWN: usize = 20;

/// What bringing one child to its desired state took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Applied {
    /// It did not exist: created.
    Created,
    /// It drifted: applied. The desired fields whose live value differed.
    Changed(Vec<String>),
    /// Already as desired: no write.
    Unchanged,
}

impl Applied {
    pub fn wrote(&self) -> bool {
        !matches!(self, Self::Unchanged)
    }
}

/// Bring one child to its desired state, unless the cache shows it already converged.
///
/// Ownership comes first: the host changes only objects whose controller is this parent. A
/// child missing from the cache (which holds only objects labelled for this policy) is
/// created, never applied, so an existing object of the same name — a hand-made Service, or
/// one another parent controls — turns into a `ChildConflict` instead of being taken over.
pub(crate) async fn apply_child(
    child: &DesiredChild,
    parent: &ParentIdentity,
    ctx: &PolicyContext,
    own: &OwnWrites,
) -> Result<Applied, ReconcileError> {
    let cache = &ctx.caches.children[child.kind_index];
    let mut key = ObjectRef::new_with(&child.name, cache.resource.clone());
    if let Some(namespace) = &child.namespace {
        key = key.within(namespace);
    }
    let Some(observed) = cache.store.get(&key) else {
        return create_child(child, parent, ctx, own).await;
    };
    // This reconcile may run before the cache shows an update an earlier one wrote.
    let version = observed
        .metadata
        .resource_version
        .as_deref()
        .unwrap_or_default();
    let pending_key = (child.namespace.clone(), child.name.clone());
    if cache.pending.written(&pending_key, &child.hash, version) {
        return Ok(Applied::Unchanged);
    }
    update_child(
        child,
        &observed.metadata,
        observed.to_value(),
        parent,
        ctx,
        own,
    )
    .await
}

/// Create a child the cache does not know. An `AlreadyExists` means either that the cache has
/// not seen an earlier create of ours yet, or that someone else's object holds the name: a
/// live read tells them apart.
pub(crate) async fn create_child(
    child: &DesiredChild,
    parent: &ParentIdentity,
    ctx: &PolicyContext,
    own: &OwnWrites,
) -> Result<Applied, ReconcileError> {
    let resource = &ctx.caches.children[child.kind_index].resource;
    let api = dynamic_api(&ctx.client, resource, child.namespace.as_deref());
    let apply_error = |source| ReconcileError::Apply {
        kind: ctx.caches.allowed[child.kind_index].kind.clone(),
        name: child.name.clone(),
        source,
    };
    let params = PostParams {
        field_manager: Some(ctx.field_manager.clone()),
        ..PostParams::default()
    };
    let created = lean_writes::create(
        &ctx.client,
        resource,
        child.namespace.as_deref(),
        &params,
        // Written as the plugin's answer was validated and stamped, as an apply writes it.
        &child.object,
    );
    match created.await {
        Ok(created) => {
            own.child(child.key(), created.resource_version());
            Ok(Applied::Created)
        }
        Err(kube::Error::Api(status)) if status.code == 409 => {
            let live = api.get(&child.name).await.map_err(apply_error)?;
            let live_json = serde_json::to_value(&live).unwrap_or_default();
            update_child(child, &live.metadata, live_json, parent, ctx, own).await
        }
        Err(source) => Err(apply_error(source)),
    }
}

/// Server-side apply a child that exists (its `metadata`, and the whole `observed` object),
/// if this parent controls it and it drifted. The apply carries the observed uid, so an
/// object deleted and re-created by someone else since the read is refused by the API
/// server rather than taken over.
pub(crate) async fn update_child(
    child: &DesiredChild,
    metadata: &ObjectMeta,
    observed_json: Value,
    parent: &ParentIdentity,
    ctx: &PolicyContext,
    own: &OwnWrites,
) -> Result<Applied, ReconcileError> {
    let kind = &ctx.caches.allowed[child.kind_index].kind;
    let owners = metadata.owner_references.as_deref().unwrap_or_default();
    if let Some(owner) = children::foreign_controller(owners, &parent.uid) {
        return Err(ReconcileError::ChildConflict {
            kind: kind.clone(),
            name: child.name.clone(),
            owner,
        });
    }
    if children::is_converged(child, &observed_json) {
        return Ok(Applied::Unchanged);
    }
    let changed = changed_fields(child, &observed_json);
    tracing::debug!(%kind, name = %child.name, differs_at = %changed[0], "child drifted from its desired state");
    let mut body = child.object.clone();
    if let (Some(uid), Some(body_metadata)) = (&metadata.uid, body["metadata"].as_object_mut()) {
        body_metadata.insert("uid".into(), json!(uid));
    }
    let apply_error = |source| ReconcileError::Apply {
        kind: kind.clone(),
        name: child.name.clone(),
        source,
    };
    let cache = &ctx.caches.children[child.kind_index];
    let api = dynamic_api(&ctx.client, &cache.resource, child.namespace.as_deref());
    // The versions the cache may still show until it has this update: the one it was
    // decided against, and the hand-over's.
    let mut decided_at = vec![metadata.resource_version.clone().unwrap_or_default()];
    if cache
        .created
        .needs_hand_over(child.namespace.as_deref(), &child.name)
    {
        let handed_over = cache
            .created
            .hand_over(&api, &child.name)
            .await
            .map_err(apply_error)?;
        own.child(child.key(), handed_over.as_deref());
        decided_at.extend(handed_over);
    }
    let applied = lean_writes::patch(
        &ctx.client,
        &cache.resource,
        child.namespace.as_deref(),
        &child.name,
        &PatchParams::apply(&ctx.field_manager).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(apply_error)?;
    own.child(child.key(), applied.resource_version());
    if decided_at.len() == 1
        && applied.resource_version().is_some()
        && applied.resource_version() == metadata.resource_version.as_deref()
    {
        // The server found nothing to change (what looked different is what it keeps
        // anyway): no update is on its way to the cache.
        return Ok(Applied::Unchanged);
    }
    cache.pending.updated(
        (child.namespace.clone(), child.name.clone()),
        &child.hash,
        decided_at,
    );
    Ok(Applied::Changed(changed))
}

/// The desired fields of `child` whose live value differs, leaving out the desired-state
/// hash (it differs whenever anything does). When only the hash differs, the desired state
/// dropped a field the live object still has.
fn changed_fields(child: &DesiredChild, observed: &Value) -> Vec<String> {
    let hash_path = format!(".metadata.annotations.{}", DESIRED_HASH_ANNOTATION);
    let mut changed: Vec<String> =
        children::differences(&child.object, observed, CHANGED_FIELDS_SHOWN + 1)
            .into_iter()
            .filter(|path| !path.starts_with(&hash_path))
            .take(CHANGED_FIELDS_SHOWN)
            .collect();
    if changed.is_empty() {
        changed.push("(a field no longer desired)".to_owned());
    }
    changed
}

/// What the prune step did.
#[derive(Debug)]
pub(crate) enum Pruned {
    /// Deleted these children, by kind and name.
    Deleted(Vec<(String, String)>),
    /// The prune guard held these deletions (`Kind name` each): nothing was deleted.
    Held(Vec<String>),
}

/// Delete observed children that are no longer desired, unless the prune guard holds them.
/// Called only after every apply succeeded, and only for objects this parent controls (the
/// delete is preconditioned on the observed uid, so a same-named replacement is never hit).
pub(crate) async fn prune(
    observed: &[crate::controller::reconcile::request::Observed],
    desired: &[DesiredChild],
    parent: &ObjectRef<CachedObject>,
    ctx: &PolicyContext,
) -> Result<Pruned, ReconcileError> {
    let resources: Vec<_> = ctx
        .caches
        .children
        .iter()
        .map(|cache| children::GroupResource {
            group: &cache.resource.group,
            resource: &cache.resource.plural,
        })
        .collect();
    let positions = children::to_prune(
        observed
            .iter()
            .map(|(index, child)| (*index, child.metadata.name.as_deref().unwrap_or_default())),
        desired,
        &resources,
    );
    let doomed: Vec<String> = positions
        .iter()
        .map(|&position| {
            let (index, child) = &observed[position];
            format!("{} {}", ctx.caches.allowed[*index].kind, child.name_any())
        })
        .collect();
    if ctx
        .prune_guard
        .admit(parent, observed.len() as u64, &doomed)
        == Admission::Hold
    {
        return Ok(Pruned::Held(doomed));
    }
    let mut pruned = Vec::new();
    for position in positions {
        let (index, child) = &observed[position];
        let name = child.name_any();
        let cache = &ctx.caches.children[*index];
        let api = dynamic_api(
            &ctx.client,
            &cache.resource,
            child.metadata.namespace.as_deref(),
        );
        let params = DeleteParams {
            propagation_policy: Some(PropagationPolicy::Background),
            preconditions: Some(Preconditions {
                uid: child.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(&name, &params).await {
            Ok(_) => {
                let kind = &ctx.caches.allowed[*index].kind;
                ctx.metrics.children(kind, ChildOperation::Pruned, 1);
                pruned.push((kind.clone(), name));
            }
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(source) => {
                return Err(ReconcileError::Prune {
                    kind: ctx.caches.allowed[*index].kind.clone(),
                    name,
                    source,
                });
            }
        }
    }
    Ok(Pruned::Deleted(pruned))
}

/// Write the status of a successful reconcile: the plugin's status with `Reconciled=True`.
/// Returns the status as desired and whether it was written.
pub(crate) async fn write_status(
    parent: &DynamicObject,
    identity: &ParentIdentity,
    plugin_status: Option<crate::plugin::JsonObject>,
    outcome: &Outcome,
    ctx: &PolicyContext,
    own: &OwnWrites,
) -> Result<(Value, bool), ReconcileError> {
    let observed = parent.data.get("status");
    let desired = status::after_success(
        plugin_status,
        parent.metadata.generation,
        observed,
        outcome,
        &status::now(),
    );
    let version = parent.metadata.resource_version.clone();
    let written = apply_status(identity, &desired, observed, version, None, ctx).await?;
    let wrote = written.is_some();
    own.parent(written.flatten().as_deref());
    Ok((Value::Object(desired), wrote))
}

/// Write the status of a failed reconcile: `Reconciled=False`, and every other status field
/// this policy's field manager owns as the parent holds it now. The same writer as a success
/// (server-side apply under the policy's manager), so `status.conditions` has one owner
/// whatever the reconciles ended with.
///
/// An apply removes the fields its manager owned and left out, so the apply must carry what
/// the last success reported, or the failure would erase it; and it must carry nothing more,
/// or the manager would take fields other writers own. The cache knows neither the current
/// status for sure (it may lag a write) nor who owns what (it drops `managedFields`), so the
/// parent is read, and the apply is bound to the version read: a parent changed since is
/// refused, and the change brings another reconcile.
pub(crate) async fn write_failure_status(
    identity: &ParentIdentity,
    outcome: &Outcome,
    ctx: &PolicyContext,
) -> Result<bool, ReconcileError> {
    let api = dynamic_api(&ctx.client, &ctx.parent, identity.namespace.as_deref());
    let Some(live) = api
        .get_opt(&identity.name)
        .await
        .map_err(ReconcileError::Status)?
    else {
        return Ok(false);
    };
    if live.metadata.uid.as_deref() != Some(identity.uid.as_str()) {
        return Ok(false);
    }
    let observed = live.data.get("status");
    let mut desired = applied_status(&live.metadata, &ctx.field_manager, observed);
    let conditions =
        status::after_failure(live.metadata.generation, observed, outcome, &status::now());
    desired.insert("conditions".into(), Value::Array(conditions));
    let version = live.metadata.resource_version.clone();
    let written = apply_status(identity, &desired, observed, version.clone(), version, ctx).await?;
    Ok(written.is_some())
}

/// Write `desired` through the status subresource, unless it would not change `observed`.
/// Server-side apply with the policy's field manager: fields other writers own are left
/// alone. `version` is the parent's version the status was decided against (for the
/// pending-writes memory); `precondition`, when given, must still be the parent's version.
/// Returns `None` when nothing was written, else the parent's version after the write.
async fn apply_status(
    identity: &ParentIdentity,
    desired: &crate::plugin::JsonObject,
    observed: Option<&Value>,
    version: Option<String>,
    precondition: Option<String>,
    ctx: &PolicyContext,
) -> Result<Option<Option<String>>, ReconcileError> {
    if status::is_unchanged(desired, observed) {
        return Ok(None);
    }
    // The same status, written by an earlier reconcile that the cache has not shown yet
    // (this one started from the version that one was decided against).
    let version = version.unwrap_or_default();
    let pending_key = (identity.namespace.clone(), identity.name.clone());
    let fingerprint = status::fingerprint(desired);
    if ctx
        .outcomes
        .status_writes
        .written(&pending_key, &fingerprint, &version)
    {
        return Ok(None);
    }
    let mut body = json!({
        "apiVersion": identity.api_version,
        "kind": identity.kind,
        // The uid makes the write a precondition: a parent deleted (and perhaps re-created)
        // since this reconcile read it is refused, never re-created by the apply.
        "metadata": {"name": identity.name, "namespace": identity.namespace, "uid": identity.uid},
        "status": desired,
    });
    if let Some(precondition) = precondition {
        body["metadata"]["resourceVersion"] = json!(precondition);
    }
    let written = lean_writes::patch_status(
        &ctx.client,
        &ctx.parent,
        identity.namespace.as_deref(),
        &identity.name,
        &PatchParams::apply(&ctx.field_manager).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(ReconcileError::Status)?;
    ctx.outcomes
        .status_writes
        .updated(pending_key, &fingerprint, vec![version]);
    Ok(Some(written.into_resource_version()))
}

pub(crate) async fn add_finalizer(
    parent: &DynamicObject,
    identity: &ParentIdentity,
    finalizer: &str,
    ctx: &PolicyContext,
    own: &OwnWrites,
) -> Result<(), ReconcileError> {
    // The resourceVersion test turns a concurrent change into a conflict and a retry, rather
    // than a lost finalizer list.
    let ops = if parent.finalizers().is_empty() {
        json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": parent.metadata.resource_version},
            {"op": "add", "path": "/metadata/finalizers", "value": [finalizer]},
        ])
    } else {
        json!([
            {"op": "test", "path": "/metadata/resourceVersion", "value": parent.metadata.resource_version},
            {"op": "add", "path": "/metadata/finalizers/-", "value": finalizer},
        ])
    };
    own.parent(json_patch(identity, ops, ctx).await?.as_deref());
    Ok(())
}

pub(crate) async fn remove_finalizer(
    parent: &DynamicObject,
    identity: &ParentIdentity,
    finalizer: &str,
    ctx: &PolicyContext,
) -> Result<(), ReconcileError> {
    let Some(index) = parent.finalizers().iter().position(|f| f == finalizer) else {
        return Ok(());
    };
    let path = format!("/metadata/finalizers/{index}");
    let ops = json!([
        {"op": "test", "path": path, "value": finalizer},
        {"op": "remove", "path": path},
    ]);
    match json_patch(identity, ops, ctx).await {
        Err(ReconcileError::Finalizer(kube::Error::Api(status))) if status.code == 404 => Ok(()),
        other => other.map(drop),
    }
}

/// Returns the parent's version after the patch.
pub(crate) async fn json_patch(
    identity: &ParentIdentity,
    ops: Value,
    ctx: &PolicyContext,
) -> Result<Option<String>, ReconcileError> {
    // Every finalizer patch first tests the uid: it applies to the parent this reconcile
    // read, never to a same-named successor.
    let mut ops = ops;
    if let Some(list) = ops.as_array_mut() {
        list.insert(
            0,
            json!({"op": "test", "path": "/metadata/uid", "value": identity.uid}),
        );
    }
    let patch: json_patch::Patch = serde_json::from_value(ops)
        .map_err(|e| ReconcileError::Finalizer(kube::Error::SerdeError(e)))?;
    let patched = lean_writes::patch(
        &ctx.client,
        &ctx.parent,
        identity.namespace.as_deref(),
        &identity.name,
        &PatchParams::default(),
        &Patch::<()>::Json(patch),
    )
    .await
    .map_err(ReconcileError::Finalizer)?;
    Ok(patched.into_resource_version())
}

pub(crate) fn dynamic_api(
    client: &Client,
    resource: &ApiResource,
    namespace: Option<&str>,
) -> Api<DynamicObject> {
    match namespace {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, resource),
        None => Api::all_with(client.clone(), resource),
    }
}
