//! Rollouts that run themselves: the leader walks a policy's candidate through the stages of
//! `spec.plugin.rollout`, measuring each stage's gates from what the reconciles and shadow
//! runs left behind, and advances, waits or rolls back.
//!
//! Everything the rollout knows lives in `status.rollout` (the stage, when it began, the
//! history), so a leader that takes over mid-rollout reads it and continues the same stage;
//! only the measurements start over, as they are taken from the new leader's own reconciles.
//! On sharded hosts the holder of shard 0 decides over every shard's figures and the others
//! follow (see [`rollout_across`]).
//! What a stage decides is applied to [`Serving`] (the candidate's share, or its stop) before
//! the status says so, and every change re-enqueues every parent at the controller's normal
//! concurrency: parents moved to a plugin that decides as the last one see no write.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt as _;
use kube::runtime::events::EventType;
use kube::runtime::reflector::Store;
use tokio::sync::{Mutex, mpsc, watch};

use crate::controller::cache::cached::CachedObject;
use crate::controller::cache::stores::ChildCache;
use crate::controller::policy_run::status::PolicyStatusWriter;
use crate::controller::policy_run::{replay_gate, rollout_across};
use crate::controller::reconcile::context::PolicyContext;
use crate::controller::reconcile::events::EventSink;
use crate::controller::reconcile::parent::parent_key;
use crate::controller::reconcile::prune_guard::PruneLimits;
use crate::controller::reconcile::serving::Candidate;
use crate::controller::reconcile::status::PROGRESSING;
use crate::controller::reconcile::waits::observed_not_ready;
use crate::lock;
use crate::plugin::Verdict;
use crate::policy::{
    ReconcilePolicy, ReplayGate, ReplayResult, RolloutSpec, RolloutStage, RolloutStatus,
    RolloutTransition,
};

/// How often the leader looks at the gates.
const INTERVAL: Duration = Duration::from_secs(2);

/// Transitions kept in `status.rollout.history`.
const HISTORY: usize = 10;

/// Parents named in a rollback's status.
const EXAMPLES: usize = 5;

/// `maxWouldChange` when a stage sets none.
const DEFAULT_MAX_WOULD_CHANGE: f64 = 0.5;

/// `maxFailing` when a stage sets none.
const DEFAULT_MAX_FAILING: f64 = 0.5;

/// `maxNotReady` when a stage sets none.
const DEFAULT_MAX_NOT_READY: f64 = 0.1;

/// `progressDeadlineSeconds` when a stage sets none.
const DEFAULT_PROGRESS_DEADLINE: Duration = Duration::from_secs(600);

/// The phases `status.rollout.phase` takes.
mod phase {
    pub const PROGRESSING: &str = "Progressing";
    pub const PAUSED: &str = "Paused";
    pub const COMPLETE: &str = "Complete";
    pub const ROLLED_BACK: &str = "RolledBack";
}

/// What one stage's gates are measured on: the parents that exist now, split into those the
/// candidate serves and the rest (which the active plugin serves and the candidate shadows).
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub(crate) struct Measured {
    /// Parents the candidate shadows.
    pub shadowed: u64,
    /// Of those, parents it was compared on.
    pub evaluated: u64,
    pub would_fail: u64,
    pub would_change: u64,
    /// The children the active plugin answered for the parents compared, and of those, the
    /// children the candidate's answers leave out.
    pub shadow_children: u64,
    pub would_prune: u64,
    /// Parents the candidate serves.
    pub served: u64,
    /// Of those, parents whose last reconcile the candidate decided, or which are failing.
    pub served_decided: u64,
    pub served_failing: u64,
    /// Of those the candidate decided, parents that are not ready (a child not ready, as
    /// the host judges it, or a `Ready` condition that is not `True`).
    pub served_not_ready: u64,
    /// Parents the active plugin serves.
    pub rest: u64,
    pub rest_failing: u64,
    pub rest_not_ready: u64,
    /// A few parents that fail under the candidate, or would, `namespace/name`.
    pub examples: Vec<String>,
    /// A few of the candidate's parents that are not ready, with why.
    pub not_ready_examples: Vec<String>,
}

/// What the gates say about a stage.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Decision {
    /// Every gate passed: on to the next stage.
    Advance(String),
    /// No gate failed, but not all can decide yet.
    Wait(String),
    /// A gate failed (`gate` names it); the figures are in the message.
    RollBack { gate: &'static str, message: String },
}

/// The share `part` is of `whole` (0 of nothing).
fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// A share as a percentage, for messages.
fn percent(fraction: f64) -> String {
    format!("{:.1}%", fraction * 100.0)
}

/// How many shadowed parents the stage compares before it may end.
fn to_compare(stage: &RolloutStage, m: &Measured) -> u64 {
    stage
        .min_parents
        .map_or(m.shadowed, u64::from)
        .min(m.shadowed)
}

/// Decide a stage from what was measured `elapsed` after it began; `prune` is the policy's
/// prune guard, whose share and floor `maxWouldPrune` defaults to.
pub(crate) fn decide(
    stage: &RolloutStage,
    prune: PruneLimits,
    m: &Measured,
    elapsed: Duration,
) -> Decision {
    if let Some(breach) = breach(stage, prune, m, elapsed) {
        return breach;
    }
    let to_compare = to_compare(stage, m);
    let served_all = m.served_decided >= m.served;
    let figures = format!(
        "serving {} parent(s), {} failing, {} not ready (the rest: {} of {}); compared {} of {} shadowed, {} would fail, {} would change, {} of {} children would be pruned",
        m.served,
        m.served_failing,
        m.served_not_ready,
        m.rest_not_ready,
        m.rest,
        m.evaluated,
        m.shadowed,
        m.would_fail,
        m.would_change,
        m.would_prune,
        m.shadow_children
    );
    let soak = Duration::from_secs(u64::from(stage.soak_seconds.unwrap_or(0)));
    if elapsed < soak {
        return Decision::Wait(format!(
            "soaking for {}s more; {figures}",
            (soak - elapsed).as_secs()
        ));
    }
    let timed_out = stage
        .max_seconds
        .is_some_and(|max| elapsed >= Duration::from_secs(u64::from(max)));
    let ready = readiness_gap(stage, m).is_none();
    if (m.evaluated >= to_compare && served_all && ready) || timed_out {
        return Decision::Advance(figures);
    }
    let mut missing = Vec::new();
    if m.evaluated < to_compare {
        missing.push(format!(
            "{} more shadowed parent(s) to compare",
            to_compare - m.evaluated
        ));
    }
    if !served_all {
        missing.push(format!(
            "{} served parent(s) not yet reconciled by the candidate",
            m.served - m.served_decided
        ));
    }
    if let Some(gap) = readiness_gap(stage, m) {
        missing.push(format!("the candidate's parents to be ready ({gap})"));
    }
    Decision::Wait(format!("waiting for {}; {figures}", missing.join(" and ")))
}

/// When the candidate's parents are less ready than the rest by more than `maxNotReady`:
/// the figures, in words.
fn readiness_gap(stage: &RolloutStage, m: &Measured) -> Option<String> {
    let max_not_ready = stage.max_not_ready.unwrap_or(DEFAULT_MAX_NOT_READY);
    // Judged against the rest: with none (a stage at 100 %), there is nothing to compare
    // with, and a cluster where some parents are never ready would hold every rollout.
    if m.served == 0 || m.rest == 0 || m.served_decided < m.served {
        return None;
    }
    let (served, rest) = (
        share(m.served_not_ready, m.served),
        share(m.rest_not_ready, m.rest),
    );
    let examples = if m.not_ready_examples.is_empty() {
        String::new()
    } else {
        format!("; e.g. {}", m.not_ready_examples.join(", "))
    };
    (served - rest > max_not_ready).then(|| {
        format!(
            "{} of the {} parents the candidate serves are not ready ({}), against {} of the {} the active plugin serves ({}); at most {} more allowed{examples}",
            m.served_not_ready,
            m.served,
            percent(served),
            m.rest_not_ready,
            m.rest,
            percent(rest),
            percent(max_not_ready)
        )
    })
}

/// The first gate that failed, if one did.
fn breach(
    stage: &RolloutStage,
    prune: PruneLimits,
    m: &Measured,
    elapsed: Duration,
) -> Option<Decision> {
    // Shadow gates: decided as soon as the failures already exceed what the share allows of
    // all the parents the stage will compare.
    let basis = m.evaluated.max(to_compare(stage, m));
    let max_would_fail = stage.max_would_fail.unwrap_or(0.0);
    if m.would_fail as f64 > max_would_fail * basis as f64 {
        return Some(Decision::RollBack {
            gate: "maxWouldFail",
            message: format!(
                "the candidate would fail on {} of {} shadowed parents compared (at most {} of {basis} allowed)",
                m.would_fail,
                m.evaluated,
                percent(max_would_fail)
            ),
        });
    }
    let max_would_prune = stage.max_would_prune.unwrap_or(prune.max_fraction);
    let budget = PruneLimits {
        max_fraction: max_would_prune,
        ..prune
    };
    let allowed = budget.allowed(m.shadow_children);
    {
        if m.would_prune > allowed {
            return Some(Decision::RollBack {
                gate: "maxWouldPrune",
                message: format!(
                    "the candidate would prune {} of the {} children of the {} shadowed parents compared (at most {} allowed: {} of them, at least {})",
                    m.would_prune,
                    m.shadow_children,
                    m.evaluated,
                    allowed,
                    percent(max_would_prune),
                    prune.floor
                ),
            });
        }
    }
    let max_would_change = stage.max_would_change.unwrap_or(DEFAULT_MAX_WOULD_CHANGE);
    if m.would_change as f64 > max_would_change * basis as f64 {
        return Some(Decision::RollBack {
            gate: "maxWouldChange",
            message: format!(
                "the candidate would change {} of {} shadowed parents compared (at most {} of {basis} allowed)",
                m.would_change,
                m.evaluated,
                percent(max_would_change)
            ),
        });
    }
    // Canary gates: the candidate's parents against the rest.
    let (served_failing, rest_failing) = (
        share(m.served_failing, m.served),
        share(m.rest_failing, m.rest),
    );
    let max_failure_rate = stage.max_failure_rate.unwrap_or(0.05);
    if m.served > 0 && served_failing - rest_failing > max_failure_rate {
        return Some(Decision::RollBack {
            gate: "maxFailureRate",
            message: format!(
                "{} of the {} parents the candidate serves fail ({}), against {} of the {} the active plugin serves ({}); at most {} more allowed",
                m.served_failing,
                m.served,
                percent(served_failing),
                m.rest_failing,
                m.rest,
                percent(rest_failing),
                percent(max_failure_rate)
            ),
        });
    }
    let max_failing = stage.max_failing.unwrap_or(DEFAULT_MAX_FAILING);
    if m.served > 0 && served_failing > max_failing {
        return Some(Decision::RollBack {
            gate: "maxFailing",
            message: format!(
                "{} of the {} parents the candidate serves fail ({}); at most {} may, whatever the rest do",
                m.served_failing,
                m.served,
                percent(served_failing),
                percent(max_failing)
            ),
        });
    }
    let deadline = stage
        .progress_deadline_seconds
        .map_or(DEFAULT_PROGRESS_DEADLINE, |s| {
            Duration::from_secs(u64::from(s))
        });
    if elapsed >= deadline
        && let Some(gap) = readiness_gap(stage, m)
    {
        return Some(Decision::RollBack {
            gate: "maxNotReady",
            message: format!("{gap}, {}s after the stage began", deadline.as_secs()),
        });
    }
    None
}

impl Measured {
    /// Add what `other` measured of other parents.
    pub fn merge(&mut self, other: Measured) {
        self.shadowed += other.shadowed;
        self.evaluated += other.evaluated;
        self.would_fail += other.would_fail;
        self.would_change += other.would_change;
        self.shadow_children += other.shadow_children;
        self.would_prune += other.would_prune;
        self.served += other.served;
        self.served_decided += other.served_decided;
        self.served_failing += other.served_failing;
        self.served_not_ready += other.served_not_ready;
        self.rest += other.rest;
        self.rest_failing += other.rest_failing;
        self.rest_not_ready += other.rest_not_ready;
        self.examples.extend(other.examples);
        self.examples.sort();
        self.examples.truncate(EXAMPLES);
        self.not_ready_examples.extend(other.not_ready_examples);
        self.not_ready_examples.sort();
        self.not_ready_examples.truncate(EXAMPLES);
    }
}

/// Measure the gates over the parents that exist now.
pub(crate) fn measure(
    ctx: &PolicyContext,
    candidate: &Candidate,
    parents: &Store<CachedObject>,
) -> Measured {
    measure_by(ctx, candidate, parents, |_| Some(0))
        .remove(&0)
        .unwrap_or_default()
}

/// The candidate's gate figures for each of `held` (this replica's shards), for their
/// Leases to carry to the replica that decides (see [`rollout_across`]).
pub(crate) fn shard_reports(
    ctx: &PolicyContext,
    candidate: &Candidate,
    parents: &Store<CachedObject>,
    shards: &crate::shards::ShardOwnership,
    held: &std::collections::BTreeSet<u32>,
) -> std::collections::BTreeMap<u32, crate::shards::RolloutReport> {
    let figures = measure_by(ctx, candidate, parents, |parent| {
        let shard = shards.shard_of_parent(parent);
        held.contains(&shard).then_some(shard)
    });
    rollout_across::reports(candidate, held, figures)
}

/// [`measure`] with the parents in groups (their shards): `group` names each parent's, and
/// leaves out those it gives none. A group without parents is not in the answer.
pub(crate) fn measure_by(
    ctx: &PolicyContext,
    candidate: &Candidate,
    parents: &Store<CachedObject>,
    group: impl Fn(&CachedObject) -> Option<u32>,
) -> std::collections::BTreeMap<u32, Measured> {
    let digest = *candidate.serving.plugin.digest();
    let reconciled = lock(&ctx.outcomes.reconciled).clone();
    let shadow = lock(&ctx.serving.shadow);
    let mut groups: std::collections::BTreeMap<u32, (Measured, Vec<String>)> =
        std::collections::BTreeMap::new();
    for parent in parents.state() {
        let Some(in_group) = group(&parent) else {
            continue;
        };
        let (m, shadow_examples) = groups.entry(in_group).or_default();
        let key = parent_key(parent.as_ref(), &ctx.parent);
        let name = match &key.namespace {
            Some(namespace) => format!("{namespace}/{}", key.name),
            None => key.name.clone(),
        };
        let failing = ctx.outcomes.backoff.is_failing(&key);
        let not_ready = not_ready(&parent, &ctx.caches.children);
        if candidate.serves(&parent.labels(), parent.metadata.uid.as_deref()) {
            m.served += 1;
            let decided = reconciled.get(&key).is_some_and(|d| *d == Some(digest));
            if failing {
                m.served_failing += 1;
                m.served_decided += 1;
                m.examples.push(name);
            } else if decided {
                m.served_decided += 1;
                if let Some(why) = not_ready {
                    m.served_not_ready += 1;
                    m.not_ready_examples.push(format!("{name}: {why}"));
                }
            }
        } else {
            m.rest += 1;
            m.rest_failing += u64::from(failing);
            m.rest_not_ready += u64::from(not_ready.is_some() && !failing);
            m.shadowed += 1;
            if let Some(shadowed) = shadow.get(&key) {
                m.shadow_children += shadowed.children;
                m.would_prune += shadowed.would_prune;
            }
            match shadow.get(&key).map(|s| &s.verdict) {
                None => {}
                Some(Verdict::Unchanged) => m.evaluated += 1,
                Some(Verdict::WouldChange(_)) => {
                    m.evaluated += 1;
                    m.would_change += 1;
                }
                Some(Verdict::WouldFail(_)) => {
                    m.evaluated += 1;
                    m.would_fail += 1;
                    shadow_examples.push(name);
                }
            }
        }
    }
    groups
        .into_iter()
        .map(|(in_group, (mut m, shadow_examples))| {
            m.examples.extend(shadow_examples);
            m.examples.sort();
            m.examples.truncate(EXAMPLES);
            m.not_ready_examples.sort();
            m.not_ready_examples.truncate(EXAMPLES);
            (in_group, m)
        })
        .collect()
}

/// Why `parent` is not ready, if it is not: the first of its children (in the caches) that
/// the host judges not ready, children the host holds back, or its own `Ready` condition
/// when that is there and not `True`. A plugin writes the condition; it cannot write its
/// children's status.
fn not_ready(parent: &CachedObject, children: &[ChildCache]) -> Option<String> {
    let uid = parent.metadata.uid.as_deref()?;
    for cache in children {
        for key in cache.by_controller.get(uid) {
            let Some(child) = cache.store.get(&key) else {
                continue;
            };
            if let Some(why) = observed_not_ready(cache, &child) {
                let kind = child.types.as_ref().map_or("", |t| t.kind.as_str());
                return Some(format!("{kind} {} {why}", child.name_any()));
            }
        }
    }
    by_conditions(&parent.to_value())
}

/// Why `parent` is not ready by its conditions: the host's `Progressing=True, WaitingFor`
/// (children held back for what they depend on, so not there to be judged), or a `Ready`
/// condition that is not `True`.
fn by_conditions(parent: &serde_json::Value) -> Option<String> {
    let conditions = parent["status"]["conditions"].as_array()?;
    if let Some(waiting) = conditions
        .iter()
        .find(|c| c["type"] == PROGRESSING && c["reason"] == "WaitingFor")
    {
        return Some(format!(
            "waiting: {}",
            waiting["message"].as_str().unwrap_or_default()
        ));
    }
    conditions
        .iter()
        .find(|c| c["type"] == "Ready" && c["status"] != "True")
        .map(|c| format!("Ready={}", c["status"].as_str().unwrap_or("Unknown")))
}

/// The leader's rollout loop for one policy.
pub(crate) struct Driver {
    pub ctx: Arc<PolicyContext>,
    pub parents: Store<CachedObject>,
    pub status: Arc<Mutex<PolicyStatusWriter>>,
    /// Re-enqueues every parent of the policy.
    pub requeue_all: mpsc::UnboundedSender<()>,
    /// Events on the policy, as the host (they are about the policy, not its parents).
    pub events: EventSink,
}

impl Driver {
    /// Run until the controller stops.
    pub async fn run(self, mut updates: watch::Receiver<Arc<ReconcilePolicy>>) {
        let mut leading = self.ctx.leadership.subscribe();
        let mut was_leading = false;
        loop {
            tokio::select! {
                () = tokio::time::sleep(INTERVAL) => {}
                changed = updates.changed() => if changed.is_err() { return },
                changed = leading.changed() => if changed.is_err() { return },
            }
            let is_leading = self.ctx.leadership.is_leader();
            if !is_leading {
                was_leading = false;
                if self.ctx.leadership.shards().is_some() {
                    let policy = updates.borrow_and_update().clone();
                    self.follow(&policy).await;
                }
                continue;
            }
            if !was_leading {
                // What the last leader wrote is where this one continues.
                self.status.lock().await.adopt_rollout().await;
                was_leading = true;
            }
            let policy = updates.borrow_and_update().clone();
            self.tick(&policy).await;
        }
    }

    /// On a sharded replica that does not decide: serve the candidate to the share the
    /// rollout's status says (read afresh), so this replica's shards follow the decision.
    async fn follow(&self, policy: &ReconcilePolicy) {
        let (Some(spec), Some(candidate)) = (
            &policy.spec.plugin.rollout,
            self.ctx.serving.candidate.load_full(),
        ) else {
            return;
        };
        let digest = candidate.serving.plugin.digest().to_string();
        let decided = {
            let mut status = self.status.lock().await;
            status.adopt_rollout().await;
            status.rollout().filter(|r| r.digest == digest).cloned()
        };
        if let Some(rollout) = decided {
            let share = share_for(&rollout, spec.replay.is_some());
            self.apply(&candidate, share);
            self.ctx
                .metrics
                .set_rollout_stage(Some(share.map_or(-1, i64::from)));
        }
    }

    /// Look at the gates once, and act on what they say.
    async fn tick(&self, policy: &ReconcilePolicy) {
        let serving = &self.ctx.serving;
        let candidate = serving.candidate.load_full();
        let (Some(spec), Some(candidate)) = (&policy.spec.plugin.rollout, candidate) else {
            // Without a rollout, or with its candidate removed, there is nothing to keep: a
            // candidate named again (even the one rolled back) starts a new rollout.
            if policy.spec.plugin.rollout.is_none() || policy.spec.plugin.candidate.is_none() {
                self.status.lock().await.set_rollout(None);
                self.ctx.metrics.set_rollout_stage(None);
            }
            return;
        };
        let digest = candidate.serving.plugin.digest().to_string();
        // The replay gate runs before the status is locked: replaying takes a while.
        let replayed = match &spec.replay {
            Some(gate) if self.replay_pending(&digest).await => {
                self.apply(&candidate, Some(0));
                let namespace = policy.namespace();
                Some(
                    replay_gate::replay(
                        &self.ctx,
                        gate,
                        namespace.as_deref(),
                        &candidate.serving,
                        &replay_gate::convert_to(policy),
                    )
                    .await,
                )
            }
            _ => None,
        };
        let mut status = self.status.lock().await;
        let retry = retry_annotation(policy);
        let mut state = match status.rollout() {
            Some(state)
                if state.digest == digest
                    && !(state.phase == phase::ROLLED_BACK
                        && retry.is_some()
                        && state.retried_for.as_deref() != retry) =>
            {
                state.clone()
            }
            Some(state) if state.digest == digest => {
                // Rolled back, and the retry annotation took a new value: start over, keeping
                // the history.
                let mut again = started(&digest, spec);
                again.retried_for = retry.map(str::to_owned);
                let mut history = state.history.clone();
                history.insert(0, again.history[0].clone());
                history.truncate(HISTORY);
                again.history = history;
                self.transition(
                    policy,
                    &again,
                    "started",
                    "RolloutRetried",
                    EventType::Normal,
                )
                .await;
                again
            }
            _ => {
                let mut state = started(&digest, spec);
                // A value set before this rollout began asks for no retry of it.
                state.retried_for = retry.map(str::to_owned);
                self.transition(
                    policy,
                    &state,
                    "started",
                    "RolloutStarted",
                    EventType::Normal,
                )
                .await;
                state
            }
        };
        let last = spec.stages.len().saturating_sub(1);
        state.stage = state.stage.min(u32::try_from(last).unwrap_or(u32::MAX));
        let gated = match &spec.replay {
            Some(gate) if state.replay.is_none() && !finished(&state) => {
                self.replay_gate(policy, gate, &candidate, &mut state, replayed)
                    .await
            }
            _ => false,
        };
        match state.phase.as_str() {
            _ if gated => {}
            phase::ROLLED_BACK => self.apply(&candidate, None),
            phase::COMPLETE => self.apply(&candidate, Some(100)),
            _ => {
                let stage = &spec.stages[state.stage as usize];
                self.apply(&candidate, Some(stage.percent));
                self.step(policy, spec, &candidate, &mut state).await;
            }
        }
        self.ctx
            .metrics
            .set_rollout_stage(Some(match state.phase.as_str() {
                phase::ROLLED_BACK => -1,
                _ => i64::from(state.percent),
            }));
        status.set_rollout(Some(state));
        status.flush().await;
    }

    /// Whether the rollout of `digest` still waits for its replay gate.
    async fn replay_pending(&self, digest: &str) -> bool {
        match self.status.lock().await.rollout() {
            Some(state) if state.digest == digest => state.replay.is_none() && !finished(state),
            _ => true,
        }
    }

    /// Act on what the replay gate found (`replayed`, when it ran in this tick): record a
    /// pass, roll back on a failure. Whether the rollout is held here (waiting for the
    /// cases, or rolled back), serving no parent.
    async fn replay_gate(
        &self,
        policy: &ReconcilePolicy,
        gate: &ReplayGate,
        candidate: &Candidate,
        state: &mut RolloutStatus,
        replayed: Option<anyhow::Result<ReplayResult>>,
    ) -> bool {
        match replayed {
            None => {
                self.apply(candidate, Some(0));
                state.message =
                    "replaying the recorded cases before the candidate serves any parent"
                        .to_owned();
                true
            }
            Some(Err(error)) => {
                self.apply(candidate, Some(0));
                state.message = format!(
                    "waiting for the replay gate: {error:#}; the candidate serves no parent until its cases replay"
                );
                true
            }
            Some(Ok(result)) if replay_gate::passed(gate, &result) => {
                push(
                    state,
                    "Replayed",
                    format!(
                        "{} cases: {} unchanged, {} would change, 0 would fail",
                        result.cases, result.unchanged, result.would_change
                    ),
                );
                state.replay = Some(result);
                false
            }
            Some(Ok(result)) => {
                let message = format!(
                    "{} of {} cases would fail, {} would change{}",
                    result.would_fail,
                    result.cases,
                    result.would_change,
                    if gate.fail_on_change {
                        " (failOnChange)"
                    } else {
                        ""
                    }
                );
                state.phase = phase::ROLLED_BACK.to_owned();
                state.stage_since = Time(jiff::Timestamp::now());
                state.percent = 0;
                state.examples = result.examples.clone();
                state.message = format!(
                    "rolled back before serving: the replay gate failed: {message}; the active plugin serves every parent"
                );
                push(state, "RolledBack", format!("replay: {message}"));
                state.replay = Some(result);
                self.apply(candidate, None);
                self.transition(
                    policy,
                    state,
                    "rolled_back",
                    "RolledBack",
                    EventType::Warning,
                )
                .await;
                true
            }
        }
    }

    /// The gates' figures over every parent: on sharded hosts, this replica's shards
    /// measured now and the others as their holders last reported them, with what is still
    /// missing (the shards that have not reported for the candidate at its share yet).
    fn measure_stage(&self, candidate: &Candidate) -> (Measured, Option<String>) {
        let Some(shards) = self.ctx.leadership.shards() else {
            return (measure(&self.ctx, candidate, &self.parents), None);
        };
        let held = shards.held();
        let (others, waiting): (Vec<Measured>, _) =
            rollout_across::reported(&self.ctx.policy, candidate, shards, &held);
        let mut total = measure_by(&self.ctx, candidate, &self.parents, |parent| {
            let shard = shards.shard_of_parent(parent);
            held.contains(&shard).then_some(0)
        })
        .remove(&0)
        .unwrap_or_default();
        for figures in others {
            total.merge(figures);
        }
        (total, waiting)
    }

    /// Measure the current stage and move on, wait or roll back.
    async fn step(
        &self,
        policy: &ReconcilePolicy,
        spec: &RolloutSpec,
        candidate: &Candidate,
        state: &mut RolloutStatus,
    ) {
        let index = state.stage as usize;
        let stage = &spec.stages[index];
        let elapsed = jiff::Timestamp::now()
            .duration_since(state.stage_since.0)
            .unsigned_abs();
        let (measured, waiting) = self.measure_stage(candidate);
        let decision = match (
            decide(stage, self.ctx.prune_guard.limits(), &measured, elapsed),
            waiting,
        ) {
            // What the shards reported already is enough to roll back (the failures are
            // real), not to move on.
            (rollback @ Decision::RollBack { .. }, _) => rollback,
            (_, Some(waiting)) => Decision::Wait(waiting),
            (decision, None) => decision,
        };
        if spec.paused {
            state.phase = phase::PAUSED.to_owned();
            state.message = format!(
                "paused by spec.plugin.rollout.paused; the gates say: {}",
                describe(&decision)
            );
            return;
        }
        state.phase = phase::PROGRESSING.to_owned();
        match decision {
            Decision::Wait(message) => state.message = message,
            Decision::Advance(figures) => {
                let now = Time(jiff::Timestamp::now());
                state.stage_since = now;
                state.examples.clear();
                if let Some(next) = spec.stages.get(index + 1) {
                    state.stage += 1;
                    state.stage_name = next.name();
                    state.percent = next.percent;
                    state.message = format!("entered {}", next.name());
                    push(
                        state,
                        "Advanced",
                        format!("{} passed: {figures}", stage.name()),
                    );
                    self.apply(candidate, Some(next.percent));
                    self.transition(
                        policy,
                        state,
                        "advanced",
                        "RolloutAdvanced",
                        EventType::Normal,
                    )
                    .await;
                } else {
                    state.phase = phase::COMPLETE.to_owned();
                    state.stage_name = "all".to_owned();
                    state.percent = 100;
                    state.message = "the candidate serves every parent; promote it in the spec (move it to the active fields) when convenient, which changes nothing".to_owned();
                    push(
                        state,
                        "Completed",
                        format!("{} passed: {figures}", stage.name()),
                    );
                    self.apply(candidate, Some(100));
                    self.transition(
                        policy,
                        state,
                        "completed",
                        "RolloutCompleted",
                        EventType::Normal,
                    )
                    .await;
                }
            }
            Decision::RollBack { gate, message } => {
                state.phase = phase::ROLLED_BACK.to_owned();
                state.stage_since = Time(jiff::Timestamp::now());
                state.percent = 0;
                state.examples = measured.examples;
                state.message = format!(
                    "rolled back in {}: {gate} failed: {message}; the active plugin serves every parent again. name a new candidate, or give the wasmctrl.dev/retry-rollout annotation a new value, to start over",
                    stage.name()
                );
                push(state, "RolledBack", format!("{gate}: {message}"));
                self.apply(candidate, None);
                self.transition(
                    policy,
                    state,
                    "rolled_back",
                    "RolledBack",
                    EventType::Warning,
                )
                .await;
            }
        }
    }

    /// Have the candidate serve `percent` of the parents, or stop it (`None`): when that is
    /// a change, a prune guard window opens (counted against the rollout's change, or, for a
    /// rollback, a change of its own) and every parent is re-enqueued.
    fn apply(&self, candidate: &Candidate, percent: Option<u8>) {
        let stop = percent.is_none();
        let percent = percent.unwrap_or(0);
        let was_stopped = candidate.stopped.swap(stop, Ordering::Relaxed);
        let was_percent = candidate.percent.swap(percent, Ordering::Relaxed);
        if was_stopped == stop && was_percent == percent {
            return;
        }
        if was_stopped && !stop {
            // Started over after a rollback: what it was found to do before (under its old
            // config, perhaps, while a swap to the new one is under way) is no evidence now.
            lock(&self.ctx.serving.shadow).clear();
        }
        let digest = candidate.serving.plugin.digest().short();
        let since = if stop {
            format!("the rollback of candidate {digest}")
        } else {
            format!("the rollout of candidate {digest} to {percent}%")
        };
        if stop {
            // The active plugin's cleanup of what the candidate made is not the candidate's.
            self.ctx.prune_guard.roll_back(since);
        } else {
            self.ctx.prune_guard.reopen(since);
        }
        tracing::info!(policy = %self.ctx.policy, candidate = %digest, percent, stopped = stop, "rollout share changed; re-enqueuing every parent");
        let _ = self.requeue_all.send(());
    }

    /// Count, log and record a transition as an Event on the policy.
    async fn transition(
        &self,
        policy: &ReconcilePolicy,
        state: &RolloutStatus,
        result: &'static str,
        reason: &str,
        type_: EventType,
    ) {
        self.ctx.metrics.rollout_transition(result);
        let message = match state.history.first() {
            Some(last) => format!("{} {}: {}", last.result, last.stage, last.reason),
            None => state.message.clone(),
        };
        tracing::info!(policy = %self.ctx.policy, result, %message, "rollout transition");
        let reference = ObjectReference {
            api_version: Some("wasmctrl.dev/v1alpha1".to_owned()),
            kind: Some("ReconcilePolicy".to_owned()),
            name: Some(policy.name_any()),
            uid: policy.metadata.uid.clone(),
            ..ObjectReference::default()
        };
        self.events
            .publish(&reference, type_, reason, "Rollout", message)
            .await;
    }
}

/// Whether the rollout is over: completed or rolled back.
fn finished(state: &RolloutStatus) -> bool {
    state.phase == phase::COMPLETE || state.phase == phase::ROLLED_BACK
}

/// The annotation that starts a rolled-back candidate's rollout over, each time it takes a
/// new value (`kubectl annotate reconcilepolicy NAME wasmctrl.dev/retry-rollout="$(date +%s)"`).
pub(crate) const RETRY_ANNOTATION: &str = crate::policy::RETRY_ROLLOUT_ANNOTATION;

pub(crate) fn retry_annotation(policy: &ReconcilePolicy) -> Option<&str> {
    policy
        .annotations()
        .get(RETRY_ANNOTATION)
        .map(String::as_str)
}

/// Give a freshly loaded candidate the share `rollout` (its own, from the status) left it
/// with, before it serves.
/// A rollout whose replay gate (`gated`) has not passed yet gives it none.
pub(crate) fn resume(candidate: &Candidate, rollout: &RolloutStatus, gated: bool) {
    match share_for(rollout, gated) {
        None => candidate.stopped.store(true, Ordering::Relaxed),
        Some(percent) => candidate.percent.store(percent, Ordering::Relaxed),
    }
}

/// The share of the parents `rollout` has its candidate serve: `None` once rolled back
/// (stopped), all once complete, none while its replay gate (`gated`) has not passed.
pub(crate) fn share_for(rollout: &RolloutStatus, gated: bool) -> Option<u8> {
    match rollout.phase.as_str() {
        phase::ROLLED_BACK => None,
        phase::COMPLETE => Some(100),
        _ if gated && rollout.replay.is_none() => Some(0),
        _ => Some(rollout.percent),
    }
}

/// The first stage of a new rollout of `digest`.
fn started(digest: &str, spec: &RolloutSpec) -> RolloutStatus {
    let first = spec.stages.first().cloned().unwrap_or_default();
    let mut state = RolloutStatus {
        digest: digest.to_owned(),
        phase: phase::PROGRESSING.to_owned(),
        stage: 0,
        stage_name: first.name(),
        percent: first.percent,
        stage_since: Time(jiff::Timestamp::now()),
        message: format!("entered {}", first.name()),
        examples: Vec::new(),
        history: Vec::new(),
        retried_for: None,
        replay: None,
    };
    push(&mut state, "Started", format!("candidate {digest}"));
    state
}

/// Record a transition into the stage `state` is in now.
fn push(state: &mut RolloutStatus, result: &str, reason: String) {
    state.history.insert(
        0,
        RolloutTransition {
            time: Time(jiff::Timestamp::now()),
            digest: state.digest.clone(),
            stage: state.stage_name.clone(),
            result: result.to_owned(),
            reason: crate::controller::reconcile::events::truncate(reason, 512),
        },
    );
    state.history.truncate(HISTORY);
}

/// A decision in words, for a paused rollout's status.
fn describe(decision: &Decision) -> String {
    match decision {
        Decision::Advance(figures) => format!("ready to advance ({figures})"),
        Decision::Wait(message) => message.clone(),
        Decision::RollBack { gate, message } => format!("{gate} failed: {message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parent_with_children_held_back_is_not_ready_whatever_its_plugin_says() {
        let parent = |conditions: serde_json::Value| serde_json::json!({"status": {"conditions": conditions}});
        let waiting = parent(serde_json::json!([
            {"type": "Ready", "status": "True"},
            {"type": "Progressing", "status": "True", "reason": "WaitingFor",
             "message": "Deployment app waits for Job migrate: not complete"},
        ]));
        assert_eq!(
            by_conditions(&waiting).as_deref(),
            Some("waiting: Deployment app waits for Job migrate: not complete")
        );
        let applied = parent(serde_json::json!([
            {"type": "Ready", "status": "True"},
            {"type": "Progressing", "status": "False", "reason": "Applied"},
        ]));
        assert_eq!(by_conditions(&applied), None);
        let claimed_not = parent(serde_json::json!([{"type": "Ready", "status": "False"}]));
        assert_eq!(by_conditions(&claimed_not).as_deref(), Some("Ready=False"));
    }

    fn stage(percent: u8) -> RolloutStage {
        RolloutStage {
            percent,
            ..RolloutStage::default()
        }
    }

    const NOW: Duration = Duration::from_secs(1);

    const PRUNE: PruneLimits = PruneLimits {
        max_fraction: 0.2,
        floor: 5,
        period: Duration::from_secs(600),
    };

    #[test]
    fn a_shadow_stage_waits_for_every_shadowed_parent_then_advances() {
        let mut m = Measured {
            shadowed: 200,
            evaluated: 150,
            rest: 200,
            ..Measured::default()
        };
        let waiting = decide(&stage(0), PRUNE, &m, NOW);
        assert!(
            matches!(&waiting, Decision::Wait(w) if w.contains("50 more shadowed")),
            "{waiting:?}"
        );
        m.evaluated = 200;
        assert!(matches!(
            decide(&stage(0), PRUNE, &m, NOW),
            Decision::Advance(_)
        ));
        let fewer = RolloutStage {
            min_parents: Some(100),
            ..stage(0)
        };
        m.evaluated = 100;
        assert!(matches!(
            decide(&fewer, PRUNE, &m, NOW),
            Decision::Advance(_)
        ));
    }

    #[test]
    fn one_would_fail_rolls_back_by_default_and_a_share_is_judged_on_what_will_be_compared() {
        let m = Measured {
            shadowed: 200,
            evaluated: 10,
            would_fail: 1,
            rest: 200,
            ..Measured::default()
        };
        let decision = decide(&stage(0), PRUNE, &m, NOW);
        assert!(
            matches!(&decision, Decision::RollBack { gate: "maxWouldFail", message } if message.contains("1 of 10")),
            "{decision:?}"
        );
        // 5% of 200 is 10: one early failure cannot decide it yet, eleven do.
        let tolerant = RolloutStage {
            max_would_fail: Some(0.05),
            ..stage(0)
        };
        assert!(matches!(
            decide(&tolerant, PRUNE, &m, NOW),
            Decision::Wait(_)
        ));
        let many = Measured {
            would_fail: 11,
            evaluated: 20,
            ..m
        };
        assert!(matches!(
            decide(&tolerant, PRUNE, &many, NOW),
            Decision::RollBack {
                gate: "maxWouldFail",
                ..
            }
        ));
    }

    #[test]
    fn a_canary_that_fails_more_than_the_rest_rolls_back_and_an_outage_of_all_does_not() {
        let failing = Measured {
            served: 20,
            served_decided: 20,
            served_failing: 5,
            rest: 180,
            shadowed: 180,
            evaluated: 180,
            examples: vec!["a/p-1".into()],
            ..Measured::default()
        };
        let decision = decide(&stage(10), PRUNE, &failing, NOW);
        assert!(
            matches!(&decision, Decision::RollBack { gate: "maxFailureRate", message } if message.contains("5 of the 20")),
            "{decision:?}"
        );
        let outage = Measured {
            rest_failing: 180,
            ..failing.clone()
        };
        assert!(matches!(
            decide(&stage(10), PRUNE, &outage, NOW),
            Decision::Advance(_)
        ));
        let one = Measured {
            served_failing: 1,
            ..failing
        };
        assert!(
            matches!(decide(&stage(10), PRUNE, &one, NOW), Decision::Advance(_)),
            "1 of 20 is within the default 5%"
        );
    }

    #[test]
    fn a_canary_waits_for_its_parents_and_its_soak() {
        let m = Measured {
            served: 20,
            served_decided: 12,
            rest: 180,
            shadowed: 180,
            evaluated: 180,
            ..Measured::default()
        };
        let waiting = decide(&stage(10), PRUNE, &m, NOW);
        assert!(
            matches!(&waiting, Decision::Wait(w) if w.contains("8 served parent(s)")),
            "{waiting:?}"
        );
        let decided = Measured {
            served_decided: 20,
            ..m
        };
        let soaking = RolloutStage {
            soak_seconds: Some(30),
            ..stage(10)
        };
        let early = decide(&soaking, PRUNE, &decided, Duration::from_secs(10));
        assert!(
            matches!(&early, Decision::Wait(w) if w.contains("soaking for 20s")),
            "{early:?}"
        );
        assert!(matches!(
            decide(&soaking, PRUNE, &decided, Duration::from_secs(30)),
            Decision::Advance(_)
        ));
        let timed = RolloutStage {
            max_seconds: Some(60),
            ..stage(10)
        };
        let undecided = Measured {
            served_decided: 12,
            ..decided
        };
        assert!(matches!(
            decide(&timed, PRUNE, &undecided, Duration::from_secs(61)),
            Decision::Advance(_)
        ));
    }

    #[test]
    fn a_less_ready_canary_waits_then_rolls_back_at_its_deadline() {
        let m = Measured {
            served: 100,
            served_decided: 100,
            served_not_ready: 30,
            rest: 100,
            rest_not_ready: 10,
            shadowed: 100,
            evaluated: 100,
            not_ready_examples: vec!["a/p-1: Deployment p-1 availableReplicas 0 of 1".into()],
            ..Measured::default()
        };
        let waiting = decide(&stage(50), PRUNE, &m, NOW);
        assert!(
            matches!(&waiting, Decision::Wait(w) if w.contains("30 of the 100") && w.contains("Deployment p-1")),
            "gated by default: {waiting:?}"
        );
        let late = decide(&stage(50), PRUNE, &m, DEFAULT_PROGRESS_DEADLINE);
        assert!(
            matches!(
                &late,
                Decision::RollBack {
                    gate: "maxNotReady",
                    ..
                }
            ),
            "{late:?}"
        );
        let deadline = RolloutStage {
            progress_deadline_seconds: Some(30),
            ..stage(50)
        };
        assert!(matches!(
            decide(&deadline, PRUNE, &m, Duration::from_secs(30)),
            Decision::RollBack {
                gate: "maxNotReady",
                ..
            }
        ));
        let lenient = RolloutStage {
            max_not_ready: Some(0.5),
            ..stage(50)
        };
        assert!(matches!(
            decide(&lenient, PRUNE, &m, NOW),
            Decision::Advance(_)
        ));
        let close = Measured {
            served_not_ready: 15,
            ..m
        };
        assert!(matches!(
            decide(&stage(50), PRUNE, &close, NOW),
            Decision::Advance(_)
        ));
    }

    #[test]
    fn a_candidate_that_would_prune_past_the_guards_share_is_rolled_back_in_shadow() {
        let m = Measured {
            shadowed: 30,
            evaluated: 30,
            would_change: 10,
            shadow_children: 30,
            would_prune: 7,
            rest: 30,
            ..Measured::default()
        };
        // The guard's 20 % of 30 is 6.
        let decision = decide(&stage(0), PRUNE, &m, NOW);
        assert!(
            matches!(&decision, Decision::RollBack { gate: "maxWouldPrune", message } if message.contains("7 of the 30")),
            "{decision:?}"
        );
        let within = Measured {
            would_prune: 6,
            ..m.clone()
        };
        assert!(matches!(
            decide(&stage(0), PRUNE, &within, NOW),
            Decision::Advance(_)
        ));
        let allowed = RolloutStage {
            max_would_prune: Some(1.0),
            ..stage(0)
        };
        assert!(matches!(
            decide(&allowed, PRUNE, &m, NOW),
            Decision::Advance(_)
        ));
    }

    #[test]
    fn by_default_a_candidate_may_change_half_the_parents_and_fail_on_half_its_own() {
        let changes = Measured {
            shadowed: 100,
            evaluated: 100,
            would_change: 51,
            rest: 100,
            ..Measured::default()
        };
        assert!(matches!(
            decide(&stage(0), PRUNE, &changes, NOW),
            Decision::RollBack {
                gate: "maxWouldChange",
                ..
            }
        ));
        let everything = RolloutStage {
            max_would_change: Some(1.0),
            ..stage(0)
        };
        assert!(matches!(
            decide(&everything, PRUNE, &changes, NOW),
            Decision::Advance(_)
        ));
        // An outage failing the rest too passes the relative gate, not the ceiling.
        let outage = Measured {
            served: 20,
            served_decided: 20,
            served_failing: 11,
            rest: 80,
            rest_failing: 80,
            shadowed: 80,
            evaluated: 80,
            ..Measured::default()
        };
        assert!(matches!(
            decide(&stage(20), PRUNE, &outage, NOW),
            Decision::RollBack {
                gate: "maxFailing",
                ..
            }
        ));
    }

    /// Shards' figures add up, as one host's over all their parents would, and survive the
    /// trip through a shard Lease's annotation; the examples stay the first few, sorted.
    #[test]
    fn shards_figures_sum_to_the_whole() {
        let shard = |served: u64, failing: u64, examples: &[&str]| Measured {
            shadowed: 10 - served,
            evaluated: 10 - served,
            served,
            served_decided: served,
            served_failing: failing,
            rest: 10 - served,
            examples: examples.iter().map(|e| (*e).to_owned()).collect(),
            ..Measured::default()
        };
        let carried = serde_json::to_value(shard(2, 1, &["ns/w-8"])).expect("json");
        let mut total = shard(1, 0, &["ns/w-1", "ns/w-2", "ns/w-3", "ns/w-4"]);
        total.merge(serde_json::from_value(carried).expect("read back"));
        total.merge(shard(3, 2, &["ns/w-0", "ns/w-9"]));
        assert_eq!(
            (
                total.served,
                total.served_failing,
                total.shadowed,
                total.rest
            ),
            (6, 3, 24, 24)
        );
        assert_eq!(
            total.examples,
            ["ns/w-0", "ns/w-1", "ns/w-2", "ns/w-3", "ns/w-4"],
            "the first five, sorted"
        );
    }

    #[test]
    fn history_keeps_the_newest_ten() {
        let spec = RolloutSpec {
            stages: vec![stage(0)],
            paused: false,
            replay: None,
        };
        let mut state = started("sha256:abc", &spec);
        for i in 0..12 {
            push(&mut state, "Advanced", format!("step {i}"));
        }
        assert_eq!(state.history.len(), HISTORY);
        assert_eq!(state.history[0].reason, "step 11");
        assert_eq!(state.history[9].reason, "step 2");
    }
}
