//! A policy's watches, wired into one kube-runtime `Controller`: the parents it reconciles,
//! the children it owns (found by the policy label) and the related objects it reads (by
//! selector, or the metadata of those chosen by name). Each watch fills a cache the
//! reconciles read and triggers the parents it concerns; one builder method per kind of
//! watch, as kube-runtime's own `Controller` builder does.

use std::sync::Arc;

use tokio::sync::watch;

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;
use kube::core::{ApiResource, DynamicObject, PartialObjectMeta, Selector, TypeMeta};
use kube::runtime::controller::Controller;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{PredicateConfig, WatchStreamExt as _, watcher};
use kube::{Client, ResourceExt as _};

use crate::controller::cache::cached::{CachedObject, HasLabels, HasTypes};
use crate::controller::cache::field_ownership::CreatedFields;
use crate::controller::cache::named_objects::{self, NamedKind, NamedObjects};
use crate::controller::cache::per_shard;
use crate::controller::cache::read_cache::ReadBudget;
use crate::controller::cache::related::{self, FieldPath};
use crate::controller::cache::removals::Removals;
use crate::controller::cache::store_index::{self, StoreIndex};
use crate::controller::cache::stores::{ChildCache, Related, RelatedCache, object_ref};
use crate::controller::kinds::ResolvedKind;
use crate::controller::labels::{self, POLICY_LABEL, SHARD_LABEL, UID_SHARD_LABEL};
use crate::controller::policy_run::shard_feeds::ShardFeeds;
use crate::controller::policy_run::shard_labels::{ParentLabels, Unlabelled};
use crate::controller::policy_run::shared_watches::{Following, HostWatches, WatchKey};
use crate::controller::policy_run::watch_health::{ShardWatch, WatchHealth};
use crate::controller::reconcile::children::AllowedKind;
use crate::controller::reconcile::context::Caches;
use crate::controller::reconcile::decisions::{self, Decisions};
use crate::controller::reconcile::queue::{ParentKey, QueueGauge};
use crate::metrics::PolicyMetrics;
use crate::policy::KindRef;
use crate::shards::selector::shard_client;
use crate::watch_backoff::WatchBackoff;

/// What a policy's caches may hold: a kind of any resource (its `ApiResource` shared), whose
/// apiVersion and kind can be set back after a list.
pub(crate) trait Cacheable:
    kube::Resource<DynamicType = Arc<ApiResource>, Scope = kube::core::DynamicResourceScope>
    + HasTypes
    + HasLabels
    + Clone
    + serde::de::DeserializeOwned
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> Cacheable for K where
    K: kube::Resource<DynamicType = Arc<ApiResource>, Scope = kube::core::DynamicResourceScope>
        + HasTypes
        + HasLabels
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static
{
}

/// What every watch of one policy shares.
pub(crate) struct WatchSetup {
    pub client: Client,
    /// Watch namespaced kinds in this namespace only; cluster-scoped kinds are watched
    /// cluster-wide (and need cluster RBAC).
    pub namespace: Option<String>,
    pub health: Arc<WatchHealth>,
    pub queue: Arc<QueueGauge>,
    /// The policy's series (the named objects' cache reports its bytes).
    pub metrics: PolicyMetrics,
    /// The policy's field manager, whose create-time fields are handed over before applies.
    pub field_manager: String,
    /// Selects the children the policy owns.
    pub owned_selector: String,
    /// The host's bound on what related objects' read caches keep, over all policies.
    pub related_budget: Arc<ReadBudget>,
    /// What each parent's last decision was made on: every watch notes what it brings.
    pub decisions: Arc<Decisions>,
    /// Wakes the policy's teardown for a parent whose children's order may let one go.
    pub teardown: super::teardown::Wake,
    /// When the parents' cache may have lost parents: what is kept per parent is swept then.
    pub parents_gone: Arc<Removals>,
    /// Who the policy acts as (its ServiceAccount, `namespace/name`; `None`: the host): its
    /// watches of related kinds are shared only with policies acting as the same.
    pub identity: Option<String>,
    /// The watches of related kinds the host's policies share.
    pub shared: Arc<HostWatches>,
    /// Sharded: the parents and children are watched per shard held, so the caches hold
    /// this replica's share only.
    pub per_shard: Option<Arc<ShardFeeds>>,
}

/// How a cache is fed per shard.
#[derive(Clone)]
enum ShardedBy {
    /// The parents, by the uid the API server narrows by.
    Uid,
    /// The parents, where the API server does not narrow by uid: by the uid's shard label (see
    /// [`super::shard_labels`]), each put in its shard by its uid all the same; one whose
    /// label names another shard goes to the labeller to be put right.
    ParentLabel(tokio::sync::mpsc::UnboundedSender<Unlabelled>),
    /// The children, by the shard label the host stamps.
    Label,
}

/// A cache fed per shard: how its watches are narrowed, and where it says which shards it
/// holds whole.
type PerShardCache = (ShardedBy, watch::Sender<per_shard::Whole>);

impl WatchSetup {
    fn scope(&self, kind: &ResolvedKind) -> Option<&str> {
        self.namespace.as_deref().filter(|_| kind.namespaced)
    }

    /// `kind` as `K`, whose dynamic type (a shared or an owned `ApiResource`) is `dyntype`.
    fn api<K>(&self, kind: &ResolvedKind, dyntype: &K::DynamicType) -> Api<K>
    where
        K: kube::Resource<Scope = kube::core::DynamicResourceScope>,
    {
        scoped_api(self.client.clone(), self.scope(kind), dyntype)
    }

    /// A watch of `kind` in the policy's scope, each object as its cache keeps it (see
    /// [`source_of`]).
    fn source<K>(
        &self,
        kind: &ResolvedKind,
        config: watcher::Config,
        created: Option<Arc<CreatedFields>>,
    ) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static + use<K>
    where
        K: Cacheable,
    {
        source_of(
            self.api(kind, &kind.resource),
            &kind.resource,
            config,
            created,
        )
    }

    /// A watch of `kind` fed per shard held (see [`per_shard`]), each shard's narrowed `by`
    /// the uid or the shard label; `listed` is told which shards the store holds whole.
    fn per_shard_source<K>(
        &self,
        (feeds, by, listed): (&Arc<ShardFeeds>, ShardedBy, watch::Sender<per_shard::Whole>),
        kind: &ResolvedKind,
        config: watcher::Config,
        created: Option<Arc<CreatedFields>>,
        store: Store<K>,
    ) -> per_shard::Events<K>
    where
        K: Cacheable,
    {
        let count = feeds.ownership.count();
        let (client, scope) = (self.client.clone(), self.scope(kind).map(str::to_owned));
        let resource = kind.resource.clone();
        let api = move |client: Client| scoped_api::<K>(client, scope.as_deref(), &resource);
        let resource = kind.resource.clone();
        let label_key = match &by {
            ShardedBy::ParentLabel(_) => UID_SHARD_LABEL,
            ShardedBy::Uid | ShardedBy::Label => SHARD_LABEL,
        };
        let start: per_shard::StartWatch<K> = match by {
            ShardedBy::Uid => Box::new(move |shard| {
                let client = shard_client(client.clone(), shard, count);
                source_of(api(client), &resource, config.clone(), created.clone()).boxed()
            }),
            ShardedBy::ParentLabel(_) | ShardedBy::Label => Box::new(move |shard| {
                let label = format!("{label_key}={}", labels::shard_label_value(shard, count));
                let selector = match &config.label_selector {
                    Some(selector) => format!("{selector},{label}"),
                    None => label,
                };
                let config = config.clone().labels(&selector);
                source_of(api(client.clone()), &resource, config, created.clone()).boxed()
            }),
        };
        let shard_of: per_shard::ShardOf<K> = match by {
            // A parent's shard is its uid's, whatever its label says.
            ShardedBy::Uid | ShardedBy::ParentLabel(_) => Box::new(move |object: &K| {
                let uid = object.meta().uid.as_deref().unwrap_or_default();
                Some(crate::shards::shard_of(uid, count))
            }),
            // By the label the watch selects on: a child whose controller someone changed
            // is still told as its shard's watch sees it.
            ShardedBy::Label => Box::new(move |object: &K| {
                labels::shard_of_label(&object.label(SHARD_LABEL)?, count)
            }),
        };
        let misplaced: Option<per_shard::Misplaced<K>> = match &by {
            ShardedBy::ParentLabel(labeller) => {
                let labeller = labeller.clone();
                Some(Box::new(move |object: &K| {
                    if let Some(parent) = Unlabelled::of(object) {
                        // Gone only with the policy, whose watches end with it.
                        let _ = labeller.send(parent);
                    }
                }))
            }
            ShardedBy::Uid | ShardedBy::Label => None,
        };
        let wanted = match by {
            ShardedBy::Uid | ShardedBy::ParentLabel(_) => feeds.for_parents(),
            ShardedBy::Label => feeds.held(),
        };
        // Each shard's watch reports its health as a watch of its own.
        let (health, name) = (self.health.clone(), watch_name(kind));
        let start: per_shard::StartWatch<K> = Box::new(move |shard| {
            let health = ShardWatch::new(health.clone(), &name, shard);
            start(shard)
                .inspect(move |event| health.observe(event))
                .boxed()
        });
        let feed = per_shard::PerShard {
            start,
            shard_of,
            store,
            listed,
            outside: feeds.outside.clone(),
            misplaced,
            kind: watch_name(kind),
            dyntype: kind.resource.clone(),
        };
        per_shard::merged(feed, wanted).boxed()
    }
}

impl WatchSetup {
    /// Where the parents are watched by the shard label, the labeller of the parents of
    /// `parent` in the policy's scope (see [`super::shard_labels`]); `None` otherwise.
    pub fn parent_labels(
        &self,
        parent: &ResolvedKind,
        parents: &Store<CachedObject>,
    ) -> Option<ParentLabels> {
        let feeds = self.per_shard.as_ref()?;
        let misplaced = feeds.labeller_input()?;
        let scope = self.scope(parent).map(str::to_owned);
        Some(ParentLabels::new(
            (self.client.clone(), parent.resource.clone(), scope),
            (
                self.field_manager.clone(),
                parents.clone(),
                feeds.parents_held(),
            ),
            feeds.ownership.clone(),
            misplaced,
        ))
    }
}

/// A kind (of dynamic type `dyntype`) through `client`: in `namespace`, or cluster-wide.
fn scoped_api<K>(client: Client, namespace: Option<&str>, dyntype: &K::DynamicType) -> Api<K>
where
    K: kube::Resource<Scope = kube::core::DynamicResourceScope>,
{
    match namespace {
        Some(namespace) => Api::namespaced_with(client, namespace, dyntype),
        None => Api::all_with(client, dyntype),
    }
}

/// A watch of `resource` through `api` (through [`crate::watch_lists`], with backoff), each
/// object as its cache keeps it: with `managedFields` dropped (plugins never see them and
/// the host does not need to hold them; what `created` notes of the policy's own fields is
/// noted first) and its apiVersion and kind set.
fn source_of<K>(
    api: Api<K>,
    resource: &ApiResource,
    config: watcher::Config,
    created: Option<Arc<CreatedFields>>,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static + use<K>
where
    K: Cacheable,
{
    // List responses leave out each item's apiVersion and kind; plugins and the convergence
    // check need them, so every cached object gets them back.
    let types = TypeMeta {
        api_version: resource.api_version.clone(),
        kind: resource.kind.clone(),
    };
    crate::watch_lists::watcher(api, config)
        .backoff(WatchBackoff::default())
        .modify(move |object: &mut K| {
            if let Some(created) = &created {
                created.note(object.meta());
            }
            object.managed_fields_mut().clear();
            let object_types = object.types_mut();
            if object_types.is_none() {
                *object_types = Some(types.clone());
            }
        })
}

impl WatchSetup {
    /// A watch stream of `kind` in the policy's scope, cached in a store of the policy's own
    /// (as `K`, in practice compactly: [`CachedObject`]) and fed to `indexes`; with
    /// `sharded`, fed per shard (see [`Self::per_shard_source`]).
    fn cached_watch<K>(
        &self,
        kind: &ResolvedKind,
        config: watcher::Config,
        (created, sharded): (Option<Arc<CreatedFields>>, Option<PerShardCache>),
        indexes: Vec<Arc<StoreIndex<K>>>,
    ) -> (
        Store<K>,
        impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    )
    where
        K: Cacheable,
    {
        let resource = &kind.resource;
        let writer = reflector::store::Writer::new(resource.clone());
        let reader = writer.as_reader();
        let health = self.health.clone();
        let name = watch_name(kind);
        let decisions = self.decisions.clone();
        let listed = reader.clone();
        let forget = created.clone();
        let (source, per_shard) = match (&self.per_shard, sharded) {
            (Some(feeds), Some((by, listed))) => {
                let feed = (feeds, by, listed);
                let source = self.per_shard_source(feed, kind, config, created, reader.clone());
                (source, true)
            }
            _ => (self.source(kind, config, created).boxed(), false),
        };
        let stream = source
            // Fed per shard, each shard's watch reports its own.
            .inspect(move |event| {
                if !per_shard {
                    health.observe(&name, event);
                }
            })
            .inspect(move |event| {
                if let Ok(event) = event {
                    for index in &indexes {
                        index.observe(event);
                    }
                }
            })
            .reflect(writer)
            // After the store took the event: a decision made on the old list is asked
            // again, and what is noted of children is dropped with them.
            .inspect(move |event| match event {
                Ok(watcher::Event::Delete(object)) => {
                    if let Some(created) = &forget {
                        created.forget(object.meta());
                    }
                }
                Ok(watcher::Event::InitDone) => {
                    decisions.relisted();
                    if let Some(created) = &forget {
                        let cached = listed.state();
                        created.retain_cached(cached.iter().map(|object| {
                            let meta = object.meta();
                            (
                                meta.namespace.as_deref(),
                                meta.name.as_deref().unwrap_or_default(),
                            )
                        }));
                    }
                }
                _ => {}
            });
        (reader, stream)
    }

    /// What tells this policy's watch of `kind` with `labels` from another's (see
    /// [`crate::controller::policy_run::shared_watches`]).
    fn watch_key(&self, kind: &ResolvedKind, labels: Option<String>) -> WatchKey {
        WatchKey {
            identity: self.identity.clone(),
            api_version: kind.resource.api_version.clone(),
            plural: kind.resource.plural.clone(),
            namespace: self.scope(kind).map(str::to_owned),
            labels,
        }
    }

    /// The host's watch of a related `kind` (narrowed by `selector`) as this policy follows
    /// it: the shared store, and the events that feed `indexes` and trigger the policy's
    /// parents, with whether they have brought a whole list yet.
    fn followed_watch(
        &self,
        kind: &ResolvedKind,
        selector: Option<String>,
        indexes: Vec<Arc<StoreIndex<CachedObject>>>,
    ) -> (
        Store<CachedObject>,
        impl futures::Stream<Item = Result<watcher::Event<CachedObject>, watcher::Error>>
        + Send
        + 'static,
        tokio::sync::watch::Receiver<bool>,
    ) {
        let config = match &selector {
            Some(selector) => watcher::Config::default().labels(selector),
            None => watcher::Config::default(),
        };
        let following = self.shared.objects.follow(
            self.watch_key(kind, selector),
            kind.resource.clone(),
            || self.source(kind, config, None),
            self.health.clone(),
            related_watch_name(kind),
        );
        let decisions = self.decisions.clone();
        let stream = following.events.inspect(move |event| {
            if let Ok(event) = event {
                for index in &indexes {
                    index.observe(event);
                }
                // The store already holds the new list: a decision made on the old one is
                // asked again.
                if matches!(event, watcher::Event::InitDone) {
                    decisions.relisted();
                }
            }
        });
        (following.store, stream, following.synced)
    }

    /// The host's watch of `kind`'s metadata in the policy's scope, each object kept as its
    /// name, namespace and resourceVersion only: what tells a named object exists and
    /// whether it changed. The shared store, and the events as this policy follows them,
    /// with whether they have brought a whole list yet.
    fn followed_metadata_watch(
        &self,
        kind: &ResolvedKind,
    ) -> Following<PartialObjectMeta<DynamicObject>> {
        let source = || {
            crate::watch_lists::watcher(
                self.api::<PartialObjectMeta<DynamicObject>>(kind, &kind.resource),
                watcher::Config::default(),
            )
            .backoff(WatchBackoff::default())
            .modify(|object| {
                let meta = std::mem::take(&mut object.metadata);
                object.metadata = ObjectMeta {
                    name: meta.name,
                    namespace: meta.namespace,
                    resource_version: meta.resource_version,
                    ..ObjectMeta::default()
                };
            })
        };
        self.shared.metadata.follow(
            self.watch_key(kind, None),
            ApiResource::clone(&kind.resource),
            source,
            self.health.clone(),
            related_watch_name(kind),
        )
    }
}

/// A kind as a policy's watch health names it.
fn watch_name(kind: &ResolvedKind) -> String {
    format!("{} {}", kind.resource.api_version, kind.resource.kind)
}

/// A related kind as a policy's watch health names it: apart from a child kind of the same
/// name, whose watch is the policy's own and fails or works on its own.
fn related_watch_name(kind: &ResolvedKind) -> String {
    format!("{} (related)", watch_name(kind))
}

/// A policy's controller and the caches its reconciles read.
pub(crate) struct Watches {
    controller: Controller<CachedObject>,
    parents: Store<CachedObject>,
    /// The parents by namespace, for the related objects that concern all of a namespace.
    parents_by_namespace: Arc<StoreIndex<CachedObject>>,
    /// The parents by the objects they name, for related kinds chosen by name.
    parents_by_reference: Arc<StoreIndex<CachedObject>>,
    parent: Arc<ApiResource>,
    /// The child kinds the policy allows, in the order of `children`.
    allowed: Vec<AllowedKind>,
    children: Vec<ChildCache>,
    related: Vec<Related>,
    /// Whether each followed watch (of a related kind) has brought this policy a whole list.
    synced: Vec<tokio::sync::watch::Receiver<bool>>,
    /// Fed per shard: the shards whose parents the caches hold whole (their children too).
    shards_whole: Option<watch::Receiver<per_shard::Whole>>,
}

impl Watches {
    /// The controller over the parent kind. Status-only updates (the host's own status writes
    /// among them) do not trigger a reconcile: they would turn every failure into an
    /// immediate retry and defeat backoff. `references` are the related kinds chosen by name
    /// (their place in the policy's `related`, the field naming them, whether namespaced):
    /// the parents are indexed by the objects they name. `by_namespace`: some related kind
    /// concerns every parent in an object's namespace, so the parents are indexed by it.
    pub fn parents(
        setup: &WatchSetup,
        parent: &ResolvedKind,
        references: Vec<(usize, FieldPath, bool)>,
        by_namespace: bool,
    ) -> Self {
        // Only related kinds read by selector (or all of a kind) look parents up by
        // namespace; without one, the index stays empty rather than hold every parent.
        let parents_by_namespace = Arc::new(StoreIndex::new(
            parent.resource.clone(),
            move |parent: &CachedObject| store_index::namespace(parent).filter(|_| by_namespace),
        ));
        let parents_by_reference = Arc::new(StoreIndex::new(
            parent.resource.clone(),
            move |parent: &CachedObject| {
                // Only a policy with related kinds chosen by name pays for reading the body.
                if references.is_empty() {
                    Vec::new()
                } else {
                    related::parent_reference_keys(&references, &parent.to_dynamic())
                }
            },
        ));
        let sharded = setup.per_shard.as_ref().map(|feeds| {
            let by = match feeds.misplaced_parents() {
                Some(labeller) => ShardedBy::ParentLabel(labeller),
                None => ShardedBy::Uid,
            };
            (by, feeds.parents_listed())
        });
        let (parents, stream) = setup.cached_watch(
            parent,
            watcher::Config::default(),
            (None, sharded),
            vec![parents_by_namespace.clone(), parents_by_reference.clone()],
        );
        let queue = setup.queue.clone();
        let gone = setup.queue.clone();
        let listed = parents.clone();
        let resource = parent.resource.clone();
        let decided = setup.decisions.clone();
        let parents_gone = setup.parents_gone.clone();
        // A parent that is gone is not reconciled: it no longer waits, and its last decision
        // is dropped. (After the store took the event, so a re-list's check reads the list.)
        let stream = stream.inspect(move |event| match event {
            Ok(watcher::Event::Apply(parent) | watcher::Event::InitApply(parent)) => {
                let key =
                    decisions::parent_key(parent.metadata.namespace.as_deref(), &parent.name_any());
                decided.noted_parent(key, parent.metadata.resource_version.as_deref());
            }
            Ok(watcher::Event::Delete(parent)) => {
                gone.started(&(parent.metadata.namespace.clone(), parent.name_any()));
                decided.remove(decisions::parent_key(
                    parent.metadata.namespace.as_deref(),
                    &parent.name_any(),
                ));
                parents_gone.happened();
            }
            Ok(watcher::Event::InitDone) => {
                gone.retain(|(namespace, name)| {
                    listed
                        .get(&object_ref(&resource, namespace.as_deref(), name))
                        .is_some()
                });
                let kept: std::collections::HashSet<u64> = listed
                    .state()
                    .iter()
                    .map(|p| decisions::parent_key(p.metadata.namespace.as_deref(), &p.name_any()))
                    .collect();
                decided.retain(|key| kept.contains(&key));
                parents_gone.happened();
            }
            _ => {}
        });
        let controller = Controller::for_stream_with(
            stream
                .applied_objects()
                .predicate_filter(parent_changed, PredicateConfig::default())
                .inspect_ok(move |parent| {
                    queue.added([(parent.metadata.namespace.clone(), parent.name_any())]);
                }),
            parents.clone(),
            parent.resource.clone(),
        );
        Self {
            controller,
            parents,
            parents_by_namespace,
            parents_by_reference,
            parent: parent.resource.clone(),
            allowed: Vec::new(),
            children: Vec::new(),
            related: Vec::new(),
            synced: Vec::new(),
            shards_whole: setup.per_shard.as_ref().map(|feeds| feeds.parents_held()),
        }
    }

    /// Watch the children of one allowed kind: a change to one triggers its controlling
    /// parent.
    pub fn owns(mut self, setup: &WatchSetup, kind: &KindRef, resolved: &ResolvedKind) -> Self {
        let created = Arc::new(CreatedFields::new(setup.field_manager.clone()));
        let by_controller = Arc::new(StoreIndex::new(
            resolved.resource.clone(),
            store_index::controller_uid::<CachedObject>,
        ));
        let sharded = setup
            .per_shard
            .as_ref()
            .map(|feeds| (ShardedBy::Label, feeds.child_kind()));
        let (store, stream) = setup.cached_watch(
            resolved,
            watcher::Config::default().labels(&setup.owned_selector),
            (Some(created.clone()), sharded),
            vec![by_controller.clone()],
        );
        let queue = setup.queue.clone();
        let parents = self.parents.clone();
        let parent = self.parent.clone();
        let decided = setup.decisions.clone();
        let teardown = setup.teardown.clone();
        // This kind's place among the allowed ones, which a child's key in decisions holds.
        let kind_index = self.children.len();
        let stream = stream.touched_objects().inspect_ok(move |child| {
            // Before the parent lookup: a parent already gone still has children to let go.
            if super::teardown::concerns(child)
                && let Some(uid) = store_index::controller_uid(child)
            {
                let _ = teardown.send(uid);
            }
            if let Some(key) = controlling_parent(child, &parent, &parents) {
                let meta = &child.metadata;
                let name = meta.name.as_deref().unwrap_or_default();
                decided.noted_child(
                    decisions::parent_key(key.0.as_deref(), &key.1),
                    decisions::child_key((kind_index, meta.namespace.as_deref(), name)),
                    meta.resource_version.as_deref(),
                );
                queue.added([key]);
            }
        });
        self.controller = self
            .controller
            .owns_stream_with(stream, resolved.resource.clone());
        self.allowed.push(AllowedKind {
            api_version: kind.api_version.clone(),
            kind: kind.kind.clone(),
            namespaced: resolved.namespaced,
        });
        self.children.push(ChildCache {
            resource: resolved.resource.clone(),
            store,
            by_controller,
            created,
            pending: Default::default(),
        });
        self
    }

    /// Watch one related kind (narrowed by its selector): a related object concerns every
    /// parent in its namespace.
    pub fn reads(
        mut self,
        setup: &WatchSetup,
        resolved: &ResolvedKind,
        selector: Option<&Selector>,
    ) -> Self {
        let by_namespace = Arc::new(StoreIndex::new(
            resolved.resource.clone(),
            store_index::namespace::<CachedObject>,
        ));
        let (store, stream, synced) = setup.followed_watch(
            resolved,
            selector.map(ToString::to_string),
            vec![by_namespace.clone()],
        );
        self.synced.push(synced);
        let parents = parents_under(self.parents_by_namespace.clone(), setup);
        let mapper = move |object: CachedObject| {
            parents(object.metadata.namespace.as_deref().unwrap_or_default())
        };
        self.controller = self.controller.watches_stream_with(
            stream.touched_objects(),
            mapper,
            resolved.resource.clone(),
        );
        self.related.push(Related::Selected(RelatedCache {
            store,
            by_namespace,
        }));
        self
    }

    /// Watch the metadata of one related kind chosen by name (`position` in the policy's
    /// `related`, the parents' field `path`): a change to an object triggers the parents that
    /// name it, and only those; the objects themselves are read when a reconcile needs them,
    /// and what was read of one no parent names any more is dropped.
    pub fn reads_named(
        mut self,
        setup: &WatchSetup,
        resolved: &ResolvedKind,
        position: usize,
        path: FieldPath,
    ) -> Self {
        let following = setup.followed_metadata_watch(resolved);
        let named = Arc::new(NamedObjects::new(
            NamedKind {
                position,
                path,
                resource: ApiResource::clone(&resolved.resource),
                namespaced: resolved.namespaced,
            },
            setup.client.clone(),
            following.store,
            setup.metrics.clone(),
            named_objects::READ_CACHE_BYTES,
            setup.related_budget.clone(),
        ));
        let unnamed = named.clone();
        self.parents_by_reference
            .on_vacated(move |key| unnamed.unnamed(key));
        self.synced.push(following.synced);
        // What was read of a deleted object is dropped, and after a re-list what the list no
        // longer shows (the shared store already holds the list).
        let (forgetting, decided) = (named.clone(), setup.decisions.clone());
        let stream = following.events.inspect(move |event| match event {
            Ok(watcher::Event::Delete(object)) => forgetting.forget(object),
            Ok(watcher::Event::InitDone) => {
                forgetting.relisted();
                decided.relisted();
            }
            _ => {}
        });
        let parents = parents_under(self.parents_by_reference.clone(), setup);
        let namespaced = resolved.namespaced;
        let mapper = move |object: PartialObjectMeta<DynamicObject>| {
            let namespace = object.metadata.namespace.as_deref().filter(|_| namespaced);
            parents(&related::reference_key(
                position,
                namespace,
                &object.name_any(),
            ))
        };
        self.controller = self.controller.watches_stream_with(
            stream.touched_objects(),
            mapper,
            ApiResource::clone(&resolved.resource),
        );
        self.related.push(Related::Named(named));
        self
    }

    /// The controller, the parents' cache, the caches the reconciles read, and a future to
    /// run beside the controller that marks those caches ready, and releases `syncing` (the
    /// host's readiness), once every one, the parents' included, has listed its objects.
    pub fn finish(
        self,
        syncing: crate::health::SyncGuard,
    ) -> (
        Controller<CachedObject>,
        Store<CachedObject>,
        Caches,
        impl Future<Output = ()> + use<>,
    ) {
        let (ready, wait_for_caches) = self.caches_ready(syncing);
        let caches = Caches {
            parents: self.parents.clone(),
            allowed: self.allowed,
            children: self.children,
            related: self.related,
            ready,
            shards_whole: self.shards_whole,
        };
        (self.controller, self.parents, caches, wait_for_caches)
    }

    /// kube-runtime's store readiness wakes only one waiter at a time, so one task waits for
    /// every cache on behalf of all reconciles and publishes the result on the receiver; a
    /// shared store of related objects is waited for through this policy's own follower.
    fn caches_ready(
        &self,
        mut syncing: crate::health::SyncGuard,
    ) -> (
        tokio::sync::watch::Receiver<bool>,
        impl Future<Output = ()> + use<>,
    ) {
        let (ready_tx, caches_ready) = tokio::sync::watch::channel(false);
        let mut stores: Vec<futures::future::BoxFuture<'static, bool>> = Vec::new();
        let parents = self.parents.clone();
        stores.push(Box::pin(
            async move { parents.wait_until_ready().await.is_ok() },
        ));
        for store in self.children.iter().map(|c| c.store.clone()) {
            stores.push(Box::pin(
                async move { store.wait_until_ready().await.is_ok() },
            ));
        }
        // A related kind's store is shared: other policies' tasks wait on it too, and only
        // one of them would be woken. Each follower's own stream says instead when it has
        // brought a whole list, which the shared store then holds (and may have held long
        // before this policy's indexes did).
        for synced in &self.synced {
            let mut synced = synced.clone();
            stores.push(Box::pin(async move {
                synced.wait_for(|whole| *whole).await.is_ok()
            }));
        }
        let wait = async move {
            for store in stores {
                if !store.await {
                    return std::future::pending().await;
                }
            }
            let _ = ready_tx.send(true);
            syncing.synced();
            std::future::pending::<()>().await
        };
        (caches_ready, wait)
    }
}

/// The parent a child's event queues, as kube-runtime finds it (the owner's name in the
/// child's namespace): the child's controller of the parent kind, if the parents' cache
/// holds it. An owner reference to a parent that does not exist queues nothing (kube-runtime
/// drops it), so it is not counted.
fn controlling_parent(
    child: &CachedObject,
    parent: &Arc<ApiResource>,
    parents: &Store<CachedObject>,
) -> Option<ParentKey> {
    let owner = child
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == parent.kind)?;
    let namespace = child.metadata.namespace.clone();
    parents.get(&object_ref(parent, namespace.as_deref(), &owner.name))?;
    Some((namespace, owner.name.clone()))
}

/// What a related event triggers: the parents `index` holds under a key, counted as queued,
/// each with its last decision marked as made on what has moved.
fn parents_under(
    index: Arc<StoreIndex<CachedObject>>,
    setup: &WatchSetup,
) -> impl Fn(&str) -> Vec<ObjectRef<CachedObject>> + Send + Sync + 'static {
    let queue = setup.queue.clone();
    let decided = setup.decisions.clone();
    move |key| {
        let parents = index.get(key);
        for parent in &parents {
            decided.moved(decisions::parent_key(
                parent.namespace.as_deref(),
                &parent.name,
            ));
        }
        queue.added(
            parents
                .iter()
                .map(|p| (p.namespace.clone(), p.name.clone())),
        );
        parents
    }
}

/// A fingerprint of what a parent's reconcile depends on besides its children: spec (via the
/// generation), labels, annotations, finalizers and deletion.
fn parent_changed(parent: &CachedObject) -> Option<u64> {
    use std::hash::{Hash as _, Hasher as _};
    let meta = &parent.metadata;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    meta.generation.hash(&mut hasher);
    parent.labels_text().hash(&mut hasher);
    parent.annotations_text().hash(&mut hasher);
    meta.finalizers.hash(&mut hasher);
    meta.deletion_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
        .hash(&mut hasher);
    Some(hasher.finish())
}

/// The children label selector of a policy's owned children.
pub(crate) fn owned_selector(policy_label: &str) -> String {
    format!("{}={policy_label}", POLICY_LABEL)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::controller::testing;

    fn child(namespace: &str, owner: Option<(&str, &str, bool)>) -> CachedObject {
        let owners: Vec<_> = owner
            .map(|(kind, name, controller)| {
                json!({"apiVersion": "example.com/v1", "kind": kind, "name": name,
                       "uid": format!("uid-{name}"), "controller": controller})
            })
            .into_iter()
            .collect();
        CachedObject::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": namespace, "ownerReferences": owners},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_child_queues_only_a_parent_that_exists() {
        let kind = Arc::new(testing::myapps());
        let parents = testing::store(testing::myapps(), vec![testing::parent("a", "web", &[])]);
        let queued = |child: CachedObject| controlling_parent(&child, &kind, &parents);
        assert_eq!(
            queued(child("a", Some(("MyApp", "web", true)))),
            Some((Some("a".to_owned()), "web".to_owned()))
        );
        // An owner reference naming no parent would wait in the count for ever.
        assert_eq!(queued(child("a", Some(("MyApp", "ghost", true)))), None);
        assert_eq!(queued(child("b", Some(("MyApp", "web", true)))), None);
        // Not the controller, or not of the parent kind.
        assert_eq!(queued(child("a", Some(("MyApp", "web", false)))), None);
        assert_eq!(queued(child("a", Some(("Other", "web", true)))), None);
        assert_eq!(queued(child("a", None)), None);
    }
}
