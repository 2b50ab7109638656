//! Watches shared between policies. Two policies that read the same related kind, as the
//! same identity, in the same scope and with the same selector, would each hold a watch of
//! the same objects and a cache of them; the host holds one of each, and both policies
//! follow it.
//!
//! One task runs the watch and keeps its store. Each follower reads that store and gets the
//! watch's events on a stream of its own, to keep its own indexes and trigger its own
//! parents; it joins when that stream is first polled (as a policy's own watch would start),
//! and the watch itself starts with its first follower, who gets the first list as it comes.
//! A follower that comes to a watch already running is first sent what the store holds as
//! a list of its own (`Init`, an `InitApply` per object, `InitDone`): at once if the watch
//! is between lists, at the end of its list if one is under way. Every follower so sees one
//! consistent sequence of events, as if it had the watch to itself. The watch, and its
//! cache, end with their last follower.
//!
//! A follower's stream is unbounded, as a watch's own events are: its reader is a
//! kube-runtime `Controller`, which takes each trigger as it comes into its scheduler. Only
//! related kinds are shared: a policy's children carry its own label and its parents are its
//! own (no two policies reconcile one kind in one place), so no other policy watches them.

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, Mutex, Weak};

use futures::stream::BoxStream;
use futures::{Stream, StreamExt as _};
use kube::Resource;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::Store;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher::{self, Event};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::mpsc;

use crate::controller::policy_run::watch_health::{self, WatchHealth};
use crate::metrics::Metrics;

/// The watches the host's policies share: of whole objects, and of metadata only.
pub(crate) struct HostWatches {
    pub objects: SharedWatches<crate::controller::cache::cached::CachedObject>,
    pub metadata: SharedWatches<kube::core::PartialObjectMeta<kube::core::DynamicObject>>,
}

impl HostWatches {
    /// No watch yet; each counted in `metrics` while it runs.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            objects: SharedWatches::counted(metrics.clone()),
            metadata: SharedWatches::counted(metrics),
        }
    }
}

/// What tells two watches apart: who watches, which kind, where, and which of its objects.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct WatchKey {
    /// The ServiceAccount a policy acts as (`namespace/name`), or `None` for the host itself:
    /// what one identity may see is never served to another.
    pub identity: Option<String>,
    pub api_version: String,
    pub plural: String,
    /// `None`: cluster-wide.
    pub namespace: Option<String>,
    /// The label selector, as the watch sends it.
    pub labels: Option<String>,
}

/// The watches running, by what they watch; each lives while someone follows it.
pub(crate) struct SharedWatches<K: Resource + Clone + 'static>
where
    K::DynamicType: Eq + Hash + Clone,
{
    watches: Mutex<HashMap<WatchKey, Weak<SharedWatch<K>>>>,
    /// Where each running watch is counted (`wasmctrl_related_watches`).
    metrics: Option<Arc<Metrics>>,
}

impl<K: Resource + Clone + 'static> SharedWatches<K>
where
    K::DynamicType: Eq + Hash + Clone,
{
    fn counted(metrics: Arc<Metrics>) -> Self {
        Self {
            watches: Mutex::default(),
            metrics: Some(metrics),
        }
    }
}

impl<K: Resource + Clone + 'static> Default for SharedWatches<K>
where
    K::DynamicType: Eq + Hash + Clone,
{
    fn default() -> Self {
        Self {
            watches: Mutex::default(),
            metrics: None,
        }
    }
}

/// One watch and its store, run by a task that ends when the last follower lets go.
struct SharedWatch<K: Resource + Clone + 'static>
where
    K::DynamicType: Eq + Hash + Clone,
{
    store: Store<K>,
    joining: mpsc::UnboundedSender<Follower<K>>,
    task: tokio::task::AbortHandle,
    /// Raised while the watch runs.
    running: Option<Gauge>,
}

impl<K: Resource + Clone + 'static> Drop for SharedWatch<K>
where
    K::DynamicType: Eq + Hash + Clone,
{
    fn drop(&mut self) {
        self.task.abort();
        if let Some(running) = &self.running {
            running.dec();
        }
    }
}

/// A policy following a watch: where its events go and where the watch's health is told.
struct Follower<K> {
    events: mpsc::UnboundedSender<Event<K>>,
    health: Arc<WatchHealth>,
    /// The kind as the policy's health names it.
    kind: String,
}

impl<K: Resource + Clone + 'static> Follower<K>
where
    K::DynamicType: Eq + Hash + Clone,
{
    /// Send what `store` holds as a list of its own; `false` once the follower is gone.
    fn send_list(&self, store: &Store<K>) -> bool {
        let send = |event| self.events.send(event).is_ok();
        send(Event::Init)
            && store
                .state()
                .into_iter()
                .all(|object| send(Event::InitApply(K::clone(&object))))
            && send(Event::InitDone)
    }
}

/// What one follower gets: the shared store, its own events, and whether those events
/// have brought it a whole list yet (its indexes are built from them, not from the store).
pub(crate) struct Following<K: Resource + Clone + 'static>
where
    K::DynamicType: Eq + Hash + Clone,
{
    pub store: Store<K>,
    pub events: BoxStream<'static, Result<Event<K>, watcher::Error>>,
    pub synced: tokio::sync::watch::Receiver<bool>,
}

impl<K> SharedWatches<K>
where
    K: Resource + Clone + Debug + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + Hash + Send + Sync,
{
    /// Follow the watch `key` names, starting it (with `start`, a watch of `dyntype` already
    /// normalized as its store should hold it) if none runs. `health` is told, under `kind`,
    /// when the watch fails and when it works again.
    pub fn follow<S>(
        &self,
        key: WatchKey,
        dyntype: K::DynamicType,
        start: impl FnOnce() -> S,
        health: Arc<WatchHealth>,
        kind: String,
    ) -> Following<K>
    where
        S: Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static,
    {
        let watch = {
            let mut watches = crate::lock(&self.watches);
            watches.retain(|_, watch| watch.strong_count() > 0);
            // A watch whose task ended (it never should) takes no one new: start another.
            let running = watches
                .get(&key)
                .and_then(Weak::upgrade)
                .filter(|watch| !watch.joining.is_closed());
            match running {
                Some(watch) => watch,
                None => {
                    let running = self.metrics.as_ref().map(|metrics| {
                        metrics.related_watches(&format!("{}/{}", key.api_version, key.plural))
                    });
                    let watch = Arc::new(SharedWatch::start(start(), dyntype, &key, running));
                    watches.insert(key, Arc::downgrade(&watch));
                    watch
                }
            }
        };
        let (events, mut received) = mpsc::unbounded_channel();
        let ended = (health.clone(), kind.clone());
        // Joined when the stream is first polled: a policy that builds its watches and then
        // loads a plugin for a while is sent nothing it would hold meanwhile.
        let mut joining = Some(Follower {
            events,
            health,
            kind,
        });
        let (synced_tx, synced) = tokio::sync::watch::channel(false);
        let store = watch.store.clone();
        let events = futures::stream::poll_fn(move |cx| {
            if let Some(follower) = joining.take() {
                // Refused only by a task that ended; then the stream ends too.
                let _ = watch.joining.send(follower);
            }
            let next = received.poll_recv(cx);
            if let std::task::Poll::Ready(None) = next {
                // The watch's task ended (it never should; a panic would): the policy's
                // `Ready` condition says which kind it no longer watches.
                let (health, kind) = &ended;
                health.failing(kind, "WatchFailed", "the host's shared watch of it ended");
            }
            next
        })
        .map(move |event| {
            if matches!(event, Event::InitDone) {
                synced_tx.send_replace(true);
            }
            Ok(event)
        })
        .boxed();
        Following {
            store,
            events,
            synced,
        }
    }

    /// How many watches run now (for tests).
    #[cfg(test)]
    fn running(&self) -> usize {
        crate::lock(&self.watches)
            .values()
            .filter(|watch| watch.strong_count() > 0)
            .count()
    }
}

impl<K> SharedWatch<K>
where
    K: Resource + Clone + Debug + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + Hash + Send + Sync,
{
    fn start<S>(events: S, dyntype: K::DynamicType, key: &WatchKey, running: Option<Gauge>) -> Self
    where
        S: Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static,
    {
        let writer = Writer::new(dyntype);
        let store = writer.as_reader();
        let (joining, joined) = mpsc::unbounded_channel();
        let watch = format!("{} {}", key.api_version, key.plural);
        let task = tokio::spawn(run(events.reflect(writer), store.clone(), joined, watch));
        if let Some(running) = &running {
            running.inc();
        }
        Self {
            store,
            joining,
            task: task.abort_handle(),
            running,
        }
    }
}

/// Pass each of the watch's events (already in `store`) to every follower, and bring each
/// newcomer in with a list of its own once the store holds a whole one (or with the first
/// list, if it comes before it).
async fn run<K, S>(
    events: S,
    store: Store<K>,
    mut joined: mpsc::UnboundedReceiver<Follower<K>>,
    watch: String,
) where
    K: Resource + Clone + Send + Sync + 'static,
    K::DynamicType: Clone + Eq + Hash,
    S: Stream<Item = Result<Event<K>, watcher::Error>> + Send,
{
    let mut events = std::pin::pin!(events);
    let mut followers: Vec<Follower<K>> = Vec::new();
    // Those who came while a list was under way, until it is whole.
    let mut waiting: Vec<Follower<K>> = Vec::new();
    let mut phase = Phase::BeforeList;
    let mut failing: Option<(&'static str, String)> = None;
    // The watch begins with its first follower (when that one's stream is first polled), who
    // gets the first list as it comes.
    let Some(first) = joined.recv().await else {
        return;
    };
    followers.push(first);
    loop {
        tokio::select! {
            biased;
            Some(follower) = joined.recv() => {
                // A policy that stopped while the kind was quiet leaves no follower behind.
                followers.retain(|f| !f.events.is_closed());
                waiting.retain(|f| !f.events.is_closed());
                if let Some((reason, message)) = &failing {
                    follower.health.failing(&follower.kind, reason, message);
                }
                match phase {
                    // Nothing sent yet: the list to come is the follower's as well.
                    Phase::BeforeList => followers.push(follower),
                    Phase::Listing => waiting.push(follower),
                    Phase::Listed => {
                        if follower.send_list(&store) {
                            followers.push(follower);
                        }
                    }
                }
            }
            event = events.next() => match event {
                None => {
                    for follower in followers.iter().chain(&waiting) {
                        follower.health.failing(&follower.kind, "WatchFailed", "the watch ended");
                    }
                    return;
                }
                Some(Err(error)) => {
                    tracing::warn!(%watch, %error, "shared watch failed; retrying");
                    let (reason, message) = watch_health::classify(&error);
                    for follower in followers.iter().chain(&waiting) {
                        follower.health.failing(&follower.kind, reason, &message);
                    }
                    failing = Some((reason, message));
                }
                Some(Ok(event)) => {
                    if failing.take().is_some() {
                        for follower in followers.iter().chain(&waiting) {
                            follower.health.working(&follower.kind);
                        }
                    }
                    match &event {
                        Event::Init => phase = Phase::Listing,
                        Event::InitDone => phase = Phase::Listed,
                        _ => {}
                    }
                    dispatch(&mut followers, event);
                    if phase == Phase::Listed {
                        for follower in waiting.drain(..) {
                            if follower.send_list(&store) {
                                followers.push(follower);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Where a shared watch stands in its lists.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Its first list has not begun: a follower gets it as it comes.
    BeforeList,
    /// A list is under way: a newcomer waits for the whole of it.
    Listing,
    /// The store holds a whole list: a newcomer is sent it.
    Listed,
}

/// Send `event` to every follower (the last one gets it without a copy), dropping those gone.
fn dispatch<K: Clone>(followers: &mut Vec<Follower<K>>, event: Event<K>) {
    let Some((last, others)) = followers.split_last() else {
        return;
    };
    let mut gone = Vec::new();
    for (at, follower) in others.iter().enumerate() {
        if follower.events.send(event.clone()).is_err() {
            gone.push(at);
        }
    }
    if last.events.send(event).is_err() {
        gone.push(others.len());
    }
    for at in gone.into_iter().rev() {
        followers.swap_remove(at);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    use super::*;

    fn config_map(name: &str, version: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some("a".to_owned()),
                resource_version: Some(version.to_owned()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    fn key(labels: &str) -> WatchKey {
        WatchKey {
            identity: None,
            api_version: "v1".to_owned(),
            plural: "configmaps".to_owned(),
            namespace: Some("a".to_owned()),
            labels: Some(labels.to_owned()),
        }
    }

    type Sent = Result<Event<ConfigMap>, watcher::Error>;

    /// What `receiver` receives, as a stream.
    fn receiver_stream<T>(mut receiver: mpsc::UnboundedReceiver<T>) -> impl Stream<Item = T> {
        futures::stream::poll_fn(move |cx| receiver.poll_recv(cx))
    }

    /// Poll a follower's stream once, which joins it to its watch, expecting no event yet.
    async fn join(following: &mut Following<ConfigMap>) {
        assert!(futures::poll!(following.events.next()).is_pending());
    }

    /// A watch whose events the test sends, and how many times one was started.
    struct Source {
        events: Mutex<Option<mpsc::UnboundedReceiver<Sent>>>,
        started: std::sync::atomic::AtomicUsize,
    }

    impl Source {
        fn new() -> (Arc<Self>, mpsc::UnboundedSender<Sent>) {
            let (send, events) = mpsc::unbounded_channel();
            let source = Arc::new(Self {
                events: Mutex::new(Some(events)),
                started: Default::default(),
            });
            (source, send)
        }

        fn start(&self) -> impl Stream<Item = Sent> + Send + 'static + use<> {
            self.started
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let events = crate::lock(&self.events)
                .take()
                .unwrap_or_else(|| mpsc::unbounded_channel().1);
            receiver_stream(events)
        }
    }

    fn follow(
        watches: &SharedWatches<ConfigMap>,
        source: &Arc<Source>,
        labels: &str,
    ) -> (Following<ConfigMap>, Arc<WatchHealth>) {
        let health = Arc::new(WatchHealth::default());
        let following = watches.follow(
            key(labels),
            (),
            || source.start(),
            health.clone(),
            "v1 ConfigMap".to_owned(),
        );
        (following, health)
    }

    /// The next event a follower gets, as `kind name@version`.
    async fn next(following: &mut Following<ConfigMap>) -> String {
        let event = tokio::time::timeout(Duration::from_secs(5), following.events.next())
            .await
            .unwrap_or_else(|_| panic!("no event came"))
            .unwrap_or_else(|| panic!("the stream ended"))
            .unwrap_or_else(|e| panic!("{e}"));
        let named = |object: &ConfigMap| {
            format!(
                "{}@{}",
                object.metadata.name.as_deref().unwrap_or_default(),
                object
                    .metadata
                    .resource_version
                    .as_deref()
                    .unwrap_or_default()
            )
        };
        match event {
            Event::Init => "Init".to_owned(),
            Event::InitApply(object) => format!("InitApply {}", named(&object)),
            Event::InitDone => "InitDone".to_owned(),
            Event::Apply(object) => format!("Apply {}", named(&object)),
            Event::Delete(object) => format!("Delete {}", named(&object)),
        }
    }

    #[tokio::test]
    async fn followers_of_one_watch_share_it_and_a_late_one_gets_a_list_of_its_own() {
        let watches = SharedWatches::default();
        let (source, send) = Source::new();
        let (mut first, _) = follow(&watches, &source, "app=x");
        // The watch waits for its first follower to poll its stream, who then gets the first
        // list as it comes (an `Init` taken before would leave it waiting for the list's end).
        send.send(Ok(Event::Init)).unwrap_or_else(|e| panic!("{e}"));
        tokio::task::yield_now().await;
        // A second follower coming during the first list waits for it to be whole.
        send.send(Ok(Event::InitApply(config_map("one", "1"))))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(next(&mut first).await, "Init");
        assert_eq!(next(&mut first).await, "InitApply one@1");
        let (mut second, _) = follow(&watches, &source, "app=x");
        join(&mut second).await;
        send.send(Ok(Event::InitApply(config_map("two", "1"))))
            .unwrap_or_else(|e| panic!("{e}"));
        send.send(Ok(Event::InitDone))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(next(&mut first).await, "InitApply two@1");
        assert_eq!(next(&mut first).await, "InitDone");
        assert!(*first.synced.borrow());
        assert_eq!(next(&mut second).await, "Init");
        let mut listed = vec![next(&mut second).await, next(&mut second).await];
        listed.sort();
        assert_eq!(listed, ["InitApply one@1", "InitApply two@1"]);
        assert_eq!(next(&mut second).await, "InitDone");
        assert!(*second.synced.borrow());

        // One watch, one store, and every event reaches both.
        assert_eq!(source.started.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(watches.running(), 1);
        send.send(Ok(Event::Apply(config_map("one", "2"))))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(next(&mut first).await, "Apply one@2");
        assert_eq!(next(&mut second).await, "Apply one@2");
        assert_eq!(first.store.state().len(), 2);
        assert_eq!(second.store.state().len(), 2);

        // A third coming between lists gets the store at once, then what follows.
        let (mut third, _) = follow(&watches, &source, "app=x");
        join(&mut third).await;
        send.send(Ok(Event::Delete(config_map("two", "3"))))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(next(&mut third).await, "Init");
        let mut listed = vec![next(&mut third).await, next(&mut third).await];
        listed.sort();
        assert_eq!(listed, ["InitApply one@2", "InitApply two@1"]);
        assert_eq!(next(&mut third).await, "InitDone");
        assert_eq!(next(&mut third).await, "Delete two@3");
        assert_eq!(next(&mut first).await, "Delete two@3");
    }

    #[tokio::test]
    async fn another_selector_is_another_watch_and_the_last_follower_ends_one() {
        let watches = SharedWatches::default();
        let (source, send) = Source::new();
        let (first, _) = follow(&watches, &source, "app=x");
        let (other_source, _other_send) = Source::new();
        let (other, _) = follow(&watches, &other_source, "app=y");
        assert_eq!(watches.running(), 2);
        assert_eq!(
            other_source
                .started
                .load(std::sync::atomic::Ordering::SeqCst),
            1
        );
        drop(other);
        assert_eq!(watches.running(), 1);
        drop(first);
        assert_eq!(watches.running(), 0);
        // The task let go of the watch: its source has no reader any more.
        let closed = tokio::time::timeout(Duration::from_secs(5), send.closed()).await;
        assert!(
            closed.is_ok(),
            "the watch's task ended with its last follower"
        );
        // Following again starts a new watch.
        let (_again, _) = follow(&watches, &source, "app=x");
        assert_eq!(source.started.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn what_one_identity_watches_is_never_shared_with_another() {
        let watches = SharedWatches::default();
        let (source, _send) = Source::new();
        let (host, _) = follow(&watches, &source, "app=x");
        let (team_source, _team_send) = Source::new();
        let team = watches.follow(
            WatchKey {
                identity: Some("team-a/app".to_owned()),
                ..key("app=x")
            },
            (),
            || team_source.start(),
            Arc::new(WatchHealth::default()),
            "v1 ConfigMap".to_owned(),
        );
        // The same kind, scope and selector, as another identity: a watch of its own.
        assert_eq!(watches.running(), 2);
        assert_eq!(
            team_source
                .started
                .load(std::sync::atomic::Ordering::SeqCst),
            1
        );
        drop((host, team));
    }

    #[tokio::test]
    async fn a_watch_whose_task_ended_is_reported_to_its_follower_and_started_again() {
        let watches = SharedWatches::default();
        let (source, send) = Source::new();
        let (mut first, health) = follow(&watches, &source, "app=x");
        join(&mut first).await;
        // The watch's events end: its task returns, and the follower's stream with it.
        drop(send);
        let ended = tokio::time::timeout(Duration::from_secs(5), first.events.next()).await;
        assert!(matches!(ended, Ok(None)), "the follower's stream ended");
        assert!(
            health
                .problem()
                .is_some_and(|state| format!("{state:?}").contains("shared watch of it ended"))
        );
        // Someone following now gets a new watch, not the ended one.
        let (_again, _) = follow(&watches, &source, "app=x");
        assert_eq!(source.started.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_failing_watch_is_told_to_every_follower_and_its_recovery_too() {
        let watches = SharedWatches::default();
        let (source, send) = Source::new();
        let (mut first, first_health) = follow(&watches, &source, "app=x");
        join(&mut first).await;
        send.send(Err(watcher::Error::NoResourceVersion))
            .unwrap_or_else(|e| panic!("{e}"));
        let problem = || first_health.problem().map(|state| format!("{state:?}"));
        for _ in 0..100 {
            if problem().is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(problem().is_some_and(|p| p.contains("v1 ConfigMap")));
        // One that comes while it fails hears of it too.
        let (mut second, second_health) = follow(&watches, &source, "app=x");
        join(&mut second).await;
        for _ in 0..100 {
            if second_health.problem().is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(second_health.problem().is_some());
        send.send(Ok(Event::Init)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(next(&mut first).await, "Init");
        assert!(first_health.problem().is_none());
        assert!(second_health.problem().is_none());
    }
}
