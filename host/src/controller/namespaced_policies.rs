//! NamespacedReconcilePolicies become ReconcilePolicies (see [`crate::policy::namespaced`]).
//!
//! For each NamespacedReconcilePolicy `<name>` in `<namespace>`, the host applies a
//! ReconcilePolicy `<namespace>.<name>` with the same spec, confined to the namespace and
//! acting as one of its accounts, and marked with the source's uid. Which host does it is
//! the admin's decision, never the team's: a host with a `--policy-selector` takes the team
//! policies of the namespaces whose labels match it, and labels the ReconcilePolicy as the
//! namespace is (so its own selector runs it); the labels a team sets on its policy are not
//! copied. When a namespace's labels change, its policies follow: a host whose selector no
//! longer matches relabels what it made, and the host that matches now takes it. The ReconcilePolicy's
//! status is copied back, so the team sees its policy's state where it made it. A
//! finalizer on the source lets the ReconcilePolicy — and the parents it releases — go first
//! when the source is deleted. Only the leader writes.
//!
//! A ReconcilePolicy whose source is gone without it (its finalizer removed by hand, or
//! while no host ran) or was made anew under the same name is collected: by the leader's
//! sweep, and at once when the new source comes, instead of the name counting as taken. A
//! cluster-scoped object cannot have a namespaced owner, so garbage collection cannot do it.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, Preconditions};
use kube::core::ApiResource;
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Client, ResourceExt as _};
use serde_json::{Value, json};

use crate::controller::policy_run::release;
use crate::controller::reconcile::prune_guard::CONFIRM_ANNOTATION;
use crate::leader::Leadership;
use crate::policy::namespaced::{self, Refusal};
use crate::policy::placement::PolicySelector;
use crate::policy::{ReconcilePolicy, ReconcilePolicySpec};

/// On each NamespacedReconcilePolicy: its ReconcilePolicy goes before it does.
pub const FINALIZER: &str = "wasmctrl.dev/namespaced-policy";
/// On each ReconcilePolicy made from one: the source's uid.
pub const SOURCE_UID_LABEL: &str = "wasmctrl.dev/namespaced-policy-uid";
pub use crate::policy::namespaced::SOURCE_ANNOTATION;
const FIELD_MANAGER: &str = "wasmctrl-namespaced-policies";
/// How often the leader looks for ReconcilePolicies whose source is gone.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

struct Context {
    client: Client,
    resource: ApiResource,
    leadership: Arc<Leadership>,
    bounds: namespaced::TeamBounds,
    /// With a `--policy-selector`: which namespaces' team policies are this host's.
    placement: Option<Placement>,
}

/// The host's selector, and every namespace's labels to match it against.
struct Placement {
    selector: PolicySelector,
    namespaces: Store<PartialObjectMeta<Namespace>>,
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("{0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Serde(#[from] serde_json::Error),
    #[error("NamespacedReconcilePolicy {0} has no namespace")]
    NoNamespace(String),
    #[error(
        "the namespaces' labels, which place team policies, could not be listed (the host needs get, list and watch on namespaces)"
    )]
    NamespacesUnknown,
}

/// How long a reconcile waits for the first list of namespaces before it fails (and is
/// retried after [`NAMESPACES_RETRY`]), so a host that may not list them says so instead of
/// waiting in silence. Short, because a reconcile in flight holds back the next one of the
/// same policy: a deletion, which needs no labels, must not wait behind it.
const NAMESPACES_READY: Duration = Duration::from_secs(1);
const NAMESPACES_RETRY: Duration = Duration::from_secs(2);

/// Run until `stop`: turn every NamespacedReconcilePolicy the host watches (in `namespace`,
/// or all; in a namespace whose labels match `selector`, if any) into its ReconcilePolicy.
pub(crate) async fn run(
    client: Client,
    leadership: Arc<Leadership>,
    scope: (Option<String>, Option<PolicySelector>),
    bounds: namespaced::TeamBounds,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let (namespace, selector) = scope;
    let resource = namespaced::api_resource();
    let sources: Api<DynamicObject> = match &namespace {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    let made = watcher::Config::default().labels(SOURCE_UID_LABEL);
    let mapped = resource.clone();
    // Each watch backs off on its own and the merged stream does not (see `watch_backoff`):
    // a watch refused at start (its RBAC binding not yet seen by the API server's
    // authorizer) must not stall the others for kube-runtime's 30 s and more.
    let writer = reflector::store::Writer::new(resource.clone());
    let reader = writer.as_reader();
    let controller = Controller::for_stream_with(
        reflector::reflector(
            writer,
            crate::watch_lists::watcher(sources, watcher::Config::default())
                .backoff(crate::watch_backoff::WatchBackoff::default()),
        )
        .applied_objects(),
        reader,
        resource.clone(),
    )
    .trigger_backoff(crate::watch_backoff::NoExtraDelay);
    // Namespaces' labels place team policies; a change of them re-runs the namespace's.
    let (placement, namespace_changes) = match selector.clone() {
        Some(selector) => {
            let (store, writer) = reflector::store();
            let namespaces = Api::<PartialObjectMeta<Namespace>>::all(client.clone());
            let changes = reflector::reflector(
                writer,
                crate::watch_lists::watcher(namespaces, watcher::Config::default())
                    .backoff(crate::watch_backoff::WatchBackoff::default()),
            )
            .touched_objects();
            (
                Some(Placement {
                    selector,
                    namespaces: store,
                }),
                Some(changes),
            )
        }
        None => (None, None),
    };
    let ctx = Arc::new(Context {
        client: client.clone(),
        resource: resource.clone(),
        leadership,
        bounds,
        placement,
    });
    let sweeper = sweep_while_leading(
        ctx.clone(),
        namespace,
        selector.map(|s| s.as_str().to_owned()),
    );
    let mut controller = controller;
    if let Some(changes) = namespace_changes {
        let sources = controller.store();
        let resource = resource.clone();
        controller =
            controller.watches_stream(changes, move |changed: PartialObjectMeta<Namespace>| {
                let name = changed.name_any();
                sources
                    .state()
                    .into_iter()
                    .filter(|source| source.namespace().as_deref() == Some(name.as_str()))
                    .map(|source| ObjectRef::from_obj_with(source.as_ref(), resource.clone()))
                    .collect::<Vec<_>>()
            });
    }
    let controller = controller
        .watches_stream(
            crate::watch_lists::watcher(Api::<ReconcilePolicy>::all(client), made)
                .backoff(crate::watch_backoff::WatchBackoff::default())
                .touched_objects(),
            move |policy: ReconcilePolicy| {
                namespaced::source(&policy).map(|(namespace, name)| {
                    ObjectRef::new_with(name, mapped.clone()).within(namespace)
                })
            },
        )
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "namespaced policy");
            }
        });
    // Stopped at once, not drained: each write is whole and repeated on the next start, and a
    // watch that cannot list (a host without rights to the kind) must not hold a shutdown.
    tokio::select! {
        () = controller => {}
        () = sweeper => {}
        () = stop => {}
    }
}

/// Sweep for orphans as soon as this host leads, then every [`SWEEP_EVERY`]; never returns.
async fn sweep_while_leading(
    ctx: Arc<Context>,
    namespace: Option<String>,
    selector: Option<String>,
) {
    loop {
        if !ctx.leadership.is_leader() {
            tokio::time::sleep(Duration::from_secs(2)).await;
            continue;
        }
        match sweep(&ctx, namespace.as_deref(), selector.as_deref()).await {
            Ok(0) => {}
            Ok(collected) => tracing::info!(
                collected,
                "collected ReconcilePolicies whose NamespacedReconcilePolicy is gone"
            ),
            Err(error) => {
                tracing::warn!(%error, "could not look for ReconcilePolicies whose NamespacedReconcilePolicy is gone")
            }
        }
        tokio::time::sleep(SWEEP_EVERY).await;
    }
}

/// Whether a ReconcilePolicy made from the source of uid `made_from` has lost it: no source
/// of that name is there (`live` is `None`), or one made anew with another uid.
fn orphaned(made_from: &str, live: Option<&str>) -> bool {
    live != Some(made_from)
}

/// Whether source `name`, as the API server has it now, is not the one of uid `made_from`.
async fn source_gone(
    sources: &Api<DynamicObject>,
    name: &str,
    made_from: &str,
) -> Result<bool, kube::Error> {
    let live = sources.get_opt(name).await?;
    let live_uid = live
        .as_ref()
        .and_then(|source| source.metadata.uid.as_deref());
    Ok(orphaned(made_from, live_uid))
}

/// Delete every made ReconcilePolicy this host is responsible for (its namespace and
/// selector) whose source is gone; how many. A source the host cannot read is left alone.
async fn sweep(
    ctx: &Context,
    namespace: Option<&str>,
    selector: Option<&str>,
) -> Result<usize, Error> {
    let policies: Api<ReconcilePolicy> = Api::all(ctx.client.clone());
    let labels = match selector {
        Some(selector) => format!("{SOURCE_UID_LABEL},{selector}"),
        None => SOURCE_UID_LABEL.to_owned(),
    };
    // A 404 must mean "no such source", never "no such kind": a host whose CRD version is
    // no longer served must not take every team's policy for an orphan.
    let all_sources: Api<DynamicObject> = match namespace {
        Some(namespace) => Api::namespaced_with(ctx.client.clone(), namespace, &ctx.resource),
        None => Api::all_with(ctx.client.clone(), &ctx.resource),
    };
    all_sources
        .list_metadata(&ListParams::default().limit(1))
        .await?;
    let mut collected = 0;
    for made in policies
        .list(&ListParams::default().labels(&labels))
        .await?
    {
        let (Some((source_namespace, source_name)), Some(made_from)) = (
            namespaced::source(&made),
            made.labels().get(SOURCE_UID_LABEL),
        ) else {
            continue;
        };
        if made.metadata.deletion_timestamp.is_some()
            || made.name_any() != namespaced::cluster_name(source_namespace, source_name)
            || namespace.is_some_and(|watched| watched != source_namespace)
            || !ctx.leadership.is_leader()
        {
            continue;
        }
        let sources: Api<DynamicObject> =
            Api::namespaced_with(ctx.client.clone(), source_namespace, &ctx.resource);
        let gone = match source_gone(&sources, source_name, made_from).await {
            Ok(gone) => gone,
            Err(error) => {
                tracing::debug!(%error, policy = %made.name_any(), "cannot read the NamespacedReconcilePolicy it was made from; leaving it");
                continue;
            }
        };
        if gone {
            tracing::info!(policy = %made.name_any(), source = %format!("{source_namespace}/{source_name}"), "the NamespacedReconcilePolicy this ReconcilePolicy was made from is gone; deleting it");
            match delete_made(&policies, &made).await {
                Ok(()) => collected += 1,
                // One that cannot be deleted does not keep the others.
                Err(error) => {
                    tracing::warn!(%error, policy = %made.name_any(), "could not delete it");
                }
            }
        }
    }
    Ok(collected)
}

/// Delete `made`, and no other object that took its name meanwhile. Its own finalizer
/// releases its parents first.
async fn delete_made(policies: &Api<ReconcilePolicy>, made: &ReconcilePolicy) -> Result<(), Error> {
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: made.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match policies.delete(&made.name_any(), &params).await {
        Ok(_) => Ok(()),
        // Gone already, or another object under that name now.
        Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(()),
        Err(error) => Err(error.into()),
    }
}

fn error_policy(source: Arc<DynamicObject>, error: &Error, _: Arc<Context>) -> Action {
    tracing::warn!(namespace = ?source.namespace(), name = %source.name_any(), error = %error, "could not run a NamespacedReconcilePolicy");
    match error {
        Error::NamespacesUnknown => Action::requeue(NAMESPACES_RETRY),
        _ => Action::requeue(Duration::from_secs(5)),
    }
}

async fn reconcile(source: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    if !ctx.leadership.is_leader() {
        // A takeover re-lists; until then a standby writes nothing.
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    let name = source.name_any();
    let namespace = source
        .namespace()
        .ok_or_else(|| Error::NoNamespace(name.clone()))?;
    let uid = source.metadata.uid.clone().unwrap_or_default();
    let policies: Api<ReconcilePolicy> = Api::all(ctx.client.clone());
    let made_name = namespaced::cluster_name(&namespace, &name);
    let made = policies.get_opt(&made_name).await?;
    let ours = made
        .as_ref()
        .is_some_and(|p| p.labels().get(SOURCE_UID_LABEL) == Some(&uid));
    let sources: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &namespace, &ctx.resource);

    // A deletion is seen through by any host, placed or not: what it does is the same
    // whoever does it, and a namespace no host's selector matches must not hang on it.
    if source.metadata.deletion_timestamp.is_some() {
        if ours && let Some(made) = &made {
            // Its own finalizer releases its parents first; wait for it to be gone.
            if made.metadata.deletion_timestamp.is_none() {
                policies.delete(&made_name, &Default::default()).await?;
            }
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        set_finalizer(&sources, &source, false).await?;
        return Ok(Action::await_change());
    }
    let Some(placed) = placement(&ctx, &namespace, made.as_ref(), ours).await? else {
        // Another host's (or no host's, until an admin labels the namespace for one).
        return Ok(Action::await_change());
    };
    set_finalizer(&sources, &source, true).await?;
    // Made from an earlier source of this name, whose finalizer did not hold it: that
    // policy goes (releasing its parents), then this one is made.
    if let Some(made) = &made
        && !ours
        && let Some(made_from) = made.labels().get(SOURCE_UID_LABEL)
        && namespaced::source(made) == Some((namespace.as_str(), name.as_str()))
    {
        // The source from the cache may be older than the policy just read: only the source
        // as the API server has it now decides that the policy is an orphan.
        if made.metadata.deletion_timestamp.is_none()
            && source_gone(&sources, &name, made_from).await?
        {
            tracing::info!(policy = %made_name, "replacing the ReconcilePolicy made from an earlier NamespacedReconcilePolicy of this name");
            delete_made(&policies, made).await?;
        }
        return Ok(Action::requeue(Duration::from_secs(5)));
    }

    let confined = serde_json::from_value::<ReconcilePolicySpec>(source.data["spec"].clone())
        .map_err(|error| Refusal {
            reason: "InvalidSpec",
            message: format!("spec: {error}"),
        })
        .and_then(|spec| namespaced::confine(&namespace, spec, &ctx.bounds));
    let spec = match confined {
        Ok(spec) if made.is_none() || ours => spec,
        Ok(_) => {
            let refusal = Refusal {
                reason: "NameTaken",
                message: format!(
                    "a ReconcilePolicy {made_name} that was not made from this one exists; rename this policy"
                ),
            };
            refuse(&sources, &source, &refusal).await?;
            return Ok(Action::await_change());
        }
        Err(refusal) => {
            refuse(&sources, &source, &refusal).await?;
            return Ok(Action::await_change());
        }
    };
    // The team answers its own prune guard's holds and retries its own rollouts: those
    // annotations go with the policy.
    let mut annotations = serde_json::Map::new();
    annotations.insert(
        SOURCE_ANNOTATION.to_owned(),
        json!(format!("{namespace}/{name}")),
    );
    for carried in [CONFIRM_ANNOTATION, crate::policy::RETRY_ROLLOUT_ANNOTATION] {
        if let Some(value) = source.annotations().get(carried) {
            annotations.insert(carried.to_owned(), json!(value));
        }
    }
    // The namespace's labels, which the admin sets, never the team's own.
    let mut labels = placed;
    labels.insert(SOURCE_UID_LABEL.to_owned(), uid);
    let policy = json!({
        "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
        "metadata": {
            "name": made_name,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": spec,
    });
    let applied = policies
        .patch(
            &made_name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&policy),
        )
        .await?;
    mirror_status(&sources, &source, &applied).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// The labels the ReconcilePolicy made from a team policy in `namespace` gets, if this host
/// is the one to make it: every host without a selector; a host with one when the
/// namespace's labels match it — or when they no longer do but the policy it made (`made`,
/// `ours`) still carries labels that do, so that relabelling moves it to the host that
/// matches now.
async fn placement(
    ctx: &Context,
    namespace: &str,
    made: Option<&ReconcilePolicy>,
    ours: bool,
) -> Result<Option<BTreeMap<String, String>>, Error> {
    let Some(placement) = &ctx.placement else {
        return Ok(Some(BTreeMap::new()));
    };
    // Before the namespaces are listed, every namespace would look unlabelled.
    match tokio::time::timeout(NAMESPACES_READY, placement.namespaces.wait_until_ready()).await {
        Ok(Ok(())) => {}
        _ => return Err(Error::NamespacesUnknown),
    }
    let labels = placement
        .namespaces
        .get(&ObjectRef::new(namespace))
        .map(|n| n.labels().clone())
        .unwrap_or_default();
    if placement.selector.matches(&labels) {
        return Ok(Some(labels));
    }
    let stale = made.filter(|_| ours).is_some_and(|made| {
        let mut carried = made.labels().clone();
        carried.remove(SOURCE_UID_LABEL);
        carried != labels && placement.selector.matches(&carried)
    });
    Ok(stale.then_some(labels))
}

/// Add or remove [`FINALIZER`] on `source`, bound to the resourceVersion read.
async fn set_finalizer(
    sources: &Api<DynamicObject>,
    source: &DynamicObject,
    present: bool,
) -> Result<(), Error> {
    let Some(ops) = release::finalizer_patch(&source.metadata, FINALIZER, present) else {
        return Ok(());
    };
    let patch: json_patch::Patch = serde_json::from_value(ops)?;
    let patched = sources
        .patch(
            &source.name_any(),
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await;
    gone_is_done(patched)
}

/// Say on `source` why it does not run.
async fn refuse(
    sources: &Api<DynamicObject>,
    source: &DynamicObject,
    refusal: &Refusal,
) -> Result<(), Error> {
    tracing::info!(namespace = ?source.namespace(), name = %source.name_any(), reason = refusal.reason, message = %refusal.message, "NamespacedReconcilePolicy refused");
    let condition = json!({
        "type": "Ready", "status": "False", "reason": refusal.reason, "message": refusal.message,
        "observedGeneration": source.metadata.generation,
        "lastTransitionTime": crate::controller::reconcile::status::now(),
    });
    write_status(
        sources,
        source,
        json!({"observedGeneration": source.metadata.generation, "conditions": [condition]}),
    )
    .await
}

/// Copy the ReconcilePolicy's status to its source. The generation it observed is the
/// source's when the ReconcilePolicy has acted on the spec last applied.
async fn mirror_status(
    sources: &Api<DynamicObject>,
    source: &DynamicObject,
    made: &ReconcilePolicy,
) -> Result<(), Error> {
    let Some(status) = &made.status else {
        return Ok(());
    };
    let mut status = serde_json::to_value(status)?;
    let current = status["observedGeneration"].as_i64() == made.metadata.generation;
    let generation = source.metadata.generation.filter(|_| current);
    let observed = |object: &mut Value| {
        if let Some(object) = object.as_object_mut() {
            match generation {
                Some(generation) => object.insert("observedGeneration".into(), json!(generation)),
                None => object.remove("observedGeneration"),
            };
        }
    };
    if let Some(conditions) = status["conditions"].as_array_mut() {
        conditions.iter_mut().for_each(observed);
    }
    observed(&mut status);
    write_status(sources, source, status).await
}

/// Replace `source`'s status when it differs.
async fn write_status(
    sources: &Api<DynamicObject>,
    source: &DynamicObject,
    status: Value,
) -> Result<(), Error> {
    if source.data.get("status") == Some(&status) {
        return Ok(());
    }
    // The whole status, so nothing the ReconcilePolicy dropped lingers here.
    let patch: json_patch::Patch =
        serde_json::from_value(json!([{"op": "add", "path": "/status", "value": status}]))?;
    let patched = sources
        .patch_status(
            &source.name_any(),
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await;
    gone_is_done(patched)
}

/// A write to a source deleted meanwhile has nothing left to do.
fn gone_is_done(result: Result<DynamicObject, kube::Error>) -> Result<(), Error> {
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(error) => Err(error.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::orphaned;

    #[test]
    fn a_made_policy_is_orphaned_when_its_source_is_gone_or_made_anew() {
        assert!(orphaned("uid-1", None), "no source of that name");
        assert!(
            orphaned("uid-1", Some("uid-2")),
            "a new source under the name"
        );
        assert!(!orphaned("uid-1", Some("uid-1")), "its own source");
    }
}
