//! The operator host: every `ReconcilePolicy` in the cluster becomes one running controller
//! whose decisions come from the policy's plugin.
//!
//! - [`Host`] watches ReconcilePolicies and starts, restarts and stops one policy controller
//!   per policy, each in its own task, so one policy's trouble never reaches another.
//! - `policy_run` takes one policy from start to stop: plugin loading, kind discovery and
//!   checks, then a running kube-runtime `Controller` and what runs beside it.
//! - `reconcile` is one parent, start to finish: the steps of one reconcile, the request the
//!   plugin is asked, what becomes of its children, and every write.
//! - `cache` is what reconciles read, and what the host's own writes have not shown yet.
//!
//! Each room uses only the ones before it (cache ← reconcile ← policy_run);
//! `host/tests/module_rooms.rs` fails on any import against that order.

mod cache;
pub(crate) mod kinds;
mod labels;
mod namespaced_policies;
pub mod offline;
mod options;
mod policy_run;
mod reconcile;
mod stopping;
mod supervise;
#[cfg(test)]
mod testing;
pub mod uninstall;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use futures::StreamExt as _;
use kube::runtime::{WatchStreamExt as _, reflector, watcher};
use kube::{Api, Client, ResourceExt as _};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::plugin::PluginEngine;
use crate::policy::{ReconcilePolicy, ReconcilePolicySpec};
use crate::registry::{PluginRegistry, RegistryOptions};
use policy_run::Shared;
use policy_run::parent_claims::{self, Standing};

pub use labels::{
    DESIRED_HASH_ANNOTATION, MANAGED_BY, MANAGED_BY_LABEL, POLICY_FINALIZER, POLICY_LABEL,
    policy_label_value,
};
pub use options::HostOptions;
pub use reconcile::status::RECONCILED;
pub use stopping::{Activity, StopTimedOut};

/// The operator host.
pub struct Host {
    shared: Arc<Shared>,
}

/// A running policy controller.
struct Running {
    /// The policy version it runs: a new uid means a new controller.
    uid: Option<String>,
    generation: Option<i64>,
    spec: ReconcilePolicySpec,
    /// The annotations the running policy acts on (prune confirmation, rollout retry): a
    /// change of them alone (no new generation) is passed to the running controller.
    controls: Controls,
    /// Hands a plugin-only change to the running controller (a hot swap).
    updates: watch::Sender<Arc<ReconcilePolicy>>,
    stop: CancellationToken,
    task: JoinHandle<()>,
    /// The policy is being deleted and the task releases its parents.
    retiring: bool,
    /// Where the task stands on its parent kind, for [`Host::recheck_claims`].
    standing: Arc<Standing>,
    /// Removes the policy's metric series once it is deleted and the task has ended.
    forget: Arc<ForgetOnDeletion>,
}

/// Removes a deleted policy's metric series when both the policy is deleted and its task has
/// ended, whichever comes second: nothing counts into the series once they are removed, and a
/// policy created again under the name waits for the old task (see [`Running::after`]), so
/// its series are never the ones removed.
#[derive(Debug, Default)]
struct ForgetOnDeletion(AtomicU8);

impl ForgetOnDeletion {
    const DELETED: u8 = 1;
    const ENDED: u8 = 2;

    fn mark(&self, this: u8, other: u8, metrics: &crate::metrics::Metrics, policy: &str) {
        if self.0.fetch_or(this, Ordering::AcqRel) & other != 0 {
            metrics.forget_policy(policy);
        }
    }

    fn deleted(&self, metrics: &crate::metrics::Metrics, policy: &str) {
        self.mark(Self::DELETED, Self::ENDED, metrics, policy);
    }

    fn ended(&self, metrics: &crate::metrics::Metrics, policy: &str) {
        self.mark(Self::ENDED, Self::DELETED, metrics, policy);
    }
}

impl Host {
    /// A host that talks to the cluster through `client` and runs plugins on `engine`, the
    /// only writer (no leader election).
    pub fn new(client: Client, engine: PluginEngine, options: HostOptions) -> Self {
        Self::elected(client, engine, options, crate::leader::Leadership::always())
    }

    /// A host that writes only while `leadership` says this replica leads (see
    /// [`crate::leader`]); `client` should be made by [`crate::leader::gated_client`] on the
    /// same `leadership`.
    pub fn elected(
        client: Client,
        engine: PluginEngine,
        options: HostOptions,
        leadership: Arc<crate::leader::Leadership>,
    ) -> Self {
        let metrics = Arc::new(crate::metrics::Metrics::new());
        metrics.observe_plugin_pool(engine.clone());
        Self {
            shared: Arc::new(Shared {
                registry: Arc::new(PluginRegistry::new(
                    client.clone(),
                    engine,
                    RegistryOptions {
                        credentials_namespace: options.credentials_namespace.clone(),
                        plugin_dirs: options.plugin_dirs.clone(),
                        max_concurrent_loads: options.max_concurrent_loads,
                        max_concurrent_fetches: options.max_concurrent_fetches,
                        trust: options.trust.clone(),
                        default_verify: options.default_verify.clone(),
                        signing: options.signing.clone(),
                    },
                    metrics.clone(),
                )),
                identities: policy_run::identity::Identities::new(
                    client.clone(),
                    leadership.clone(),
                    options.require_policy_identity,
                ),
                client,
                related_budget: Arc::new(cache::read_cache::ReadBudget::new(
                    options.related_cache_bytes,
                )),
                watches: Arc::new(policy_run::shared_watches::HostWatches::new(
                    metrics.clone(),
                )),
                options,
                metrics,
                readiness: Arc::new(crate::health::Readiness::default()),
                leadership,
                activity: Arc::default(),
                webhooks: None,
                narrows_by_shard: tokio::sync::OnceCell::new(),
                shutting_down: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// Let policies act as the ServiceAccounts they name (`spec.serviceAccount`), by
    /// impersonation with the credentials in `config` (the host's own). Without this, a
    /// policy that names an account is refused (`IdentityUnavailable`).
    pub fn impersonating_from(mut self, config: kube::Config) -> Self {
        match Arc::get_mut(&mut self.shared) {
            Some(shared) => shared.identities.impersonating_from(config),
            None => unreachable!("a Host's shared state is handed out only when it runs"),
        }
        self
    }

    /// Serve the webhooks policies ask for (`spec.admission`) through `hosting`'s listener.
    /// Without this, a policy that asks for webhooks is told the host serves none
    /// (`WebhooksServed=False`, `WebhooksOff`).
    pub fn serving_webhooks(mut self, hosting: crate::admission::hosting::Hosting) -> Self {
        match Arc::get_mut(&mut self.shared) {
            Some(shared) => shared.webhooks = Some(Arc::new(hosting)),
            None => unreachable!("a Host's shared state is handed out only when it runs"),
        }
        self
    }

    /// The host's readiness, for `/readyz`.
    pub fn readiness(&self) -> Arc<crate::health::Readiness> {
        self.shared.readiness.clone()
    }

    /// The records of the host's reconciles, for `/explain`.
    pub fn explain(&self) -> Arc<crate::explain::Explain> {
        self.shared.options.explain.clone()
    }

    /// The host's metrics, shared with every policy controller it runs.
    pub fn metrics(&self) -> Arc<crate::metrics::Metrics> {
        self.shared.metrics.clone()
    }

    /// The tasks the host runs and where each stands: what a stop waits for, and what to
    /// name when it waits too long.
    pub fn activity(&self) -> Arc<Activity> {
        self.shared.activity.clone()
    }

    /// Watch ReconcilePolicies and run their controllers until `shutdown` completes, then
    /// stop every controller gracefully.
    ///
    /// Returns within [`HostOptions::drain_timeout`] of `shutdown` (and a second's grace for
    /// what it aborts) whatever its policies are doing: what has not stopped by then is
    /// abandoned and named in a [`StopTimedOut`] error.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        // Dropped before it returns (its caller gave up on it), the run takes its tasks with
        // it: none may go on writing after the caller releases leadership.
        let _abort_on_drop = stopping::AbortOnDrop(self.shared.activity.clone());
        let api: Api<ReconcilePolicy> = Api::all(self.shared.client.clone());
        let mut config = watcher::Config::default();
        if let Some(selector) = &self.shared.options.policy_selector {
            config = config.labels(selector);
        }
        // Boxed, not pinned on the stack, so they can be dropped before the stop's wait.
        let mut policies = Box::pin(
            crate::watch_lists::watcher(api.clone(), config)
                .backoff(crate::watch_backoff::WatchBackoff::default()),
        );
        // Every policy in the cluster, this host's or not: who holds which parent kind.
        let (claims, claims_writer) = reflector::store();
        let mut claim_changes = Box::pin(reflector(
            claims_writer,
            crate::watch_lists::watcher(api, watcher::Config::default())
                .backoff(crate::watch_backoff::WatchBackoff::default()),
        ));
        let beside = self.start_beside(claims.clone());
        let mut running: HashMap<String, Running> = HashMap::new();
        let mut listed: HashSet<String> = HashSet::new();
        let mut shutdown = std::pin::pin!(shutdown);
        // NamespacedReconcilePolicies become ReconcilePolicies, which this loop then runs.
        let namespaced_stop = CancellationToken::new();
        let namespaced = tokio::spawn(run_namespaced_policies(
            self.shared.clone(),
            namespaced_stop.clone(),
        ));
        self.shared.activity.track(
            "namespaced policies",
            Activity::step("turning NamespacedReconcilePolicies into ReconcilePolicies"),
            namespaced.abort_handle(),
        );
        loop {
            let event = tokio::select! {
                () = &mut shutdown => break,
                event = policies.next() => event,
                change = claim_changes.next() => {
                    match change {
                        Some(Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone)) => {
                            self.recheck_claims(&mut running, &claims.state());
                        }
                        Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => {}
                        Some(Err(error)) => {
                            tracing::warn!(error = %error, "watching every ReconcilePolicy for parent kind claims");
                        }
                        None => break,
                    }
                    continue;
                }
            };
            // Controllers of deleted policies stay in the map until their task ends, so a
            // policy re-created under the same name waits for the old one.
            running.retain(|_, r| !(r.stop.is_cancelled() && r.task.is_finished()));
            match event {
                Some(Ok(watcher::Event::Apply(policy) | watcher::Event::InitApply(policy))) => {
                    listed.insert(policy.name_any());
                    if policy.metadata.deletion_timestamp.is_some() {
                        self.retire(&mut running, policy);
                    } else {
                        self.ensure(&mut running, policy);
                    }
                }
                Some(Ok(watcher::Event::Delete(policy))) => {
                    // Gone, its finalizers with it: its CRD's conversion is put back (or an
                    // admin let it go).
                    if let Some(hosting) = &self.shared.webhooks {
                        hosting.answerers.stop_converting(&policy.name_any());
                    }
                    if let Some(old) = running.get(&policy.name_any()) {
                        tracing::info!(policy = %policy.name_any(), "policy deleted; stopping its controller");
                        old.delete(&self.shared.metrics, &policy.name_any());
                    }
                    // A policy that held no finalizer of its own is gone before anything
                    // could retire it: its children's teardown order goes with it.
                    tokio::spawn(release_teardown(self.shared.clone(), policy));
                }
                Some(Ok(watcher::Event::Init)) => listed.clear(),
                Some(Ok(watcher::Event::InitDone)) => {
                    self.shared.readiness.policies_listed();
                    // Policies deleted while the watch was down: stopped, and kept in the map
                    // until their task ends, like any deleted policy.
                    for (name, r) in &running {
                        if !listed.contains(name) && !r.stop.is_cancelled() {
                            tracing::info!(policy = %name, "policy deleted; stopping its controller");
                            r.delete(&self.shared.metrics, name);
                        }
                    }
                }
                Some(Err(error)) => {
                    tracing::warn!(error = %error, "watching ReconcilePolicies (is the CRD installed?)");
                }
                None => break,
            }
        }
        tracing::info!(controllers = running.len(), "shutting down");
        beside.iter().flatten().for_each(JoinHandle::abort);
        self.shared.shutting_down.store(true, Ordering::Release);
        namespaced_stop.cancel();
        for r in running.values() {
            r.stop.cancel();
        }
        // The watches above are not read any more: drop them before the wait, so the API
        // server's connections are not held open unread while the policies stop.
        drop(policies);
        drop(claim_changes);
        stopping::drain(&self.shared.activity, self.shared.options.drain_timeout).await?;
        tracing::info!("every controller stopped");
        Ok(())
    }

    /// What runs beside the policies' controllers until the host stops: the sweep of
    /// deleted policies' webhooks, and on a sharded host the explain records' share.
    fn start_beside(
        &self,
        claims: reflector::Store<ReconcilePolicy>,
    ) -> [Option<JoinHandle<()>>; 2] {
        [
            self.sweep_webhooks(claims),
            self.forget_records_of_shards_given_back(),
        ]
    }

    /// A sharded replica drops the explain records of the parents of each shard it gives
    /// back (their new holder records them from then on), so its store follows its share as
    /// its caches do. Looked at again every minute: a reconcile of such a parent that was
    /// under way may record after the shard went.
    fn forget_records_of_shards_given_back(&self) -> Option<JoinHandle<()>> {
        let shards = self.shared.leadership.shards()?.clone();
        let explain = self.shared.options.explain.clone();
        Some(tokio::spawn(async move {
            let mut held = shards.subscribe();
            let mut every_minute = tokio::time::interval(Duration::from_secs(60));
            loop {
                tokio::select! {
                    changed = held.changed() => if changed.is_err() {
                        return;
                    },
                    _ = every_minute.tick() => {}
                }
                let now: HashSet<u32> = held.borrow_and_update().keys().copied().collect();
                let count = shards.count();
                let dropped = explain
                    .store
                    .forget(|hash| now.contains(&crate::shards::shard_of_hash(hash, count)));
                if dropped > 0 {
                    tracing::debug!(dropped, "dropped the explain records of shards given back");
                }
            }
        }))
    }

    /// Once this replica leads and knows every policy in the cluster, remove the webhook
    /// entries of policies deleted (or moved to another host's selector) while no host ran:
    /// nothing else would, their controllers are gone. A failure is logged; a policy's own leader rewrites its entries within a
    /// minute should one be swept as it was made.
    fn sweep_webhooks(&self, claims: reflector::Store<ReconcilePolicy>) -> Option<JoinHandle<()>> {
        let hosting = self.shared.webhooks.clone()?;
        let shared = self.shared.clone();
        Some(tokio::spawn(async move {
            shared.leadership.until_leader().await;
            if claims.wait_until_ready().await.is_err() {
                return;
            }
            // Tried again, with what is known then: a sweep refused because a configuration
            // changed under it (a policy's own write) is no failure of the sweep.
            let retry =
                reconcile::backoff::Backoff::new(Duration::from_secs(2), Duration::from_secs(60));
            // The policies this host runs: one moved to another host's selector while none
            // ran has its entries here removed too.
            let selector = shared
                .options
                .policy_selector
                .as_deref()
                .map(crate::policy::placement::PolicySelector::parse);
            if let Some(Err(_)) = selector {
                return;
            }
            let selected = |policy: &ReconcilePolicy| match &selector {
                Some(Ok(selector)) => selector.matches(policy.labels()),
                _ => true,
            };
            for _ in 0..5 {
                let kept = claims
                    .state()
                    .iter()
                    .filter(|p| selected(p))
                    .flat_map(|p| crate::admission::configurations::webhook_names(&p.name_any()))
                    .collect();
                match hosting.configurations(&shared.client).sweep(&kept).await {
                    Ok(_) => return,
                    Err(error) => {
                        let delay = retry.failed(&()).delay;
                        tracing::warn!(error = %format!("{error:#}"), retry_in = ?delay, "could not remove the webhooks of deleted policies");
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        }))
    }

    /// Stop the controller of a policy that is being deleted, then release the finalizers it
    /// holds on parents and let the policy go (retried until it works).
    fn retire(&self, running: &mut HashMap<String, Running>, policy: ReconcilePolicy) {
        let name = policy.name_any();
        if running
            .get(&name)
            .is_some_and(|r| r.retiring && r.uid == policy.metadata.uid)
        {
            return;
        }
        let shared = self.shared.clone();
        let policy = Arc::new(policy);
        let retired = policy.clone();
        let entry = Running::after(
            running.remove(&name),
            &retired,
            true,
            Arc::default(),
            &self.shared,
            move |_, stop, step| {
                let (shared, policy) = (shared.clone(), policy.clone());
                async move {
                    step.set("releasing the deleted policy's parents");
                    // Every replica converts its kind while its CRD still points here.
                    let converting =
                        policy_run::conversion::keep_converting_while_retiring(&policy, &shared);
                    if stop.run_until_cancelled(converting).await.is_none() {
                        return;
                    }
                    let retry = reconcile::backoff::Backoff::new(
                        Duration::from_secs(1),
                        Duration::from_secs(30),
                    );
                    loop {
                        tokio::select! {
                            () = shared.leadership.until_leader() => {}
                            () = stop.cancelled() => return,
                        }
                        let Some(result) = stop
                            .run_until_cancelled(retire_once(&shared, &policy))
                            .await
                        else {
                            return;
                        };
                        let Err(error) = result else {
                            return;
                        };
                        let delay = retry.failed(&()).delay;
                        tracing::warn!(policy = %policy.name_any(), error = %format!("{error:#}"), retry_in = ?delay, "could not let the deleted policy go");
                        tokio::select! {
                            () = tokio::time::sleep(delay) => {}
                            () = stop.cancelled() => return,
                        }
                    }
                }
            },
        );
        running.insert(name, entry);
    }

    /// Re-check who holds each parent kind against the newest copy of every policy: a running
    /// policy whose kind an older policy holds too (two started at once) restarts, to be
    /// refused; a policy refused its kind tries again as soon as the holder is deleted or
    /// moved to another kind. Policies whose newest version this host has not acted on yet
    /// are left to [`Self::ensure`].
    fn recheck_claims(&self, running: &mut HashMap<String, Running>, all: &[Arc<ReconcilePolicy>]) {
        let mut restart = Vec::new();
        for (name, r) in running.iter() {
            if r.retiring || r.stop.is_cancelled() {
                continue;
            }
            let Some(policy) = all
                .iter()
                .find(|p| p.metadata.uid == r.uid && p.metadata.generation == r.generation)
            else {
                continue;
            };
            match parent_claims::recheck(r.standing.get(), policy, all.iter().map(|p| &**p)) {
                parent_claims::Recheck::Keep => {}
                parent_claims::Recheck::Retry => {
                    tracing::info!(policy = %name, "parent kind free; trying again");
                    r.standing.retry_now();
                }
                parent_claims::Recheck::Restart => restart.push(policy.clone()),
            }
        }
        for policy in restart {
            let name = policy.name_any();
            tracing::warn!(policy = %name, "another policy holds this parent kind; restarting to give it up");
            self.start(running, policy);
        }
    }

    /// Make sure the controller for `policy` runs this version of it: nothing if it already
    /// does, a hot swap if only the plugin changed, a restart otherwise.
    fn ensure(&self, running: &mut HashMap<String, Running>, policy: ReconcilePolicy) {
        let name = policy.name_any();
        let uid = policy.metadata.uid.clone();
        let generation = policy.metadata.generation;
        let previous = running.remove(&name);
        if let Some(mut r) = previous {
            if r.uid == uid && r.generation == generation && !r.stop.is_cancelled() {
                let controls = controls_of(&policy);
                if r.controls != controls && !r.retiring {
                    tracing::info!(policy = %name, ?controls, "control annotations changed");
                    r.controls = controls;
                    let _ = r.updates.send(Arc::new(policy));
                }
                running.insert(name, r);
                return;
            }
            if r.uid == uid
                && !r.retiring
                && only_the_plugin_differs(&r.spec, &policy.spec)
                && !r.task.is_finished()
            {
                tracing::info!(policy = %name, generation, "plugin changed; swapping it in place");
                r.generation = generation;
                r.spec = policy.spec.clone();
                r.controls = controls_of(&policy);
                let _ = r.updates.send(Arc::new(policy));
                running.insert(name, r);
                return;
            }
            running.insert(name.clone(), r);
        }
        self.start(running, Arc::new(policy));
    }

    /// Start a controller for `policy`, once the one it replaces (if any) has stopped.
    fn start(&self, running: &mut HashMap<String, Running>, policy: Arc<ReconcilePolicy>) {
        let name = policy.name_any();
        let shared = self.shared.clone();
        // Counted as syncing from now, before the list of policies is done: the host must
        // not report ready while a listed policy's plugin is still loading.
        // A controller started again after a panic does not hold readiness back.
        let mut syncing = Some(self.shared.readiness.syncing());
        let standing = Arc::new(Standing::default());
        let task_standing = standing.clone();
        let entry = Running::after(
            running.remove(&name),
            &policy,
            false,
            standing,
            &self.shared,
            move |updates, stop, step| {
                let syncing = syncing
                    .take()
                    .unwrap_or_else(crate::health::SyncGuard::already_synced);
                policy_run::run(
                    updates,
                    shared.clone(),
                    stop,
                    syncing,
                    task_standing.clone(),
                    step,
                )
            },
        );
        running.insert(name, entry);
    }
}

impl Running {
    /// Run `work` for `policy` once `previous` (if any) has stopped: the old controller
    /// finishes its in-flight reconciles before anything new starts, so no parent is ever
    /// reconciled by both. A `work` that panics is started again (see [`supervise`]) and
    /// reported on the policy meanwhile; a panic ends this task alone, never the host.
    fn after<F, Fut>(
        previous: Option<Running>,
        policy: &Arc<ReconcilePolicy>,
        retiring: bool,
        standing: Arc<Standing>,
        shared: &Arc<Shared>,
        mut work: F,
    ) -> Self
    where
        F: FnMut(
                watch::Receiver<Arc<ReconcilePolicy>>,
                CancellationToken,
                Arc<stopping::Step>,
            ) -> Fut
            + Send
            + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let stop = CancellationToken::new();
        let (updates, updates_rx) = watch::channel(policy.clone());
        let work_stop = stop.clone();
        let name = policy.name_any();
        let forget = Arc::new(ForgetOnDeletion::default());
        let task_forget = forget.clone();
        let step = Activity::step("starting");
        let task_step = step.clone();
        let activity = shared.activity.clone();
        let task_name = name.clone();
        let shared = shared.clone();
        let task = tokio::spawn(async move {
            if let Some(previous) = previous {
                tracing::info!(policy = %name, "policy changed; stopping its previous controller first");
                task_step.set("waiting for the policy's previous controller to stop");
                previous.stop.cancel();
                let _ = previous.task.await;
            }
            supervise::supervise(
                &name,
                &work_stop,
                || work(updates_rx.clone(), work_stop.clone(), task_step.clone()),
                |crash| report_crash(&shared, &name, crash),
            )
            .await;
            task_forget.ended(&shared.metrics, &name);
        });
        activity.track(format!("policy {task_name:?}"), step, task.abort_handle());
        Self {
            uid: policy.metadata.uid.clone(),
            generation: policy.metadata.generation,
            spec: policy.spec.clone(),
            controls: controls_of(policy),
            updates,
            stop,
            task,
            retiring,
            standing,
            forget,
        }
    }

    /// The policy was deleted: stop its controller, and forget its metrics once it stopped.
    fn delete(&self, metrics: &crate::metrics::Metrics, policy: &str) {
        self.stop.cancel();
        self.forget.deleted(metrics, policy);
    }
}

/// Turn NamespacedReconcilePolicies into ReconcilePolicies until `stop`; a panic restarts
/// the loop, as it restarts a policy's controller.
async fn run_namespaced_policies(shared: Arc<Shared>, stop: CancellationToken) {
    // A selector that does not parse places nothing here, rather than everything.
    let selector = match shared.options.policy_selector.as_deref() {
        None => None,
        Some(text) => match crate::policy::placement::PolicySelector::parse(text) {
            Ok(selector) => Some(selector),
            Err(error) => {
                tracing::error!(%error, "--policy-selector: no team policy is placed on this host");
                return;
            }
        },
    };
    supervise::supervise(
        "namespaced policies",
        &stop,
        || {
            namespaced_policies::run(
                shared.client.clone(),
                shared.leadership.clone(),
                (shared.options.namespace.clone(), selector.clone()),
                shared.options.team_bounds.clone(),
                stop.clone().cancelled_owned(),
            )
        },
        |_crash| std::future::ready(()),
    )
    .await;
}

/// Count a policy controller's panic and say on the policy that it is down until its restart.
async fn report_crash(shared: &Shared, policy: &str, crash: supervise::Crash) {
    shared.metrics.controller_restarted(policy);
    let state = policy_run::status::State::failed(
        "ControllerRestarting",
        format!(
            "the policy's controller stopped on an internal error ({}); restarting it in {} s",
            crash.message,
            crash.restart_in.as_secs()
        ),
    );
    policy_run::status::set_ready_once(
        Api::all(shared.client.clone()),
        policy,
        shared.leadership.clone(),
        state,
    )
    .await;
}

/// The annotations a running policy acts on without a new generation: the prune
/// confirmation and the rollout retry, owned.
fn controls_of(policy: &ReconcilePolicy) -> Controls {
    Controls {
        confirm_prune: reconcile::prune_guard::confirmation(policy).map(str::to_owned),
        retry_rollout: policy_run::rollout::retry_annotation(policy).map(str::to_owned),
    }
}

/// What [`controls_of`] reads.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Controls {
    confirm_prune: Option<String>,
    retry_rollout: Option<String>,
}

/// Whether two versions of a policy differ in `spec.plugin` alone, and not in who must sign
/// it: a policy whose `verify` changed starts again, so the plugin it serves is verified
/// anew, and one that no longer verifies stops serving instead of staying the last good.
fn only_the_plugin_differs(old: &ReconcilePolicySpec, new: &ReconcilePolicySpec) -> bool {
    let mut aligned = old.clone();
    aligned.plugin = new.plugin.clone();
    aligned == *new && old.plugin.verify == new.plugin.verify
}

/// Let the children of a deleted policy go from their teardown order (see
/// [`policy_run::teardown`]); the leader does it, trying a few times, and says when it
/// cannot.
async fn release_teardown(shared: Arc<Shared>, policy: ReconcilePolicy) {
    const ATTEMPTS: u32 = 5;
    let acting = match shared.identities.acting_for(&policy) {
        Ok(acting) => acting,
        Err(refused) => {
            tracing::warn!(policy = %policy.name_any(), reason = refused.reason, "cannot release the deleted policy's children from their teardown order without its identity");
            return;
        }
    };
    let namespace = shared.options.namespace.as_deref();
    for attempt in 1..=ATTEMPTS {
        if !shared.leadership.is_leader() {
            return;
        }
        match policy_run::release::release_teardown(&acting.client, &policy, namespace).await {
            Ok(_) => return,
            Err(error) if attempt == ATTEMPTS => {
                tracing::warn!(policy = %policy.name_any(), error = %format!("{error:#}"), "could not release the deleted policy's children from their teardown order; `wasmctrl uninstall` or removing the finalizer releases them");
            }
            Err(error) => {
                tracing::info!(policy = %policy.name_any(), error = %format!("{error:#}"), attempt, "could not release the deleted policy's children from their teardown order yet");
                tokio::time::sleep(Duration::from_secs(1 << attempt)).await;
            }
        }
    }
}

/// One attempt at letting a deleted policy go: its webhook entries removed (nothing answers
/// them any more; garbage collection would remove them too, once the policy is gone), its
/// parents released, its CRD's conversion put back (refused while a stored object needs it:
/// then the policy stays, and says why), its finalizers removed.
async fn retire_once(shared: &Shared, policy: &ReconcilePolicy) -> anyhow::Result<()> {
    if let Some(hosting) = &shared.webhooks {
        hosting
            .configurations(&shared.client)
            .remove(&policy.name_any())
            .await?;
    }
    let acting = shared.identities.acting_for(policy).map_err(|refused| {
        anyhow::anyhow!(
            "no identity to release its parents with: {}",
            refused.message
        )
    })?;
    policy_run::release::retire(
        &shared.client,
        &acting.client,
        policy,
        shared.options.namespace.as_deref(),
        policy_run::conversion::retire(policy, shared),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Metrics, ReconcileResult};

    fn counted(metrics: &Arc<Metrics>) {
        metrics
            .policy("p")
            .reconciled(ReconcileResult::Success, Duration::from_millis(1));
    }

    #[test]
    fn a_deleted_policys_series_go_once_its_task_has_ended_in_either_order() {
        let metrics = Arc::new(Metrics::new());
        let has_series = |m: &Metrics| m.encode().contains(r#"controller="p""#);

        counted(&metrics);
        let forget = ForgetOnDeletion::default();
        forget.deleted(&metrics, "p");
        assert!(has_series(&metrics), "the task still runs");
        forget.ended(&metrics, "p");
        assert!(!has_series(&metrics));

        counted(&metrics);
        let forget = ForgetOnDeletion::default();
        forget.ended(&metrics, "p");
        assert!(has_series(&metrics), "stopped for a restart, not deleted");
        forget.deleted(&metrics, "p");
        assert!(!has_series(&metrics));
    }
}
