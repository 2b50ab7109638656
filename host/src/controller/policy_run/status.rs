//! The ReconcilePolicy's status as one running policy controller reports it: `Ready` and
//! `PluginLoaded` with reasons a user can act on, the active digest, and parent counts.
//! Written only when something changed.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use std::sync::Arc;

use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;

use crate::leader::Leadership;
use crate::plugin::Digest;
use crate::policy::admission::ServedWebhook;
use crate::policy::conversion::ConversionStatus;
use crate::policy::{
    CandidateStatus, KindRef, ParentRef, PruneGuardStatus, ReconcilePolicy, ReconcilePolicyStatus,
    RolloutStatus, Signer,
};

/// The field manager the host writes policy status with.
const FIELD_MANAGER: &str = "wasmctrl";

/// One condition's state, before timestamps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct State {
    pub ok: bool,
    pub reason: &'static str,
    pub message: String,
}

impl State {
    pub fn ok(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            ok: true,
            reason,
            message: message.into(),
        }
    }

    pub fn failed(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            ok: false,
            reason,
            message: message.into(),
        }
    }
}

/// How a policy's parents stand, among those that still exist.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    /// Whose last reconcile succeeded.
    pub reconciled: u64,
    /// Whose last reconcile failed.
    pub failing: u64,
    /// Whose last successful reconcile was decided by the active plugin: a rollout is done
    /// when this reaches the number of parents.
    pub on_active: u64,
}

/// Writes one policy's status.
pub(crate) struct PolicyStatusWriter {
    api: Api<ReconcilePolicy>,
    name: String,
    generation: Option<i64>,
    current: ReconcilePolicyStatus,
    written: Option<ReconcilePolicyStatus>,
    /// A standby keeps its status to itself; it writes what it has once it leads.
    leadership: Arc<Leadership>,
}

/// Set the `Ready` condition of the policy `name` to `state` once, on the status it has in
/// the cluster now (read first, so what its controller wrote last stays as it was). For a
/// policy that has no running controller to write it (its controller panicked).
pub(crate) async fn set_ready_once(
    api: Api<ReconcilePolicy>,
    name: &str,
    leadership: Arc<Leadership>,
    state: State,
) {
    if !leadership.is_leader() {
        return;
    }
    match api.get_status(name).await {
        Ok(policy) => {
            let mut writer = PolicyStatusWriter::new(api, &policy, leadership);
            writer.set_ready(state);
            writer.flush().await;
        }
        Err(error) => {
            tracing::warn!(policy = %name, error = %error, "could not read the policy to report on it");
        }
    }
}

impl PolicyStatusWriter {
    /// Start from the status the policy already has, so unchanged conditions keep their
    /// transition times across host restarts.
    pub fn new(
        api: Api<ReconcilePolicy>,
        policy: &ReconcilePolicy,
        leadership: Arc<Leadership>,
    ) -> Self {
        let mut current = policy.status.clone().unwrap_or_default();
        // Written by `scopes` alone (a field manager of its own): left out here, so that this
        // writer's apply neither owns nor resets it.
        current.finalized_scopes.clear();
        Self {
            api,
            name: policy.metadata.name.clone().unwrap_or_default(),
            generation: policy.metadata.generation,
            written: Some(current.clone()),
            current,
            leadership,
        }
    }

    pub fn set_plugin(&mut self, state: State, digest: Option<&Digest>) {
        self.set_condition("PluginLoaded", state);
        let rolled_out = self.rolled_out();
        if let Some(digest) = digest.filter(|_| !rolled_out) {
            let digest_text = digest.to_string();
            if self.current.active_digest.as_ref() != Some(&digest_text) {
                self.current.active_since = Some(Time(jiff::Timestamp::now()));
            }
            self.current.active_digest = Some(digest_text);
            self.current.active_digest_short = Some(digest.short());
        }
    }

    /// The policy was updated in place (a hot swap): report on its new generation.
    pub fn set_generation(&mut self, generation: Option<i64>) {
        self.generation = generation;
        for condition in &mut self.current.conditions {
            condition.observed_generation = generation;
        }
    }

    /// The active plugin changed now.
    pub fn set_active_since_now(&mut self) {
        self.current.active_since = Some(Time(jiff::Timestamp::now()));
    }

    /// The candidate's condition (`CandidateLoaded`), or no candidate at all.
    pub fn set_candidate(&mut self, state: Option<State>, digest: Option<&Digest>) {
        match state {
            Some(state) => self.set_condition("CandidateLoaded", state),
            None => {
                self.current
                    .conditions
                    .retain(|c| c.type_ != "CandidateLoaded");
                self.current.candidate = None;
            }
        }
        if let Some(digest) = digest {
            self.current.candidate = Some(CandidateStatus {
                digest: digest.to_string(),
                ..CandidateStatus::default()
            });
        }
    }

    /// The candidate's shadow and canary counts.
    pub fn set_candidate_counts(&mut self, counts: Option<CandidateStatus>) {
        if let (Some(current), Some(counts)) = (&mut self.current.candidate, counts) {
            let signers = std::mem::take(&mut current.signers);
            *current = counts;
            current.signers = signers;
        }
    }

    /// Who signed the active plugin (none when no signatures are required).
    pub fn set_active_signers(&mut self, signers: Vec<Signer>) {
        if !self.rolled_out() {
            self.current.active_signers = signers;
        }
    }

    /// Whether a completed rollout's candidate serves every parent: it is then the plugin the
    /// status names as active, until the rollout is promoted or removed from the spec.
    fn rolled_out(&self) -> bool {
        self.current
            .rollout
            .as_ref()
            .is_some_and(|r| r.phase == "Complete")
    }

    /// Who signed the candidate.
    pub fn set_candidate_signers(&mut self, signers: Vec<Signer>) {
        if let Some(candidate) = &mut self.current.candidate {
            candidate.signers = signers;
        }
    }

    /// How the candidate's rollout stands, as this writer last set or adopted it.
    pub fn rollout(&self) -> Option<&RolloutStatus> {
        self.current.rollout.as_ref()
    }

    /// The rollout's state, or none. A completed rollout's candidate serves every parent, so
    /// it is the active plugin the status names.
    pub fn set_rollout(&mut self, rollout: Option<RolloutStatus>) {
        if let Some(done) = rollout.as_ref().filter(|r| r.phase == "Complete")
            && let Ok(digest) = done.digest.parse::<Digest>()
            && self.current.active_digest.as_deref() != Some(done.digest.as_str())
        {
            self.current.active_since = Some(Time(jiff::Timestamp::now()));
            self.current.active_digest = Some(digest.to_string());
            self.current.active_digest_short = Some(digest.short());
            if let Some(candidate) = &self.current.candidate {
                self.current.active_signers = candidate.signers.clone();
            }
        }
        self.current.rollout = rollout;
    }

    /// Take the rollout state the policy has in the cluster now, as the last leader left it:
    /// a replica that takes over continues from there. Unknown when the read fails; this
    /// replica then keeps what it had.
    pub async fn adopt_rollout(&mut self) {
        match self.api.get_status(&self.name).await {
            Ok(policy) => {
                self.current.rollout = policy.status.and_then(|s| s.rollout);
            }
            Err(error) => {
                tracing::warn!(policy = %self.name, error = %error, "could not read the rollout state the last leader left");
            }
        }
    }

    /// A condition that only some policies have (e.g. `RelatedNarrowed`), or none.
    pub fn set_optional(&mut self, type_: &str, state: Option<State>) {
        match state {
            Some(state) => self.set_condition(type_, state),
            None => self.current.conditions.retain(|c| c.type_ != type_),
        }
    }

    pub fn set_ready(&mut self, state: State) {
        self.set_condition("Ready", state);
    }

    /// The child kinds the last run managed, and those it left unmanaged.
    pub fn child_kinds(&self) -> (&[KindRef], &[KindRef]) {
        (
            &self.current.child_kinds,
            &self.current.unmanaged_child_kinds,
        )
    }

    pub fn set_child_kinds(&mut self, managed: Vec<KindRef>, unmanaged: Vec<KindRef>) {
        self.current.child_kinds = managed;
        self.current.unmanaged_child_kinds = unmanaged;
    }

    /// The parent kind this policy holds (see [`ReconcilePolicyStatus::claimed_parent`]), or
    /// none.
    pub fn set_claimed_parent(&mut self, claim: Option<ParentRef>) {
        self.current.claimed_parent = claim;
    }

    /// The prune guard's window; `None` in the steady state.
    pub fn set_prune_guard(&mut self, window: Option<PruneGuardStatus>) {
        self.current.prune_guard = window;
    }

    /// The webhooks served for the policy, as last reported.
    pub fn webhooks(&self) -> &[ServedWebhook] {
        &self.current.webhooks
    }

    /// The webhooks served for the policy.
    pub fn set_webhooks(&mut self, webhooks: Vec<ServedWebhook>) {
        self.current.webhooks = webhooks;
    }

    /// The parent CRD's conversion served for the policy, as last reported.
    pub fn conversion(&self) -> Option<&ConversionStatus> {
        self.current.conversion.as_ref()
    }

    /// The parent CRD's conversion served for the policy.
    pub fn set_conversion(&mut self, conversion: Option<ConversionStatus>) {
        self.current.conversion = conversion;
    }

    /// How the policy's parents stand.
    pub fn set_counts(&mut self, counts: Counts) {
        self.current.parents_reconciled = counts.reconciled;
        self.current.parents_failing = counts.failing;
        self.current.parents_on_active_digest = counts.on_active;
    }

    /// Each shard's holder and counts, for a policy on sharded hosts.
    pub fn set_shards(&mut self, shards: Vec<crate::policy::ShardStatus>) {
        self.current.shards = shards;
    }

    fn set_condition(&mut self, type_: &str, state: State) {
        let status = if state.ok { "True" } else { "False" };
        let conditions = &mut self.current.conditions;
        let previous = conditions.iter().position(|c| c.type_ == type_);
        let last_transition_time = previous
            .map(|i| &conditions[i])
            .filter(|c| c.status == status)
            .map_or_else(
                || Time(jiff::Timestamp::now()),
                |c| c.last_transition_time.clone(),
            );
        let condition = Condition {
            type_: type_.to_owned(),
            status: status.to_owned(),
            reason: state.reason.to_owned(),
            message: crate::controller::reconcile::events::truncate(state.message, 4096),
            observed_generation: self.generation,
            last_transition_time,
        };
        match previous {
            Some(i) => conditions[i] = condition,
            None => conditions.push(condition),
        }
    }

    /// Write the status if it changed since the last write. Failures are logged and retried
    /// with the next flush.
    pub async fn flush(&mut self) {
        self.current.observed_generation = self.generation;
        if !self.leadership.is_leader() {
            // What the leader writes meanwhile is unknown here: write in full once leading.
            self.written = None;
            return;
        }
        if self.written.is_none() {
            // The first write since this replica took over: the rollout is where the last
            // leader left it, not where this replica last saw it.
            self.adopt_rollout().await;
        }
        if self.written.as_ref() == Some(&self.current) {
            return;
        }
        let body = json!({
            "apiVersion": "wasmctrl.dev/v1alpha1",
            "kind": "ReconcilePolicy",
            "metadata": {"name": self.name},
            "status": self.current,
        });
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let body = Patch::Apply(&body);
        let patch = self.api.patch_status(&self.name, &params, &body);
        // Sharded, the status is shard 0's to write: fenced as a reconcile of shard 0 is, so
        // a write under way when shard 0 moves is refused, and the move waits for it.
        let written = match self.leadership.shards() {
            None => patch.await,
            Some(shards) => match shards.start_writing(0) {
                Some(writing) => crate::shards::write_for(writing, patch).await,
                None => return,
            },
        };
        match written {
            Ok(_) => self.written = Some(self.current.clone()),
            Err(error) => {
                tracing::warn!(policy = %self.name, error = %error, "could not write policy status");
            }
        }
    }
}
