//! Letting go of parents. A policy that finalizes holds `wasmctrl.dev/<policy>` on each of
//! its parents; if the policy went away (or stopped finalizing, or moved to another parent
//! kind or namespace) and left those behind, the parents — and their namespaces — would stay
//! Terminating for ever. So a finalizing policy itself carries [`POLICY_FINALIZER`] and
//! records where its parents are ([`scopes`]); the host releases every parent in every
//! recorded scope before letting the policy go, and the parents of a scope the policy left
//! (or of every scope, once it stops finalizing) when its controller restarts.
//!
//! Released, not finalized: a parent of a scope the policy no longer manages loses the
//! finalizer without a last plugin call, as it does when the policy is deleted. The policy's
//! plugin now decides about other parents, and may not even understand the old ones; keeping
//! the old scope running until every old parent is gone would make an edit wait on deletions
//! nobody asked for. Whoever needs a last word on the old parents finalizes them before the
//! edit (delete them while the policy still names their kind).

use anyhow::Context as _;
use kube::api::{ListParams, Patch, PatchParams};
use kube::core::{DynamicObject, PartialObjectMeta};
use kube::{Api, Client, ResourceExt as _};
use serde_json::json;

use crate::controller::kinds::{self, ResolvedKind};
use crate::controller::labels::{
    POLICY_FINALIZER, POLICY_LABEL, TEARDOWN_FINALIZER, parent_finalizer, policy_label_value,
};
use crate::controller::policy_run::scopes;
use crate::policy::{FinalizedScope, KindRef, ReconcilePolicy};

/// How many parents one list request of [`release_parents`] asks for.
const RELEASE_PAGE: u32 = 500;

/// Remove `finalizer` from every parent of `parent` kind (in `namespace`, if the host is
/// restricted to one), except those in `except` (a namespace the policy still holds). Each
/// removal tests the parent's uid and the finalizer's position, so it never edits a
/// different object or a list that changed meanwhile (a conflict is an error, and the caller
/// tries again). Returns how many parents were released.
///
/// The parents are listed as metadata only (the finalizers are all it needs) and
/// [`RELEASE_PAGE`] at a time, so a kind with many large parents costs neither the API
/// server nor the host one response holding them all.
pub(crate) async fn release_parents(
    client: &Client,
    parent: &ResolvedKind,
    namespace: Option<&str>,
    except: Option<&str>,
    finalizer: &str,
) -> anyhow::Result<usize> {
    release_parents_paged(client, parent, (namespace, except), finalizer, RELEASE_PAGE).await
}

/// [`release_parents`], listing `page` parents at a time.
async fn release_parents_paged(
    client: &Client,
    parent: &ResolvedKind,
    (namespace, except): (Option<&str>, Option<&str>),
    finalizer: &str,
    page: u32,
) -> anyhow::Result<usize> {
    let api: Api<DynamicObject> = match namespace.filter(|_| parent.namespaced) {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, &*parent.resource),
        None => Api::all_with(client.clone(), &*parent.resource),
    };
    let mut released = 0;
    let mut params = ListParams::default().limit(page);
    loop {
        let listed = api
            .list_metadata(&params)
            .await
            .with_context(|| format!("listing {} to release finalizers", parent.resource.kind))?;
        for object in &listed.items {
            if except.is_some() && object.metadata.namespace.as_deref() == except {
                continue;
            }
            released += release_one(client, parent, object, finalizer).await?;
        }
        match listed.metadata.continue_.filter(|token| !token.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(released),
        }
    }
}

/// Remove `finalizer` from one listed parent, if it holds it: 1 if it was released.
async fn release_one(
    client: &Client,
    parent: &ResolvedKind,
    object: &PartialObjectMeta<DynamicObject>,
    finalizer: &str,
) -> anyhow::Result<usize> {
    let name = object.name_any();
    match remove_finalizer(client, &parent.resource, &object.metadata, finalizer).await {
        Ok(removed) => Ok(usize::from(removed)),
        Err(error) => Err(error).with_context(|| {
            format!(
                "removing finalizer {finalizer} from {} {name}",
                parent.resource.kind
            )
        }),
    }
}

/// Remove `finalizer` from the object of `resource` whose `metadata` was read, if it is
/// still that object (same uid) and still holds it where it was: true if it was removed,
/// false if it did not hold it or is gone.
pub(crate) async fn remove_finalizer(
    client: &Client,
    resource: &kube::core::ApiResource,
    metadata: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    finalizer: &str,
) -> Result<bool, kube::Error> {
    let finalizers = metadata.finalizers.as_deref().unwrap_or_default();
    let Some(index) = finalizers.iter().position(|f| f == finalizer) else {
        return Ok(false);
    };
    let name = metadata.name.as_deref().unwrap_or_default();
    let api: Api<DynamicObject> = match &metadata.namespace {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, resource),
        None => Api::all_with(client.clone(), resource),
    };
    let path = format!("/metadata/finalizers/{index}");
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/uid", "value": metadata.uid},
        {"op": "test", "path": path, "value": finalizer},
        {"op": "remove", "path": path},
    ]))
    .map_err(kube::Error::SerdeError)?;
    match api
        .patch_metadata(name, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
        Err(error) => Err(error),
    }
}

/// The JSON patch that adds `finalizer` to an object with `metadata` (`present`) or removes
/// it, bound to the resourceVersion read, so a concurrent change to the finalizer list is a
/// conflict, never a lost finalizer; `None` when the list is already so.
pub(crate) fn finalizer_patch(
    metadata: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    finalizer: &str,
    present: bool,
) -> Option<serde_json::Value> {
    let finalizers = metadata.finalizers.as_deref().unwrap_or_default();
    let index = finalizers.iter().position(|f| f == finalizer);
    let guard = json!({"op": "test", "path": "/metadata/resourceVersion", "value": metadata.resource_version});
    Some(match (present, index) {
        (true, Some(_)) | (false, None) => return None,
        (true, None) if finalizers.is_empty() => json!([
            guard,
            {"op": "add", "path": "/metadata/finalizers", "value": [finalizer]},
        ]),
        (true, None) => json!([
            guard,
            {"op": "add", "path": "/metadata/finalizers/-", "value": finalizer},
        ]),
        (false, Some(index)) => json!([
            guard,
            {"op": "remove", "path": format!("/metadata/finalizers/{index}")},
        ]),
    })
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
    set_finalizer_of_policy(client, name, uid, POLICY_FINALIZER, present).await
}

/// Add (`present`) or remove `finalizer` on policy `name` with `uid` (nothing if the policy
/// is gone or was re-created).
pub(crate) async fn set_finalizer_of_policy(
    client: &Client,
    name: &str,
    uid: Option<&str>,
    finalizer: &str,
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
    let Some(ops) = finalizer_patch(&policy.metadata, finalizer, present) else {
        return Ok(());
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

/// Release every parent of a policy that is being deleted (of its parent kind, and of every
/// scope it recorded; through `acting`, the client the policy acts through), then let the
/// policy go (as the host, through `host`). `namespace` is the host's own restriction, if
/// any; the policy's `spec.parent.namespace` narrows it.
///
/// `last` runs after the parents are released and before the policy goes: an error keeps
/// the policy (its conversion, which may have to outlive its controller).
pub(crate) async fn retire(
    host: &Client,
    acting: &Client,
    policy: &ReconcilePolicy,
    namespace: Option<&str>,
    last: impl Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    release_teardown(acting, policy, namespace).await?;
    let releases = policy.finalizers().iter().any(|f| f == POLICY_FINALIZER);
    if !releases {
        return last.await;
    }
    release_parents_of(host, acting, policy, namespace).await?;
    last.await?;
    let_go(host, policy).await
}

/// Remove [`TEARDOWN_FINALIZER`] from every child of the policy (labelled for it, of its
/// child kinds, through `acting`): with the policy gone, no host would let them go, and a
/// child held for ever would keep its parent's deletion (and its namespace's) from ending.
/// Their teardown order is given up with the policy. Returns how many were released.
pub(crate) async fn release_teardown(
    acting: &Client,
    policy: &ReconcilePolicy,
    namespace: Option<&str>,
) -> anyhow::Result<usize> {
    let name = policy.name_any();
    let selector = format!("{POLICY_LABEL}={}", policy_label_value(&name));
    let namespace = policy.spec.parent.namespace.as_deref().or(namespace);
    let mut released = 0;
    for kind in &policy.spec.children {
        let Some((resolved, children)) = labelled(
            acting,
            kind,
            namespace,
            &selector,
            &format!("children of policy {name}"),
        )
        .await?
        else {
            continue;
        };
        for child in &children {
            released += release_one(acting, &resolved, child, TEARDOWN_FINALIZER).await?;
        }
    }
    if released > 0 {
        tracing::info!(policy = %name, released, "policy deleted; its children's teardown order released");
    }
    Ok(released)
}

/// Remove [`POLICY_FINALIZER`] from `policy`.
async fn let_go(host: &Client, policy: &ReconcilePolicy) -> anyhow::Result<()> {
    set_policy_finalizer(
        host,
        &policy.name_any(),
        policy.metadata.uid.as_deref(),
        false,
    )
    .await
}

/// [`retire`], whether or not the policy holds [`POLICY_FINALIZER`]: an uninstall releases
/// what a policy's parents hold even after someone removed the policy's own finalizer.
pub(crate) async fn release_all(
    host: &Client,
    acting: &Client,
    policy: &ReconcilePolicy,
    namespace: Option<&str>,
) -> anyhow::Result<()> {
    release_teardown(acting, policy, namespace).await?;
    release_parents_of(host, acting, policy, namespace).await?;
    let_go(host, policy).await
}

/// The parents' part of [`release_all`].
async fn release_parents_of(
    host: &Client,
    acting: &Client,
    policy: &ReconcilePolicy,
    namespace: Option<&str>,
) -> anyhow::Result<()> {
    let name = policy.name_any();
    let uid = policy.metadata.uid.as_deref();
    // Read again: the controller may have recorded a scope since this version was seen.
    let Some(policy) = scopes::fresh_policy(host, &name, uid).await? else {
        return Ok(());
    };
    let finalizer = parent_finalizer(&policy_label_value(&name));
    let namespace = policy.spec.parent.namespace.as_deref().or(namespace);
    let mut released = 0;
    if let Some(parent) = resolve(acting, &policy.spec.parent.kind_ref()).await? {
        released += release_parents(acting, &parent, namespace, None, &finalizer).await?;
    }
    for scope in scopes::recorded(&policy) {
        released += release_scope(acting, &scope, None, &finalizer).await?;
    }
    tracing::info!(policy = %name, released, "policy deleted; its parents' finalizers released");
    Ok(())
}

/// The objects of `kind` that `selector` picks (in `namespace`, for a namespaced kind), as
/// metadata, with the kind resolved; `None` when the kind is not served (a kind that is
/// gone has no objects left). `what` names them in an error.
async fn labelled(
    client: &Client,
    kind: &KindRef,
    namespace: Option<&str>,
    selector: &str,
    what: &str,
) -> anyhow::Result<Option<(ResolvedKind, Vec<PartialObjectMeta<DynamicObject>>)>> {
    let Some(resolved) = resolve(client, kind).await? else {
        return Ok(None);
    };
    let api: Api<DynamicObject> = match namespace.filter(|_| resolved.namespaced) {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, &*resolved.resource),
        None => Api::all_with(client.clone(), &*resolved.resource),
    };
    let listed = api
        .list_metadata(&ListParams::default().labels(selector))
        .await
        .with_context(|| format!("listing the {} {} {what}", kind.api_version, kind.kind))?;
    Ok(Some((resolved, listed.items)))
}

/// A kind resolved, or `None` if it is not served: a kind that is gone has no parents left
/// holding anything.
async fn resolve(client: &Client, kind: &KindRef) -> anyhow::Result<Option<ResolvedKind>> {
    match kinds::resolve(client, kind).await {
        Ok(resolved) => Ok(Some(resolved)),
        Err(kinds::KindError::NotFound { .. }) => Ok(None),
        Err(error) => Err(error.into()),
    }
}

/// Remove `finalizer` from the parents of a recorded `scope`, but not from those in `except`.
async fn release_scope(
    client: &Client,
    scope: &FinalizedScope,
    except: Option<&str>,
    finalizer: &str,
) -> anyhow::Result<usize> {
    let kind = KindRef {
        api_version: scope.api_version.clone(),
        kind: scope.kind.clone(),
    };
    let parent = match resolve(client, &kind).await? {
        Some(parent) => Some(parent),
        None => in_another_version(client, scope).await?,
    };
    match parent {
        Some(parent) => {
            release_parents(
                client,
                &parent,
                scope.namespace.as_deref(),
                except,
                finalizer,
            )
            .await
        }
        None => Ok(0),
    }
}

/// The scope's kind in the version its group prefers now, when the recorded version is no
/// longer served (its objects are, under another version); `None` when the kind is gone.
async fn in_another_version(
    client: &Client,
    scope: &FinalizedScope,
) -> anyhow::Result<Option<ResolvedKind>> {
    let group = scope
        .api_version
        .split_once('/')
        .map_or("", |(group, _)| group);
    let served = match kube::discovery::group(client, group).await {
        Ok(served) => served,
        Err(kube::Error::Discovery(_)) => return Ok(None),
        Err(kube::Error::Api(status)) if status.code == 404 => return Ok(None),
        Err(error) => {
            return Err(error).with_context(|| format!("discovering API group {group:?}"));
        }
    };
    Ok(served
        .recommended_kind(&scope.kind)
        .map(|(resource, capabilities)| ResolvedKind {
            resource: std::sync::Arc::new(resource),
            namespaced: capabilities.scope == kube::discovery::Scope::Namespaced,
        }))
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
        let Some((_, children)) =
            labelled(client, kind, namespace, &selector, "children left behind").await?
        else {
            continue;
        };
        let count = children.len();
        if count > 0 {
            found.push((kind.clone(), count));
        }
    }
    Ok(found)
}

/// Bring the finalizers in line with the policy. A finalizing policy records the scope it
/// finalizes in and carries [`POLICY_FINALIZER`] (both written as the host, through `host`)
/// — then says `ready`: from there on its parents may get a finalizer — and releases the
/// parents of the scopes it left (through `acting`, the client the policy acts through); one
/// that stopped finalizing releases every scope, then drops its own finalizer.
pub(crate) async fn sync_finalizers(
    host: &Client,
    acting: &Client,
    policy: &ReconcilePolicy,
    (parent, namespace): (&ResolvedKind, Option<&str>),
    ready: &tokio::sync::watch::Sender<bool>,
) -> anyhow::Result<()> {
    let name = policy.name_any();
    let uid = policy.metadata.uid.as_deref();
    let Some(fresh) = scopes::fresh_policy(host, &name, uid).await? else {
        return Ok(());
    };
    let mut recorded = scopes::recorded(&fresh);
    let current = scopes::of(parent, namespace);
    let finalizer = parent_finalizer(&policy_label_value(&name));
    if policy.spec.finalize {
        if !recorded.contains(&current) {
            recorded.push(current.clone());
            scopes::record(host, &name, uid, &recorded).await?;
        }
        set_policy_finalizer(host, &name, uid, true).await?;
        // A scope left behind that cannot be released yet must not hold up the new one.
        ready.send_replace(true);
        for scope in recorded.iter().filter(|s| !scopes::covers(&current, s)) {
            let except = scopes::still_held(scope, &current);
            let released = release_scope(acting, scope, except.as_deref(), &finalizer).await?;
            tracing::info!(policy = %name, api_version = %scope.api_version, kind = %scope.kind, namespace = ?scope.namespace, released, "the policy no longer finalizes these parents; released");
        }
        return scopes::record(host, &name, uid, std::slice::from_ref(&current)).await;
    }
    let holds = fresh.finalizers().iter().any(|f| f == POLICY_FINALIZER);
    if !holds && recorded.is_empty() {
        return Ok(());
    }
    // The running scope first: parents may hold the finalizer from before scopes were
    // recorded.
    let mut released = release_parents(acting, parent, namespace, None, &finalizer).await?;
    for scope in recorded.iter().filter(|s| !scopes::covers(&current, s)) {
        released += release_scope(acting, scope, None, &finalizer).await?;
    }
    tracing::info!(policy = %name, released, "policy no longer finalizes; parents released");
    scopes::record(host, &name, uid, &[]).await?;
    set_policy_finalizer(host, &name, uid, false).await
}

/// On a sharded replica that does not hold shard 0 (whose holder runs [`sync_finalizers`]):
/// wait until the policy's status records the running scope and the policy holds its own
/// finalizer, so that a parent's finalizer added here is one the holder of shard 0 will
/// release, then say `ready`. Reads the policy every 2 s until then; returns at once for a
/// policy that does not finalize.
pub(crate) async fn wait_for_recorded_scope(
    host: &Client,
    policy: &ReconcilePolicy,
    (parent, namespace): (&ResolvedKind, Option<&str>),
    ready: &tokio::sync::watch::Sender<bool>,
) {
    if !policy.spec.finalize {
        return;
    }
    let name = policy.name_any();
    let uid = policy.metadata.uid.as_deref();
    let current = scopes::of(parent, namespace);
    loop {
        match scopes::fresh_policy(host, &name, uid).await {
            Ok(Some(fresh))
                if fresh.finalizers().iter().any(|f| f == POLICY_FINALIZER)
                    && scopes::recorded(&fresh).contains(&current) =>
            {
                ready.send_replace(true);
                return;
            }
            Ok(_) => {}
            Err(error) => {
                tracing::debug!(policy = %name, error = %format!("{error:#}"), "could not read whether the policy's scope is recorded; trying again");
            }
        }
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    }
}

/// For a finalizing policy that cannot start (its new kind not served yet, its plugin not
/// loaded, its kind taken): release the parents of every recorded scope it has certainly
/// left, so that an edit that does not start yet strands nothing meanwhile. What only
/// discovery can tell apart waits for the controller's [`sync_finalizers`].
pub(crate) async fn release_left_scopes(
    host: &Client,
    acting: &Client,
    policy: &ReconcilePolicy,
    host_namespace: Option<&str>,
) -> anyhow::Result<()> {
    let name = policy.name_any();
    let uid = policy.metadata.uid.as_deref();
    let Some(fresh) = scopes::fresh_policy(host, &name, uid).await? else {
        return Ok(());
    };
    let named = scopes::named(policy, host_namespace);
    let (left, kept): (Vec<_>, Vec<_>) = scopes::recorded(&fresh)
        .into_iter()
        .partition(|s| !policy.spec.finalize || scopes::certainly_left(&named, s));
    if left.is_empty() {
        return Ok(());
    }
    let finalizer = parent_finalizer(&policy_label_value(&name));
    for scope in &left {
        let released = release_scope(acting, scope, None, &finalizer).await?;
        tracing::info!(policy = %name, api_version = %scope.api_version, kind = %scope.kind, namespace = ?scope.namespace, released, "the policy no longer finalizes these parents; released");
    }
    scopes::record(host, &name, uid, &kept).await
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::PostParams;
    use kube::core::ApiResource;

    use super::*;

    /// Against the real API server, ConfigMaps standing in for parents: four of ours hold
    /// the finalizer, one of them in a namespace the policy keeps, and every ConfigMap of
    /// the cluster is listed two at a time. Stopping after the first page would miss them.
    #[tokio::test]
    async fn parents_are_released_over_every_page_of_a_metadata_list() -> anyhow::Result<()> {
        const FINALIZER: &str = "wasmctrl.dev/release-paged";
        const OTHER: &str = "example.com/other";
        let env = wasmctrl_testenv::TestEnv::get();
        let (client, ns) = env.namespace("release-paged").await?;
        let (_, kept) = env.namespace("release-paged-kept").await?;
        let maps = |ns: &str| Api::<ConfigMap>::namespaced(client.clone(), ns);
        let parents = [
            (&ns, "p0", vec![FINALIZER]),
            (&ns, "p1", vec![OTHER, FINALIZER]),
            (&ns, "p2", vec![OTHER]),
            (&kept, "p3", vec![FINALIZER]),
            (&ns, "p4", vec![FINALIZER]),
        ];
        for (namespace, name, finalizers) in &parents {
            let map: ConfigMap = serde_json::from_value(
                json!({"metadata": {"name": name, "finalizers": finalizers}}),
            )?;
            maps(namespace).create(&PostParams::default(), &map).await?;
        }
        let kind = ResolvedKind {
            resource: Arc::new(ApiResource::erase::<ConfigMap>(&())),
            namespaced: true,
        };

        let released =
            release_parents_paged(&client, &kind, (None, Some(&kept)), FINALIZER, 2).await?;

        assert_eq!(released, 3);
        for (namespace, name, finalizers) in &parents {
            let now = maps(namespace).get(name).await?.finalizers().to_vec();
            let expected: Vec<&str> = if *namespace == &kept {
                finalizers.clone()
            } else {
                finalizers
                    .iter()
                    .copied()
                    .filter(|f| *f != FINALIZER)
                    .collect()
            };
            assert_eq!(now, expected, "{namespace}/{name}");
            // Let the namespaces go when the cluster is cleaned.
            maps(namespace)
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                )
                .await?;
        }
        Ok(())
    }
}
