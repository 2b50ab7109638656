//! One reconcile of one parent, step by step as DESIGN.md lays it out: finalizer, observed
//! children, the plugin call, validation, apply, prune, status, events, requeue.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions, PropagationPolicy};
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource as _, ResourceExt as _};
use serde_json::{Value, json};

use arc_swap::ArcSwap;

use super::backoff::{Backoff, Retry};
use super::children::{self, AllowedKind, DesiredChild, InvalidChild, ParentIdentity};
use super::events::EventSink;
use super::status::{self, Outcome};
use crate::plugin::{
    EventType as PluginEventType, ObservedObject, Plugin, PluginError, ReconcileRequest, Verdict,
    compare,
};

/// A child kind as one policy's reconciles see it: the cache of the children it already has.
/// Its index is its index in [`PolicyContext::allowed`].
pub(crate) struct ChildCache {
    pub resource: ApiResource,
    pub store: Store<DynamicObject>,
}

/// A related kind: a cache of the objects the plugin may read.
pub(crate) struct RelatedCache {
    pub store: Store<DynamicObject>,
}

/// Everything one policy's reconciles share.
pub(crate) struct PolicyContext {
    pub client: Client,
    pub policy: String,
    /// Value of the policy label stamped on children.
    pub policy_label: String,
    /// Server-side apply field manager for children and status.
    pub field_manager: String,
    /// The finalizer this policy holds on parents, when it asks for one.
    pub finalizer: Option<String>,
    pub parent: ApiResource,
    /// The child kinds the policy allows, in the order of `children`.
    pub allowed: Vec<AllowedKind>,
    pub children: Vec<ChildCache>,
    pub related: Vec<RelatedCache>,
    /// The plugin and config serving this policy. Each reconcile takes what is active when
    /// it starts; a swap affects only reconciles that start after it.
    pub active: ArcSwap<ActivePlugin>,
    /// The candidate plugin, if the policy names one.
    pub candidate: arc_swap::ArcSwapOption<Candidate>,
    /// The candidate's shadow verdict per parent, since it was loaded.
    pub shadow: Mutex<std::collections::HashMap<ObjectRef<DynamicObject>, Verdict>>,
    pub resync: Duration,
    pub backoff: Backoff<ObjectRef<DynamicObject>>,
    /// Parents whose last reconcile succeeded.
    pub reconciled: Mutex<HashSet<ObjectRef<DynamicObject>>>,
    pub events: EventSink,
    /// Becomes true once every child and related cache has listed its objects.
    pub caches_ready: tokio::sync::watch::Receiver<bool>,
}

/// The plugin serving a policy and the config it is called with, swapped as one.
pub(crate) struct ActivePlugin {
    pub plugin: Plugin,
    pub config: Option<String>,
}

/// A candidate plugin: serving the parents its canary selector matches, and evaluated in
/// shadow for all others.
pub(crate) struct Candidate {
    pub serving: ActivePlugin,
    pub canary: Option<kube::core::Selector>,
}

/// Annotation on each parent: the digest of the plugin that last reconciled it, so a user
/// can follow a rollout (`kubectl get myapps -o jsonpath=...`).
pub const PLUGIN_DIGEST_ANNOTATION: &str = "wasmctrl.dev/plugin-digest";

/// A failed reconcile and when to retry it.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub(crate) struct Failure {
    #[source]
    pub error: ReconcileError,
    pub retry: Retry,
}

/// What can fail in one reconcile. Each variant is one condition reason.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReconcileError {
    #[error("the parent has no {0}")]
    MalformedParent(&'static str),
    #[error("{0}")]
    Plugin(#[from] PluginError),
    #[error("the plugin's answer was refused, nothing was changed: {}", describe(.0))]
    InvalidChildren(Vec<InvalidChild>),
    #[error("applying {kind} {name}: {source}")]
    Apply {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("pruning {kind} {name}: {source}")]
    Prune {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the parent's status: {0}")]
    Status(#[source] kube::Error),
    #[error("updating the parent's finalizers: {0}")]
    Finalizer(#[source] kube::Error),
    #[error("recording the plugin digest on the parent: {0}")]
    Annotate(#[source] kube::Error),
    #[error("the caches are not ready")]
    CachesNotReady,
}

impl ReconcileError {
    /// The condition and Event reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::MalformedParent(_) => "MalformedParent",
            Self::Plugin(PluginError::Reported { .. }) => "PluginReportedError",
            Self::Plugin(_) => "PluginFailed",
            Self::InvalidChildren(_) => "InvalidChildren",
            Self::Apply { .. } => "ApplyFailed",
            Self::Prune { .. } => "PruneFailed",
            Self::Status(_) => "StatusWriteFailed",
            Self::Finalizer(_) => "FinalizerFailed",
            Self::Annotate(_) => "AnnotateFailed",
            Self::CachesNotReady => "CachesNotReady",
        }
    }
}

/// The first few refusals, joined; enough to act on without flooding a condition.
fn describe(problems: &[InvalidChild]) -> String {
    const SHOWN: usize = 3;
    let mut text = problems
        .iter()
        .take(SHOWN)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    if problems.len() > SHOWN {
        text.push_str(&format!("; and {} more", problems.len() - SHOWN));
    }
    text
}

/// The kube-runtime reconcile function: run one reconcile, keep the backoff history, and
/// report a failure on the parent.
pub(crate) async fn reconcile(
    parent: Arc<DynamicObject>,
    ctx: Arc<PolicyContext>,
) -> Result<Action, Failure> {
    let key = ObjectRef::from_obj_with(&*parent, ctx.parent.clone());
    let span = tracing::info_span!("reconcile", policy = %ctx.policy, parent = %key);
    let result = tracing::Instrument::instrument(reconcile_parent(&parent, &ctx), span).await;
    let record = |ok: bool| {
        let mut reconciled = lock(&ctx.reconciled);
        if ok {
            reconciled.insert(key.clone());
        } else {
            reconciled.remove(&key);
        }
    };
    match result {
        Ok(action) => {
            record(true);
            ctx.backoff.succeeded(&key);
            Ok(action)
        }
        Err(error) => {
            record(false);
            let retry = ctx.backoff.failed(&key);
            tracing::warn!(policy = %ctx.policy, parent = %key, attempt = retry.attempt, retry_in = ?retry.delay, error = %error, "reconcile failed");
            report_failure(&parent, &ctx, &error, retry).await;
            Err(Failure { error, retry })
        }
    }
}

/// The kube-runtime error policy: retry after the backoff the failure was given.
pub(crate) fn error_policy(
    _parent: Arc<DynamicObject>,
    failure: &Failure,
    _ctx: Arc<PolicyContext>,
) -> Action {
    Action::requeue(failure.retry.delay)
}

async fn reconcile_parent(
    parent: &DynamicObject,
    ctx: &PolicyContext,
) -> Result<Action, ReconcileError> {
    // Observed children must come from synced caches: an empty cache would look like
    // "nothing exists yet" and turn a converged parent into a round of writes.
    ctx.caches_ready
        .clone()
        .wait_for(|ready| *ready)
        .await
        .map_err(|_| ReconcileError::CachesNotReady)?;
    let identity = identity(parent, &ctx.parent)?;
    let deleting = parent.metadata.deletion_timestamp.is_some();
    let holds_finalizer = ctx
        .finalizer
        .as_ref()
        .is_some_and(|f| parent.finalizers().contains(f));
    if deleting {
        return if holds_finalizer {
            finalize(parent, &identity, ctx).await
        } else {
            // Owned children go with the parent through garbage collection.
            Ok(Action::await_change())
        };
    }
    if let (Some(finalizer), false) = (&ctx.finalizer, holds_finalizer) {
        add_finalizer(parent, &identity, finalizer, ctx).await?;
    }

    let active = ctx.active.load_full();
    let candidate = ctx.candidate.load_full();
    let canary = canary_for(candidate.as_deref(), parent);
    let serving = canary.map_or(&*active, |c| &c.serving);
    let observed = observed_children(&identity, ctx);
    let request = ReconcileRequest {
        parent: serde_json::to_string(parent).unwrap_or_default(),
        children: observed.iter().map(|(_, o)| observed_object(o)).collect(),
        related: related_objects(&identity, ctx),
        config: serving.config.clone(),
        finalizing: false,
    };
    let key = ObjectRef::from_obj_with(parent, ctx.parent.clone());
    let answer = match (&candidate, canary) {
        (Some(shadow), None) => {
            let shadow_request = ReconcileRequest {
                config: shadow.serving.config.clone(),
                ..request.clone()
            };
            let answer = serving.plugin.reconcile(request).await;
            let verdict = compare(
                &answer,
                &shadow.serving.plugin.reconcile(shadow_request).await,
            );
            lock(&ctx.shadow).insert(key, verdict);
            answer
        }
        _ => {
            lock(&ctx.shadow).remove(&key);
            serving.plugin.reconcile(request).await
        }
    };
    let response = answer?;

    let desired = children::prepare(
        response.children,
        &ctx.allowed,
        &identity,
        &ctx.policy_label,
    )
    .map_err(ReconcileError::InvalidChildren)?;

    let mut applied = 0;
    for child in &desired {
        if apply_child(child, ctx).await? {
            applied += 1;
        }
    }
    let pruned = prune(&observed, &desired, ctx).await?;
    if applied + pruned > 0 {
        tracing::info!(
            applied,
            pruned,
            unchanged = desired.len() - applied,
            "children reconciled"
        );
    }

    let outcome = Outcome {
        success: true,
        reason: "Reconciled".into(),
        message: format!(
            "{} children desired by plugin {}",
            desired.len(),
            serving.plugin.digest()
        ),
    };
    write_status(parent, &identity, response.status, &outcome, ctx).await?;
    record_plugin_digest(parent, &identity, serving.plugin.digest(), ctx).await?;
    publish_plugin_events(parent, ctx, response.events).await;
    Ok(Action::requeue(
        response.requeue_after.unwrap_or(ctx.resync),
    ))
}

fn identity(
    parent: &DynamicObject,
    resource: &ApiResource,
) -> Result<ParentIdentity, ReconcileError> {
    Ok(ParentIdentity {
        api_version: resource.api_version.clone(),
        kind: resource.kind.clone(),
        name: parent
            .metadata
            .name
            .clone()
            .ok_or(ReconcileError::MalformedParent("metadata.name"))?,
        namespace: parent.metadata.namespace.clone(),
        uid: parent
            .metadata
            .uid
            .clone()
            .ok_or(ReconcileError::MalformedParent("metadata.uid"))?,
    })
}

/// Children in the caches whose controller is this parent, with the index of their kind.
fn observed_children(
    parent: &ParentIdentity,
    ctx: &PolicyContext,
) -> Vec<(usize, Arc<DynamicObject>)> {
    let mut observed = Vec::new();
    for (index, cache) in ctx.children.iter().enumerate() {
        observed.extend(
            cache
                .store
                .state_filter(|child| {
                    child.metadata.namespace == parent.namespace
                        && child
                            .owner_references()
                            .iter()
                            .any(|owner| owner.controller == Some(true) && owner.uid == parent.uid)
                })
                .into_iter()
                .map(|child| (index, child)),
        );
    }
    observed
}

fn observed_object(object: &Arc<DynamicObject>) -> ObservedObject {
    let (api_version, kind) = object
        .types
        .as_ref()
        .map(|t| (t.api_version.clone(), t.kind.clone()))
        .unwrap_or_default();
    ObservedObject {
        api_version,
        kind,
        name: object.name_any(),
        json: serde_json::to_string(&**object).unwrap_or_default(),
    }
}

/// Related objects in the parent's namespace (the watches already applied the selector).
fn related_objects(parent: &ParentIdentity, ctx: &PolicyContext) -> Vec<ObservedObject> {
    ctx.related
        .iter()
        .flat_map(|cache| {
            cache
                .store
                .state_filter(|o| o.metadata.namespace == parent.namespace)
        })
        .map(|o| observed_object(&o))
        .collect()
}

/// Server-side apply one child unless the cache shows it already converged. Returns whether
/// it wrote.
async fn apply_child(child: &DesiredChild, ctx: &PolicyContext) -> Result<bool, ReconcileError> {
    let cache = &ctx.children[child.kind_index];
    let mut key = ObjectRef::new_with(&child.name, cache.resource.clone());
    if let Some(namespace) = &child.namespace {
        key = key.within(namespace);
    }
    if let Some(observed) = cache.store.get(&key)
        && let Ok(observed) = serde_json::to_value(&*observed)
    {
        if children::is_converged(child, &observed) {
            return Ok(false);
        }
        tracing::debug!(
            kind = %ctx.allowed[child.kind_index].kind,
            name = %child.name,
            differs_at = children::first_difference(&child.object, &observed).as_deref().unwrap_or(".metadata.annotations (hash)"),
            "child drifted from its desired state"
        );
    }
    let api = dynamic_api(&ctx.client, &cache.resource, child.namespace.as_deref());
    api.patch(
        &child.name,
        &PatchParams::apply(&ctx.field_manager).force(),
        &Patch::Apply(&child.object),
    )
    .await
    .map_err(|source| ReconcileError::Apply {
        kind: ctx.allowed[child.kind_index].kind.clone(),
        name: child.name.clone(),
        source,
    })?;
    Ok(true)
}

/// Delete observed children that are no longer desired. Called only after every apply
/// succeeded, and only for objects this parent controls (the delete is preconditioned on the
/// observed uid, so a same-named replacement is never hit).
async fn prune(
    observed: &[(usize, Arc<DynamicObject>)],
    desired: &[DesiredChild],
    ctx: &PolicyContext,
) -> Result<usize, ReconcileError> {
    let wanted: HashSet<(usize, &str)> = desired
        .iter()
        .map(|d| (d.kind_index, d.name.as_str()))
        .collect();
    let mut pruned = 0;
    for (index, child) in observed {
        let name = child.name_any();
        if wanted.contains(&(*index, name.as_str())) {
            continue;
        }
        let cache = &ctx.children[*index];
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
            Ok(_) => pruned += 1,
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(source) => {
                return Err(ReconcileError::Prune {
                    kind: ctx.allowed[*index].kind.clone(),
                    name,
                    source,
                });
            }
        }
    }
    Ok(pruned)
}

/// Write the status through the status subresource, unless it would not change. Server-side
/// apply with the policy's field manager: fields other writers own are left alone.
async fn write_status(
    parent: &DynamicObject,
    identity: &ParentIdentity,
    plugin_status: Option<crate::plugin::JsonObject>,
    outcome: &Outcome,
    ctx: &PolicyContext,
) -> Result<(), ReconcileError> {
    let observed = parent.data.get("status");
    let desired = status::after_success(
        plugin_status,
        parent.metadata.generation,
        observed,
        outcome,
        &now(),
    );
    if status::is_unchanged(&desired, observed) {
        return Ok(());
    }
    let body = json!({
        "apiVersion": identity.api_version,
        "kind": identity.kind,
        "metadata": {"name": identity.name, "namespace": identity.namespace},
        "status": desired,
    });
    dynamic_api(&ctx.client, &ctx.parent, identity.namespace.as_deref())
        .patch_status(
            &identity.name,
            &PatchParams::apply(&ctx.field_manager).force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(ReconcileError::Status)?;
    Ok(())
}

/// Record which plugin reconciled the parent, when that changed. Server-side apply with the
/// policy's field manager owns just this one annotation.
async fn record_plugin_digest(
    parent: &DynamicObject,
    identity: &ParentIdentity,
    digest: &crate::plugin::Digest,
    ctx: &PolicyContext,
) -> Result<(), ReconcileError> {
    let digest = digest.to_string();
    if parent.annotations().get(PLUGIN_DIGEST_ANNOTATION) == Some(&digest) {
        return Ok(());
    }
    let body = json!({
        "apiVersion": identity.api_version,
        "kind": identity.kind,
        "metadata": {
            "name": identity.name,
            "namespace": identity.namespace,
            "annotations": {PLUGIN_DIGEST_ANNOTATION: digest},
        },
    });
    dynamic_api(&ctx.client, &ctx.parent, identity.namespace.as_deref())
        .patch(
            &identity.name,
            &PatchParams::apply(&ctx.field_manager).force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(ReconcileError::Annotate)?;
    Ok(())
}

/// Set `Reconciled=False` with the cause and record a Warning Event. Best effort: the failure
/// itself is what the controller acts on.
async fn report_failure(
    parent: &DynamicObject,
    ctx: &PolicyContext,
    error: &ReconcileError,
    retry: Retry,
) {
    let reason = error.reason();
    let message = super::events::truncate(
        format!(
            "{error:#} (attempt {}, next retry in {}s)",
            retry.attempt,
            retry.delay.as_secs_f64()
        ),
        2048,
    );
    if let Ok(identity) = identity(parent, &ctx.parent) {
        let outcome = Outcome {
            success: false,
            reason: reason.into(),
            message: message.clone(),
        };
        let conditions = status::after_failure(
            parent.metadata.generation,
            parent.data.get("status"),
            &outcome,
            &now(),
        );
        let patch = json!({"status": {"conditions": conditions}});
        if let Err(e) = dynamic_api(&ctx.client, &ctx.parent, identity.namespace.as_deref())
            .patch_status(
                &identity.name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            tracing::warn!(error = %e, "could not record the failure in the parent's status");
        }
    }
    ctx.events
        .publish(
            &reference(parent, ctx),
            EventType::Warning,
            reason,
            "Reconcile",
            message,
        )
        .await;
}

async fn publish_plugin_events(
    parent: &DynamicObject,
    ctx: &PolicyContext,
    events: Vec<crate::plugin::PluginEvent>,
) {
    for event in events {
        let type_ = match event.type_ {
            PluginEventType::Normal => EventType::Normal,
            PluginEventType::Warning => EventType::Warning,
        };
        ctx.events
            .publish(
                &reference(parent, ctx),
                type_,
                &event.reason,
                "Reconcile",
                event.message,
            )
            .await;
    }
}

/// Call the plugin on a deleted parent, and drop the finalizer once it says it is done.
async fn finalize(
    parent: &DynamicObject,
    identity: &ParentIdentity,
    ctx: &PolicyContext,
) -> Result<Action, ReconcileError> {
    let active = ctx.active.load_full();
    let candidate = ctx.candidate.load_full();
    let canary = canary_for(candidate.as_deref(), parent);
    let active = canary.map_or(&*active, |c| &c.serving);
    let observed = observed_children(identity, ctx);
    let request = ReconcileRequest {
        parent: serde_json::to_string(parent).unwrap_or_default(),
        children: observed.iter().map(|(_, o)| observed_object(o)).collect(),
        related: related_objects(identity, ctx),
        config: active.config.clone(),
        finalizing: true,
    };
    let response = active.plugin.reconcile(request).await?;
    publish_plugin_events(parent, ctx, response.events).await;
    if !response.finalized {
        tracing::info!("plugin has not finished finalizing; will ask again");
        return Ok(Action::requeue(
            response.requeue_after.unwrap_or(Duration::from_secs(5)),
        ));
    }
    if let Some(finalizer) = &ctx.finalizer {
        remove_finalizer(parent, identity, finalizer, ctx).await?;
        tracing::info!("plugin finalized the parent; finalizer removed");
    }
    Ok(Action::await_change())
}

async fn add_finalizer(
    parent: &DynamicObject,
    identity: &ParentIdentity,
    finalizer: &str,
    ctx: &PolicyContext,
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
    json_patch(identity, ops, ctx).await
}

async fn remove_finalizer(
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
        other => other,
    }
}

async fn json_patch(
    identity: &ParentIdentity,
    ops: Value,
    ctx: &PolicyContext,
) -> Result<(), ReconcileError> {
    let patch: json_patch::Patch = serde_json::from_value(ops)
        .map_err(|e| ReconcileError::Finalizer(kube::Error::SerdeError(e)))?;
    dynamic_api(&ctx.client, &ctx.parent, identity.namespace.as_deref())
        .patch(
            &identity.name,
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await
        .map_err(ReconcileError::Finalizer)?;
    Ok(())
}

fn dynamic_api(
    client: &Client,
    resource: &ApiResource,
    namespace: Option<&str>,
) -> Api<DynamicObject> {
    match namespace {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, resource),
        None => Api::all_with(client.clone(), resource),
    }
}

fn reference(parent: &DynamicObject, ctx: &PolicyContext) -> ObjectReference {
    parent.object_ref(&ctx.parent)
}

/// The candidate, if it serves `parent` as a canary.
fn canary_for<'a>(
    candidate: Option<&'a Candidate>,
    parent: &DynamicObject,
) -> Option<&'a Candidate> {
    use kube::core::SelectorExt as _;
    candidate.filter(|c| {
        c.canary
            .as_ref()
            .is_some_and(|selector| selector.matches(parent.labels()))
    })
}

/// Lock a mutex that only holds plain bookkeeping: a panic elsewhere cannot leave it
/// inconsistent, so poisoning is ignored.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The current time as Kubernetes writes it (RFC 3339, seconds).
fn now() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .map_or_else(|_| jiff::Timestamp::now().to_string(), |t| t.to_string())
}
