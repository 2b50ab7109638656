//! Hot swap: a running policy controller's plugin is replaced without restarting anything.
//!
//! The swapper watches for a new plugin spec (source, digest or config in the policy) and for
//! new bytes behind the current source (a replaced file, an edited ConfigMap). It loads the
//! new plugin off the reconcile path from the plugin registry (which fetches, verifies the
//! digest, compiles or takes what is already loaded or precompiled), then swaps it in with one
//! atomic store: reconciles already running finish on the old plugin, every later one uses the
//! new one.
//! Then every parent is re-enqueued so all converge to the new logic at the controller's
//! normal concurrency. A plugin that fails to load never replaces a working one: the policy
//! keeps the old one and reports `PluginLoaded=False` with the cause.
//!
//! Each swap (and each candidate change) opens a new prune guard window before the new plugin
//! serves, so a plugin that answers fewer children cannot delete many of them unconfirmed; and
//! the swapper hands the guard each new confirmation annotation, re-enqueuing every parent
//! when one lets held deletions proceed.

use std::collections::VecDeque;
use std::sync::Arc;

use kube::ResourceExt as _;
use kube::core::Selector;
use tokio::sync::{Mutex, mpsc, watch};

use crate::controller::policy_run::prepare::loaded_message;
use crate::controller::policy_run::rollout;
use crate::controller::policy_run::status::{PolicyStatusWriter, State};
use crate::controller::reconcile::prune_guard::{self, PruneGuard};
use crate::controller::reconcile::serving::{ActivePlugin, Candidate, Serving};
use crate::lock;
use crate::metrics::PolicyMetrics;
use crate::plugin::Digest;
use crate::policy::{CandidateSpec, PluginSpec, ReconcilePolicy};
use crate::registry::{PluginRegistry, PluginRequest};

/// Digests a policy served before, newest first, to tell a rollback from a new version.
const SERVED_BEFORE: usize = 8;

/// What the swap of one policy works with; nothing else of the policy's controller.
pub(crate) struct Swapper {
    /// The policy's swappable serving state.
    pub serving: Arc<Serving>,
    /// Opened anew by every swap; told of every confirmation.
    pub prune_guard: Arc<PruneGuard>,
    pub registry: Arc<PluginRegistry>,
    pub metrics: PolicyMetrics,
    pub status: Arc<Mutex<PolicyStatusWriter>>,
    /// Re-enqueues every parent of the policy.
    pub requeue_all: mpsc::UnboundedSender<()>,
}

impl Swapper {
    /// The swapper of the policy whose reconciles share `ctx`.
    pub fn new(
        ctx: &crate::controller::reconcile::context::PolicyContext,
        shared: &crate::controller::policy_run::shared::Shared,
        metrics: &PolicyMetrics,
        status: &Arc<Mutex<PolicyStatusWriter>>,
        requeue_all: &mpsc::UnboundedSender<()>,
    ) -> Self {
        Self {
            serving: ctx.serving.clone(),
            prune_guard: ctx.prune_guard.clone(),
            registry: shared.registry.clone(),
            metrics: metrics.clone(),
            status: status.clone(),
            requeue_all: requeue_all.clone(),
        }
    }

    /// Run until the controller stops: apply plugin updates as they come.
    pub async fn run(
        self,
        mut policy: Arc<ReconcilePolicy>,
        mut updates: watch::Receiver<Arc<ReconcilePolicy>>,
        mut candidate: Option<CandidateSpec>,
    ) {
        let mut served_before: VecDeque<Digest> = VecDeque::new();
        let mut source_changes = self.registry.watch_source(&policy.spec.plugin.source);
        loop {
            self.sync_candidate(&policy, &mut candidate).await;
            self.status.lock().await.flush().await;
            let swap = tokio::select! {
                changed = updates.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let next = updates.borrow_and_update().clone();
                    let old_source = policy.spec.plugin.source.clone();
                    let spec_changed = next.spec != policy.spec;
                    policy = next;
                    self.status.lock().await.set_generation(policy.metadata.generation);
                    if policy.spec.plugin.source != old_source {
                        source_changes = self.registry.watch_source(&policy.spec.plugin.source);
                    }
                    self.confirm(&policy);
                    spec_changed
                }
                () = source_changes.changed() => {
                    tracing::info!(policy = %policy.name_any(), "plugin source changed");
                    true
                }
            };
            if swap {
                self.swap_to(&policy, &mut served_before).await;
            }
        }
    }

    /// Hand the guard the policy's confirmation; when it lets held deletions proceed, every
    /// parent is reconciled again to make them.
    fn confirm(&self, policy: &ReconcilePolicy) {
        let confirmation = prune_guard::confirmation(policy);
        if self.prune_guard.set_confirmation(confirmation) {
            tracing::info!(policy = %policy.name_any(), confirmation, "held deletions confirmed; re-enqueuing every parent");
            let _ = self.requeue_all.send(());
        }
    }

    /// Open a prune guard window for a change to what decides (`since` says which): the
    /// `active` plugin and the `candidate` (if any) under the policy's generation. Before the
    /// change serves, so nothing it decides is pruned outside the window.
    fn open_window(
        &self,
        policy: &ReconcilePolicy,
        active: &Digest,
        candidate: Option<&Digest>,
        since: String,
    ) {
        let generation = policy.metadata.generation;
        self.prune_guard.open(
            prune_guard::change_key(generation, active, candidate),
            format!("{since} (generation {})", generation.unwrap_or_default()),
        );
    }

    /// Obtain what `policy` names and make it active, unless it already is.
    async fn swap_to(&self, policy: &ReconcilePolicy, served_before: &mut VecDeque<Digest>) {
        let name = policy.name_any();
        let config = config_text(&policy.spec.plugin);
        let current = self.serving.active.load_full();
        let started = std::time::Instant::now();
        let (plugin, signers) = match self
            .registry
            .obtain(&name, PluginRequest::active(policy))
            .await
        {
            Ok(obtained) => (obtained.plugin, obtained.signers),
            Err(error) => {
                let (reason, message) = (error.reason(), error.to_string());
                tracing::warn!(policy = %name, reason, %message, active = %current.plugin.digest(), "new plugin refused; the active one keeps serving");
                self.metrics.swapped("refused");
                self.status.lock().await.set_plugin(
                    State::failed(
                        reason,
                        format!("{message}; still serving {}", current.plugin.digest()),
                    ),
                    None,
                );
                return;
            }
        };
        let mut status = self.status.lock().await;
        let converts = policy.spec.conversion.is_some() || status.conversion().is_some();
        if converts && !plugin.served_webhooks().convert {
            // Every read of the kind at another version than stored would fail.
            let message = format!(
                "plugin {} does not serve convert, and the policy's kind is converted by its plugin (spec.conversion); still serving {}",
                plugin.digest().short(),
                current.plugin.digest()
            );
            tracing::warn!(policy = %name, %message, "new plugin refused; the active one keeps serving");
            self.metrics.swapped("refused");
            status.set_plugin(State::failed("ConvertNotServed", message), None);
            return;
        }
        status.set_plugin(
            State::ok("Loaded", loaded_message(plugin.digest(), &signers)),
            Some(plugin.digest()),
        );
        status.set_active_signers(signers);
        if plugin.digest() == current.plugin.digest()
            && config == current.config
            && plugin.limits() == current.plugin.limits()
        {
            return;
        }
        let from = *current.plugin.digest();
        let to = *plugin.digest();
        let since = if from == to {
            format!("a config change of plugin {}", to.short())
        } else {
            format!("a swap from plugin {} to {}", from.short(), to.short())
        };
        let candidate = self
            .serving
            .candidate
            .load()
            .as_ref()
            .map(|c| *c.serving.plugin.digest());
        self.open_window(policy, &to, candidate.as_ref(), since);
        self.serving
            .active
            .store(Arc::new(ActivePlugin { plugin, config }));
        status.set_active_since_now();
        let _ = self.requeue_all.send(());
        self.metrics.set_active_plugin(Some(&to.to_string()));
        let result = if served_before.contains(&to) {
            "rolled_back"
        } else {
            "swapped"
        };
        self.metrics.swapped(result);
        tracing::info!(policy = %name, %from, %to, load_time = ?started.elapsed(), "plugin swapped; re-enqueuing every parent");
        if from != to {
            served_before.retain(|d| *d != to && *d != from);
            served_before.push_front(from);
            served_before.truncate(SERVED_BEFORE);
        }
    }

    /// Load the policy's candidate before the first reconcile, so that no parent a canary
    /// or a rollout gives it is decided first by the active plugin; what was loaded, for
    /// [`Self::run`]. A candidate that cannot be loaded is reported and tried again there.
    pub async fn prime(&self, policy: &ReconcilePolicy) -> Option<CandidateSpec> {
        let mut loaded = None;
        self.sync_candidate(policy, &mut loaded).await;
        loaded
    }

    /// Load, replace or drop the candidate plugin when the policy's candidate changed.
    async fn sync_candidate(&self, policy: &ReconcilePolicy, loaded: &mut Option<CandidateSpec>) {
        let wanted = policy.spec.plugin.candidate.clone();
        if wanted == *loaded {
            return;
        }
        let name = policy.name_any();
        let active = *self.serving.active.load().plugin.digest();
        let Some(spec) = &wanted else {
            self.open_window(policy, &active, None, "the candidate's removal".to_owned());
            self.serving.candidate.store(None);
            lock(&self.serving.shadow).clear();
            self.status.lock().await.set_candidate(None, None);
            *loaded = None;
            let _ = self.requeue_all.send(());
            tracing::info!(policy = %name, "candidate plugin removed");
            return;
        };
        let canary = match spec
            .canary
            .as_ref()
            .map(|c| Selector::try_from(c.selector.clone()))
            .transpose()
        {
            Ok(canary) => canary,
            Err(error) => {
                let state = State::failed("InvalidSelector", format!("canary selector: {error}"));
                self.status.lock().await.set_candidate(Some(state), None);
                return;
            }
        };
        let request = PluginRequest::candidate(policy, spec);
        match self.registry.obtain(&name, request).await {
            Ok(obtained) => {
                let config = spec
                    .config
                    .as_ref()
                    .filter(|c| !c.is_null())
                    .map(ToString::to_string)
                    .or_else(|| config_text(&policy.spec.plugin));
                let digest = *obtained.plugin.digest();
                let signers = obtained.signers;
                let mode = if canary.is_some() { "canary" } else { "shadow" };
                let candidate = Candidate::new(
                    Arc::new(ActivePlugin {
                        plugin: obtained.plugin,
                        config,
                    }),
                    canary,
                );
                // A rollout of this candidate already under way (before a restart or a
                // takeover) goes on with the share it had.
                if policy.spec.plugin.rollout.is_some()
                    && let Some(rollout) = self
                        .status
                        .lock()
                        .await
                        .rollout()
                        .filter(|r| r.digest == digest.to_string())
                {
                    let gated = policy
                        .spec
                        .plugin
                        .rollout
                        .as_ref()
                        .is_some_and(|r| r.replay.is_some());
                    rollout::resume(&candidate, rollout, gated);
                }
                self.open_window(
                    policy,
                    &active,
                    Some(&digest),
                    format!("candidate {} ({mode})", digest.short()),
                );
                self.serving.candidate.store(Some(Arc::new(candidate)));
                lock(&self.serving.shadow).clear();
                let message = format!(
                    "candidate {} ({mode})",
                    loaded_message(&digest, &signers).trim_start_matches("plugin ")
                );
                let mut status = self.status.lock().await;
                status.set_candidate(Some(State::ok("Loaded", message)), Some(&digest));
                status.set_candidate_signers(signers);
                drop(status);
                *loaded = wanted;
                let _ = self.requeue_all.send(());
                tracing::info!(policy = %name, %digest, mode, "candidate plugin loaded; re-evaluating every parent");
            }
            Err(error) => {
                let (reason, message) = (error.reason(), error.to_string());
                tracing::warn!(policy = %name, reason, %message, "candidate plugin refused");
                self.status
                    .lock()
                    .await
                    .set_candidate(Some(State::failed(reason, message)), None);
            }
        }
    }
}

/// The config a plugin is called with, as text (`None` when absent or null).
pub(crate) fn config_text(spec: &PluginSpec) -> Option<String> {
    spec.config
        .as_ref()
        .filter(|c| !c.is_null())
        .map(ToString::to_string)
}
