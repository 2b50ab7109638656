//! One parent, start to finish: the request the plugin is asked, the steps of a reconcile,
//! what becomes of the plugin's children, the writes, the status, Events, backoff and the
//! record of what happened.
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | the kube-runtime entry points: a reconcile's bookkeeping around [`steps`] |
//! | `steps` | [`steps::Reconcile`]: one reconcile as a value, one method per step |
//! | `context` | what one policy's reconciles share |
//! | `decisions` | what each parent's last decision was made on: when a reconcile may skip it |
//! | `serving` | the active plugin, the candidate and its shadow verdicts (what a swap replaces) |
//! | `parent` | who the parent is |
//! | `visibility` | what a plugin may see, shared with `plugin run --policy` |
//! | `request` | the request built from the caches |
//! | `children/` | what the host does to desired and observed children (pure decisions) |
//! | `waits` | which ordered children wait for what they depend on, in one apply |
//! | `writes` | every cluster write of a reconcile: children, prunes, parent status, finalizers |
//! | `lean_writes` | writes answered with the object's metadata only |
//! | `prune_guard` | holds a change's mass deletion for an admin to confirm |
//! | `status` | the parent's status as the host writes it (pure) |
//! | `events` | Kubernetes Events, rate-limited |
//! | `backoff`, `queue` | retry delays per parent; the work queue as metrics see it |
//! | `error` | what can fail, one condition reason per cause |
//! | `trace` | the reconcile's record for `wasmctrl explain` |

pub(crate) mod backoff;
pub(crate) mod children;
pub(crate) mod context;
pub(crate) mod decisions;
pub(crate) mod error;
pub(crate) mod events;
pub(crate) mod lean_writes;
pub(crate) mod parent;
pub(crate) mod prune_guard;
pub(crate) mod queue;
pub(crate) mod request;
pub(crate) mod serving;
pub(crate) mod status;
pub(crate) mod steps;
pub(crate) mod trace;
pub(crate) mod visibility;
pub(crate) mod waits;
pub(crate) mod writes;

use std::sync::Arc;

use kube::ResourceExt as _;
use kube::runtime::controller::Action;
use tracing::Instrument as _;

use crate::controller::cache::cached::CachedObject;
use crate::controller::labels;
use crate::explain::RecordResult;
use crate::lock;
use crate::metrics::ReconcileResult;
use context::PolicyContext;
use error::{Failure, ReconcileError};
use parent::ParentIdentity;
use steps::{Done, Reconcile, report_failure};
use trace::Trace;

/// When a sharded host that found itself stalled tries a parent again.
const STALLED_RETRY: std::time::Duration = std::time::Duration::from_secs(5);

/// The kube-runtime reconcile function: run one reconcile, keep the backoff history, and
/// report a failure on the parent.
pub(crate) async fn reconcile(
    cached: Arc<CachedObject>,
    ctx: Arc<PolicyContext>,
) -> Result<Action, Failure> {
    let key = parent::parent_key(&*cached, &ctx.parent);
    let outcome = match ctx.leadership.shards() {
        None => reconcile_parent(cached, ctx.clone()).await,
        Some(shards) => {
            let shard = shards.shard_of_parent(cached.as_ref());
            let Some(writing) = shards.start_writing(shard) else {
                // Another replica's parent; this one reconciles it if it takes the shard.
                ctx.queue
                    .started(&(cached.metadata.namespace.clone(), cached.name_any()));
                return Ok(Action::await_change());
            };
            crate::shards::write_for(writing, reconcile_parent(cached, ctx.clone())).await
        }
    };
    // What a reconcile that ended after its parent was deleted noted of it (its outcome, the
    // prune guard's visit) is swept at the next report, not at the minute's sweep.
    if ctx.caches.parents.get(&key).is_none() {
        ctx.parents_gone.happened();
    }
    outcome
}

async fn reconcile_parent(
    cached: Arc<CachedObject>,
    ctx: Arc<PolicyContext>,
) -> Result<Action, Failure> {
    // Off the queue first: a standby's reconcile ends here too.
    ctx.queue
        .started(&(cached.metadata.namespace.clone(), cached.name_any()));
    if !ctx.leadership.may_write() {
        // Taking over re-enqueues every parent, so nothing waits on this. A sharded host
        // writes nothing while one of its shards stands past its deadline (the process
        // stood still) until its coordinator's next round lets that shard go; nothing
        // re-enqueues the parents of the shards it keeps, so they are tried again.
        return Ok(match ctx.leadership.shards() {
            Some(_) => Action::requeue(STALLED_RETRY),
            None => Action::await_change(),
        });
    }
    let key = parent::parent_key(&*cached, &ctx.parent);
    // A change (or a takeover) brought it: it is tried again whatever its last failure was.
    lock(&ctx.outcomes.awaiting_change).remove(&key);
    // Parents are cached compactly; this reconcile reads the whole object.
    let parent = cached.to_dynamic();
    drop(cached);
    let started = std::time::Instant::now();
    ctx.metrics.worker(1);
    let span = tracing::info_span!("reconcile", policy = %ctx.policy, parent = %key);
    let identity = ParentIdentity::of(&parent, &ctx.parent).map(|mut identity| {
        if let Some(shards) = ctx.leadership.shards() {
            let shard = shards.shard_of(&identity.uid);
            identity.shard = Some(labels::shard_label_value(shard, shards.count()));
        }
        identity
    });
    let window = ctx.prune_guard.epoch();
    let (result, mut trace): (Result<Done, ReconcileError>, Trace) = async {
        let trace = Trace::new(ctx.explain.wanted(), ctx.redaction.clone());
        match &identity {
            Ok(identity) => {
                let reconcile = Reconcile::new(&parent, identity, &ctx, trace);
                (reconcile.run().await, reconcile.into_trace())
            }
            Err(field) => (Err(ReconcileError::MalformedParent(field)), trace),
        }
    }
    .instrument(span)
    .await;
    ctx.metrics.worker(-1);
    ctx.prune_guard.visited(window, &key);
    let took = started.elapsed();
    match result {
        Ok(Done {
            action,
            requeued,
            decided_by,
            result,
            unchanged,
        }) => {
            if !unchanged {
                trace.finish(&parent, &ctx, result, None);
            }
            lock(&ctx.outcomes.reconciled).insert(key.clone(), decided_by);
            ctx.outcomes.backoff.succeeded(&key);
            let result = if requeued {
                ReconcileResult::RequeueAfter
            } else {
                ReconcileResult::Success
            };
            ctx.metrics.reconciled(result, took);
            Ok(action)
        }
        Err(error) => {
            lock(&ctx.outcomes.reconciled).remove(&key);
            ctx.decisions
                .forget(decisions::parent_key(key.namespace.as_deref(), &key.name));
            ctx.metrics.reconciled(ReconcileResult::Error, took);
            let retry = ctx.outcomes.backoff.failed(&key);
            let await_change = error.awaits_change();
            if await_change {
                lock(&ctx.outcomes.awaiting_change).insert(key.clone());
            } else {
                ctx.metrics.retried();
            }
            tracing::warn!(policy = %ctx.policy, parent = %key, attempt = retry.attempt, retry_in = ?(!await_change).then_some(retry.delay), error = %error, "reconcile failed");
            report_failure(
                &parent,
                identity.as_ref().ok(),
                &ctx,
                &error,
                retry,
                await_change,
                &mut trace,
            )
            .await;
            trace.finish(&parent, &ctx, RecordResult::Failed, Some(&error));
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
