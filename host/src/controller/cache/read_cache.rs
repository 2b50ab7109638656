//! The related objects a policy has read by name, kept so a reconcile does not read an
//! unchanged object again, and bounded by bytes: a parent may name large objects, and many
//! parents may name different ones, so what is kept must not grow with what was ever read.
//!
//! The least recently used object goes first when a new one does not fit. An entry carries
//! the resourceVersion it was read at; a caller asks for a version and gets the entry only
//! while the two agree, so an object that moved is read again rather than served stale.
//! Objects are kept as the JSON text a request carries: it is what a reconcile copies into
//! the request, and its length is what the bound counts.
//!
//! Besides its own bound, every cache of the host draws on one [`ReadBudget`], so the total
//! does not grow with the number of policies and related kinds: a cache that finds the
//! budget spent makes room from its own least recently used objects, and keeps nothing new
//! when it has none (the object is still served, just read again next time). Caches do not
//! evict each other's objects: what one holds is its own until it is unchanged no longer,
//! unnamed, or pushed out by its own newer reads.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The bytes all the host's read caches may keep together.
#[derive(Debug)]
pub(crate) struct ReadBudget {
    limit: usize,
    used: AtomicUsize,
}

impl ReadBudget {
    /// A budget of `limit` bytes, none of it used.
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            used: AtomicUsize::new(0),
        }
    }

    /// The bytes kept now, over all caches.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Take `bytes` if they fit.
    fn try_take(&self, bytes: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|total| *total <= self.limit)
            })
            .is_ok()
    }

    fn give_back(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}

use crate::plugin::ObservedObject;

/// One object as read: its resourceVersion and the object as a request shows it.
#[derive(Debug)]
pub(crate) struct ReadObject {
    pub resource_version: Option<String>,
    pub object: ObservedObject,
}

impl ReadObject {
    /// What the object costs to keep: its text, identity and version.
    pub fn bytes(&self) -> usize {
        let object = &self.object;
        object.json.len()
            + object.name.len()
            + object.kind.len()
            + object.api_version.len()
            + self.resource_version.as_ref().map_or(0, String::len)
    }
}

/// Objects read, by key, at most `limit` bytes of them, and only while the host's budget
/// has room.
pub(crate) struct ReadCache<K> {
    limit: usize,
    budget: Arc<ReadBudget>,
    bytes: usize,
    /// Counts uses; an entry's last use orders it for eviction.
    clock: u64,
    entries: HashMap<K, Entry>,
    /// The keys by their last use, oldest first.
    by_use: BTreeMap<u64, K>,
}

struct Entry {
    object: Arc<ReadObject>,
    used: u64,
}

impl<K: Clone + Eq + Hash> ReadCache<K> {
    /// An empty cache that keeps at most `limit` bytes, drawn from `budget`.
    pub fn new(limit: usize, budget: Arc<ReadBudget>) -> Self {
        Self {
            limit,
            budget,
            bytes: 0,
            clock: 0,
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
        }
    }

    /// The bytes kept now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// How many objects are kept.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The object under `key` if it was read at `version`, now the most recently used.
    pub fn get(&mut self, key: &K, version: Option<&str>) -> Option<Arc<ReadObject>> {
        let entry = self.entries.get_mut(key)?;
        if entry.object.resource_version.as_deref() != version {
            return None;
        }
        self.clock += 1;
        self.by_use.remove(&entry.used);
        entry.used = self.clock;
        self.by_use.insert(self.clock, key.clone());
        Some(entry.object.clone())
    }

    /// Keep `object` under `key` (replacing what was there), dropping the least recently
    /// used objects until it fits this cache and the host's budget. An object larger than
    /// the whole cache is not kept, nor one the budget has no room for once this cache is
    /// empty.
    pub fn insert(&mut self, key: K, object: Arc<ReadObject>) {
        self.remove(&key);
        let bytes = object.bytes();
        // What this cache could make room for by giving up all it holds: when even that is
        // short (the others hold the budget), it keeps nothing new rather than everything old.
        let others = self.budget.used().saturating_sub(self.bytes);
        if bytes > self.limit || bytes > self.budget.limit.saturating_sub(others) {
            return;
        }
        while self.bytes + bytes > self.limit || !self.budget.try_take(bytes) {
            let Some(oldest) = self.by_use.values().next().cloned() else {
                return;
            };
            self.remove(&oldest);
        }
        self.clock += 1;
        self.by_use.insert(self.clock, key.clone());
        self.bytes += bytes;
        self.entries.insert(
            key,
            Entry {
                object,
                used: self.clock,
            },
        );
    }

    /// Drop the object under `key`, if kept.
    pub fn remove(&mut self, key: &K) {
        if let Some(entry) = self.entries.remove(key) {
            self.by_use.remove(&entry.used);
            let freed = entry.object.bytes();
            self.bytes -= freed;
            self.budget.give_back(freed);
        }
    }

    /// Keep only the objects for which `keep(key, version)` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(&K, Option<&str>) -> bool) {
        let dropped: Vec<K> = self
            .entries
            .iter()
            .filter(|(key, entry)| !keep(key, entry.object.resource_version.as_deref()))
            .map(|(key, _)| key.clone())
            .collect();
        for key in &dropped {
            self.remove(key);
        }
    }
}

impl<K> Drop for ReadCache<K> {
    /// A stopped policy's objects leave the host's budget with it.
    fn drop(&mut self) {
        self.budget.give_back(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An object whose JSON text is `size` bytes, read at `version`.
    fn read(name: &str, version: &str, size: usize) -> Arc<ReadObject> {
        Arc::new(ReadObject {
            resource_version: Some(version.to_owned()),
            object: ObservedObject {
                api_version: String::new(),
                kind: String::new(),
                name: name.to_owned(),
                json: "x".repeat(size - name.len() - version.len()),
            },
        })
    }

    /// A host budget no test here reaches.
    fn unbounded() -> Arc<ReadBudget> {
        Arc::new(ReadBudget::new(usize::MAX))
    }

    fn kept(cache: &ReadCache<&'static str>) -> Vec<&'static str> {
        let mut keys: Vec<_> = cache.entries.keys().copied().collect();
        keys.sort();
        keys
    }

    #[test]
    fn an_object_is_served_only_at_the_version_it_was_read() {
        let mut cache = ReadCache::new(1000, unbounded());
        cache.insert("a", read("a", "1", 100));
        assert!(cache.get(&"a", Some("1")).is_some());
        assert!(
            cache.get(&"a", Some("2")).is_none(),
            "moved since: read again"
        );
        assert!(cache.get(&"b", Some("1")).is_none());
        assert_eq!(cache.bytes(), 100);
    }

    #[test]
    fn the_least_recently_used_objects_go_first_until_a_new_one_fits() {
        let mut cache = ReadCache::new(1000, unbounded());
        cache.insert("a", read("a", "1", 400));
        cache.insert("b", read("b", "1", 300));
        cache.insert("c", read("c", "1", 200));
        // `a` is used again: `b` is now the oldest.
        assert!(cache.get(&"a", Some("1")).is_some());
        cache.insert("d", read("d", "1", 250));
        assert_eq!(kept(&cache), ["a", "c", "d"]);
        assert_eq!(cache.bytes(), 850);
        // Room for 600 takes the two oldest, `c` then `a`: bytes, not counts, decide.
        cache.insert("e", read("e", "1", 600));
        assert_eq!(kept(&cache), ["d", "e"]);
        assert_eq!(cache.bytes(), 850);
        assert!(cache.bytes() <= 1000);
    }

    #[test]
    fn a_new_version_replaces_the_old_and_is_counted_once() {
        let mut cache = ReadCache::new(1000, unbounded());
        cache.insert("a", read("a", "1", 400));
        cache.insert("a", read("a", "2", 500));
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.bytes(), 500);
        assert!(cache.get(&"a", Some("2")).is_some());
    }

    #[test]
    fn an_object_larger_than_the_cache_is_not_kept_and_evicts_nothing() {
        let mut cache = ReadCache::new(1000, unbounded());
        cache.insert("a", read("a", "1", 400));
        cache.insert("huge", read("huge", "1", 1001));
        assert_eq!(kept(&cache), ["a"]);
        assert_eq!(cache.bytes(), 400);
    }

    #[test]
    fn retain_drops_what_its_test_refuses_and_frees_its_bytes() {
        let mut cache = ReadCache::new(1000, unbounded());
        cache.insert("a", read("a", "1", 100));
        cache.insert("b", read("b", "1", 100));
        cache.insert("c", read("c", "2", 100));
        cache.retain(|key, version| *key != "b" && version == Some("1"));
        assert_eq!(kept(&cache), ["a"]);
        assert_eq!(cache.bytes(), 100);
        // The evicted are gone from the use order too: a full cache evicts only `a`.
        cache.insert("d", read("d", "1", 950));
        assert_eq!(kept(&cache), ["d"]);
    }

    #[test]
    fn caches_sharing_a_budget_never_keep_more_than_it_together() {
        let budget = Arc::new(ReadBudget::new(1000));
        let mut first = ReadCache::new(800, budget.clone());
        let mut second = ReadCache::new(800, budget.clone());
        first.insert("a", read("a", "1", 400));
        first.insert("b", read("b", "1", 300));
        // The budget has 300 left: the second cache, empty, cannot make room from its own.
        second.insert("x", read("x", "1", 400));
        assert!(kept(&second).is_empty());
        assert_eq!(budget.used(), 700);
        second.insert("y", read("y", "1", 300));
        assert_eq!(kept(&second), ["y"]);
        assert_eq!(budget.used(), 1000);
        // The first makes room from its own oldest to take a new one.
        first.insert("c", read("c", "1", 350));
        assert_eq!(kept(&first), ["b", "c"]);
        assert_eq!(budget.used(), 950);
        assert_eq!(budget.used(), first.bytes() + second.bytes());
        // Room the first cannot make by giving up its own: it keeps what it has.
        first.insert("d", read("d", "1", 800));
        assert_eq!(kept(&first), ["b", "c"]);
        // What a dropped cache kept goes back to the budget.
        drop(first);
        assert_eq!(budget.used(), 300);
        second.remove(&"y");
        assert_eq!(budget.used(), 0);
    }
}
