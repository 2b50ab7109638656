//! One reconcile of one parent, step by step as DESIGN.md lays it out: finalizer, observed
//! children, the plugin call, validation, apply, prune, status, events, requeue.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions, PropagationPolicy};
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource as _, ResourceExt as _};
use serde_json::{Value, json};

use arc_swap::ArcSwap;

use super::backoff::{Backoff, Retry};
use super::children::{self, AllowedKind, DesiredChild, InvalidChild, ParentIdentity};
use super::events::{EventSink, Published};
use super::status::{self, Outcome};
use crate::metrics::{ChildOperation, Metrics, ReconcileResult};
use crate::plugin::{
    EventType as PluginEventType, ObservedObject, Plugin, PluginError, ReconcileRequest,
    ReconcileResponse, ReportedKind, Verdict, compare,
};

/// The shortest delay a plugin's `requeue-after` can ask for: a plugin answering 0 must not
/// turn one parent into a tight loop that holds a call slot for ever.
pub(crate) const MIN_REQUEUE: Duration = Duration::from_secs(1);

/// Most Events one reconcile may record; the rest are dropped (and counted), so a plugin
/// cannot flood the Events API by inventing a new reason per Event.
pub(crate) const MAX_EVENTS_PER_RECONCILE: usize = 10;

/// Longest a reconcile waits for the caches to sync before it fails (and is retried).
const CACHE_SYNC_WAIT: Duration = Duration::from_secs(5);

/// A child kind as one policy's reconciles see it: the cache of the children it already has.
/// Its index is its index in [`PolicyContext::allowed`].
pub(crate) struct ChildCache {
    pub resource: ApiResource,
    pub store: Store<DynamicObject>,
    /// Children whose create-time fields must be handed over before an apply.
    pub created: Arc<super::field_ownership::CreatedFields>,
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
    pub metrics: Arc<Metrics>,
    /// Parents waiting for a reconcile, for `workqueue_depth`.
    pub queue: Arc<super::queue::QueueGauge>,
    /// A standby reconciles nothing; its caches stay warm for a takeover.
    pub leadership: Arc<crate::leader::Leadership>,
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
    /// Retrying cannot help until something the reconcile reads changes: wait for a watch
    /// event instead of a timer.
    pub await_change: bool,
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
    #[error(
        "{kind} {name} already exists and is not controlled by this parent ({owner}); wasmctrl never changes an object it does not own: delete or rename it, or let the plugin choose another name"
    )]
    ChildConflict {
        kind: String,
        name: String,
        /// Who does control it, in words.
        owner: String,
    },
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
    #[error(
        "the caches of the policy's kinds have not synced; the policy's Ready condition says which kind cannot be watched and why"
    )]
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
            Self::ChildConflict { .. } => "ChildConflict",
            Self::Apply { .. } => "ApplyFailed",
            Self::Prune { .. } => "PruneFailed",
            Self::Status(_) => "StatusWriteFailed",
            Self::Finalizer(_) => "FinalizerFailed",
            Self::Annotate(_) => "AnnotateFailed",
            Self::CachesNotReady => "CachesNotReady",
        }
    }

    /// Whether the contract says to wait for a change rather than retry: the plugin reported
    /// a permanent error or an invalid parent, so the same request would fail the same way.
    pub fn awaits_change(&self) -> bool {
        matches!(
            self,
            Self::Plugin(PluginError::Reported {
                kind: ReportedKind::Permanent | ReportedKind::InvalidParent,
                ..
            })
        )
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
    if !ctx.leadership.is_leader() {
        // Taking over re-enqueues every parent, so nothing waits on this.
        return Ok(Action::await_change());
    }
    let key = ObjectRef::from_obj_with(&*parent, ctx.parent.clone());
    ctx.queue
        .started(&(parent.metadata.namespace.clone(), parent.name_any()));
    let started = std::time::Instant::now();
    ctx.metrics.worker(&ctx.policy, 1);
    let span = tracing::info_span!("reconcile", policy = %ctx.policy, parent = %key);
    let result = tracing::Instrument::instrument(reconcile_parent(&parent, &ctx), span).await;
    ctx.metrics.worker(&ctx.policy, -1);
    let took = started.elapsed();
    let record = |ok: bool| {
        let mut reconciled = lock(&ctx.reconciled);
        if ok {
            reconciled.insert(key.clone());
        } else {
            reconciled.remove(&key);
        }
    };
    match result {
        Ok((action, requeued)) => {
            record(true);
            ctx.backoff.succeeded(&key);
            let result = if requeued {
                ReconcileResult::RequeueAfter
            } else {
                ReconcileResult::Success
            };
            ctx.metrics.reconciled(&ctx.policy, result, took);
            Ok(action)
        }
        Err(error) => {
            record(false);
            ctx.metrics
                .reconciled(&ctx.policy, ReconcileResult::Error, took);
            let retry = ctx.backoff.failed(&key);
            let await_change = error.awaits_change();
            if !await_change {
                ctx.metrics.retried(&ctx.policy);
            }
            tracing::warn!(policy = %ctx.policy, parent = %key, attempt = retry.attempt, retry_in = ?(!await_change).then_some(retry.delay), error = %error, "reconcile failed");
            report_failure(&parent, &ctx, &error, retry, await_change).await;
            Err(Failure {
                error,
                retry,
                await_change,
            })
        }
    }
}

/// The kube-runtime error policy: retry after the backoff the failure was given.
pub(crate) fn error_policy(
    _parent: Arc<DynamicObject>,
    failure: &Failure,
    _ctx: Arc<PolicyContext>,
) -> Action {
    if failure.await_change {
        Action::await_change()
    } else {
        Action::requeue(failure.retry.delay)
    }
}

/// The plugin's requeue delay, never below [`MIN_REQUEUE`]; the resync period without one.
fn requeue_delay(asked: Option<Duration>, resync: Duration) -> Duration {
    asked.map_or(resync, |delay| delay.max(MIN_REQUEUE))
}

/// One reconcile; on success, the next action and whether the plugin asked for the requeue.
async fn reconcile_parent(
    parent: &DynamicObject,
    ctx: &PolicyContext,
) -> Result<(Action, bool), ReconcileError> {
    // Observed children must come from synced caches: an empty cache would look like
    // "nothing exists yet" and turn a converged parent into a round of writes.
    // The wait is bounded: a kind that cannot be listed must not hold reconciles (and with
    // them a restart or shutdown) for ever. The policy's Ready condition says which and why.
    let mut caches_ready = ctx.caches_ready.clone();
    match tokio::time::timeout(CACHE_SYNC_WAIT, caches_ready.wait_for(|ready| *ready)).await {
        Ok(Ok(_)) => {}
        _ => return Err(ReconcileError::CachesNotReady),
    }
    let identity = identity(parent, &ctx.parent)?;
    let deleting = parent.metadata.deletion_timestamp.is_some();
    let holds_finalizer = ctx
        .finalizer
        .as_ref()
        .is_some_and(|f| parent.finalizers().contains(f));
    if deleting {
        return if holds_finalizer {
            finalize(parent, &identity, ctx).await.map(|a| (a, false))
        } else {
            // Owned children go with the parent through garbage collection.
            Ok((Action::await_change(), false))
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
            let answer = call_plugin(&serving.plugin, request, ctx).await;
            let shadow_answer = call_plugin(&shadow.serving.plugin, shadow_request, ctx).await;
            let verdict = match &shadow_answer {
                // An answer the host would refuse is a failure, however it compares.
                Ok(response) => match children::prepare(
                    response.children.clone(),
                    &ctx.allowed,
                    &identity,
                    &ctx.policy_label,
                ) {
                    Err(problems) => Verdict::WouldFail(format!(
                        "the host would refuse its answer: {}",
                        describe(&problems)
                    )),
                    Ok(_) => compare(&answer, &shadow_answer),
                },
                Err(_) => compare(&answer, &shadow_answer),
            };
            lock(&ctx.shadow).insert(key, verdict);
            answer
        }
        _ => {
            lock(&ctx.shadow).remove(&key);
            call_plugin(&serving.plugin, request, ctx).await
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
        let wrote = apply_child(child, &identity, ctx).await?;
        let operation = if wrote {
            ChildOperation::Applied
        } else {
            ChildOperation::Unchanged
        };
        let kind = &ctx.allowed[child.kind_index].kind;
        ctx.metrics.children(&ctx.policy, kind, operation, 1);
        applied += usize::from(wrote);
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
    Ok((
        Action::requeue(requeue_delay(response.requeue_after, ctx.resync)),
        response.requeue_after.is_some(),
    ))
}

/// Call the plugin, counting the call's outcome and duration.
async fn call_plugin(
    plugin: &Plugin,
    request: ReconcileRequest,
    ctx: &PolicyContext,
) -> Result<ReconcileResponse, PluginError> {
    let started = std::time::Instant::now();
    let answer = plugin.reconcile_as(&ctx.policy, request).await;
    let outcome = answer.as_ref().map_or_else(PluginError::outcome, |_| "ok");
    ctx.metrics
        .plugin_called(&ctx.policy, outcome, started.elapsed());
    answer
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

/// Bring one child to its desired state, unless the cache shows it already converged.
/// Returns whether it wrote.
///
/// Ownership comes first: the host changes only objects whose controller is this parent. A
/// child missing from the cache (which holds only objects labelled for this policy) is
/// created, never applied, so an existing object of the same name — a hand-made Service, or
/// one another parent controls — turns into a `ChildConflict` instead of being taken over.
async fn apply_child(
    child: &DesiredChild,
    parent: &ParentIdentity,
    ctx: &PolicyContext,
) -> Result<bool, ReconcileError> {
    let cache = &ctx.children[child.kind_index];
    let mut key = ObjectRef::new_with(&child.name, cache.resource.clone());
    if let Some(namespace) = &child.namespace {
        key = key.within(namespace);
    }
    match cache.store.get(&key) {
        Some(observed) => update_child(child, &observed, parent, ctx).await,
        None => create_child(child, parent, ctx).await,
    }
}

/// Create a child the cache does not know. An `AlreadyExists` means either that the cache has
/// not seen an earlier create of ours yet, or that someone else's object holds the name: a
/// live read tells them apart.
async fn create_child(
    child: &DesiredChild,
    parent: &ParentIdentity,
    ctx: &PolicyContext,
) -> Result<bool, ReconcileError> {
    let api = dynamic_api(
        &ctx.client,
        &ctx.children[child.kind_index].resource,
        child.namespace.as_deref(),
    );
    let apply_error = |source| ReconcileError::Apply {
        kind: ctx.allowed[child.kind_index].kind.clone(),
        name: child.name.clone(),
        source,
    };
    let object: DynamicObject = serde_json::from_value(child.object.clone())
        .map_err(|e| apply_error(kube::Error::SerdeError(e)))?;
    let params = PostParams {
        field_manager: Some(ctx.field_manager.clone()),
        ..PostParams::default()
    };
    match api.create(&params, &object).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => {
            let live = api.get(&child.name).await.map_err(apply_error)?;
            update_child(child, &live, parent, ctx).await
        }
        Err(source) => Err(apply_error(source)),
    }
}

/// Server-side apply a child that exists, if this parent controls it and it drifted. The
/// apply carries the observed uid, so an object deleted and re-created by someone else
/// since the read is refused by the API server rather than taken over.
async fn update_child(
    child: &DesiredChild,
    observed: &DynamicObject,
    parent: &ParentIdentity,
    ctx: &PolicyContext,
) -> Result<bool, ReconcileError> {
    let kind = &ctx.allowed[child.kind_index].kind;
    if let Some(owner) = children::foreign_controller(observed.owner_references(), &parent.uid) {
        return Err(ReconcileError::ChildConflict {
            kind: kind.clone(),
            name: child.name.clone(),
            owner,
        });
    }
    let observed_json = serde_json::to_value(observed).unwrap_or_default();
    if children::is_converged(child, &observed_json) {
        return Ok(false);
    }
    tracing::debug!(
        %kind,
        name = %child.name,
        differs_at = children::first_difference(&child.object, &observed_json).as_deref().unwrap_or(".metadata.annotations (hash)"),
        "child drifted from its desired state"
    );
    let mut body = child.object.clone();
    if let (Some(uid), Some(metadata)) = (&observed.metadata.uid, body["metadata"].as_object_mut())
    {
        metadata.insert("uid".into(), json!(uid));
    }
    let apply_error = |source| ReconcileError::Apply {
        kind: kind.clone(),
        name: child.name.clone(),
        source,
    };
    let cache = &ctx.children[child.kind_index];
    let api = dynamic_api(&ctx.client, &cache.resource, child.namespace.as_deref());
    if cache
        .created
        .needs_hand_over(child.namespace.as_deref(), &child.name)
    {
        cache
            .created
            .hand_over(&api, &child.name)
            .await
            .map_err(apply_error)?;
    }
    api.patch(
        &child.name,
        &PatchParams::apply(&ctx.field_manager).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(apply_error)?;
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
            Ok(_) => {
                pruned += 1;
                let kind = &ctx.allowed[*index].kind;
                ctx.metrics
                    .children(&ctx.policy, kind, ChildOperation::Pruned, 1);
            }
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
        // The uid makes the write a precondition: a parent deleted (and perhaps re-created)
        // since this reconcile read it is refused, never re-created by the apply.
        "metadata": {"name": identity.name, "namespace": identity.namespace, "uid": identity.uid},
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
            "uid": identity.uid,
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
    await_change: bool,
) {
    let reason = error.reason();
    let next = if await_change {
        "not retried until the parent, its children or related objects change".to_owned()
    } else {
        format!("next retry in {}s", retry.delay.as_secs_f64())
    };
    let message = super::events::truncate(
        format!("{error:#} (attempt {}, {next})", retry.attempt),
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
        let patch = json!({
            "metadata": {"uid": identity.uid},
            "status": {"conditions": conditions},
        });
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
    let dropped = events.len().saturating_sub(MAX_EVENTS_PER_RECONCILE);
    if dropped > 0 {
        tracing::warn!(
            dropped,
            limit = MAX_EVENTS_PER_RECONCILE,
            "the plugin asked for more Events than one reconcile may record"
        );
        ctx.metrics.events_dropped(&ctx.policy, dropped as u64);
    }
    let mut over_quota = 0;
    for event in events.into_iter().take(MAX_EVENTS_PER_RECONCILE) {
        let type_ = match event.type_ {
            PluginEventType::Normal => EventType::Normal,
            PluginEventType::Warning => EventType::Warning,
        };
        let published = ctx
            .events
            .publish(
                &reference(parent, ctx),
                type_,
                &event.reason,
                "Reconcile",
                event.message,
            )
            .await;
        if published == Published::OverQuota {
            over_quota += 1;
        }
    }
    if over_quota > 0 {
        ctx.metrics.events_dropped(&ctx.policy, over_quota);
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
    let response = call_plugin(&active.plugin, request, ctx).await?;
    publish_plugin_events(parent, ctx, response.events).await;
    if !response.finalized {
        tracing::info!("plugin has not finished finalizing; will ask again");
        return Ok(Action::requeue(requeue_delay(
            response.requeue_after,
            Duration::from_secs(5),
        )));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requeue_of_zero_is_raised_to_the_floor_and_none_means_resync() {
        let resync = Duration::from_secs(300);
        assert_eq!(requeue_delay(Some(Duration::ZERO), resync), MIN_REQUEUE);
        assert_eq!(
            requeue_delay(Some(Duration::from_secs(7)), resync),
            Duration::from_secs(7)
        );
        assert_eq!(requeue_delay(None, resync), resync);
    }

    #[test]
    fn only_permanent_and_invalid_parent_reports_wait_for_a_change() {
        let reported = |kind| {
            ReconcileError::Plugin(PluginError::Reported {
                kind,
                message: "m".into(),
            })
        };
        assert!(reported(ReportedKind::Permanent).awaits_change());
        assert!(reported(ReportedKind::InvalidParent).awaits_change());
        assert!(!reported(ReportedKind::Transient).awaits_change());
        assert!(
            !ReconcileError::Plugin(PluginError::DeadlineExceeded {
                timeout: Duration::from_secs(1)
            })
            .awaits_change()
        );
    }
}
