//! One policy's controller, from start to stop: load the plugin, resolve the kinds through
//! discovery (waiting, with `Ready=False`, for a kind that is not served yet), then run a
//! kube-runtime `Controller` over the parent kind, its children and its related kinds until
//! told to stop. Stopping is graceful: reconciles in flight finish first.

pub(crate) mod conversion;
pub(crate) mod identity;
pub(crate) mod parent_claims;
pub(crate) mod permissions;
pub(crate) mod prepare;
pub(crate) mod release;
mod replay_gate;
pub(crate) mod report;
mod resync;
pub(crate) mod rollout;
mod rollout_across;
pub(crate) mod scopes;
pub(crate) mod shard_feeds;
pub(crate) mod shard_labels;
pub(crate) mod shared;
pub(crate) mod shared_watches;
pub(crate) mod status;
pub(crate) mod swap;
pub(crate) mod teardown;
pub(crate) mod watch_health;
pub(crate) mod watches;
pub(crate) mod webhooks;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use kube::ResourceExt as _;
use kube::api::Api;
use kube::runtime::controller;
use kube::runtime::reflector::Store;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::case::Redaction;
use crate::controller::cache::cached::CachedObject;
use crate::controller::cache::related::RelatedBy;
use crate::controller::kinds::ResolvedKind;
use crate::controller::labels;
use crate::controller::reconcile;
use crate::controller::reconcile::backoff::Backoff;
use crate::controller::reconcile::context::{Caches, Outcomes, PolicyContext};
use crate::controller::reconcile::events::EventSink;
use crate::controller::reconcile::prune_guard::{self, PruneGuard, PruneLimits};
use crate::controller::reconcile::queue::QueueGauge;
use crate::controller::reconcile::serving::{ActivePlugin, Serving};
use crate::controller::stopping::{self, Step};
use crate::metrics::PolicyMetrics;
use crate::plugin::Plugin;
use crate::policy::ReconcilePolicy;
use identity::Acting;
use parent_claims::{Stand, Standing};
use prepare::Parts;
pub(crate) use shared::Shared;
use status::{PolicyStatusWriter, State};
use watch_health::WatchHealth;
use watches::{WatchSetup, Watches};

/// How often a running policy's counts are written to its status (when they changed).
const STATUS_INTERVAL: Duration = Duration::from_secs(5);
/// Report ticks between sweeps of what is kept per parent when no parent went (a minute).
const SWEEP_AT_LEAST_EVERY: u64 = 12;

/// Run a policy until `stop` is cancelled. `updates` carries the policy, and later versions
/// of it that differ only in their plugin (those are hot-swapped, not restarted).
///
/// `syncing` holds the host's readiness back until the controller's caches are synced, or
/// until the first attempt to start it failed (that failure is on the policy's status; the
/// host is as ready as it can be without it).
///
/// `standing` tells the host where the policy stands on its parent kind, and lets the host
/// wake a refused policy when the kind becomes free.
///
/// `step` says where the policy stands, for a stop that takes too long to name it. Every
/// wait here ends on `stop`, except the reconciles in flight, which finish first.
pub(crate) async fn run(
    mut updates: watch::Receiver<Arc<ReconcilePolicy>>,
    shared: Arc<Shared>,
    stop: CancellationToken,
    mut syncing: crate::health::SyncGuard,
    standing: Arc<Standing>,
    step: Arc<Step>,
) {
    let mut policy = updates.borrow_and_update().clone();
    let name = policy.name_any();
    let mut status = PolicyStatusWriter::new(
        Api::all(shared.client.clone()),
        &policy,
        shared.leadership.clone(),
    );
    let retry = Backoff::new(Duration::from_secs(1), Duration::from_secs(15));
    let mut plugin: Option<Plugin> = None;
    loop {
        step.set("loading its plugin and checking its kinds and permissions");
        // A fetch or discovery that hangs must not hold up the policy's restart or
        // deletion, nor a new plugin spec: stopping or an update wins over preparing.
        let prepared = tokio::select! {
            parts = prepare::prepare(&policy, &shared, &mut status, &mut plugin, &standing) => Some(parts),
            () = stop.cancelled() => return,
            Ok(()) = updates.changed() => None,
        };
        let Some(prepared) = prepared else {
            policy = updates.borrow_and_update().clone();
            status.set_generation(policy.metadata.generation);
            plugin = None;
            continue;
        };
        match prepared {
            Some(parts) => {
                standing.set(Stand::Running);
                let launch = Launch {
                    policy,
                    parts,
                    status,
                    stop,
                    updates,
                    syncing,
                    step,
                };
                let metrics = shared.metrics.policy(&name);
                run_controller(launch, &shared, &metrics).await;
                metrics.set_active_plugin(None);
                metrics.forget_prune_held();
                tracing::info!(policy = %name, "policy controller stopped");
                return;
            }
            None => {
                syncing.synced();
                step.set("reporting why it cannot start, and releasing the parents it left");
                let reported = async {
                    webhooks::remove_unanswered(&policy, &shared, &mut status).await;
                    status.flush().await;
                    release_left_scopes(&policy, &shared).await;
                };
                tokio::select! {
                    () = reported => {}
                    () = stop.cancelled() => return,
                }
                step.set("waiting to try starting again");
                let delay = retry.failed(&()).delay;
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    // The host saw the parent kind this policy was refused become free.
                    () = standing.retried() => {}
                    Ok(()) = updates.changed() => {
                        // A new plugin spec while waiting: load that one instead.
                        policy = updates.borrow_and_update().clone();
                        status.set_generation(policy.metadata.generation);
                        plugin = None;
                    }
                    () = stop.cancelled() => return,
                }
            }
        }
    }
}

/// A policy that cannot start still lets go of the parents it certainly left (see
/// [`release::release_left_scopes`]); failures are logged and tried again with the next
/// attempt to start. A standby leaves it to the leader.
async fn release_left_scopes(policy: &ReconcilePolicy, shared: &Shared) {
    if !shared.leadership.is_leader() {
        return;
    }
    let namespace = shared.options.namespace.as_deref();
    // Released as the policy's identity, which may be why it cannot start.
    let acting = match shared.identities.acting_for(policy) {
        Ok(acting) => acting,
        Err(refused) => {
            tracing::warn!(policy = %policy.name_any(), reason = refused.reason, "cannot release the parents of a kind or namespace the policy left without its identity");
            return;
        }
    };
    let released =
        release::release_left_scopes(&shared.client, &acting.client, policy, namespace).await;
    if let Err(error) = released {
        tracing::warn!(policy = %policy.name_any(), error = %format!("{error:#}"), "could not release the parents of a kind or namespace the policy left");
    }
}

/// A policy whose checks passed, and what its controller starts with.
struct Launch {
    policy: Arc<ReconcilePolicy>,
    parts: Parts,
    status: PolicyStatusWriter,
    stop: CancellationToken,
    updates: watch::Receiver<Arc<ReconcilePolicy>>,
    syncing: crate::health::SyncGuard,
    step: Arc<Step>,
}

/// Start the policy's controller and everything that runs beside it, and run them until
/// `stop`: the controller stops gracefully, the rest with it. A stop while starting ends the
/// start wherever it is.
async fn run_controller(launch: Launch, shared: &Arc<Shared>, metrics: &PolicyMetrics) {
    let Launch {
        policy,
        parts,
        mut status,
        stop,
        updates,
        syncing,
        step,
    } = launch;
    let (teardown_wake, teardown_woken) = tokio::sync::mpsc::unbounded_channel();
    let setup = watch_setup(&policy, shared, &parts.acting, metrics, teardown_wake).await;
    let mut syncing = syncing;
    if policy.spec.conversion.is_some() {
        // Its parents are listed through the conversion webhook, which the API server
        // reaches through a Service that sends it to ready hosts only: this host's readiness
        // cannot wait for them.
        syncing.synced();
    }
    let (controller, parents, caches, wait_for_caches) = watches(&setup, &parts).finish(syncing);
    metrics.set_active_plugin(Some(&parts.plugin.digest().to_string()));
    let (finalizers_ready, finalizers_ready_rx) = watch::channel(false);
    let ctx = Arc::new(policy_context(
        &policy,
        shared,
        &setup,
        &parts,
        caches,
        metrics.clone(),
        finalizers_ready_rx,
    ));
    let namespace = setup.namespace.as_deref();
    let acting = &parts.acting.client;
    let scope = (&parts.parent, namespace);
    step.set("starting: setting up finalizers and reporting itself running");
    let started = stop
        .run_until_cancelled(start_running(
            &policy,
            &parts,
            shared,
            &mut status,
            namespace,
            &finalizers_ready,
        ))
        .await;
    let Some((first_sync, running)) = started else {
        return;
    };
    let finalizers =
        keep_finalizers_in_sync(first_sync, &policy, shared, acting, scope, finalizers_ready);

    // A swap, a candidate change and a takeover re-enqueue every parent through this channel.
    let (requeue_all, requeue_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let status = Arc::new(tokio::sync::Mutex::new(status));
    let swapper = swap::Swapper::new(&ctx, shared, metrics, &status, &requeue_all);
    step.set("starting: loading its rollout candidate");
    let Some(candidate) = stop.run_until_cancelled(swapper.prime(&policy)).await else {
        return;
    };
    step.set("running");
    let run = run_reconciles(
        (controller, &setup),
        &policy,
        &ctx,
        &parents,
        requeue_rx,
        (stop, step),
    );
    let takeover = requeue_on_takeover(&ctx, requeue_all.clone());
    let rollout = rollout::Driver {
        ctx: ctx.clone(),
        parents: parents.clone(),
        status: status.clone(),
        requeue_all: requeue_all.clone(),
        // Every transition is worth its Event: none is held back as a repeat.
        events: EventSink::new(shared.client.clone(), "wasmctrl".to_owned(), Duration::ZERO),
    }
    .run(updates.clone());
    let swapper = swapper.run(policy.clone(), updates, candidate);
    let report = report_periodically(&ctx, &policy, &parents, &status, &setup, running);
    let conversion = conversion::PolicyConversion::new(
        &policy,
        shared,
        &parts.parent,
        ctx.serving.clone(),
        status.clone(),
    );
    let webhooks = webhooks::PolicyWebhooks::new(
        &policy,
        shared,
        scope,
        &parts.acting,
        ctx.serving.clone(),
        status.clone(),
    );
    let teardown = teardown::Teardown::new(ctx.clone(), teardown_woken, &policy).run();
    let labels = shard_labels::run(setup.parent_labels(&parts.parent, &parents));
    // The controller ends on `stop` (gracefully); everything else runs beside it.
    tokio::select! {
        () = run => {}
        () = async { tokio::join!(report, wait_for_caches, swapper, finalizers, takeover, rollout, webhooks.serve(shared), conversion.serve(shared), teardown, labels); } => {}
    }
    webhooks.finish(shared).await;
}

/// The watches of the policy's parents, children and related objects.
fn watches(setup: &WatchSetup, parts: &Parts) -> Watches {
    let references = parts
        .related
        .iter()
        .enumerate()
        .filter_map(|(position, (resolved, by))| match by {
            RelatedBy::Name(path) => Some((position, path.clone(), resolved.namespaced)),
            RelatedBy::All | RelatedBy::Selector(_) => None,
        })
        .collect();
    let by_namespace = parts
        .related
        .iter()
        .any(|(_, by)| matches!(by, RelatedBy::All | RelatedBy::Selector(_)));
    let mut watches = Watches::parents(setup, &parts.parent, references, by_namespace);
    for (kind, resolved) in &parts.children {
        watches = watches.owns(setup, kind, resolved);
    }
    for (position, (resolved, by)) in parts.related.iter().enumerate() {
        watches = match by {
            RelatedBy::All => watches.reads(setup, resolved, None),
            RelatedBy::Selector(selector) => watches.reads(setup, resolved, Some(selector)),
            RelatedBy::Name(path) => watches.reads_named(setup, resolved, position, path.clone()),
        };
    }
    watches
}

/// What the policy's reconciles share, as the policy and the host's options say.
fn policy_context(
    policy: &ReconcilePolicy,
    shared: &Shared,
    setup: &WatchSetup,
    parts: &Parts,
    caches: Caches,
    metrics: PolicyMetrics,
    finalizers_ready: watch::Receiver<bool>,
) -> PolicyContext {
    let name = policy.name_any();
    let policy_label = labels::policy_label_value(&name);
    let spec = &policy.spec;
    let options = &shared.options;
    PolicyContext {
        client: parts.acting.client.clone(),
        policy: name,
        finalizer: spec
            .finalize
            .then(|| labels::parent_finalizer(&policy_label)),
        finalizers_ready,
        policy_label,
        field_manager: setup.field_manager.clone(),
        parent: parts.parent.resource.clone(),
        resync: Duration::from_secs(
            spec.resync_period_seconds
                .map_or(options.resync.as_secs(), u64::from),
        ),
        events: EventSink::new(
            parts.acting.client.clone(),
            setup.field_manager.clone(),
            options.event_interval,
        ),
        metrics,
        queue: setup.queue.clone(),
        leadership: shared.leadership.clone(),
        caches,
        serving: Arc::new(Serving::new(ActivePlugin {
            plugin: parts.plugin.clone(),
            config: swap::config_text(&spec.plugin),
        })),
        prune_guard: Arc::new(starting_prune_guard(policy, parts.plugin.digest())),
        outcomes: Outcomes::new(options.backoff_base, options.backoff_max),
        decisions: setup.decisions.clone(),
        explain: options.explain.clone(),
        redaction: Arc::new(Redaction::of_policy(spec, options.explain.secret_data)),
        parents_gone: setup.parents_gone.clone(),
    }
}

/// The prune guard of a controller that starts: its first window opens now, as the controller
/// cannot know whether the plugin it starts with made the children it finds.
fn starting_prune_guard(policy: &ReconcilePolicy, digest: &crate::plugin::Digest) -> PruneGuard {
    let generation = policy.metadata.generation;
    let guard = PruneGuard::new(
        PruneLimits::of(policy.spec.safety.as_ref()),
        prune_guard::change_key(generation, digest, None),
        format!(
            "the controller started (generation {}, plugin {})",
            generation.unwrap_or_default(),
            digest.short()
        ),
    );
    guard.set_confirmation(prune_guard::confirmation(policy));
    guard
}

/// What the policy's watches share: who they watch as, where they look, what they report to.
async fn watch_setup(
    policy: &ReconcilePolicy,
    shared: &Shared,
    acting: &Acting,
    metrics: &PolicyMetrics,
    teardown: teardown::Wake,
) -> WatchSetup {
    let name = policy.name_any();
    WatchSetup {
        client: acting.client.clone(),
        // A namespace restriction applies to namespaced kinds; cluster-scoped ones are
        // watched cluster-wide (and need cluster RBAC).
        namespace: policy
            .spec
            .parent
            .namespace
            .clone()
            .or_else(|| shared.options.namespace.clone()),
        health: Arc::new(WatchHealth::default()),
        queue: Arc::new(QueueGauge::new(metrics.clone())),
        decisions: Arc::default(),
        metrics: metrics.clone(),
        field_manager: field_manager_for(&name),
        owned_selector: watches::owned_selector(&labels::policy_label_value(&name)),
        related_budget: shared.related_budget.clone(),
        teardown,
        parents_gone: Arc::default(),
        identity: acting.account.as_ref().map(ToString::to_string),
        shared: shared.watches.clone(),
        per_shard: shard_feeds(shared).await,
    }
}

/// Sharded, the feeds of a policy's caches per shard (see [`shard_feeds::ShardFeeds`]): its
/// parents watched by uid where the API server narrows watches so, and by the shard label
/// otherwise (the API server is asked once per host). Not sharded, `None`: the caches hold
/// the whole kind.
async fn shard_feeds(shared: &Shared) -> Option<Arc<shard_feeds::ShardFeeds>> {
    let shards = shared.leadership.shards()?;
    let narrows = shared
        .narrows_by_shard
        .get_or_try_init(|| async {
            let asked = crate::shards::selector::narrows_by_shard(&shared.client);
            let narrows = tokio::time::timeout(Duration::from_secs(10), asked)
                .await
                .map_err(|_| anyhow::anyhow!("no answer within 10 s"))??;
            if narrows {
                tracing::info!("the API server narrows watches by shard: each policy caches the parents and children of the shards this replica holds, its parents watched by uid");
            } else {
                tracing::info!("the API server does not narrow watches by shard (its ShardedListAndWatch feature gate is off): each policy caches the parents and children of the shards this replica holds, its parents watched by a shard label each replica stamps once on its shards' parents");
            }
            Ok::<_, anyhow::Error>(narrows)
        })
        .await;
    let narrows = match narrows {
        Ok(narrows) => narrows,
        Err(error) => {
            // The label works with any API server; it is asked again at the next start.
            tracing::warn!(error = %format!("{error:#}"), "could not ask the API server whether it narrows watches by shard: this policy watches its parents by the shard label");
            &false
        }
    };
    Some(shard_feeds::ShardFeeds::new(shards.clone(), *narrows))
}

/// The leader's first attempt to set up finalizers (see [`keep_finalizers_in_sync`]; `None`
/// on a standby), then the report that the policy runs, returning its `Ready=True` state.
async fn start_running(
    policy: &ReconcilePolicy,
    parts: &Parts,
    shared: &Shared,
    status: &mut PolicyStatusWriter,
    namespace: Option<&str>,
    finalizers_ready: &watch::Sender<bool>,
) -> (Option<anyhow::Result<()>>, State) {
    let first_sync = if shared.leadership.is_leader() {
        let scope = (&parts.parent, namespace);
        let acting = &parts.acting.client;
        Some(
            release::sync_finalizers(&shared.client, acting, policy, scope, finalizers_ready).await,
        )
    } else {
        None
    };
    let running = announce_running(policy, parts, status, namespace).await;
    (first_sync, running)
}

/// Report the policy running (returning that `Ready=True` state), with what it should know
/// about its related kinds and about children of kinds it no longer manages.
async fn announce_running(
    policy: &ReconcilePolicy,
    parts: &Parts,
    status: &mut PolicyStatusWriter,
    namespace: Option<&str>,
) -> State {
    let running = running_state(policy, &parts.acting);
    status.set_ready(running.clone());
    status.set_optional("RelatedNarrowed", report::related_cost(&parts.related));
    report::report_unmanaged_children(&parts.acting.client, policy, status, namespace).await;
    status.flush().await;
    tracing::info!(policy = %policy.name_any(), parent = %policy.spec.parent.kind, acting_as = %parts.acting.who(), "policy controller running");
    running
}

/// The `Ready=True` state of a running policy.
fn running_state(policy: &ReconcilePolicy, acting: &Acting) -> State {
    let spec = &policy.spec;
    State::ok(
        "Running",
        format!(
            "reconciling {} {} with {} child kind(s) as {}",
            spec.parent.api_version,
            spec.parent.kind,
            spec.children.len(),
            acting.who()
        ),
    )
}

/// The policy's own finalizer and the record of where it finalizes (`status.finalizedScopes`)
/// must be in place before any parent gets a finalizer, so that no edit or deletion of the
/// policy can strand a parent: reconciles add none until `ready` says so. A policy that moved
/// releases the parents it left, and one that stopped finalizing lets every parent go. The
/// leader makes the first attempt before its controller starts (`first`); a failure is
/// retried here, beside the controller. A standby leaves it to the leader until it leads
/// itself; a sharded replica that does not hold shard 0 reconciles its parents once the
/// holder of shard 0 has recorded the scope.
fn keep_finalizers_in_sync<'a>(
    first: Option<anyhow::Result<()>>,
    policy: &'a ReconcilePolicy,
    shared: &'a Shared,
    acting: &'a kube::Client,
    scope: (&'a ResolvedKind, Option<&'a str>),
    ready: watch::Sender<bool>,
) -> impl Future<Output = ()> + 'a {
    let client = &shared.client;
    async move {
        let retry = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let mut result = match first {
            Some(result) => result,
            None => {
                // A sharded replica adds the finalizer to the parents of its shards once the
                // holder of shard 0 has recorded the scope; it syncs them itself only if it
                // comes to hold shard 0.
                if shared.leadership.shards().is_some() {
                    tokio::select! {
                        () = shared.leadership.until_leader() => {}
                        () = release::wait_for_recorded_scope(client, policy, scope, &ready) => {}
                    }
                }
                shared.leadership.until_leader().await;
                release::sync_finalizers(client, acting, policy, scope, &ready).await
            }
        };
        while let Err(error) = result {
            let delay = retry.failed(&()).delay;
            tracing::warn!(policy = %policy.name_any(), error = %format!("{error:#}"), retry_in = ?delay, "could not set up or release finalizers");
            tokio::time::sleep(delay).await;
            result = release::sync_finalizers(client, acting, policy, scope, &ready).await;
        }
        ready.send_replace(true);
        std::future::pending::<()>().await;
    }
}

/// The controller itself: reconcile at the policy's concurrency, every parent again on
/// `requeue_all`, until `stop`; then the reconciles in flight finish (`step` says so).
fn run_reconciles(
    (controller, setup): (kube::runtime::Controller<CachedObject>, &WatchSetup),
    policy: &ReconcilePolicy,
    ctx: &Arc<PolicyContext>,
    parents: &Store<CachedObject>,
    requeue_all: tokio::sync::mpsc::UnboundedReceiver<()>,
    (stop, step): (CancellationToken, Arc<Step>),
) -> impl Future<Output = ()> + use<> {
    let listed = setup.per_shard.as_ref().map(|feeds| feeds.parents_held());
    let concurrency = policy.spec.max_concurrent_reconciles.unwrap_or(4).max(1);
    let controller = match ctx.leadership.shards() {
        Some(shards) => {
            controller.reconcile_on(parents_of_shards_gained(shards, parents, &ctx.parent))
        }
        None => controller,
    };
    let controller = match (listed, ctx.leadership.shards()) {
        (Some(listed), Some(shards)) => controller.reconcile_on(parents_of_shards_listed(
            listed,
            shards.clone(),
            parents,
            &ctx.parent,
        )),
        _ => controller,
    };
    let controller = controller.reconcile_on(resync::parents_due(parents.clone(), ctx.clone()));
    let every_parent = {
        let parents = parents.clone();
        let queue = ctx.queue.clone();
        futures::stream::unfold(requeue_all, |mut rx| async move {
            rx.recv().await.map(|()| ((), rx))
        })
        .inspect(move |()| {
            queue.added(
                parents
                    .state()
                    .iter()
                    .map(|p| (p.metadata.namespace.clone(), p.name_any())),
            );
        })
    };
    let run = controller
        .trigger_backoff(crate::watch_backoff::NoExtraDelay)
        .with_config(
            controller::Config::default()
                .concurrency(u16::try_from(concurrency).unwrap_or(u16::MAX)),
        )
        .reconcile_all_on(every_parent)
        .graceful_shutdown_on({
            let stop = stop.clone();
            async move {
                stop.cancelled().await;
                step.set("finishing its reconciles in flight");
            }
        })
        .run(reconcile::reconcile, reconcile::error_policy, ctx.clone())
        .for_each(|result| async move {
            if let Err(error) = result {
                // Reconcile failures are logged where they happen; this is the rest
                // (watch and queue errors).
                if !matches!(error, controller::Error::ReconcilerFailed(..)) {
                    tracing::warn!(error = %error, "controller error");
                }
            }
        });
    let parents = parents.clone();
    async move { stopping::until_controller_ends(run, &parents, &stop).await }
}

/// A sharded host skips the parents of shards it does not hold: each parent of a shard it
/// takes goes through once (the replica that gave the shard back may have left it
/// anywhere).
fn parents_of_shards_gained(
    shards: &Arc<crate::shards::ShardOwnership>,
    parents: &Store<CachedObject>,
    kind: &Arc<kube::core::ApiResource>,
) -> impl futures::Stream<Item = kube::runtime::reflector::ObjectRef<CachedObject>> + Send + use<> {
    let held = shards.subscribe();
    // The parents of the shards held already are reconciled as the controller starts.
    let start = held.borrow().clone();
    let shards = shards.clone();
    let parents = parents.clone();
    let kind = kind.clone();
    futures::stream::unfold((held, start), move |(mut held, before)| {
        let shards = shards.clone();
        let parents = parents.clone();
        let kind = kind.clone();
        async move {
            held.changed().await.ok()?;
            let now = held.borrow_and_update().clone();
            let gained = crate::shards::gained(&before, &now);
            let refs = parents_in(&gained, &shards, &parents, &kind);
            Some((futures::stream::iter(refs), (held, now)))
        }
    })
    .flatten()
}

/// The parents in `parents` of the shards `of`, to reconcile.
fn parents_in(
    of: &BTreeSet<u32>,
    shards: &crate::shards::ShardOwnership,
    parents: &Store<CachedObject>,
    kind: &Arc<kube::core::ApiResource>,
) -> Vec<kube::runtime::reflector::ObjectRef<CachedObject>> {
    if of.is_empty() {
        return Vec::new();
    }
    parents
        .state()
        .iter()
        .filter(|parent| of.contains(&shards.shard_of_parent(&***parent)))
        .map(|parent| crate::controller::reconcile::parent::parent_key(&**parent, kind))
        .collect()
}

/// Fed per shard, each parent of a shard the parents' cache comes to hold whole goes through
/// once: the watch's own event for it may not trigger a reconcile, as kube-runtime's
/// predicate remembers a parent it saw before the shard last left (unchanged since). Each
/// list is numbered, so a shard let go and listed again between two looks counts too.
fn parents_of_shards_listed(
    listed: watch::Receiver<crate::controller::cache::per_shard::Whole>,
    shards: Arc<crate::shards::ShardOwnership>,
    parents: &Store<CachedObject>,
    kind: &Arc<kube::core::ApiResource>,
) -> impl futures::Stream<Item = kube::runtime::reflector::ObjectRef<CachedObject>> + Send + use<> {
    let parents = parents.clone();
    let kind = kind.clone();
    futures::stream::unfold((listed, BTreeMap::new()), move |(mut listed, before)| {
        let (parents, kind, shards) = (parents.clone(), kind.clone(), shards.clone());
        async move {
            listed.changed().await.ok()?;
            let now = listed.borrow_and_update().clone();
            let gained = crate::shards::gained(&before, &now);
            let refs = parents_in(&gained, &shards, &parents, &kind);
            Some((futures::stream::iter(refs), (listed, now)))
        }
    })
    .flatten()
}

/// A standby skips every reconcile: when it takes over, every parent goes through once, in a
/// new prune guard window (what the last leader deleted is unknown here). A sharded host
/// opens a new window for each shard it takes.
fn requeue_on_takeover(
    ctx: &PolicyContext,
    requeue_all: tokio::sync::mpsc::UnboundedSender<()>,
) -> impl Future<Output = ()> + use<> {
    let (leadership, guard) = (&ctx.leadership, ctx.prune_guard.clone());
    let policy = ctx.policy.clone();
    let mut leading = leadership.subscribe();
    // Sharded, each shard gained brings its own parents through (see
    // `parents_of_shards_gained`); what changed hands is who writes for them.
    let mut gained = leadership.shards().map(|shards| shards.subscribe());
    async move {
        if let Some(gained) = &mut gained {
            let mut before = gained.borrow_and_update().clone();
            while gained.changed().await.is_ok() {
                let now = gained.borrow_and_update().clone();
                if !crate::shards::gained(&before, &now).is_empty() {
                    guard.reopen("this replica took over a shard".to_owned());
                }
                before = now;
            }
            return std::future::pending::<()>().await;
        }
        while leading.changed().await.is_ok() {
            if *leading.borrow_and_update() {
                guard.reopen("this replica took over".to_owned());
                tracing::info!(%policy, "leading now: reconciling every parent");
                let _ = requeue_all.send(());
            }
        }
        std::future::pending::<()>().await;
    }
}

/// Every [`STATUS_INTERVAL`], write the policy's counts and watch health (when they changed).
/// What is kept per parent is swept against the parents' cache when parents went, and every
/// [`SWEEP_AT_LEAST_EVERY`] ticks regardless (for what a reconcile that ended after its
/// parent's deletion noted).
async fn report_periodically(
    ctx: &PolicyContext,
    policy: &ReconcilePolicy,
    parents: &Store<CachedObject>,
    status: &tokio::sync::Mutex<PolicyStatusWriter>,
    setup: &WatchSetup,
    running: State,
) {
    let shards = ctx.leadership.shards().cloned();
    // What this replica counted for its shards goes with the policy.
    let _counted = shards.clone().map(|shards| ForgetCounts {
        shards,
        policy: ctx.policy.clone(),
    });
    for tick in 1u64.. {
        tokio::time::sleep(STATUS_INTERVAL).await;
        let sweep = setup.parents_gone.sweep_due() || tick.is_multiple_of(SWEEP_AT_LEAST_EVERY);
        let children: usize = ctx
            .caches
            .children
            .iter()
            .map(|c| c.store.state().len())
            .sum();
        ctx.metrics.set_cached(parents.state().len(), children);
        let whole = shards
            .as_ref()
            .is_none_or(|shards| ctx.caches.hold_all_whole(&shards.held()));
        let active = ctx.serving.digest_serving_all();
        let mut counts = report::counts(&ctx.outcomes, parents, &active, sweep);
        let own_window = report::own_prune_window(
            &ctx.prune_guard,
            parents,
            policy,
            sweep,
            (shards.as_deref(), whole),
        );
        ctx.metrics
            .set_prune_held(own_window.as_ref().map_or(0, |w| w.held_deletions));
        // Sharded, each replica reports on the parents of its shards for their Leases to
        // carry, and the holder of shard 0 reports over every shard.
        let own_candidate =
            report::candidate_counts(&ctx.serving, parents, sweep, shards.as_deref());
        let mut others = OthersReports::default();
        let per_shard = shards.as_ref().map(|shards| {
            let reported = shard_reports(
                ctx,
                parents,
                (&active, shards),
                (own_window.as_ref(), own_candidate.as_ref()),
            );
            shards.reports().count(&ctx.policy, reported);
            let held = shards.held();
            let across = shards
                .reports()
                .across_shards(&ctx.policy, shards.count(), |shard| held.contains(&shard));
            others = OthersReports::of(&across, &held, shards.reports().me());
            let (total, per_shard) = report::counts_across_shards(&across);
            counts = total;
            per_shard
        });
        let candidate = report::merge_candidates(own_candidate, others.candidates);
        let (window, held) =
            report::prune_guard(own_window, others.windows, policy, ctx.prune_guard.limits());
        let mut status = status.lock().await;
        status.set_ready(
            held.or_else(|| setup.health.problem())
                .unwrap_or_else(|| running.clone()),
        );
        status.set_prune_guard(window);
        status.set_counts(counts);
        if let Some(per_shard) = per_shard {
            status.set_shards(per_shard);
        }
        status.set_candidate_counts(candidate);
        status.flush().await;
    }
}

/// What the other replicas of a sharded host reported of a policy beyond its counts: their
/// prune guard windows and candidate verdicts, one of each per replica.
#[derive(Default)]
struct OthersReports {
    windows: Vec<crate::policy::PruneGuardStatus>,
    candidates: Vec<crate::policy::CandidateStatus>,
}

impl OthersReports {
    /// From the reports `across` the shards, those of the shards not `held` here: each
    /// other holder's window and tally, which it carries on one of its shards (`me`: a
    /// shard this replica just gave back still names it).
    fn of(
        across: &[crate::shards::ShardReport],
        held: &std::collections::BTreeSet<u32>,
        me: Option<&str>,
    ) -> Self {
        let mut windows = std::collections::BTreeMap::new();
        let mut candidates = std::collections::BTreeMap::new();
        for shard in across.iter().filter(|r| !held.contains(&r.shard)) {
            let (Some(holder), Some(report)) = (&shard.holder, &shard.report) else {
                continue;
            };
            if Some(holder.as_str()) == me {
                continue;
            }
            if let Some(window) = read(&report.prune) {
                windows.entry(holder.clone()).or_insert(window);
            }
            if let Some(candidate) = read(&report.candidate) {
                candidates.entry(holder.clone()).or_insert(candidate);
            }
        }
        Self {
            windows: windows.into_values().collect(),
            candidates: candidates.into_values().collect(),
        }
    }
}

/// How much of a shadow example's detail a shard report carries.
const CARRIED_DETAIL: usize = 200;

/// A report's part, read back (nothing when it is not what a replica writes).
fn read<T: serde::de::DeserializeOwned>(value: &Option<serde_json::Value>) -> Option<T> {
    value.clone().and_then(|v| serde_json::from_value(v).ok())
}

/// What this replica reports of a policy for each shard it holds: its parents' counts, the
/// rollout candidate's gate figures while there is one, its prune guard window and its
/// candidate's verdicts (`own`).
fn shard_reports(
    ctx: &PolicyContext,
    parents: &Store<CachedObject>,
    (active, shards): (&crate::plugin::Digest, &crate::shards::ShardOwnership),
    own: (
        Option<&crate::policy::PruneGuardStatus>,
        Option<&crate::policy::CandidateStatus>,
    ),
) -> std::collections::BTreeMap<u32, crate::shards::PolicyReport> {
    let (window, candidate) = own;
    let mut counted = report::counts_per_shard(&ctx.outcomes, parents, &ctx.parent, active, shards);
    // A shard whose parents are not all cached yet is not reported: it would count as none
    // reconciled, and a rollout would go on without its canaries.
    counted.retain(|shard, _| ctx.caches.hold_whole(*shard));
    // Measured whenever a candidate is loaded: the policy this task started with may have
    // had none, and a rollout comes with its candidate through a swap.
    let mut measured = match ctx.serving.candidate.load_full() {
        Some(candidate) => {
            let held = counted.keys().copied().collect();
            rollout::shard_reports(ctx, &candidate, parents, shards, &held)
        }
        None => Default::default(),
    };
    // The window and the tally are this replica's, not a shard's: carried once, on its
    // first shard, with the examples' details cut short (a Lease's annotations are small).
    let first = counted.keys().next().copied();
    let mut prune = window.and_then(|window| serde_json::to_value(window).ok());
    let mut candidate = candidate.cloned().and_then(|mut candidate| {
        for example in &mut candidate.examples {
            example.detail = crate::controller::reconcile::events::truncate(
                std::mem::take(&mut example.detail),
                CARRIED_DETAIL,
            );
        }
        serde_json::to_value(candidate).ok()
    });
    counted
        .into_iter()
        .map(|(shard, counts)| {
            let (prune, candidate) = if Some(shard) == first {
                (prune.take(), candidate.take())
            } else {
                (None, None)
            };
            let report = crate::shards::PolicyReport {
                counts,
                rollout: measured.remove(&shard),
                prune,
                candidate,
            };
            (shard, report)
        })
        .collect()
}

/// Drops what this replica counted of a policy's parents once its reports stop.
struct ForgetCounts {
    shards: Arc<crate::shards::ShardOwnership>,
    policy: String,
}

impl Drop for ForgetCounts {
    fn drop(&mut self) {
        self.shards.reports().forget(&self.policy);
    }
}

/// The server-side apply field manager of a policy: `wasmctrl/<policy>`, within the API
/// server's 128 characters. A longer name keeps a prefix and gains a hash of the whole name,
/// so two long policy names that share a prefix never share a field manager (and so never
/// take each other's fields).
fn field_manager_for(policy: &str) -> String {
    use sha2::Digest as _;
    const MAX: usize = 128;
    let whole = format!("wasmctrl/{policy}");
    if whole.len() <= MAX {
        return whole;
    }
    let hash = hex::encode(&sha2::Sha256::digest(policy.as_bytes())[..6]);
    let mut prefix = whole;
    prefix.truncate(MAX - hash.len() - 1);
    format!("{prefix}-{hash}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_managers_fit_the_limit_and_long_names_never_collide() {
        assert_eq!(field_manager_for("myapp"), "wasmctrl/myapp");
        let stem = "p".repeat(200);
        let (a, b) = (format!("{stem}-a"), format!("{stem}-b"));
        let (fa, fb) = (field_manager_for(&a), field_manager_for(&b));
        assert!(fa.len() <= 128 && fb.len() <= 128, "{fa} {fb}");
        assert_ne!(fa, fb);
        assert!(fa.starts_with("wasmctrl/ppp"), "{fa}");
    }
}
