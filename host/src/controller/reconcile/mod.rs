//! One reconcile of one parent, step by step as docs/host.md lays it out: finalizer, observed
//! children, the plugin call, validation, apply, prune, status, events, requeue.

pub(crate) mod backoff;
pub(crate) mod children;
pub(crate) mod context;
pub(crate) mod error;
pub(crate) mod events;
pub(crate) mod parent;
pub(crate) mod queue;
pub(crate) mod request;
pub(crate) mod serving;
pub(crate) mod status;
pub(crate) mod trace;
pub(crate) mod writes;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource as _, ResourceExt as _};
use serde_json::json;
use tracing::{Instrument as _, info_span};

use crate::controller::cache::cached::CachedObject;
use crate::controller::reconcile::context::PolicyContext;
use crate::explain::{ChildAction, RecordResult};
use crate::lock;
use crate::metrics::{ChildOperation, ReconcileResult};
use crate::plugin::{
    CallError, EventType as PluginEventType, Plugin, ReconcileRequest, ReconcileResponse, Verdict,
    compare,
};
use backoff::Retry;
pub(crate) use error::{Failure, ReconcileError};
use events::Published;
use parent::ParentIdentity;
use status::Outcome;
use trace::Trace;
use writes::Applied;

/// The shortest delay a plugin's `requeue-after` can ask for: a plugin answering 0 must not
/// turn one parent into a tight loop that holds a call slot for ever.
pub(crate) const MIN_REQUEUE: Duration = Duration::from_secs(1);

/// Most Events one reconcile may record; the rest are dropped (and counted), so a plugin
/// cannot flood the Events API by inventing a new reason per Event.
pub(crate) const MAX_EVENTS_PER_RECONCILE: usize = 10;

/// Longest a reconcile waits for the caches to sync before it fails (and is retried).
const CACHE_SYNC_WAIT: Duration = Duration::from_secs(5);

/// The kube-runtime reconcile function: run one reconcile, keep the backoff history, and
/// report a failure on the parent.
pub(crate) async fn reconcile(
    cached: Arc<CachedObject>,
    ctx: Arc<PolicyContext>,
) -> Result<Action, Failure> {
    if !ctx.leadership.is_leader() {
        // Taking over re-enqueues every parent, so nothing waits on this.
        return Ok(Action::await_change());
    }
    let key = parent_key(&*cached, &ctx.parent);
    // Parents are cached compactly; this reconcile reads the whole object.
    let parent = cached.to_dynamic();
    drop(cached);
    ctx.queue
        .started(&(parent.metadata.namespace.clone(), parent.name_any()));
    let started = std::time::Instant::now();
    ctx.metrics.worker(&ctx.policy, 1);
    let span = tracing::info_span!("reconcile", policy = %ctx.policy, parent = %key);
    let mut trace = Trace::new(ctx.explain.wanted());
    let result = reconcile_parent(&parent, &ctx, &mut trace)
        .instrument(span)
        .await;
    ctx.metrics.worker(&ctx.policy, -1);
    let took = started.elapsed();
    match result {
        Ok(Done {
            action,
            requeued,
            decided_by,
            result,
        }) => {
            trace.finish(&parent, &ctx, result, None);
            lock(&ctx.outcomes.reconciled).insert(key.clone(), decided_by);
            ctx.outcomes.backoff.succeeded(&key);
            let result = if requeued {
                ReconcileResult::RequeueAfter
            } else {
                ReconcileResult::Success
            };
            ctx.metrics.reconciled(&ctx.policy, result, took);
            Ok(action)
        }
        Err(error) => {
            lock(&ctx.outcomes.reconciled).remove(&key);
            ctx.metrics
                .reconciled(&ctx.policy, ReconcileResult::Error, took);
            let retry = ctx.outcomes.backoff.failed(&key);
            let await_change = error.awaits_change();
            if !await_change {
                ctx.metrics.retried(&ctx.policy);
            }
            tracing::warn!(policy = %ctx.policy, parent = %key, attempt = retry.attempt, retry_in = ?(!await_change).then_some(retry.delay), error = %error, "reconcile failed");
            report_failure(&parent, &ctx, &error, retry, await_change, &mut trace).await;
            trace.finish(&parent, &ctx, RecordResult::Failed, Some(&error));
            Err(Failure {
                error,
                retry,
                await_change,
            })
        }
    }
}

/// A parent's key in the policy's maps (its outcome, its shadow verdict): the kind, namespace
/// and name only, none of the uid and resourceVersion a reference can carry, as the maps
/// hold one per parent.
fn parent_key(parent: &impl kube::Resource, kind: &Arc<ApiResource>) -> ObjectRef<CachedObject> {
    let key = ObjectRef::new_with(
        parent.meta().name.as_deref().unwrap_or_default(),
        kind.clone(),
    );
    match &parent.meta().namespace {
        Some(namespace) => key.within(namespace),
        None => key,
    }
}

/// The kube-runtime error policy: retry after the backoff the failure was given.
pub(crate) fn error_policy(
    _parent: Arc<CachedObject>,
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

/// A reconcile that succeeded.
struct Done {
    action: Action,
    /// The plugin asked for the requeue (rather than the resync period).
    requeued: bool,
    /// The plugin whose decision the parent now reflects (none for a parent being deleted).
    decided_by: Option<crate::plugin::Digest>,
    /// How the reconcile's record describes its end.
    result: RecordResult,
}

impl Done {
    fn deleting(action: Action, result: RecordResult) -> Self {
        Self {
            action,
            requeued: false,
            decided_by: None,
            result,
        }
    }
}

/// One reconcile.
async fn reconcile_parent(
    parent: &DynamicObject,
    ctx: &PolicyContext,
    trace: &mut Trace,
) -> Result<Done, ReconcileError> {
    // Each step is a span of its own (under the reconcile's), for traces; `trace` times the
    // same steps for `wasmctrl explain`.
    wait_for_caches(ctx)
        .instrument(info_span!("caches"))
        .await?;
    trace.step("caches");
    let identity = identity(parent, &ctx.parent)?;
    let held = finalize_or_hold(parent, &identity, ctx, trace)
        .instrument(info_span!("finalizer"))
        .await?;
    if let Some((action, result)) = held {
        return Ok(Done::deleting(action, result));
    }
    trace.step("finalizer");
    let observed = request::observed_children(&identity, &ctx.caches.children);
    let Decision {
        desired,
        status,
        events,
        requeue_after,
        digest,
    } = decide(parent, &identity, &observed, ctx, trace)
        .instrument(info_span!("decide"))
        .await?;
    apply_children(&desired, &identity, ctx, trace)
        .instrument(info_span!("apply", children = desired.len()))
        .await?;
    trace.step("apply");
    prune_children(&observed, &desired, ctx, trace)
        .instrument(info_span!("prune"))
        .await?;
    trace.step("prune");
    record_success(parent, &identity, status, desired.len(), ctx, trace)
        .instrument(info_span!("status"))
        .await?;
    trace.step("status");
    publish_plugin_events(parent, ctx, events, trace)
        .instrument(info_span!("events"))
        .await;
    trace.step("events");
    Ok(Done {
        action: Action::requeue(requeue_delay(requeue_after, ctx.resync)),
        requeued: requeue_after.is_some(),
        decided_by: Some(digest),
        result: RecordResult::Reconciled,
    })
}

/// Observed children must come from synced caches: an empty cache would look like "nothing
/// exists yet" and turn a converged parent into a round of writes. The wait is bounded: a
/// kind that cannot be listed must not hold reconciles (and with them a restart or shutdown)
/// for ever. The policy's Ready condition says which and why.
async fn wait_for_caches(ctx: &PolicyContext) -> Result<(), ReconcileError> {
    let mut caches_ready = ctx.caches.ready.clone();
    match tokio::time::timeout(CACHE_SYNC_WAIT, caches_ready.wait_for(|ready| *ready)).await {
        Ok(Ok(_)) => Ok(()),
        _ => Err(ReconcileError::CachesNotReady),
    }
}

/// A parent being deleted is finalized (when this policy holds its finalizer) and goes no
/// further; a live one gets the policy's finalizer first, if the policy asks for one.
async fn finalize_or_hold(
    parent: &DynamicObject,
    identity: &ParentIdentity,
    ctx: &PolicyContext,
    trace: &mut Trace,
) -> Result<Option<(Action, RecordResult)>, ReconcileError> {
    let holds_finalizer = ctx
        .finalizer
        .as_ref()
        .is_some_and(|f| parent.finalizers().contains(f));
    if parent.metadata.deletion_timestamp.is_some() {
        return if holds_finalizer {
            finalize(parent, identity, ctx, trace).await.map(Some)
        } else {
            // Owned children go with the parent through garbage collection.
            Ok(Some((Action::await_change(), RecordResult::Deleting)))
        };
    }
    if let (Some(finalizer), false) = (&ctx.finalizer, holds_finalizer) {
        writes::add_finalizer(parent, identity, finalizer, ctx).await?;
    }
    Ok(None)
}

/// What the serving plugin decided for one parent, validated and stamped.
struct Decision {
    desired: Vec<children::DesiredChild>,
    status: Option<crate::plugin::JsonObject>,
    events: Vec<crate::plugin::PluginEvent>,
    requeue_after: Option<Duration>,
    /// The plugin that decided.
    digest: crate::plugin::Digest,
}

/// Ask the serving plugin (and the candidate in shadow, recording its verdict) and validate
/// the children it wants.
async fn decide(
    parent: &DynamicObject,
    identity: &ParentIdentity,
    observed: &[request::Observed],
    ctx: &PolicyContext,
    trace: &mut Trace,
) -> Result<Decision, ReconcileError> {
    let selection = ctx.serving.select(parent.labels());
    let serving = &selection.serving;
    let related = request::related(parent, identity, &ctx.caches.related).await?;
    let request = request::build(parent, observed, related, serving, false);
    trace.step("request");
    trace.asked(&request, *serving.plugin.digest(), ctx.explain.secret_data);
    let key = parent_key(parent, &ctx.parent);
    let answer = match &selection.shadow {
        Some(shadow) => {
            let shadow_request = ReconcileRequest {
                config: shadow.config.clone(),
                ..request.clone()
            };
            let answer = call_plugin(&serving.plugin, request, ctx).await;
            let shadow_answer = call_plugin(&shadow.plugin, shadow_request, ctx).await;
            let verdict = shadow_verdict(
                &answer,
                &shadow_answer,
                identity,
                &ctx.caches.allowed,
                &ctx.policy_label,
            );
            trace.shadowed(&verdict);
            lock(&ctx.serving.shadow).insert(key, verdict);
            answer
        }
        None => {
            lock(&ctx.serving.shadow).remove(&key);
            call_plugin(&serving.plugin, request, ctx).await
        }
    };
    trace.answered(&answer, &ctx.policy, ctx.explain.secret_data);
    trace.step("plugin");
    let response = answer?;
    let desired = children::prepare(
        response.children,
        &ctx.caches.allowed,
        identity,
        &ctx.policy_label,
    )
    .map_err(ReconcileError::InvalidChildren)?;
    trace.step("validate");
    Ok(Decision {
        desired,
        status: response.status,
        events: response.events,
        requeue_after: response.requeue_after,
        digest: *serving.plugin.digest(),
    })
}

/// How the candidate's answer compares with the serving plugin's. An answer the host would
/// refuse is a failure, however it compares.
fn shadow_verdict(
    answer: &Result<ReconcileResponse, CallError>,
    shadow_answer: &Result<ReconcileResponse, CallError>,
    identity: &ParentIdentity,
    allowed: &[children::AllowedKind],
    policy_label: &str,
) -> Verdict {
    if let Ok(response) = shadow_answer
        && let Err(problems) =
            children::prepare(response.children.clone(), allowed, identity, policy_label)
    {
        return Verdict::WouldFail(format!(
            "the host would refuse its answer: {}",
            error::describe(&problems)
        ));
    }
    compare(answer, shadow_answer)
}

/// Apply every desired child (a child already as desired costs no write).
async fn apply_children(
    desired: &[children::DesiredChild],
    identity: &ParentIdentity,
    ctx: &PolicyContext,
    trace: &mut Trace,
) -> Result<(), ReconcileError> {
    let mut applied = 0;
    for child in desired {
        let outcome = writes::apply_child(child, identity, ctx).await?;
        let wrote = outcome.wrote();
        let operation = if wrote {
            ChildOperation::Applied
        } else {
            ChildOperation::Unchanged
        };
        let kind = &ctx.caches.allowed[child.kind_index].kind;
        ctx.metrics.children(&ctx.policy, kind, operation, 1);
        let (action, changed) = match outcome {
            Applied::Created => (ChildAction::Created, Vec::new()),
            Applied::Changed(fields) => (ChildAction::Changed, fields),
            Applied::Unchanged => (ChildAction::Unchanged, Vec::new()),
        };
        trace.child(kind, &child.name, action, changed);
        applied += usize::from(wrote);
    }
    if applied > 0 {
        tracing::info!(
            applied,
            unchanged = desired.len() - applied,
            "children applied"
        );
    }
    Ok(())
}

/// Delete the observed children the plugin no longer wants.
async fn prune_children(
    observed: &[request::Observed],
    desired: &[children::DesiredChild],
    ctx: &PolicyContext,
    trace: &mut Trace,
) -> Result<(), ReconcileError> {
    let pruned = writes::prune(observed, desired, ctx).await?;
    if !pruned.is_empty() {
        tracing::info!(pruned = pruned.len(), "children pruned");
    }
    for (kind, name) in pruned {
        trace.child(&kind, &name, ChildAction::Pruned, Vec::new());
    }
    Ok(())
}

/// Write the plugin's status with `Reconciled=True` (skipped when nothing in it changed).
/// The message leaves out which plugin decided: a swap to a plugin that decides the same must
/// cost no write. The policy's status counts the parents on its active plugin instead.
async fn record_success(
    parent: &DynamicObject,
    identity: &ParentIdentity,
    status: Option<crate::plugin::JsonObject>,
    desired: usize,
    ctx: &PolicyContext,
    trace: &mut Trace,
) -> Result<(), ReconcileError> {
    let outcome = status::Outcome::success(desired);
    let (status, written) = writes::write_status(parent, identity, status, &outcome, ctx).await?;
    trace.status(&status, written);
    Ok(())
}

/// Call the plugin, counting the call's outcome and duration.
async fn call_plugin(
    plugin: &Plugin,
    request: ReconcileRequest,
    ctx: &PolicyContext,
) -> Result<ReconcileResponse, CallError> {
    let started = std::time::Instant::now();
    let answer = plugin.reconcile_as(&ctx.policy, request).await;
    let outcome = answer.as_ref().map_or_else(CallError::outcome, |_| "ok");
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

/// Set `Reconciled=False` with the cause and record a Warning Event. Best effort: the failure
/// itself is what the controller acts on.
async fn report_failure(
    parent: &DynamicObject,
    ctx: &PolicyContext,
    error: &ReconcileError,
    retry: Retry,
    await_change: bool,
    trace: &mut Trace,
) {
    let reason = error.reason();
    let next = if await_change {
        "not retried until the parent, its children or related objects change".to_owned()
    } else {
        format!("next retry in {}s", retry.delay.as_secs_f64())
    };
    let message = crate::controller::reconcile::events::truncate(
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
            &status::now(),
        );
        let patch = json!({
            "metadata": {"uid": identity.uid},
            "status": {"conditions": conditions},
        });
        if let Err(e) = writes::dynamic_api(&ctx.client, &ctx.parent, identity.namespace.as_deref())
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
    trace.event(EventType::Warning, reason, &message);
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
    trace: &mut Trace,
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
        trace.event(type_, &event.reason, &event.message);
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
    trace: &mut Trace,
) -> Result<(Action, RecordResult), ReconcileError> {
    let serving = ctx.serving.select(parent.labels()).serving;
    let observed = request::observed_children(identity, &ctx.caches.children);
    let related = request::related(parent, identity, &ctx.caches.related).await?;
    let request = request::build(parent, &observed, related, &serving, true);
    trace.step("request");
    trace.asked(&request, *serving.plugin.digest(), ctx.explain.secret_data);
    let answer = call_plugin(&serving.plugin, request, ctx).await;
    trace.answered(&answer, &ctx.policy, ctx.explain.secret_data);
    trace.step("plugin");
    let response = answer?;
    publish_plugin_events(parent, ctx, response.events, trace).await;
    trace.step("events");
    if !response.finalized {
        tracing::info!("plugin has not finished finalizing; will ask again");
        return Ok((
            Action::requeue(requeue_delay(
                response.requeue_after,
                Duration::from_secs(5),
            )),
            RecordResult::Finalizing,
        ));
    }
    if let Some(finalizer) = &ctx.finalizer {
        writes::remove_finalizer(parent, identity, finalizer, ctx).await?;
        tracing::info!("plugin finalized the parent; finalizer removed");
    }
    trace.step("finalizer");
    Ok((Action::await_change(), RecordResult::Finalized))
}

fn reference(parent: &DynamicObject, ctx: &PolicyContext) -> ObjectReference {
    parent.object_ref(&ctx.parent)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(children: Vec<serde_json::Value>) -> Result<ReconcileResponse, CallError> {
        Ok(ReconcileResponse {
            children: children
                .into_iter()
                .map(|c| match c {
                    serde_json::Value::Object(map) => map,
                    other => panic!("not an object: {other}"),
                })
                .collect(),
            ..ReconcileResponse::default()
        })
    }

    fn config_map(name: &str, value: &str) -> serde_json::Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"k": value}})
    }

    #[test]
    fn a_shadow_answer_is_compared_unless_the_host_would_refuse_it() {
        let identity = ParentIdentity {
            api_version: "example.com/v1".into(),
            kind: "MyApp".into(),
            name: "p".into(),
            namespace: Some("a".into()),
            uid: "uid-p".into(),
        };
        let allowed = [children::AllowedKind {
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            namespaced: true,
        }];
        let verdict = |active, shadow| shadow_verdict(&active, &shadow, &identity, &allowed, "p");
        let active = || response(vec![config_map("c", "1")]);

        assert_eq!(verdict(active(), active()), Verdict::Unchanged);
        assert!(matches!(
            verdict(active(), response(vec![config_map("c", "2")])),
            Verdict::WouldChange(detail) if detail.contains("ConfigMap c")
        ));
        // A Secret is not an allowed child: whatever the comparison, the candidate would fail.
        let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}});
        assert!(matches!(
            verdict(active(), response(vec![config_map("c", "1"), secret])),
            Verdict::WouldFail(detail) if detail.contains("the host would refuse its answer")
        ));
        let trap = Err(CallError::Trap {
            message: "unreachable".into(),
            plugin_said: None,
        });
        assert!(matches!(verdict(active(), trap), Verdict::WouldFail(_)));
    }

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
}
