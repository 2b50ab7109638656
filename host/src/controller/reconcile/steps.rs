//! One reconcile of one parent as a value: [`Reconcile`] holds what every step works on (the
//! parent, who it is, the policy's context and the record being written), and has one method
//! per step, in the order they run:
//!
//! `caches` → `finalizer` → `request` → `plugin` → `validate` → `apply` → `prune` → `status`
//! → `events`
//!
//! Between `finalizer` and `request`, the parent's last decision is checked
//! ([`decisions`](super::decisions)): when nothing but the host's own writes changed since,
//! the reconcile ends there, with no step after it and no record.
//!
//! Every step runs through [`Reconcile::step`], which opens its tracing span and times it for
//! the reconcile's record, so the two can never disagree about what the steps were.

use std::sync::Mutex;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::core::DynamicObject;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource as _, ResourceExt as _};
use tracing::Instrument as _;

use super::backoff::Retry;
use super::children::{self, DesiredChild};
use super::context::PolicyContext;
use super::decisions::{self, Inputs, OwnWrites};
use super::error::{ReconcileError, describe};
use super::events::{Published, truncate};
use super::parent::{ParentIdentity, parent_key};
use super::request::{self, Observed};
use super::serving::{ActivePlugin, Selection, Shadowed};
use super::status::{Outcome, Progress};
use super::trace::Trace;
use super::waits::{self, Wait, Waits};
use super::writes::{self, Applied};
use crate::case::Redaction;
use crate::controller::cache::related::RelatedBytes;
use crate::explain::{ChildAction, RecordResult};
use crate::lock;
use crate::metrics::ChildOperation;
use crate::plugin::{
    CallError, Digest, EventType as PluginEventType, JsonObject, Plugin, PluginEvent,
    ReconcileRequest, ReconcileResponse, Verdict, compare_hiding,
};

/// The shortest delay a plugin's `requeue-after` can ask for: a plugin answering 0 must not
/// turn one parent into a tight loop that holds a call slot for ever.
pub(crate) const MIN_REQUEUE: Duration = Duration::from_secs(1);

/// Most Events one reconcile may record; the rest are dropped (and counted), so a plugin
/// cannot flood the Events API by inventing a new reason per Event.
pub(crate) const MAX_EVENTS_PER_RECONCILE: usize = 10;

/// Longest a reconcile waits for the caches to sync before it fails (and is retried).
const CACHE_SYNC_WAIT: Duration = Duration::from_secs(5);

/// Most children of an answer without order written at once by one reconcile: a parent's
/// children cost about one round trip to the API server, while a reconcile never holds
/// more than a few of the client's connections.
const CHILD_WRITES_AT_ONCE: usize = 8;

/// Whether children of `kind` are written before the rest of an answer without order: what
/// the API server admits other objects against. A Pod naming a ServiceAccount, a
/// RoleBinding naming a Role the host may not escalate to, a custom resource of a CRD, or
/// anything in a new namespace is refused until that object exists; written together,
/// they would race it.
fn written_first(kind: &children::AllowedKind) -> bool {
    let group = kind
        .api_version
        .rsplit_once('/')
        .map_or("", |(group, _)| group);
    matches!(
        (group, kind.kind.as_str()),
        (
            "",
            "Namespace" | "ServiceAccount" | "ResourceQuota" | "LimitRange"
        ) | ("apiextensions.k8s.io", "CustomResourceDefinition")
            | ("rbac.authorization.k8s.io", "Role" | "ClusterRole")
            | ("scheduling.k8s.io", "PriorityClass")
            | ("storage.k8s.io", "StorageClass")
    )
}

/// How long a parent that is still finalizing waits before the plugin is asked again, when
/// the plugin names no delay.
const FINALIZING_REQUEUE: Duration = Duration::from_secs(5);

/// One reconcile of one parent.
pub(crate) struct Reconcile<'a> {
    parent: &'a DynamicObject,
    identity: &'a ParentIdentity,
    ctx: &'a PolicyContext,
    /// The record of this reconcile. Steps take `&self` (a step's future borrows the
    /// reconcile while the step helper records it); the lock is never contended.
    trace: Mutex<Trace>,
    /// The versions this reconcile's writes produced.
    own: OwnWrites,
}

/// A reconcile that succeeded.
pub(crate) struct Done {
    pub action: Action,
    /// The plugin asked for a requeue (otherwise the policy's resync brings the parent back).
    pub requeued: bool,
    /// The plugin whose decision the parent now reflects (none for a parent being deleted).
    pub decided_by: Option<Digest>,
    /// How the reconcile's record describes its end.
    pub result: RecordResult,
    /// The last decision still stood: the plugin was not asked, nothing was written, and
    /// the reconcile leaves no record.
    pub unchanged: bool,
}

impl Done {
    fn deleting(action: Action, result: RecordResult) -> Self {
        Self {
            action,
            requeued: false,
            decided_by: None,
            result,
            unchanged: false,
        }
    }
}

/// What the apply step did: which children wait, and, for an answer with order, what the
/// parent's status says of it.
struct ApplyOutcome {
    /// Children created or changed.
    wrote: usize,
    waits: Vec<Wait>,
    ordered: Option<OrderedOutcome>,
}

/// Where an ordered answer stands after its apply.
struct OrderedOutcome {
    /// The parent's `Progressing`.
    progress: Progress,
    /// The first child not ready by the host's judgement, for the parent's `Ready`.
    not_ready: Option<String>,
}

/// What the serving plugin decided for one parent, validated and stamped.
struct Decision {
    desired: Vec<DesiredChild>,
    status: Option<JsonObject>,
    events: Vec<PluginEvent>,
    requeue_after: Option<Duration>,
    /// The plugin that decided.
    digest: Digest,
}

impl<'a> Reconcile<'a> {
    /// A reconcile of `parent`, who is `identity`, recording into `trace`.
    pub fn new(
        parent: &'a DynamicObject,
        identity: &'a ParentIdentity,
        ctx: &'a PolicyContext,
        trace: Trace,
    ) -> Self {
        Self {
            parent,
            identity,
            ctx,
            trace: Mutex::new(trace),
            own: OwnWrites::default(),
        }
    }

    /// The record, once the reconcile is over.
    pub fn into_trace(self) -> Trace {
        self.trace
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Run `work` as the step `name`: in a span of that name (under the reconcile's), timed
    /// into the record when it succeeds. A step that fails is not recorded as done: the
    /// record's `failed` step times it instead.
    async fn step<T: Ended>(&self, name: &'static str, work: impl Future<Output = T>) -> T {
        let out = work
            .instrument(tracing::info_span!("step", otel.name = name, step = name))
            .await;
        if out.succeeded() {
            lock(&self.trace).step(name);
        }
        out
    }

    /// Every step, in order; none of the deciding ones when nothing but the host's own
    /// writes changed since the last decision ([`decisions`]).
    pub async fn run(&self) -> Result<Done, ReconcileError> {
        self.step("caches", self.wait_for_caches()).await?;
        if let Some((action, result)) = self.step("finalizer", self.finalize_or_hold()).await? {
            return Ok(Done::deleting(action, result));
        }
        let ctx = self.ctx;
        let key = self.decisions_key();
        // Before the caches are read: an event the read misses is noted for the next check.
        let since = ctx.decisions.begin(key);
        let observed = request::observed_children(self.identity, &ctx.caches.children);
        let selection = ctx
            .serving
            .select(self.parent.labels(), self.parent.uid().as_deref());
        let inputs = self.inputs(&since, &observed, &selection);
        if selection.shadow.is_none()
            && let Some(standing) =
                ctx.decisions
                    .standing(key, &since, &inputs, |index, namespace, name| {
                        let cache = &ctx.caches.children[index];
                        let mut child = ObjectRef::new_with(name, cache.resource.clone());
                        if let Some(namespace) = namespace {
                            child = child.within(namespace);
                        }
                        cache.store.get(&child).is_some()
                    })
        {
            if standing.awaiting_creates {
                ctx.metrics.awaiting_creates();
            } else {
                ctx.metrics.unchanged();
            }
            // The plugin's requeue, or the wait for the decision's creates, stays this
            // parent's timer; the resync is the policy's (`policy_run::resync`).
            let timed = standing.requeued || standing.awaiting_creates;
            return Ok(Done {
                action: if timed {
                    Action::requeue(standing.requeue_in)
                } else {
                    Action::await_change()
                },
                requeued: standing.requeued,
                decided_by: Some(*selection.serving.plugin.digest()),
                result: RecordResult::Reconciled,
                unchanged: true,
            });
        }
        let carried = self
            .decide_and_carry_out(inputs, &observed, &selection)
            .await;
        let settled = carried.as_ref().is_ok_and(|(_, settled)| *settled);
        if let Some(calls) = ctx.decisions.ended(key, settled) {
            ctx.metrics.converged(calls);
        }
        carried.map(|(done, _)| done)
    }

    /// Ask the plugin, carry its decision out, and remember what it was made on. Also says
    /// whether the reconcile settled: it wrote, deleted and held back no child.
    async fn decide_and_carry_out(
        &self,
        inputs: Inputs,
        observed: &[Observed],
        selection: &Selection,
    ) -> Result<(Done, bool), ReconcileError> {
        let ctx = self.ctx;
        let key = self.decisions_key();
        let decision = self.decide(observed, selection).await?;
        let applied = self
            .step("apply", self.apply(&decision.desired, observed))
            .await?;
        let pruned = self
            .step("prune", self.prune(observed, &decision.desired))
            .await?;
        self.step(
            "status",
            self.write_status(decision.status, &decision.desired, &applied),
        )
        .await?;
        self.step("events", self.publish(decision.events)).await;
        let requeue = requeue_delay(decision.requeue_after, ctx.resync);
        let settled = pruned == Some(0) && applied.wrote == 0 && applied.waits.is_empty();
        if pruned.is_some() {
            // A waiting child is not part of what stands: it is not there to be checked.
            let outcome = decisions::Outcome {
                children: decision
                    .desired
                    .iter()
                    .enumerate()
                    .filter(|(position, _)| !applied.waits.iter().any(|w| w.child == *position))
                    .map(|(_, child)| child.key())
                    .collect(),
                written: &self.own,
                requeue,
                requeued: decision.requeue_after.is_some(),
            };
            ctx.decisions.decided(key, inputs, &outcome);
        } else {
            ctx.decisions.forget(key);
        }
        let done = Done {
            action: match decision.requeue_after {
                Some(_) => Action::requeue(requeue),
                // The policy's timer brings the resync (`policy_run::resync`).
                None => Action::await_change(),
            },
            requeued: decision.requeue_after.is_some(),
            decided_by: Some(decision.digest),
            result: RecordResult::Reconciled,
            unchanged: false,
        };
        Ok((done, settled))
    }

    /// The parent's key in the policy's memory of decisions.
    fn decisions_key(&self) -> u64 {
        decisions::parent_key(self.identity.namespace.as_deref(), &self.identity.name)
    }

    /// What a decision for this parent, begun `since`, observing `observed` and served as
    /// `selection` says, is made on.
    fn inputs(
        &self,
        since: &decisions::Since,
        observed: &[request::Observed],
        selection: &Selection,
    ) -> Inputs {
        let serving = &selection.serving;
        Inputs::new(
            since,
            &self.own,
            decisions::plugin_fingerprint(serving.plugin.digest(), serving.config.as_deref()),
            self.parent.metadata.resource_version.as_deref(),
            observed.iter().map(|(index, child)| {
                let meta = &child.metadata;
                let name = meta.name.as_deref().unwrap_or_default();
                (
                    (*index, meta.namespace.as_deref(), name),
                    meta.resource_version.as_deref(),
                )
            }),
        )
    }

    /// Observed children must come from synced caches: an empty cache would look like
    /// "nothing exists yet" and turn a converged parent into a round of writes. The wait is
    /// bounded: a kind that cannot be listed must not hold reconciles (and with them a
    /// restart or shutdown) for ever. The policy's Ready condition says which and why.
    async fn wait_for_caches(&self) -> Result<(), ReconcileError> {
        let mut caches_ready = self.ctx.caches.ready.clone();
        match tokio::time::timeout(CACHE_SYNC_WAIT, caches_ready.wait_for(|ready| *ready)).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(ReconcileError::CachesNotReady),
        }
    }

    /// A parent being deleted is finalized (when this policy holds its finalizer) and goes no
    /// further; a live one gets the policy's finalizer first, if the policy asks for one.
    async fn finalize_or_hold(&self) -> Result<Option<(Action, RecordResult)>, ReconcileError> {
        let ctx = self.ctx;
        let holds_finalizer = ctx
            .finalizer
            .as_ref()
            .is_some_and(|f| self.parent.finalizers().contains(f));
        if self.parent.metadata.deletion_timestamp.is_some() {
            return if holds_finalizer {
                self.finalize().await.map(Some)
            } else {
                // Owned children go with the parent through garbage collection.
                Ok(Some((Action::await_change(), RecordResult::Deleting)))
            };
        }
        if let (Some(finalizer), false) = (&ctx.finalizer, holds_finalizer) {
            let mut ready = ctx.finalizers_ready.clone();
            match tokio::time::timeout(CACHE_SYNC_WAIT, ready.wait_for(|ready| *ready)).await {
                Ok(Ok(_)) => {}
                _ => return Err(ReconcileError::FinalizersNotReady),
            }
            writes::add_finalizer(self.parent, self.identity, finalizer, ctx, &self.own).await?;
        }
        Ok(None)
    }

    /// Call the plugin on a deleted parent, and drop the finalizer once it says it is done.
    async fn finalize(&self) -> Result<(Action, RecordResult), ReconcileError> {
        let ctx = self.ctx;
        let serving = ctx
            .serving
            .select(self.parent.labels(), self.parent.uid().as_deref())
            .serving;
        let observed = request::observed_children(self.identity, &ctx.caches.children);
        let request = self
            .step("request", self.request(&observed, &serving, true))
            .await?;
        let answer = self
            .step("plugin", self.call(&serving.plugin, request))
            .await?;
        self.step("events", self.publish(answer.events)).await;
        if !answer.finalized {
            tracing::info!("plugin has not finished finalizing; will ask again");
            return Ok((
                Action::requeue(requeue_delay(answer.requeue_after, FINALIZING_REQUEUE)),
                RecordResult::Finalizing,
            ));
        }
        if let Some(finalizer) = &ctx.finalizer {
            writes::remove_finalizer(self.parent, self.identity, finalizer, ctx).await?;
            tracing::info!("plugin finalized the parent; finalizer removed");
        }
        Ok((Action::await_change(), RecordResult::Finalized))
    }

    /// Ask the serving plugin (and the candidate in shadow, recording its verdict) and
    /// validate the children it wants.
    async fn decide(
        &self,
        observed: &[Observed],
        selection: &Selection,
    ) -> Result<Decision, ReconcileError> {
        let ctx = self.ctx;
        let serving = &selection.serving;
        let request = self
            .step("request", self.request(observed, serving, false))
            .await?;
        let key = parent_key(self.parent, &ctx.parent);
        ctx.decisions.calling(self.decisions_key());
        let response = self
            .step("plugin", async {
                let Some(shadow) = &selection.shadow else {
                    lock(&ctx.serving.shadow).remove(&key);
                    return self.call(&serving.plugin, request).await;
                };
                let shadow_request = ReconcileRequest {
                    config: shadow.config.clone(),
                    ..request.clone()
                };
                let answer = self.call(&serving.plugin, request).await;
                let shadow_answer = self.call_plugin(&shadow.plugin, shadow_request).await;
                let verdict = shadow_verdict(
                    &answer,
                    &shadow_answer,
                    self.identity,
                    &ctx.caches.allowed,
                    &ctx.policy_label,
                    &ctx.redaction,
                );
                lock(&self.trace).shadowed(&verdict);
                let (children, would_prune) = would_prune(&answer, &shadow_answer);
                lock(&ctx.serving.shadow).insert(
                    key,
                    Shadowed {
                        verdict,
                        children,
                        would_prune,
                    },
                );
                answer
            })
            .await?;
        let desired = self
            .step("validate", async {
                children::prepare(
                    response.children,
                    &ctx.caches.allowed,
                    self.identity,
                    &ctx.policy_label,
                )
                .map_err(ReconcileError::InvalidChildren)
            })
            .await?;
        Ok(Decision {
            desired,
            status: response.status,
            events: response.events,
            requeue_after: response.requeue_after,
            digest: *serving.plugin.digest(),
        })
    }

    /// What the plugin is asked about this parent, served by `serving`.
    async fn request(
        &self,
        observed: &[Observed],
        serving: &ActivePlugin,
        finalizing: bool,
    ) -> Result<ReconcileRequest, ReconcileError> {
        let ctx = self.ctx;
        let related = request::related(
            self.parent,
            self.identity,
            &ctx.caches.related,
            RelatedBytes::default(),
        )
        .await?;
        let request = request::build(self.parent, observed, related, serving, finalizing);
        let parent_type = (ctx.parent.api_version.as_str(), ctx.parent.kind.as_str());
        lock(&self.trace).asked(&request, *serving.plugin.digest(), parent_type);
        Ok(request)
    }

    /// Call the serving `plugin` and record its answer in the reconcile's record.
    async fn call(
        &self,
        plugin: &Plugin,
        request: ReconcileRequest,
    ) -> Result<ReconcileResponse, CallError> {
        let answer = self.call_plugin(plugin, request).await;
        lock(&self.trace).answered(&answer, &self.ctx.policy);
        answer
    }

    /// Call a plugin (serving or shadow), counting the call's outcome and duration.
    async fn call_plugin(
        &self,
        plugin: &Plugin,
        request: ReconcileRequest,
    ) -> Result<ReconcileResponse, CallError> {
        let started = std::time::Instant::now();
        let answer = plugin.reconcile_as(&self.ctx.policy, request).await;
        let outcome = answer.as_ref().map_or_else(CallError::outcome, |_| "ok");
        self.ctx.metrics.plugin_called(outcome, started.elapsed());
        answer
    }

    /// Apply the desired children, each after what it depends on, holding back those whose
    /// dependencies are not ready yet ([`waits`](super::waits)); a child already as desired
    /// costs no write.
    async fn apply(
        &self,
        desired: &[DesiredChild],
        observed: &[Observed],
    ) -> Result<ApplyOutcome, ReconcileError> {
        let ctx = self.ctx;
        let mut applied = 0;
        let mut ordering = Waits::new(desired, observed, &ctx.caches.children);
        let mut waits = Vec::new();
        // An answer without order is written before its outcomes are looked at (see
        // `write_unordered`); an ordered one, child by child below.
        let mut unordered = if ordering.ordered() {
            None
        } else {
            Some(self.write_unordered(desired).await)
        };
        let mut failed = None;
        for position in ordering.apply_order() {
            let child = &desired[position];
            if let Some(wait) = ordering.blocked(position) {
                ordering.held(position);
                let kind = &ctx.caches.allowed[child.kind_index].kind;
                let on = &desired[wait.on];
                let on_kind = &ctx.caches.allowed[on.kind_index].kind;
                lock(&self.trace).waiting(
                    kind,
                    &child.name,
                    format!("{on_kind} {}: {}", on.name, wait.why),
                );
                ctx.metrics.children(kind, ChildOperation::Waiting, 1);
                waits.push(wait);
                continue;
            }
            let outcome = match &mut unordered {
                // Every write that was made is recorded; the first failure fails the
                // reconcile once they are.
                Some(outcomes) => match outcomes[position].take() {
                    Some(Ok(outcome)) => outcome,
                    Some(Err(e)) => {
                        failed.get_or_insert(e);
                        continue;
                    }
                    None => continue,
                },
                None => writes::apply_child(child, self.identity, ctx, &self.own).await?,
            };
            let wrote = outcome.wrote();
            ordering.applied(position, wrote);
            let operation = if wrote {
                ChildOperation::Applied
            } else {
                ChildOperation::Unchanged
            };
            let kind = &ctx.caches.allowed[child.kind_index].kind;
            ctx.metrics.children(kind, operation, 1);
            let (action, changed) = match outcome {
                Applied::Created => (ChildAction::Created, Vec::new()),
                Applied::Changed(fields) => (ChildAction::Changed, fields),
                Applied::Unchanged => (ChildAction::Unchanged, Vec::new()),
            };
            lock(&self.trace).child(kind, &child.name, action, changed);
            applied += usize::from(wrote);
        }
        if applied > 0 {
            tracing::info!(
                applied,
                unchanged = desired.len() - applied - waits.len(),
                waiting = waits.len(),
                "children applied"
            );
        }
        if let Some(e) = failed {
            return Err(e);
        }
        // Only an answer with order is judged: an unordered one costs nothing more.
        let ordered = ordering.ordered().then(|| {
            let kinds: Vec<&str> = ctx.caches.allowed.iter().map(|a| a.kind.as_str()).collect();
            OrderedOutcome {
                progress: waits::describe(&waits, desired, &kinds)
                    .map_or(Progress::Applied, Progress::Waiting),
                not_ready: ordering.first_not_ready(&kinds),
            }
        });
        Ok(ApplyOutcome {
            wrote: applied,
            waits,
            ordered,
        })
    }

    /// Write an answer without order: first, one after another in the answer's order, the
    /// children others are admitted against (namespaces, CRDs, service accounts, roles: see
    /// [`written_first`]), stopping at a failure; then the rest up to
    /// [`CHILD_WRITES_AT_ONCE`] at a time, so a new parent's children cost about one round
    /// trip, not one each. Each child's outcome, in the answer's positions; none for a child
    /// not written because a first one failed.
    async fn write_unordered(
        &self,
        desired: &[DesiredChild],
    ) -> Vec<Option<Result<Applied, ReconcileError>>> {
        let ctx = self.ctx;
        let first = |child: &DesiredChild| written_first(&ctx.caches.allowed[child.kind_index]);
        let mut outcomes: Vec<_> = desired.iter().map(|_| None).collect();
        for (position, child) in desired.iter().enumerate().filter(|(_, c)| first(c)) {
            let outcome = writes::apply_child(child, self.identity, ctx, &self.own).await;
            let failed = outcome.is_err();
            outcomes[position] = Some(outcome);
            if failed {
                return outcomes;
            }
        }
        // Collected first: a stream over the closure would not be `Send` for every lifetime
        // the controller's future needs.
        let rest: Vec<_> = desired
            .iter()
            .enumerate()
            .filter(|(_, child)| !first(child))
            .map(|(position, child)| async move {
                let outcome = writes::apply_child(child, self.identity, ctx, &self.own).await;
                (position, outcome)
            })
            .collect();
        let written: Vec<_> = futures::stream::iter(rest)
            .buffer_unordered(CHILD_WRITES_AT_ONCE)
            .collect()
            .await;
        for (position, outcome) in written {
            outcomes[position] = Some(outcome);
        }
        outcomes
    }

    /// Delete the observed children the plugin no longer wants, unless the prune guard holds
    /// them (then the reconcile goes on: a hold is no failure, and the parent waits for the
    /// admin's answer rather than a retry). Returns how many were deleted, or none when the
    /// guard held them.
    async fn prune(
        &self,
        observed: &[Observed],
        desired: &[DesiredChild],
    ) -> Result<Option<usize>, ReconcileError> {
        let key = parent_key(self.parent, &self.ctx.parent);
        match writes::prune(observed, desired, &key, self.ctx).await? {
            writes::Pruned::Deleted(pruned) => {
                if !pruned.is_empty() {
                    tracing::info!(pruned = pruned.len(), "children pruned");
                }
                let mut trace = lock(&self.trace);
                let deleted = pruned.len();
                for (kind, name) in pruned {
                    trace.child(&kind, &name, ChildAction::Pruned, Vec::new());
                }
                Ok(Some(deleted))
            }
            writes::Pruned::Held(held) => {
                let guard = &self.ctx.prune_guard;
                self.ctx.metrics.set_prune_held(guard.held());
                let message = format!(
                    "the prune guard holds {} deletion(s) ({}) until the policy's change is confirmed or rolled back",
                    held.len(),
                    truncate(held.join(", "), 512)
                );
                tracing::warn!(
                    held = held.len(),
                    "children not pruned: the policy's prune guard holds its deletions"
                );
                lock(&self.trace).event(EventType::Warning, "PruneHeld", &message);
                Ok(None)
            }
        }
    }

    /// Write the plugin's status with `Reconciled=True` (skipped when nothing in it
    /// changed). The message leaves out which plugin decided: a swap to a plugin that decides
    /// the same must cost no write. The policy's status counts the parents on its active
    /// plugin instead.
    async fn write_status(
        &self,
        status: Option<JsonObject>,
        desired: &[DesiredChild],
        applied: &ApplyOutcome,
    ) -> Result<(), ReconcileError> {
        let (progress, children_ready) = applied
            .ordered
            .as_ref()
            .map(|ordered| (ordered.progress.clone(), ordered.not_ready.clone()))
            .unzip();
        let outcome = Outcome::success(desired.len())
            .with_progress(progress)
            .with_children_ready(children_ready);
        let (status, written) = writes::write_status(
            self.parent,
            self.identity,
            status,
            &outcome,
            self.ctx,
            &self.own,
        )
        .await?;
        lock(&self.trace).status(&status, written);
        Ok(())
    }

    /// Record the plugin's Events on the parent, at most [`MAX_EVENTS_PER_RECONCILE`].
    async fn publish(&self, events: Vec<PluginEvent>) {
        let ctx = self.ctx;
        let dropped = events.len().saturating_sub(MAX_EVENTS_PER_RECONCILE);
        if dropped > 0 {
            tracing::warn!(
                dropped,
                limit = MAX_EVENTS_PER_RECONCILE,
                "the plugin asked for more Events than one reconcile may record"
            );
            ctx.metrics.events_dropped(dropped as u64);
        }
        let mut over_quota = 0;
        for event in events.into_iter().take(MAX_EVENTS_PER_RECONCILE) {
            let type_ = match event.type_ {
                PluginEventType::Normal => EventType::Normal,
                PluginEventType::Warning => EventType::Warning,
            };
            lock(&self.trace).event(type_, &event.reason, &event.message);
            let published = ctx
                .events
                .publish(
                    &self.reference(),
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
            ctx.metrics.events_dropped(over_quota);
        }
    }

    fn reference(&self) -> ObjectReference {
        self.parent.object_ref(&self.ctx.parent)
    }
}

/// Set `Reconciled=False` with the cause and record a Warning Event. Best effort: the failure
/// itself is what the controller acts on. A parent without a name or uid (no `identity`) gets
/// the Event only.
pub(crate) async fn report_failure(
    parent: &DynamicObject,
    identity: Option<&ParentIdentity>,
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
    let message = truncate(
        format!("{error:#} (attempt {}, {next})", retry.attempt),
        2048,
    );
    if let Some(identity) = identity {
        let outcome = Outcome::failure(reason, message.clone());
        if let Err(e) = writes::write_failure_status(identity, &outcome, ctx).await {
            tracing::warn!(error = %e, "could not record the failure in the parent's status");
        }
    }
    trace.event(EventType::Warning, reason, &message);
    ctx.events
        .publish(
            &parent.object_ref(&ctx.parent),
            EventType::Warning,
            reason,
            "Reconcile",
            message,
        )
        .await;
}

/// What a step ended with: whether it succeeded.
trait Ended {
    fn succeeded(&self) -> bool;
}

impl Ended for () {
    fn succeeded(&self) -> bool {
        true
    }
}

impl<T, E> Ended for Result<T, E> {
    fn succeeded(&self) -> bool {
        self.is_ok()
    }
}

/// How the candidate's answer compares with the serving plugin's. An answer the host would
/// refuse is a failure, however it compares. The verdict's text ends up in the policy's
/// status, so it quotes no value `redaction` hides, nor any Secret value
/// ([`Redaction::in_status`]).
fn shadow_verdict(
    answer: &Result<ReconcileResponse, CallError>,
    shadow_answer: &Result<ReconcileResponse, CallError>,
    identity: &ParentIdentity,
    allowed: &[children::AllowedKind],
    policy_label: &str,
    redaction: &Redaction,
) -> Verdict {
    if let Ok(response) = shadow_answer
        && let Err(problems) =
            children::prepare(response.children.clone(), allowed, identity, policy_label)
    {
        return Verdict::WouldFail(format!(
            "the host would refuse its answer: {}",
            describe(&problems)
        ));
    }
    redaction
        .in_status()
        .hiding(|hide| compare_hiding(answer, shadow_answer, hide))
}

/// How many children the active plugin answered, and how many of them the candidate's answer
/// leaves out (by kind and name): none when either failed, which counts as a failure instead.
fn would_prune(
    answer: &Result<ReconcileResponse, CallError>,
    shadow_answer: &Result<ReconcileResponse, CallError>,
) -> (u64, u64) {
    let (Ok(answer), Ok(shadow_answer)) = (answer, shadow_answer) else {
        return (0, 0);
    };
    let identity = |child: &JsonObject| {
        let text = |v: Option<&serde_json::Value>| {
            v.and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        // By kind and name: every child is in the parent's namespace (or cluster-scoped), so
        // a namespace written out or left to default is the same child.
        (
            text(child.get("kind")),
            text(child.get("metadata").and_then(|m| m.get("name"))),
        )
    };
    let kept: std::collections::HashSet<_> = shadow_answer.children.iter().map(identity).collect();
    let dropped = answer
        .children
        .iter()
        .filter(|child| !kept.contains(&identity(child)))
        .count();
    (answer.children.len() as u64, dropped as u64)
}

/// The plugin's requeue delay, never below [`MIN_REQUEUE`]; `otherwise` without one.
fn requeue_delay(asked: Option<Duration>, otherwise: Duration) -> Duration {
    asked.map_or(otherwise, |delay| delay.max(MIN_REQUEUE))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

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
            shard: None,
        };
        let allowed = [children::AllowedKind {
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            namespaced: true,
        }];
        let redaction = Redaction::default();
        let verdict =
            |active, shadow| shadow_verdict(&active, &shadow, &identity, &allowed, "p", &redaction);
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
    #[test]
    fn what_others_are_admitted_against_is_written_first() {
        let kind = |api_version: &str, kind: &str| children::AllowedKind {
            api_version: api_version.into(),
            kind: kind.into(),
            namespaced: true,
        };
        for first in [
            kind("v1", "Namespace"),
            kind("v1", "ServiceAccount"),
            kind("rbac.authorization.k8s.io/v1", "Role"),
            kind("rbac.authorization.k8s.io/v1", "ClusterRole"),
            kind("apiextensions.k8s.io/v1", "CustomResourceDefinition"),
        ] {
            assert!(written_first(&first), "{}", first.kind);
        }
        for rest in [
            kind("apps/v1", "Deployment"),
            kind("v1", "ConfigMap"),
            kind("v1", "Pod"),
            kind("rbac.authorization.k8s.io/v1", "RoleBinding"),
            // Same name, another group: not the one the API server admits against.
            kind("example.com/v1", "Role"),
        ] {
            assert!(!written_first(&rest), "{}", rest.kind);
        }
    }
}
