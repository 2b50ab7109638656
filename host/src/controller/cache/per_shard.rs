//! One cache fed by a watch per shard this replica holds, so that a sharded host caches its
//! share of a kind and not all of it.
//!
//! Each shard's watch is a kube-runtime watcher of its own (narrowed by the API server to the
//! shard: see [`crate::shards::selector`]); this module merges them into the one stream of
//! events a reflector store and a `Controller` take, and starts and ends them as the shards
//! wanted change.
//!
//! A watcher's events assume it is alone: its `Init` … `InitDone` is a whole list, which a
//! reflector store swaps in for everything it held. Here one shard lists while the others
//! run, so after the first list a shard's list is told to the store object by object: each
//! listed object as an `Apply`, and once the list ends, a `Delete` for each object of that
//! shard the store still holds and the list did not bring (it went while the watch was
//! away). A shard let go is told the same way: a `Delete` for each of its objects, so the
//! store, its indexes and what is kept per object let go of them as of a deleted one.
//!
//! The first list is the merged list of the shards wanted at the start (and of those gained
//! before it ends), told as one `Init` … `InitDone`, so that the store is ready once it holds
//! every shard held at the start. A store buffers such a list and cannot take a `Delete`
//! into the buffer: a delete seen during it is held back until the list ends, and anything
//! else a watcher does not do within a list (a shard's watch listing again, a shard let go)
//! ends the first list at once and is then told object by object.
//!
//! Every event is checked against its shard: an object of another shard is dropped, so the
//! cache holds the shards wanted whatever the API server did with the selector (one that
//! ignores it sends every object to every shard's watch; see [`Outside`]). Where a watch
//! selects by a label that someone may set wrong, such an object is handed on
//! ([`PerShard::misplaced`]) to whoever puts it right.

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::stream::BoxStream;
use futures::{Stream, StreamExt as _};
use kube::Resource;
use kube::runtime::reflector::Store;
use kube::runtime::watcher::{Error, Event};
use tokio::sync::watch;
use tokio_stream::StreamMap;

/// The events of one watch.
pub(crate) type Events<K> = BoxStream<'static, Result<Event<K>, Error>>;

/// Starts the watch of one shard, narrowed to it.
pub(crate) type StartWatch<K> = Box<dyn Fn(u32) -> Events<K> + Send>;

/// The shard of an object, as its watch narrows by; `None`: in none.
pub(crate) type ShardOf<K> = Box<dyn Fn(&K) -> Option<u32> + Send>;

/// The shards a cache holds whole, each with the number of the list that made it so: a
/// shard let go and listed again between two looks has a new number, so whoever compares
/// two looks (as [`crate::shards::gained`] does) sees it listed again.
pub(crate) type Whole = BTreeMap<u32, u64>;

/// Takes an object a shard's watch brought that is of another shard.
pub(crate) type Misplaced<K> = Box<dyn Fn(&K) + Send>;

/// An object's place in a store: namespace and name.
type Key = (Option<String>, String);

fn key_of<K: Resource>(object: &K) -> Key {
    let meta = object.meta();
    (
        meta.namespace.clone(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Whether any shard's watch brought an object of another shard: an API server that does
/// not narrow watches by shard (see [`crate::shards::selector`]), which the first one logs.
#[derive(Debug, Default)]
pub(crate) struct Outside(AtomicBool);

impl Outside {
    #[cfg(test)]
    fn seen(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Note one; `true` the first time.
    fn note(&self) -> bool {
        !self.0.swap(true, Ordering::Relaxed)
    }
}

/// What a cache fed per shard needs: how to start a shard's watch, which shard an object is
/// in, the store the events end in (read for the objects a shard's list no longer shows),
/// and where to say which shards it holds whole.
pub(crate) struct PerShard<K: Resource + Clone + 'static>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    pub start: StartWatch<K>,
    pub shard_of: ShardOf<K>,
    /// The store the merged events are reflected into.
    pub store: Store<K>,
    /// The shards whose objects the store holds whole: listed, and not let go since.
    pub listed: watch::Sender<Whole>,
    pub outside: Arc<Outside>,
    /// Where an object of another shard a watch brought (created or changed) goes, when its
    /// watch selects by something that can be set wrong; `None`: it is noted in `outside`.
    pub misplaced: Option<Misplaced<K>>,
    /// The kind, as logs name it.
    pub kind: String,
    /// The kind, as the store's keys name it.
    pub dyntype: K::DynamicType,
}

/// The first list, under way.
struct FirstList<K> {
    /// The shards whose list it still waits for.
    waiting: BTreeSet<u32>,
    /// Deletes seen during it, told once it ends.
    deleted: Vec<K>,
}

struct Merge<K: Resource + Clone + 'static>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    feed: PerShard<K>,
    /// The shards wanted, as they change; `None` once whoever sets them is gone.
    wanted: Option<BoxStream<'static, BTreeSet<u32>>>,
    watching: StreamMap<u32, Events<K>>,
    /// For each shard whose list is under way, the objects it brought so far.
    listing: std::collections::HashMap<u32, HashSet<Key>>,
    first: Option<FirstList<K>>,
    /// An event taken but not yet told: the first list had to end before it.
    replay: Option<Step<K>>,
    /// What to tell before anything else is taken.
    out: VecDeque<Out<K>>,
    /// Lists that ended, as numbered in `listed`.
    lists: u64,
}

/// What the merged stream tells, in order: an event, or shards its store now holds whole
/// (said once the events that make it so are in the store).
enum Out<K> {
    Event(Result<Event<K>, Error>),
    Listed(Listed),
}

enum Listed {
    /// The first list ended: these shards are held whole.
    All(BTreeSet<u32>),
    /// A shard listed after it.
    One(u32),
}

/// What comes next: the shards wanted changed, or a shard's watch sent an event.
enum Step<K> {
    Wanted(BTreeSet<u32>),
    Shard(u32, Result<Event<K>, Error>),
}

/// The events of a cache fed by a watch per shard in `wanted` (its first item the shards at
/// the start, then each change): see the module.
pub(crate) fn merged<K>(
    feed: PerShard<K>,
    wanted: BoxStream<'static, BTreeSet<u32>>,
) -> impl Stream<Item = Result<Event<K>, Error>> + Send + 'static
where
    K: Resource + Clone + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    let merge = Merge {
        feed,
        wanted: Some(wanted),
        watching: StreamMap::new(),
        listing: std::collections::HashMap::new(),
        first: None,
        replay: None,
        out: VecDeque::new(),
        lists: 0,
    };
    futures::stream::unfold((merge, false), |(mut merge, started)| async move {
        if !started {
            merge.start().await;
        }
        loop {
            // What was decided is told first, one event at a time: the store has taken each
            // before the next step reads it.
            match merge.out.pop_front() {
                Some(Out::Event(Ok(Event::Delete(object)))) if merge.replaced(&object) => continue,
                Some(Out::Event(event)) => return Some((event, (merge, true))),
                Some(Out::Listed(listed)) => {
                    merge.listed(listed);
                    continue;
                }
                None => {}
            }
            merge.end_first_if_listed();
            if !merge.out.is_empty() {
                continue;
            }
            let step = match merge.replay.take() {
                Some(step) => step,
                None => merge.next_step().await?,
            };
            merge.take(step);
        }
    })
}

impl<K> Merge<K>
where
    K: Resource + Clone + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    fn tell(&mut self, event: Event<K>) {
        self.out.push_back(Out::Event(Ok(event)));
    }

    /// Whether the store holds another object (another uid) under `deleted`'s name: one
    /// created again under the name in another shard, whose watch told of it first. A
    /// delete is for the object it names, not for its successor.
    fn replaced(&self, deleted: &K) -> bool {
        let meta = deleted.meta();
        let Some(name) = &meta.name else {
            return false;
        };
        let key = kube::runtime::reflector::ObjectRef::new_with(name, self.feed.dyntype.clone());
        let key = match &meta.namespace {
            Some(namespace) => key.within(namespace),
            None => key,
        };
        self.feed
            .store
            .get(&key)
            .is_some_and(|cached| cached.meta().uid != meta.uid)
    }

    /// Say which shards the store holds whole, now that it does.
    fn listed(&mut self, listed: Listed) {
        match listed {
            Listed::All(shards) => {
                let whole = shards
                    .into_iter()
                    .map(|shard| (shard, self.next_list()))
                    .collect();
                self.feed.listed.send_replace(whole);
            }
            Listed::One(shard) => {
                let list = self.next_list();
                self.feed.listed.send_modify(|listed| {
                    listed.insert(shard, list);
                });
            }
        }
    }

    fn next_list(&mut self) -> u64 {
        self.lists += 1;
        self.lists
    }

    /// The first list begins, with the shards wanted at the start.
    async fn start(&mut self) {
        self.tell(Event::Init);
        self.first = Some(FirstList {
            waiting: BTreeSet::new(),
            deleted: Vec::new(),
        });
        let initial = match &mut self.wanted {
            Some(wanted) => wanted.next().await,
            None => None,
        };
        match initial {
            Some(shards) => {
                for shard in shards {
                    self.watch(shard);
                }
            }
            None => self.wanted = None,
        }
    }

    async fn next_step(&mut self) -> Option<Step<K>> {
        loop {
            let watching = !self.watching.is_empty();
            let Some(wanted) = self.wanted.as_mut() else {
                let (shard, event) = self.watching.next().await?;
                return Some(Step::Shard(shard, event));
            };
            let change = tokio::select! {
                biased;
                change = wanted.next() => change,
                Some((shard, event)) = self.watching.next(), if watching => {
                    return Some(Step::Shard(shard, event));
                }
            };
            match change {
                Some(shards) => return Some(Step::Wanted(shards)),
                // Whoever set the shards is gone: the watches run on as they are.
                None => self.wanted = None,
            }
        }
    }

    fn watch(&mut self, shard: u32) {
        self.watching.insert(shard, (self.feed.start)(shard));
        if let Some(first) = &mut self.first {
            first.waiting.insert(shard);
        }
    }

    /// End the first list when every shard it waits for has listed.
    fn end_first_if_listed(&mut self) {
        if self.first.as_ref().is_some_and(|f| f.waiting.is_empty()) {
            self.end_first();
        }
    }

    /// End the first list now: the store takes what it brought, then the deletes held back.
    /// The shards that listed whole are held whole from here.
    fn end_first(&mut self) {
        let Some(first) = self.first.take() else {
            return;
        };
        self.tell(Event::InitDone);
        for deleted in first.deleted {
            self.tell(Event::Delete(deleted));
        }
        let listed: BTreeSet<u32> = self
            .watching
            .keys()
            .copied()
            .filter(|shard| !first.waiting.contains(shard) && !self.listing.contains_key(shard))
            .collect();
        self.out.push_back(Out::Listed(Listed::All(listed)));
    }

    /// Take one step, or end the first list first and take it after (see the module).
    fn take(&mut self, step: Step<K>) {
        if self.first.is_some() && self.ends_first(&step) {
            self.end_first();
            self.replay = Some(step);
            return;
        }
        match step {
            Step::Wanted(shards) => self.want(&shards),
            Step::Shard(shard, event) => self.shard_event(shard, event),
        }
    }

    /// Whether `step` is something a list does not hold: a shard let go, a shard listing
    /// again.
    fn ends_first(&self, step: &Step<K>) -> bool {
        match step {
            Step::Wanted(shards) => self.watching.keys().any(|s| !shards.contains(s)),
            Step::Shard(shard, Ok(Event::Init)) => {
                self.listing.contains_key(shard)
                    || self
                        .first
                        .as_ref()
                        .is_some_and(|first| !first.waiting.contains(shard))
            }
            Step::Shard(..) => false,
        }
    }

    fn want(&mut self, shards: &BTreeSet<u32>) {
        let gone: Vec<u32> = self
            .watching
            .keys()
            .copied()
            .filter(|s| !shards.contains(s))
            .collect();
        for shard in gone {
            self.watching.remove(&shard);
            self.listing.remove(&shard);
            // Said at once: nothing may count on the shard's objects from here on.
            self.feed
                .listed
                .send_if_modified(|listed| listed.remove(&shard).is_some());
            self.forget_shard(shard, None);
        }
        let new: Vec<u32> = shards
            .iter()
            .copied()
            .filter(|s| !self.watching.contains_key(s))
            .collect();
        for shard in new {
            self.watch(shard);
        }
    }

    /// A `Delete` for each object of `shard` the store holds, but those `kept`.
    fn forget_shard(&mut self, shard: u32, kept: Option<&HashSet<Key>>) {
        let gone = self.feed.store.state().into_iter().filter(|object| {
            (self.feed.shard_of)(object) == Some(shard)
                && kept.is_none_or(|kept| !kept.contains(&key_of(&**object)))
        });
        let events: Vec<_> = gone
            .map(|object| Out::Event(Ok(Event::Delete(K::clone(&object)))))
            .collect();
        self.out.extend(events);
    }

    /// Whether `object`, which `shard`'s watch brought, is of that shard. One that is not is
    /// dropped; one created or changed (`arrived`) is handed to [`PerShard::misplaced`].
    fn in_shard(&self, shard: u32, object: &K, arrived: bool) -> bool {
        if (self.feed.shard_of)(object) == Some(shard) {
            return true;
        }
        if let Some(misplaced) = &self.feed.misplaced {
            if arrived {
                misplaced(object);
            }
            return false;
        }
        if self.feed.outside.note() {
            tracing::warn!(
                shard,
                kind = %self.feed.kind,
                "a shard's watch brought an object of another shard: the API server does not narrow watches by shard, so each shard's watch lists the whole kind; the host keeps its own share all the same"
            );
        }
        false
    }

    /// Tell `object` as the store takes an object now: into the first list while it runs
    /// (where it undoes a delete of the same object held back), else as an `Apply`.
    fn applied(&mut self, object: K) {
        match &mut self.first {
            Some(first) => {
                if !first.deleted.is_empty() {
                    let key = key_of(&object);
                    first.deleted.retain(|deleted| key_of(deleted) != key);
                }
                self.tell(Event::InitApply(object));
            }
            None => self.tell(Event::Apply(object)),
        }
    }

    fn shard_event(&mut self, shard: u32, event: Result<Event<K>, Error>) {
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                self.out.push_back(Out::Event(Err(error)));
                return;
            }
        };
        match event {
            Event::Init => {
                self.listing.insert(shard, HashSet::new());
            }
            Event::InitApply(object) => {
                if !self.in_shard(shard, &object, true) {
                    return;
                }
                if let Some(seen) = self.listing.get_mut(&shard) {
                    seen.insert(key_of(&object));
                }
                self.applied(object);
            }
            Event::InitDone => {
                let seen = self.listing.remove(&shard).unwrap_or_default();
                match &mut self.first {
                    Some(first) => {
                        first.waiting.remove(&shard);
                    }
                    None => {
                        self.forget_shard(shard, Some(&seen));
                        self.out.push_back(Out::Listed(Listed::One(shard)));
                    }
                }
            }
            Event::Apply(object) => {
                if !self.in_shard(shard, &object, true) {
                    return;
                }
                self.applied(object);
            }
            Event::Delete(object) => {
                if !self.in_shard(shard, &object, false) {
                    return;
                }
                match &mut self.first {
                    Some(first) => first.deleted.push(object),
                    None => self.tell(Event::Delete(object)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::time::Duration;

    use futures::FutureExt as _;
    use futures::channel::mpsc;
    use k8s_openapi::api::core::v1::ConfigMap;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kube::runtime::WatchStreamExt as _;
    use kube::runtime::reflector::store::Writer;

    use super::*;

    /// An object of the shard its name starts with (`0-a`: shard 0).
    fn object(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some("ns".to_owned()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    /// `name` with `uid`: one object of that name among those it may be deleted and
    /// created again as.
    fn object_with_uid(name: &str, uid: &str) -> ConfigMap {
        let mut object = object(name);
        object.metadata.uid = Some(uid.to_owned());
        object
    }

    type Sent = Result<Event<ConfigMap>, Error>;

    /// The merged stream of a cache over fake shard watches: `wanted` sets the shards, and
    /// each shard's watch (started anew on each start) takes its events from `shards`.
    struct Fixture {
        wanted: mpsc::UnboundedSender<BTreeSet<u32>>,
        shards: Arc<Mutex<HashMap<u32, mpsc::UnboundedSender<Sent>>>>,
        starts: Arc<Mutex<Vec<u32>>>,
        store: Store<ConfigMap>,
        listed: watch::Receiver<Whole>,
        outside: Arc<Outside>,
        /// What was handed on as misplaced, where the fixture hands on.
        misplaced: Arc<Mutex<Vec<String>>>,
        events: BoxStream<'static, Sent>,
    }

    impl Fixture {
        fn new(initial: &[u32]) -> Self {
            Self::with(initial, false)
        }

        /// Its objects of another shard handed on rather than noted.
        fn handing_on(initial: &[u32]) -> Self {
            Self::with(initial, true)
        }

        fn with(initial: &[u32], hand_on: bool) -> Self {
            let (wanted, wanted_rx) = mpsc::unbounded();
            wanted
                .unbounded_send(initial.iter().copied().collect())
                .expect("open");
            let shards = Arc::new(Mutex::new(HashMap::new()));
            let starts = Arc::new(Mutex::new(Vec::new()));
            let writer = Writer::<ConfigMap>::default();
            let store = writer.as_reader();
            let (listed_tx, listed) = watch::channel(Whole::new());
            let outside = Arc::new(Outside::default());
            let misplaced = Arc::new(Mutex::new(Vec::new()));
            let hand_on: Option<Misplaced<ConfigMap>> = hand_on.then(|| {
                let misplaced = misplaced.clone();
                Box::new(move |object: &ConfigMap| {
                    let name = object.metadata.name.clone().unwrap_or_default();
                    crate::lock(&misplaced).push(name);
                }) as Misplaced<ConfigMap>
            });
            let start = {
                let (shards, starts) = (shards.clone(), starts.clone());
                move |shard: u32| -> Events<ConfigMap> {
                    let (tx, rx) = mpsc::unbounded();
                    crate::lock(&shards).insert(shard, tx);
                    crate::lock(&starts).push(shard);
                    rx.boxed()
                }
            };
            let feed = PerShard {
                start: Box::new(start),
                shard_of: Box::new(|object: &ConfigMap| {
                    object
                        .metadata
                        .name
                        .as_deref()?
                        .split('-')
                        .next()?
                        .parse()
                        .ok()
                }),
                store: store.clone(),
                listed: listed_tx,
                outside: outside.clone(),
                misplaced: hand_on,
                kind: "v1 ConfigMap".to_owned(),
                dyntype: (),
            };
            let events = merged(feed, wanted_rx.boxed()).reflect(writer).boxed();
            Self {
                wanted,
                shards,
                starts,
                store,
                listed,
                outside,
                misplaced,
                events,
            }
        }

        fn want(&self, shards: &[u32]) {
            self.wanted
                .unbounded_send(shards.iter().copied().collect())
                .expect("open");
        }

        fn send(&self, shard: u32, events: Vec<Event<ConfigMap>>) {
            let sender = crate::lock(&self.shards).get(&shard).cloned();
            let sender = sender.expect("the shard's watch started");
            for event in events {
                sender.unbounded_send(Ok(event)).expect("the watch runs");
            }
        }

        fn list(&self, shard: u32, names: &[&str]) {
            let mut events = vec![Event::Init];
            events.extend(names.iter().map(|name| Event::InitApply(object(name))));
            events.push(Event::InitDone);
            self.send(shard, events);
        }

        /// What the merged stream told, until it waits.
        async fn told(&mut self) -> Vec<String> {
            let mut told = Vec::new();
            while let Ok(Some(event)) =
                tokio::time::timeout(Duration::from_millis(50), self.events.next()).await
            {
                let name = |o: &ConfigMap| o.metadata.name.clone().unwrap_or_default();
                told.push(match event {
                    Ok(Event::Init) => "init".to_owned(),
                    Ok(Event::InitApply(o)) => format!("list {}", name(&o)),
                    Ok(Event::InitDone) => "listed".to_owned(),
                    Ok(Event::Apply(o)) => format!("apply {}", name(&o)),
                    Ok(Event::Delete(o)) => format!("delete {}", name(&o)),
                    Err(error) => format!("error {error}"),
                });
            }
            told
        }

        fn cached(&self) -> Vec<String> {
            let mut names: Vec<String> = self
                .store
                .state()
                .iter()
                .filter_map(|o| o.metadata.name.clone())
                .collect();
            names.sort();
            names
        }

        fn listed(&self) -> Vec<u32> {
            self.listed.borrow().keys().copied().collect()
        }
    }

    #[tokio::test]
    async fn the_shards_held_at_the_start_are_one_first_list() {
        let mut cache = Fixture::new(&[0, 1]);
        assert_eq!(cache.told().await, ["init"]);
        cache.list(0, &["0-a"]);
        assert_eq!(cache.told().await, ["list 0-a"], "shard 1 has not listed");
        assert!(cache.store.wait_until_ready().now_or_never().is_none());
        cache.list(1, &["1-b"]);
        assert_eq!(cache.told().await, ["list 1-b", "listed"]);
        assert_eq!(cache.cached(), ["0-a", "1-b"]);
        assert_eq!(cache.listed(), [0, 1]);
        assert!(cache.store.wait_until_ready().now_or_never().is_some());
    }

    #[tokio::test]
    async fn a_replica_holding_no_shard_has_an_empty_cache_ready() {
        let mut cache = Fixture::new(&[]);
        assert_eq!(cache.told().await, ["init", "listed"]);
        assert!(cache.store.wait_until_ready().now_or_never().is_some());
    }

    #[tokio::test]
    async fn a_shard_taken_later_is_told_object_by_object() {
        let mut cache = Fixture::new(&[0]);
        cache.told().await;
        cache.list(0, &["0-a"]);
        cache.told().await;
        cache.want(&[0, 1]);
        assert_eq!(cache.told().await, Vec::<String>::new());
        assert_eq!(
            cache.listed(),
            [0],
            "shard 1 is not held whole until it listed"
        );
        cache.list(1, &["1-b", "1-c"]);
        assert_eq!(cache.told().await, ["apply 1-b", "apply 1-c"]);
        assert_eq!(cache.cached(), ["0-a", "1-b", "1-c"]);
        assert_eq!(cache.listed(), [0, 1]);
        cache.send(
            1,
            vec![Event::Apply(object("1-d")), Event::Delete(object("1-b"))],
        );
        assert_eq!(cache.told().await, ["apply 1-d", "delete 1-b"]);
        assert_eq!(cache.cached(), ["0-a", "1-c", "1-d"]);
    }

    #[tokio::test]
    async fn a_shard_let_go_leaves_the_cache_and_its_watch_ends() {
        let mut cache = Fixture::new(&[0, 1]);
        cache.told().await;
        cache.list(0, &["0-a"]);
        cache.list(1, &["1-b", "1-c"]);
        cache.told().await;
        let first_look = cache.listed.borrow().clone();
        cache.want(&[0]);
        let mut told = cache.told().await;
        told.sort();
        assert_eq!(told, ["delete 1-b", "delete 1-c"]);
        assert_eq!(cache.cached(), ["0-a"]);
        assert_eq!(cache.listed(), [0]);
        let sender = crate::lock(&cache.shards)
            .get(&1)
            .cloned()
            .expect("started");
        assert!(sender.is_closed(), "shard 1's watch was dropped");
        // Taken again: watched anew, from a list of its own.
        cache.want(&[0, 1]);
        cache.told().await;
        assert_eq!(*crate::lock(&cache.starts), [0, 1, 1]);
        cache.list(1, &["1-c"]);
        assert_eq!(cache.told().await, ["apply 1-c"]);
        assert_eq!(cache.cached(), ["0-a", "1-c"]);
        // Whole again as before, by a new list: who looked before and after sees it listed.
        let second_look = cache.listed.borrow().clone();
        assert_eq!(
            first_look.keys().collect::<Vec<_>>(),
            second_look.keys().collect::<Vec<_>>()
        );
        assert_eq!(
            crate::shards::gained(&first_look, &second_look),
            BTreeSet::from([1])
        );
    }

    #[tokio::test]
    async fn a_shard_listed_again_drops_what_its_list_no_longer_shows() {
        let mut cache = Fixture::new(&[0, 1]);
        cache.told().await;
        cache.list(0, &["0-a", "0-b"]);
        cache.list(1, &["1-c"]);
        cache.told().await;
        cache.list(0, &["0-b", "0-d"]);
        assert_eq!(cache.told().await, ["apply 0-b", "apply 0-d", "delete 0-a"]);
        assert_eq!(
            cache.cached(),
            ["0-b", "0-d", "1-c"],
            "shard 1 is untouched"
        );
        assert_eq!(cache.listed(), [0, 1]);
    }

    #[tokio::test]
    async fn a_delete_during_the_first_list_is_told_once_it_ends() {
        let mut cache = Fixture::new(&[0, 1]);
        cache.told().await;
        cache.list(0, &["0-a", "0-b", "0-c"]);
        cache.send(
            0,
            vec![Event::Delete(object("0-b")), Event::Delete(object("0-c"))],
        );
        // Created again under the same name: that delete no longer holds.
        cache.send(0, vec![Event::Apply(object("0-c"))]);
        assert_eq!(
            cache.told().await,
            ["list 0-a", "list 0-b", "list 0-c", "list 0-c"]
        );
        cache.list(1, &["1-d"]);
        assert_eq!(cache.told().await, ["list 1-d", "listed", "delete 0-b"]);
        assert_eq!(cache.cached(), ["0-a", "0-c", "1-d"]);
    }

    #[tokio::test]
    async fn a_shard_listing_again_within_the_first_list_ends_it() {
        let mut cache = Fixture::new(&[0, 1]);
        cache.told().await;
        // (One shard at a time: the shards' watches are taken in no set order.)
        cache.list(0, &["0-a", "0-b"]);
        assert_eq!(cache.told().await, ["list 0-a", "list 0-b"]);
        cache.list(0, &["0-a"]);
        assert_eq!(cache.told().await, ["listed", "apply 0-a", "delete 0-b"]);
        assert_eq!(cache.listed(), [0]);
        cache.list(1, &["1-c"]);
        assert_eq!(cache.told().await, ["apply 1-c"]);
        assert_eq!(cache.cached(), ["0-a", "1-c"]);
        assert_eq!(cache.listed(), [0, 1]);
    }

    #[tokio::test]
    async fn a_shard_let_go_within_the_first_list_ends_it() {
        let mut cache = Fixture::new(&[0, 1]);
        cache.told().await;
        cache.list(0, &["0-a"]);
        cache.send(1, vec![Event::Init, Event::InitApply(object("1-b"))]);
        cache.told().await;
        cache.want(&[0]);
        assert_eq!(cache.told().await, ["listed", "delete 1-b"]);
        assert_eq!(cache.cached(), ["0-a"]);
        assert_eq!(cache.listed(), [0]);
    }

    #[tokio::test]
    async fn a_delete_told_after_the_name_was_taken_again_in_another_shard_is_dropped() {
        // Names here say the shard; an object created again under a name can land in any
        // shard, and the two shards' watches are told in no set order. Here the new one is
        // told by its shard before the old one's delete is by its own.
        let mut cache = Fixture::new(&[0, 1]);
        cache.told().await;
        cache.list(0, &[]);
        cache.list(1, &[]);
        cache.told().await;
        cache.send(0, vec![Event::Apply(object_with_uid("0-a", "old"))]);
        cache.told().await;
        cache.send(0, vec![Event::Apply(object_with_uid("0-a", "new"))]);
        cache.send(0, vec![Event::Delete(object_with_uid("0-a", "old"))]);
        assert_eq!(cache.told().await, ["apply 0-a"]);
        let cached = cache.store.state();
        assert_eq!(cached.len(), 1);
        assert_eq!(cached[0].metadata.uid.as_deref(), Some("new"));
        // Its own delete goes.
        cache.send(0, vec![Event::Delete(object_with_uid("0-a", "new"))]);
        assert_eq!(cache.told().await, ["delete 0-a"]);
        assert!(cache.cached().is_empty());
    }

    #[tokio::test]
    async fn an_object_of_another_shard_is_left_out() {
        let mut cache = Fixture::new(&[0]);
        cache.told().await;
        assert!(!cache.outside.seen());
        cache.list(0, &["0-a", "1-b"]);
        cache.send(0, vec![Event::Apply(object("2-c"))]);
        assert_eq!(cache.told().await, ["list 0-a", "listed"]);
        assert_eq!(cache.cached(), ["0-a"]);
        assert!(cache.outside.seen());
    }

    #[tokio::test]
    async fn an_object_under_another_shard_s_label_is_handed_on_once_it_arrives() {
        let mut cache = Fixture::handing_on(&[0]);
        cache.told().await;
        cache.list(0, &["0-a", "1-b"]);
        cache.send(0, vec![Event::Apply(object("2-c"))]);
        assert_eq!(cache.told().await, ["list 0-a", "listed"]);
        assert_eq!(cache.cached(), ["0-a"]);
        // Handed on, not noted as an API server that ignores the selector.
        assert_eq!(*crate::lock(&cache.misplaced), ["1-b", "2-c"]);
        assert!(!cache.outside.seen());
        // Once put right, it leaves the watch: that delete is no one's business here.
        cache.send(0, vec![Event::Delete(object("2-c"))]);
        assert!(cache.told().await.is_empty());
        assert_eq!(*crate::lock(&cache.misplaced), ["1-b", "2-c"]);
    }
}
