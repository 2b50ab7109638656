//! An index over one cache, so a reconcile finds what concerns its parent without scanning
//! every cached object. Scanning made each reconcile cost grow with the number of parents:
//! with 10,000 parents and 20,000 children, one reconcile walked all 20,000 children to find
//! its two.
//!
//! The index is fed the same watch events as the kube-runtime store: just before it for a
//! policy's own watch, just after it for a shared one (`policy_run/shared_watches.rs`). A
//! re-list builds a new index that replaces the old one when the list completes, the way the
//! store swaps its contents. The store remains the truth: readers look each indexed key up in the
//! store and check it, so an index a moment ahead of the store costs nothing but a miss, and
//! one a moment behind misses an object only until its event, which triggers the parents it
//! concerns, reaches the index.
//!
//! Entries hold an object's namespace and name only. An `ObjectRef` also carries its kind's
//! whole `ApiResource`, the object's uid and its resourceVersion: about 450 bytes on the heap
//! that are the same for every entry or not needed, held twice per entry and once per key.
//! At 10,000 parents and 20,000 children that was some 30 MiB; the kind is added back when
//! a reader asks.
//!
//! A key no object is indexed under any more is *vacated*; listeners hear of it after the
//! event that emptied it (the named-object cache drops what no parent names).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use kube::Resource;
use kube::core::DynamicObject;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;

/// What an object is indexed under: no key, one, or several.
type IndexKeys<K> = Box<dyn Fn(&K) -> Vec<String> + Send + Sync>;

/// Told of each key that no object is indexed under any more.
type VacatedListener = Box<dyn Fn(&str) + Send + Sync>;

/// Objects of one cache by an index key (a controller's uid, a namespace, a name a field
/// of the object holds).
pub(crate) struct StoreIndex<K: Resource = DynamicObject> {
    resource: K::DynamicType,
    keys: IndexKeys<K>,
    inner: Mutex<Inner>,
    vacated: Mutex<Vec<VacatedListener>>,
    _kind: std::marker::PhantomData<fn() -> K>,
}

struct Inner {
    current: Entries,
    /// The re-list in progress, if any.
    relisting: Option<Entries>,
}

/// An object of the index's kind: its namespace (if namespaced) and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Entry {
    namespace: Option<Box<str>>,
    name: Box<str>,
}

impl Entry {
    fn of<K: Resource>(object: &K) -> Self {
        let meta = object.meta();
        Self {
            namespace: meta.namespace.as_deref().map(Box::from),
            name: meta.name.as_deref().unwrap_or_default().into(),
        }
    }
}

/// The index: each key's objects, and each object's keys. A key is held once, shared by
/// both maps, and a key with a single object (a parent's uid, for a kind it has one child
/// of) keeps it without a set: at 20,000 children a set per key and a second copy of each
/// uid would take some 4 MiB more.
#[derive(Default)]
struct Entries {
    by_key: HashMap<Arc<str>, Members>,
    keys_of: HashMap<Entry, Box<[Arc<str>]>>,
}

/// The objects indexed under one key.
enum Members {
    One(Entry),
    Many(HashSet<Entry>),
}

impl Members {
    fn insert(&mut self, object: Entry) {
        match self {
            Self::One(only) if *only == object => {}
            Self::One(only) => {
                let only = std::mem::replace(only, object.clone());
                *self = Self::Many(HashSet::from([only, object]));
            }
            Self::Many(set) => {
                set.insert(object);
            }
        }
    }

    /// Take `object` out; whether none is left.
    fn remove(&mut self, object: &Entry) -> bool {
        match self {
            Self::One(only) => only == object,
            Self::Many(set) => {
                set.remove(object);
                set.is_empty()
            }
        }
    }

    fn iter(&self) -> impl Iterator<Item = &Entry> {
        let (one, many) = match self {
            Self::One(only) => (Some(only), None),
            Self::Many(set) => (None, Some(set.iter())),
        };
        one.into_iter().chain(many.into_iter().flatten())
    }
}

impl Entries {
    /// Index `object` under `keys` instead of its old ones; returns the keys vacated.
    fn insert(&mut self, object: Entry, keys: Vec<String>) -> Vec<Arc<str>> {
        let mut vacated = self.remove(&object);
        if keys.is_empty() {
            return vacated;
        }
        let mut keys = keys;
        keys.sort_unstable();
        keys.dedup();
        let keys: Box<[Arc<str>]> = keys
            .into_iter()
            .map(|key| match self.by_key.get_key_value(key.as_str()) {
                Some((held, _)) => held.clone(),
                None => Arc::from(key),
            })
            .collect();
        for key in &keys {
            match self.by_key.get_mut(key) {
                Some(members) => members.insert(object.clone()),
                None => {
                    self.by_key
                        .insert(key.clone(), Members::One(object.clone()));
                }
            }
        }
        vacated.retain(|key| !self.by_key.contains_key(key));
        self.keys_of.insert(object, keys);
        vacated
    }

    /// Forget `object`; returns the keys it was the last one under.
    fn remove(&mut self, object: &Entry) -> Vec<Arc<str>> {
        let mut vacated = Vec::new();
        for old in self.keys_of.remove(object).unwrap_or_default() {
            if let Some(members) = self.by_key.get_mut(&old)
                && members.remove(object)
            {
                self.by_key.remove(&old);
                vacated.push(old);
            }
        }
        vacated
    }
}

impl<K: Resource> StoreIndex<K>
where
    K::DynamicType: Clone,
{
    /// An empty index of objects of `resource` under the key or keys `keys` gives each.
    pub fn new<Keys>(
        resource: K::DynamicType,
        keys: impl Fn(&K) -> Keys + Send + Sync + 'static,
    ) -> Self
    where
        Keys: IntoIterator<Item = String>,
    {
        Self {
            resource,
            keys: Box::new(move |object| keys(object).into_iter().collect()),
            inner: Mutex::new(Inner {
                current: Entries::default(),
                relisting: None,
            }),
            vacated: Mutex::default(),
            _kind: std::marker::PhantomData,
        }
    }

    /// Call `listener` with each key that no object is indexed under any more, once the
    /// event that vacated it is indexed (and outside the index's lock).
    pub fn on_vacated(&self, listener: impl Fn(&str) + Send + Sync + 'static) {
        crate::lock(&self.vacated).push(Box::new(listener));
    }

    /// Take one watch event, as the store will.
    pub fn observe(&self, event: &watcher::Event<K>) {
        let vacated = {
            let mut inner = crate::lock(&self.inner);
            match event {
                watcher::Event::Apply(object) => {
                    let keys = (self.keys)(object);
                    inner.current.insert(Entry::of(object), keys)
                }
                watcher::Event::Delete(object) => inner.current.remove(&Entry::of(object)),
                watcher::Event::Init => {
                    inner.relisting = Some(Entries::default());
                    Vec::new()
                }
                watcher::Event::InitApply(object) => {
                    let keys = (self.keys)(object);
                    // Keys vacated within a re-list are found when it replaces the index.
                    let _ = inner
                        .relisting
                        .get_or_insert_with(Entries::default)
                        .insert(Entry::of(object), keys);
                    Vec::new()
                }
                watcher::Event::InitDone => match inner.relisting.take() {
                    Some(listed) => {
                        let old = std::mem::replace(&mut inner.current, listed);
                        let current = &inner.current.by_key;
                        old.by_key
                            .into_keys()
                            .filter(|key| !current.contains_key(key))
                            .collect()
                    }
                    None => Vec::new(),
                },
            }
        };
        if !vacated.is_empty() {
            let listeners = crate::lock(&self.vacated);
            for key in &vacated {
                for listener in listeners.iter() {
                    listener(key);
                }
            }
        }
    }

    /// The objects indexed under `key`.
    pub fn get(&self, key: &str) -> Vec<ObjectRef<K>> {
        let inner = crate::lock(&self.inner);
        let Some(members) = inner.current.by_key.get(key) else {
            return Vec::new();
        };
        members
            .iter()
            .map(|entry| {
                let reference = ObjectRef::new_with(&entry.name, self.resource.clone());
                match &entry.namespace {
                    Some(namespace) => reference.within(namespace),
                    None => reference,
                }
            })
            .collect()
    }
}

/// The uid of an object's controller: children are indexed under their parent.
pub(crate) fn controller_uid<K: Resource>(object: &K) -> Option<String> {
    object
        .meta()
        .owner_references
        .as_ref()?
        .iter()
        .find(|owner| owner.controller == Some(true))
        .map(|owner| owner.uid.clone())
}

/// An object's namespace (`""` for a cluster-scoped one): related objects are indexed under
/// the namespace whose parents they concern.
pub(crate) fn namespace<K: Resource>(object: &K) -> Option<String> {
    Some(object.meta().namespace.clone().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::*;
    use crate::controller::testing::config_maps;

    fn child(name: &str, owner: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "a", "ownerReferences": [
                {"apiVersion": "example.com/v1", "kind": "MyApp", "name": owner,
                 "uid": owner, "controller": true}]},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn names(index: &StoreIndex, key: &str) -> Vec<String> {
        let mut names: Vec<_> = index.get(key).into_iter().map(|r| r.name).collect();
        names.sort();
        names
    }

    /// Listen to `index` for vacated keys; the returned closure takes those heard so far.
    fn vacated_keys(index: &StoreIndex) -> impl Fn() -> Vec<String> + use<> {
        let vacated = Arc::new(Mutex::new(Vec::<String>::new()));
        let heard = vacated.clone();
        index.on_vacated(move |key| crate::lock(&heard).push(key.to_owned()));
        move || std::mem::take(&mut *crate::lock(&vacated))
    }

    #[test]
    fn children_are_found_under_their_controller_as_events_arrive() {
        let index = StoreIndex::new(config_maps(), controller_uid);
        index.observe(&watcher::Event::Apply(child("x", "p")));
        index.observe(&watcher::Event::Apply(child("y", "p")));
        index.observe(&watcher::Event::Apply(child("z", "q")));
        assert_eq!(names(&index, "p"), ["x", "y"]);
        // Adopted by another controller: moves.
        index.observe(&watcher::Event::Apply(child("y", "q")));
        assert_eq!(names(&index, "p"), ["x"]);
        assert_eq!(names(&index, "q"), ["y", "z"]);
        index.observe(&watcher::Event::Delete(child("x", "p")));
        assert!(names(&index, "p").is_empty());
    }

    #[test]
    fn an_object_with_several_keys_is_found_under_each_and_moves_with_them() {
        // As the parents are indexed under the objects they name.
        let names = |object: &DynamicObject| -> Vec<String> {
            object.data["refs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        };
        let parent = |refs: &[&str]| -> DynamicObject {
            serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "p", "namespace": "a"}, "refs": refs,
            }))
            .unwrap_or_else(|e| panic!("{e}"))
        };
        let index = StoreIndex::new(config_maps(), names);
        index.observe(&watcher::Event::Apply(parent(&["x", "y"])));
        assert_eq!(self::names(&index, "x"), ["p"]);
        assert_eq!(self::names(&index, "y"), ["p"]);
        index.observe(&watcher::Event::Apply(parent(&["y", "z"])));
        assert!(self::names(&index, "x").is_empty());
        assert_eq!(self::names(&index, "y"), ["p"]);
        assert_eq!(self::names(&index, "z"), ["p"]);
        index.observe(&watcher::Event::Apply(parent(&[])));
        assert!(self::names(&index, "y").is_empty() && self::names(&index, "z").is_empty());
    }

    #[test]
    fn a_key_goes_from_one_object_to_several_and_back_and_a_key_named_twice_counts_once() {
        let index = StoreIndex::new(config_maps(), controller_uid);
        let take = vacated_keys(&index);
        index.observe(&watcher::Event::Apply(child("x", "p")));
        index.observe(&watcher::Event::Apply(child("y", "p")));
        index.observe(&watcher::Event::Delete(child("x", "p")));
        assert_eq!(names(&index, "p"), ["y"]);
        index.observe(&watcher::Event::Apply(child("z", "p")));
        assert_eq!(names(&index, "p"), ["y", "z"]);
        index.observe(&watcher::Event::Delete(child("y", "p")));
        index.observe(&watcher::Event::Delete(child("z", "p")));
        assert!(names(&index, "p").is_empty());
        assert_eq!(take(), ["p"], "vacated once, by its last object");

        let twice = StoreIndex::new(config_maps(), |_: &DynamicObject| {
            vec!["k".to_owned(), "k".to_owned()]
        });
        let take = vacated_keys(&twice);
        twice.observe(&watcher::Event::Apply(child("x", "p")));
        assert_eq!(names(&twice, "k"), ["x"]);
        twice.observe(&watcher::Event::Delete(child("x", "p")));
        assert!(names(&twice, "k").is_empty());
        assert_eq!(take(), ["k"]);
    }

    #[test]
    fn listeners_hear_of_each_key_no_object_is_under_any_more() {
        let index = StoreIndex::new(config_maps(), controller_uid);
        let take = vacated_keys(&index);

        index.observe(&watcher::Event::Apply(child("x", "p")));
        index.observe(&watcher::Event::Apply(child("y", "p")));
        index.observe(&watcher::Event::Apply(child("z", "q")));
        assert!(take().is_empty());
        // `x` moves, but `y` still holds `p`; then `y` moves too.
        index.observe(&watcher::Event::Apply(child("x", "q")));
        assert!(take().is_empty());
        index.observe(&watcher::Event::Apply(child("y", "r")));
        assert_eq!(take(), ["p"]);
        // Re-indexed under the same key: nothing is vacated.
        index.observe(&watcher::Event::Apply(child("y", "r")));
        assert!(take().is_empty());
        index.observe(&watcher::Event::Delete(child("y", "r")));
        assert_eq!(take(), ["r"]);
        // A re-list that no longer shows `z`: `q` still has `x`; a key only the old index
        // held is vacated when the list completes, not before.
        index.observe(&watcher::Event::Init);
        index.observe(&watcher::Event::InitApply(child("x", "s")));
        assert!(take().is_empty());
        index.observe(&watcher::Event::InitDone);
        assert_eq!(take(), ["q"]);
    }

    #[test]
    fn a_relist_replaces_the_index_when_it_completes() {
        let index = StoreIndex::new(config_maps(), controller_uid);
        index.observe(&watcher::Event::Apply(child("gone", "p")));
        index.observe(&watcher::Event::Init);
        index.observe(&watcher::Event::InitApply(child("new", "p")));
        // Until the list is complete, readers see what they saw.
        assert_eq!(names(&index, "p"), ["gone"]);
        index.observe(&watcher::Event::InitDone);
        assert_eq!(names(&index, "p"), ["new"]);
    }
}
