//! One policy's controller, from start to stop: load the plugin, resolve the kinds through
//! discovery (waiting, with `Ready=False`, for a kind that is not served yet), then run a
//! kube-runtime `Controller` over the parent kind, its children and its related kinds until
//! told to stop. Stopping is graceful: reconciles in flight finish first.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt as _, TryStreamExt as _};
use kube::api::Api;
use kube::core::{ApiResource, DynamicObject, Selector, TypeMeta};
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{PredicateConfig, WatchStreamExt as _, watcher};
use kube::{Client, ResourceExt as _};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::HostOptions;
use super::backoff::Backoff;
use super::children::{self, AllowedKind};
use super::context::{ActivePlugin, ChildCache, PolicyContext, RelatedCache, Serving, lock};
use super::events::{self, EventSink};
use super::field_ownership::CreatedFields;
use super::kinds::{self, KindError, ResolvedKind};
use super::parent_claims;
use super::permissions;
use super::policy_status::{PolicyStatusWriter, State};
use super::queue::QueueGauge;
use super::reconcile;
use super::release;
use super::swap;
use super::watch_health::WatchHealth;
use crate::plugin::{Plugin, Verdict};
use crate::policy::{CandidateStatus, KindRef, ReconcilePolicy, ShadowExample};
use crate::registry::{self, PluginRegistry, PluginRequest};

/// How often a running policy's counts are written to its status (when they changed).
const STATUS_INTERVAL: Duration = Duration::from_secs(5);

/// What every policy controller shares.
pub(crate) struct Shared {
    pub client: Client,
    /// Where every policy gets its plugins.
    pub registry: Arc<PluginRegistry>,
    pub options: HostOptions,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub readiness: Arc<crate::health::Readiness>,
    /// Whether this replica may write; a standby watches and loads but writes nothing.
    pub leadership: Arc<crate::leader::Leadership>,
}

/// Run a policy until `stop` is cancelled. `updates` carries the policy, and later versions
/// of it that differ only in their plugin (those are hot-swapped, not restarted).
pub(crate) async fn run(
    mut updates: watch::Receiver<Arc<ReconcilePolicy>>,
    shared: Arc<Shared>,
    stop: CancellationToken,
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
        // A fetch or discovery that hangs must not hold up the policy's restart or
        // deletion, nor a new plugin spec: stopping or an update wins over preparing.
        let prepared = tokio::select! {
            parts = prepare(&policy, &shared, &mut status, &mut plugin) => Some(parts),
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
                run_controller(policy, &shared, parts, status, stop, updates).await;
                tracing::info!(policy = %name, "policy controller stopped");
                return;
            }
            None => {
                status.flush().await;
                let delay = retry.failed(&()).delay;
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
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

/// The resolved pieces a controller needs.
struct Parts {
    plugin: Plugin,
    parent: ResolvedKind,
    children: Vec<(KindRef, ResolvedKind)>,
    related: Vec<(ResolvedKind, Option<Selector>)>,
}

/// Load the plugin (once) and resolve every kind. On failure the reason is in `status` and
/// `None` is returned, for the caller to try again.
#[expect(
    clippy::too_many_lines,
    reason = "one step per preparation check; splitting it is issue 10"
)]
async fn prepare(
    policy: &ReconcilePolicy,
    shared: &Shared,
    status: &mut PolicyStatusWriter,
    plugin: &mut Option<Plugin>,
) -> Option<Parts> {
    let name = policy.name_any();
    if plugin.is_none() {
        match shared
            .registry
            .obtain(&name, PluginRequest::active(policy))
            .await
        {
            Ok(registry::Obtained { plugin: loaded, .. }) => {
                let info = loaded.info();
                tracing::info!(policy = %name, digest = %info.digest, from_cache = info.from_cache, load_time = ?info.load_time, "plugin loaded");
                status.set_plugin(
                    State::ok("Loaded", format!("plugin {} loaded", info.digest)),
                    Some(&info.digest),
                );
                *plugin = Some(loaded);
            }
            Err(error) => {
                let (reason, message) = (error.reason(), error.to_string());
                tracing::warn!(policy = %name, reason, %message, "plugin not loaded");
                status.set_plugin(State::failed(reason, message.clone()), None);
                status.set_ready(State::failed("PluginNotLoaded", message));
                return None;
            }
        }
    }
    let spec = &policy.spec;
    let resolve_all = async {
        let parent = kinds::resolve(&shared.client, &spec.parent.kind_ref()).await?;
        let mut children = Vec::new();
        for child in &spec.children {
            children.push((child.clone(), kinds::resolve(&shared.client, child).await?));
        }
        let mut related = Vec::new();
        for rel in &spec.related {
            let kind = KindRef {
                api_version: rel.api_version.clone(),
                kind: rel.kind.clone(),
            };
            related.push(kinds::resolve(&shared.client, &kind).await?);
        }
        Ok::<_, KindError>((parent, children, related))
    };
    let (parent, children, related) = match resolve_all.await {
        Ok(kinds) => kinds,
        Err(error) => {
            let reason = match error {
                KindError::NotFound { .. } => "KindNotFound",
                KindError::Discovery { .. } => "DiscoveryFailed",
            };
            tracing::info!(policy = %name, %error, "waiting for kinds");
            status.set_ready(State::failed(reason, error.to_string()));
            return None;
        }
    };
    match parent_claims::claimed_by(&shared.client, policy).await {
        Ok(None) => {}
        Ok(Some(other)) => {
            let message = format!(
                "policy {other} already reconciles {} {}{}; give both a different spec.parent.namespace, or delete one",
                spec.parent.api_version,
                spec.parent.kind,
                spec.parent
                    .namespace
                    .as_deref()
                    .map(|ns| format!(" in namespace {ns}"))
                    .unwrap_or_default()
            );
            tracing::warn!(policy = %name, %other, "parent kind taken");
            status.set_ready(State::failed("ParentKindTaken", message));
            return None;
        }
        Err(error) => {
            status.set_ready(State::failed(
                "DiscoveryFailed",
                format!(
                    "listing ReconcilePolicies to check who reconciles this parent kind: {error}"
                ),
            ));
            return None;
        }
    }
    if let Some(problem) =
        parent_scope_problem(policy, &parent, shared.options.namespace.as_deref())
    {
        status.set_ready(problem);
        return None;
    }
    let resolved = permissions::Resolved {
        parent: &parent,
        children: children.iter().map(|(_, kind)| kind).collect(),
        related: related.iter().collect(),
    };
    let host_namespace = shared.options.namespace.as_deref();
    if let Some(forbidden) =
        permissions::check(&shared.client, spec, host_namespace, &resolved).await
    {
        tracing::warn!(policy = %name, message = %forbidden.message, "missing permissions");
        status.set_ready(forbidden);
        return None;
    }
    let mut selected = Vec::new();
    for (rel, kind) in spec.related.iter().zip(related) {
        let selector = match rel.selector.clone().map(Selector::try_from).transpose() {
            Ok(selector) => selector,
            Err(error) => {
                status.set_ready(State::failed(
                    "InvalidSelector",
                    format!("related {} selector: {error}", rel.kind),
                ));
                return None;
            }
        };
        selected.push((kind, selector));
    }
    Some(Parts {
        plugin: plugin.clone()?,
        parent,
        children,
        related: selected,
    })
}

/// Kinds that left `spec.children` (now, or in an earlier run) and still have children: kept,
/// not pruned, and named in the `ChildrenManaged` condition until none are left.
async fn report_unmanaged_children(
    client: &Client,
    policy: &ReconcilePolicy,
    status: &mut PolicyStatusWriter,
    namespace: Option<&str>,
) {
    let spec = &policy.spec;
    let (managed, unmanaged) = status.child_kinds();
    let mut candidates: Vec<KindRef> = Vec::new();
    for kind in managed.iter().chain(unmanaged) {
        if !spec.children.contains(kind) && !candidates.contains(kind) {
            candidates.push(kind.clone());
        }
    }
    let label = children::policy_label_value(&policy.name_any());
    let left = if candidates.is_empty() {
        Vec::new()
    } else {
        match release::unmanaged_children(client, &candidates, namespace, &label).await {
            Ok(left) => left,
            Err(error) => {
                // Unknown: keep reporting what was reported before.
                tracing::warn!(policy = %policy.name_any(), error = %format!("{error:#}"), "could not count children of removed kinds");
                candidates.into_iter().map(|kind| (kind, 0)).collect()
            }
        }
    };
    let condition = (!left.is_empty()).then(|| {
        let kinds = left
            .iter()
            .map(|(kind, count)| match count {
                0 => format!("{} {}", kind.api_version, kind.kind),
                n => format!("{n} {} {}", kind.api_version, kind.kind),
            })
            .collect::<Vec<_>>()
            .join(", ");
        State::failed(
            "ChildKindRemoved",
            format!(
                "{kinds} labelled {}={label} remain from kinds no longer in spec.children; the host kept them and no longer manages them (they go with their parents, or delete them yourself)",
                children::POLICY_LABEL
            ),
        )
    });
    status.set_optional("ChildrenManaged", condition);
    status.set_child_kinds(
        spec.children.clone(),
        left.into_iter().map(|(kind, _)| kind).collect(),
    );
}

/// Whether every related kind is narrowed by a selector. One that is not makes the host cache
/// every object of that kind in the watched namespaces and hand all of them to every call.
fn related_cost(related: &[(ResolvedKind, Option<Selector>)]) -> Option<State> {
    if related.is_empty() {
        return None;
    }
    let unselected: Vec<String> = related
        .iter()
        .filter(|(_, selector)| selector.is_none())
        .map(|(kind, _)| format!("{} {}", kind.resource.api_version, kind.resource.kind))
        .collect();
    Some(if unselected.is_empty() {
        State::ok("Selected", "every related kind has a selector")
    } else {
        State::failed(
            "UnselectedRelatedKind",
            format!(
                "related {} without a selector: the host caches every such object in the watched namespaces and passes all of them to each call; add a selector",
                unselected.join(", ")
            ),
        )
    })
}

/// Why `spec.parent.namespace` cannot work with this parent kind or this host, if it cannot.
fn parent_scope_problem(
    policy: &ReconcilePolicy,
    parent: &ResolvedKind,
    host_namespace: Option<&str>,
) -> Option<State> {
    let namespace = policy.spec.parent.namespace.as_deref()?;
    if !parent.namespaced {
        return Some(State::failed(
            "InvalidNamespace",
            format!(
                "{} is cluster-scoped; spec.parent.namespace {namespace:?} cannot apply",
                parent.resource.kind
            ),
        ));
    }
    match host_namespace {
        Some(host) if host != namespace => Some(State::failed(
            "NamespaceNotWatched",
            format!("spec.parent.namespace is {namespace:?}, but this host watches only {host:?}"),
        )),
        _ => None,
    }
}

/// A watch stream of `resource`, cached in a store, with `managedFields` dropped: plugins
/// never see them and the host does not need to hold them.
fn cached_watch(
    client: &Client,
    resource: &ApiResource,
    namespace: Option<&str>,
    config: watcher::Config,
    health: &Arc<WatchHealth>,
    created: Option<Arc<CreatedFields>>,
) -> (
    Store<DynamicObject>,
    impl futures::Stream<Item = Result<watcher::Event<DynamicObject>, watcher::Error>> + Send + 'static,
) {
    let writer = reflector::store::Writer::new(resource.clone());
    let reader = writer.as_reader();
    let api: Api<DynamicObject> = match namespace {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, resource),
        None => Api::all_with(client.clone(), resource),
    };
    // List responses leave out each item's apiVersion and kind; plugins and the convergence
    // check need them, so every cached object gets them back.
    let types = TypeMeta {
        api_version: resource.api_version.clone(),
        kind: resource.kind.clone(),
    };
    let health = health.clone();
    let kind = format!("{} {}", resource.api_version, resource.kind);
    let stream = watcher(api, config)
        .backoff(crate::watch_backoff::WatchBackoff::default())
        .inspect(move |event| health.observe(&kind, event))
        .modify(move |object: &mut DynamicObject| {
            if let Some(created) = &created {
                created.note(object);
            }
            object.managed_fields_mut().clear();
            if object.types.is_none() {
                object.types = Some(types.clone());
            }
        })
        .reflect(writer);
    (reader, stream)
}

#[expect(
    clippy::too_many_lines,
    reason = "wiring one policy's watches and tasks; splitting it into small functions is issue 10"
)]
async fn run_controller(
    policy: Arc<ReconcilePolicy>,
    shared: &Arc<Shared>,
    parts: Parts,
    mut status: PolicyStatusWriter,
    stop: CancellationToken,
    updates: watch::Receiver<Arc<ReconcilePolicy>>,
) {
    let name = policy.name_any();
    let spec = &policy.spec;
    let client = &shared.client;
    let policy_label = children::policy_label_value(&name);
    let owned_selector = format!("{}={policy_label}", children::POLICY_LABEL);
    let health = Arc::new(WatchHealth::default());
    let queue = Arc::new(QueueGauge::new(name.clone(), shared.metrics.clone()));

    // A namespace restriction applies to namespaced kinds; cluster-scoped ones are watched
    // cluster-wide (and need cluster RBAC).
    let namespace = spec
        .parent
        .namespace
        .as_deref()
        .or(shared.options.namespace.as_deref());
    let scope = |kind: &ResolvedKind| namespace.filter(|_| kind.namespaced);
    let (parents, parent_stream) = cached_watch(
        client,
        &parts.parent.resource,
        scope(&parts.parent),
        watcher::Config::default(),
        &health,
        None,
    );
    // Status-only updates (the host's own status writes among them) do not trigger a
    // reconcile: they would turn every failure into an immediate retry and defeat backoff.
    let parent_queue = queue.clone();
    let mut controller = Controller::for_stream_with(
        parent_stream
            .applied_objects()
            .predicate_filter(parent_changed, PredicateConfig::default())
            .inspect_ok(move |parent| {
                parent_queue.added([(parent.metadata.namespace.clone(), parent.name_any())]);
            }),
        parents.clone(),
        parts.parent.resource.clone(),
    );

    let field_manager = field_manager_for(&name);
    let mut allowed = Vec::new();
    let mut child_caches = Vec::new();
    for (kind, resolved) in &parts.children {
        let created = Arc::new(CreatedFields::new(field_manager.clone()));
        let (store, stream) = cached_watch(
            client,
            &resolved.resource,
            scope(resolved),
            watcher::Config::default().labels(&owned_selector),
            &health,
            Some(created.clone()),
        );
        let child_queue = queue.clone();
        let parent_kind = parts.parent.resource.kind.clone();
        let stream = stream.touched_objects().inspect_ok(move |child| {
            let owner = child
                .owner_references()
                .iter()
                .find(|o| o.controller == Some(true) && o.kind == parent_kind);
            if let Some(owner) = owner {
                child_queue.added([(child.metadata.namespace.clone(), owner.name.clone())]);
            }
        });
        controller = controller.owns_stream_with(stream, resolved.resource.clone());
        allowed.push(AllowedKind {
            api_version: kind.api_version.clone(),
            kind: kind.kind.clone(),
            namespaced: resolved.namespaced,
        });
        child_caches.push(ChildCache {
            resource: resolved.resource.clone(),
            store,
            created,
        });
    }

    let mut related_caches = Vec::new();
    for (resolved, selector) in &parts.related {
        let config = match selector {
            Some(selector) => watcher::Config::default().labels_from(selector),
            None => watcher::Config::default(),
        };
        let (store, stream) = cached_watch(
            client,
            &resolved.resource,
            scope(resolved),
            config,
            &health,
            None,
        );
        let parents_of = parents.clone();
        let parent_resource = parts.parent.resource.clone();
        let related_queue = queue.clone();
        // A related object concerns every parent in its namespace.
        let mapper = move |object: DynamicObject| {
            let namespace = object.metadata.namespace.clone();
            let parents = parents_of.state_filter(|p| p.metadata.namespace == namespace);
            related_queue.added(
                parents
                    .iter()
                    .map(|p| (p.metadata.namespace.clone(), p.name_any())),
            );
            parents
                .into_iter()
                .map(|p| ObjectRef::from_obj_with(&*p, parent_resource.clone()))
                .collect::<Vec<_>>()
        };
        controller = controller.watches_stream_with(
            stream.touched_objects(),
            mapper,
            resolved.resource.clone(),
        );
        related_caches.push(RelatedCache { store });
    }

    // kube-runtime's store readiness wakes only one waiter at a time, so one task waits for
    // every cache and publishes the result to all reconciles.
    let (ready_tx, caches_ready) = tokio::sync::watch::channel(false);
    let stores: Vec<Store<DynamicObject>> = child_caches
        .iter()
        .map(|c| c.store.clone())
        .chain(related_caches.iter().map(|r| r.store.clone()))
        .collect();
    let mut syncing = shared.readiness.syncing();
    let wait_for_caches = async move {
        for store in stores {
            if store.wait_until_ready().await.is_err() {
                return std::future::pending().await;
            }
        }
        let _ = ready_tx.send(true);
        syncing.synced();
        std::future::pending::<()>().await
    };

    shared
        .metrics
        .set_active_plugin(&name, Some(&parts.plugin.digest().to_string()));
    let ctx = Arc::new(PolicyContext {
        client: client.clone(),
        policy: name.clone(),
        finalizer: spec
            .finalize
            .then(|| release::parent_finalizer(&policy_label)),
        policy_label,
        field_manager: field_manager.clone(),
        parent: parts.parent.resource.clone(),
        allowed,
        children: child_caches,
        related: related_caches,
        serving: Arc::new(Serving::new(ActivePlugin {
            plugin: parts.plugin,
            config: swap::config_text(&spec.plugin),
        })),
        resync: Duration::from_secs(
            spec.resync_period_seconds
                .map_or(shared.options.resync.as_secs(), u64::from),
        ),
        backoff: Backoff::new(shared.options.backoff_base, shared.options.backoff_max),
        reconciled: Mutex::new(Default::default()),
        events: EventSink::new(client.clone(), field_manager, shared.options.event_interval),
        metrics: shared.metrics.clone(),
        queue: queue.clone(),
        leadership: shared.leadership.clone(),
        caches_ready,
    });

    // The policy's own finalizer must be in place before any parent gets one, so that
    // deleting the policy can never strand a parent; a policy that stopped finalizing lets
    // its parents go first.
    // A failure is retried in the background, beside the controller. A standby leaves it
    // to the leader until it leads itself.
    let first_sync = if shared.leadership.is_leader() {
        Some(sync_finalizers(client, &policy, &parts.parent, namespace).await)
    } else {
        None
    };
    let finalizers = async {
        let retry = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let mut result = match first_sync {
            Some(result) => result,
            None => {
                shared.leadership.until_leader().await;
                sync_finalizers(client, &policy, &parts.parent, namespace).await
            }
        };
        while let Err(error) = result {
            let delay = retry.failed(&()).delay;
            tracing::warn!(policy = %name, error = %format!("{error:#}"), retry_in = ?delay, "could not set up finalizers");
            tokio::time::sleep(delay).await;
            result = sync_finalizers(client, &policy, &parts.parent, namespace).await;
        }
        std::future::pending::<()>().await
    };

    let running = State::ok(
        "Running",
        format!(
            "reconciling {} {} with {} child kind(s)",
            spec.parent.api_version,
            spec.parent.kind,
            spec.children.len()
        ),
    );
    status.set_ready(running.clone());
    status.set_optional("RelatedNarrowed", related_cost(&parts.related));
    report_unmanaged_children(client, &policy, &mut status, namespace).await;
    status.flush().await;
    tracing::info!(policy = %name, parent = %spec.parent.kind, "policy controller running");

    let concurrency = spec.max_concurrent_reconciles.unwrap_or(4).max(1);
    let shutdown = stop.clone();
    // A swap re-enqueues every parent through this channel.
    let (requeue_all, requeue_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let run = controller
        .trigger_backoff(crate::watch_backoff::NoExtraDelay)
        .with_config(
            controller::Config::default()
                .concurrency(u16::try_from(concurrency).unwrap_or(u16::MAX)),
        )
        .reconcile_all_on(
            futures::stream::unfold(requeue_rx, |mut rx| async move {
                rx.recv().await.map(|()| ((), rx))
            })
            .inspect({
                let parents = parents.clone();
                let queue = queue.clone();
                move |()| {
                    queue.added(
                        parents
                            .state()
                            .iter()
                            .map(|p| (p.metadata.namespace.clone(), p.name_any())),
                    );
                }
            }),
        )
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
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

    let status = Arc::new(tokio::sync::Mutex::new(status));
    // A standby skips every reconcile: when it takes over, every parent goes through once.
    let takeover = {
        let mut leading = shared.leadership.subscribe();
        let requeue_all = requeue_all.clone();
        let name = name.clone();
        async move {
            while leading.changed().await.is_ok() {
                if *leading.borrow_and_update() {
                    tracing::info!(policy = %name, "leading now: reconciling every parent");
                    let _ = requeue_all.send(());
                }
            }
            std::future::pending::<()>().await;
        }
    };
    let swapper = swap::Swapper {
        serving: ctx.serving.clone(),
        registry: shared.registry.clone(),
        metrics: shared.metrics.clone(),
        status: status.clone(),
        requeue_all,
    }
    .run(policy.clone(), updates);
    let report = async {
        loop {
            tokio::time::sleep(STATUS_INTERVAL).await;
            let (reconciled, failing) = counts(&ctx, &parents);
            let candidate = candidate_counts(&ctx, &parents);
            let mut status = status.lock().await;
            status.set_ready(health.problem().unwrap_or_else(|| running.clone()));
            status.set_counts(reconciled, failing);
            status.set_candidate_counts(candidate);
            status.flush().await;
        }
    };
    // The controller ends on `stop` (gracefully); everything else runs beside it.
    tokio::select! {
        () = run => {}
        () = async { tokio::join!(report, wait_for_caches, swapper, finalizers, takeover); } => {}
    }
    shared.metrics.set_active_plugin(&name, None);
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

/// Bring the finalizers in line with `spec.finalize`: a finalizing policy carries
/// [`release::POLICY_FINALIZER`]; one that stopped finalizing releases its parents, then drops it.
async fn sync_finalizers(
    client: &Client,
    policy: &ReconcilePolicy,
    parent: &ResolvedKind,
    namespace: Option<&str>,
) -> anyhow::Result<()> {
    let name = policy.name_any();
    let uid = policy.metadata.uid.as_deref();
    if policy.spec.finalize {
        return release::set_policy_finalizer(client, &name, uid, true).await;
    }
    if !policy
        .finalizers()
        .iter()
        .any(|f| f == release::POLICY_FINALIZER)
    {
        return Ok(());
    }
    let label = children::policy_label_value(&name);
    let released = release::release_parents(
        client,
        parent,
        namespace,
        &release::parent_finalizer(&label),
    )
    .await?;
    tracing::info!(policy = %name, released, "policy no longer finalizes; parents released");
    release::set_policy_finalizer(client, &name, uid, false).await
}

/// A fingerprint of what a parent's reconcile depends on besides its children: spec (via the
/// generation), labels, annotations (except the plugin digest the host records itself),
/// finalizers and deletion.
fn parent_changed(parent: &DynamicObject) -> Option<u64> {
    use std::hash::{Hash as _, Hasher as _};
    let meta = &parent.metadata;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    meta.generation.hash(&mut hasher);
    meta.labels.hash(&mut hasher);
    if let Some(annotations) = &meta.annotations {
        annotations
            .iter()
            .filter(|(key, _)| key.as_str() != reconcile::PLUGIN_DIGEST_ANNOTATION)
            .for_each(|entry| entry.hash(&mut hasher));
    }
    meta.finalizers.hash(&mut hasher);
    meta.deletion_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
        .hash(&mut hasher);
    Some(hasher.finish())
}

/// Parents whose last reconcile succeeded and failed, among those that still exist.
fn counts(ctx: &PolicyContext, parents: &Store<DynamicObject>) -> (u64, u64) {
    let exists = |key: &ObjectRef<DynamicObject>| parents.get(key).is_some();
    ctx.backoff.retain(exists);
    for cache in &ctx.children {
        cache.created.retain(|namespace, name| {
            let key = ObjectRef::new_with(name, cache.resource.clone());
            let key = match namespace {
                Some(namespace) => key.within(namespace),
                None => key,
            };
            cache.store.get(&key).is_some()
        });
    }
    let mut reconciled = lock(&ctx.reconciled);
    reconciled.retain(exists);
    (reconciled.len() as u64, ctx.backoff.failing() as u64)
}

/// How many parents the candidate serves, and its shadow verdicts for the others, with a
/// few examples (sorted, so an unchanged picture writes nothing).
fn candidate_counts(
    ctx: &PolicyContext,
    parents: &Store<DynamicObject>,
) -> Option<CandidateStatus> {
    use kube::core::SelectorExt as _;
    const EXAMPLES: usize = 5;
    let candidate = ctx.serving.candidate.load_full()?;
    let mut verdicts = lock(&ctx.serving.shadow);
    verdicts.retain(|key, _| parents.get(key).is_some());
    let mut status = CandidateStatus {
        digest: candidate.serving.plugin.digest().to_string(),
        canary_parents: candidate.canary.as_ref().map_or(0, |selector| {
            parents
                .state()
                .iter()
                .filter(|p| selector.matches(p.labels()))
                .count() as u64
        }),
        evaluated: verdicts.len() as u64,
        ..CandidateStatus::default()
    };
    let mut examples = Vec::new();
    for (key, verdict) in verdicts.iter() {
        let parent = match &key.namespace {
            Some(ns) => format!("{ns}/{}", key.name),
            None => key.name.clone(),
        };
        match verdict {
            Verdict::Unchanged => status.unchanged += 1,
            Verdict::WouldChange(detail) => {
                status.would_change += 1;
                examples.push(ShadowExample {
                    parent,
                    verdict: "WouldChange".into(),
                    detail: events::truncate(detail.clone(), 1024),
                });
            }
            Verdict::WouldFail(detail) => {
                status.would_fail += 1;
                examples.push(ShadowExample {
                    parent,
                    verdict: "WouldFail".into(),
                    detail: events::truncate(detail.clone(), 1024),
                });
            }
        }
    }
    examples.sort_by(|a, b| a.parent.cmp(&b.parent));
    examples.truncate(EXAMPLES);
    status.examples = examples;
    Some(status)
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
