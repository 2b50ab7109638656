//! An index over one cache, so a reconcile finds what concerns its parent without scanning
//! every cached object. Scanning made each reconcile cost grow with the number of parents:
//! with 10,000 parents and 20,000 children, one reconcile walked all 20,000 children to find
//! its two.
//!
//! The index is fed the same watch events as the kube-runtime store, just before it. A
//! re-list builds a new index that replaces the old one when the list completes, the way
//! the store swaps its contents. The store remains the truth: readers look each indexed key
//! up in the store and check it, so an index a moment ahead of the store costs nothing but a
//! miss.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use kube::Resource;
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;

/// What an object is indexed under: no key, one, or several.
type IndexKeys<K> = Box<dyn Fn(&K) -> Vec<String> + Send + Sync>;

/// Objects of one cache by an index key (a controller's uid, a namespace, a name a field
/// of the object holds).
pub(crate) struct StoreIndex<K: Resource<DynamicType = ApiResource> = DynamicObject> {
    resource: ApiResource,
    keys: IndexKeys<K>,
    inner: Mutex<Inner<K>>,
}

struct Inner<K: Resource<DynamicType = ApiResource>> {
    current: Entries<K>,
    /// The re-list in progress, if any.
    relisting: Option<Entries<K>>,
}

struct Entries<K: Resource<DynamicType = ApiResource>> {
    by_key: HashMap<String, HashSet<ObjectRef<K>>>,
    keys_of: HashMap<ObjectRef<K>, Vec<String>>,
}

impl<K: Resource<DynamicType = ApiResource>> Default for Entries<K> {
    fn default() -> Self {
        Self {
            by_key: HashMap::new(),
            keys_of: HashMap::new(),
        }
    }
}

impl<K: Resource<DynamicType = ApiResource>> Entries<K> {
    fn insert(&mut self, object: ObjectRef<K>, keys: Vec<String>) {
        self.remove(&object);
        if keys.is_empty() {
            return;
        }
        for key in &keys {
            self.by_key
                .entry(key.clone())
                .or_default()
                .insert(object.clone());
        }
        self.keys_of.insert(object, keys);
    }

    fn remove(&mut self, object: &ObjectRef<K>) {
        for old in self.keys_of.remove(object).unwrap_or_default() {
            if let Some(set) = self.by_key.get_mut(&old) {
                set.remove(object);
                if set.is_empty() {
                    self.by_key.remove(&old);
                }
            }
        }
    }
}

impl<K: Resource<DynamicType = ApiResource>> StoreIndex<K> {
    /// An empty index of objects of `resource` under the key or keys `keys` gives each.
    pub fn new<Keys>(
        resource: ApiResource,
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
        }
    }

    /// Take one watch event, as the store will.
    pub fn observe(&self, event: &watcher::Event<K>) {
        let mut inner = crate::lock(&self.inner);
        let reference = |object: &K| ObjectRef::from_obj_with(object, self.resource.clone());
        match event {
            watcher::Event::Apply(object) => {
                let keys = (self.keys)(object);
                inner.current.insert(reference(object), keys);
            }
            watcher::Event::Delete(object) => inner.current.remove(&reference(object)),
            watcher::Event::Init => inner.relisting = Some(Entries::default()),
            watcher::Event::InitApply(object) => {
                let keys = (self.keys)(object);
                inner
                    .relisting
                    .get_or_insert_with(Entries::default)
                    .insert(reference(object), keys);
            }
            watcher::Event::InitDone => {
                if let Some(listed) = inner.relisting.take() {
                    inner.current = listed;
                }
            }
        }
    }

    /// The objects indexed under `key`.
    pub fn get(&self, key: &str) -> Vec<ObjectRef<K>> {
        let inner = crate::lock(&self.inner);
        inner
            .current
            .by_key
            .get(key)
            .map(|set| set.iter().cloned().collect())
            .unwrap_or_default()
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
