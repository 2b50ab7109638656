//! Updates the cache has not shown yet: of children, and of parents' status.
//!
//! A watch delivers the host's own write a moment after the API server answered it. A
//! reconcile of the same parent in that moment — one of its other children changed, which
//! during a swap or a first rollout is the rule — finds the cache still at the version the
//! write was decided against, sees drift, and sends the same apply again: a write the API
//! server must process for nothing. Each update is remembered with that version and a
//! fingerprint of what it wrote (a child's desired-state hash, a status's fingerprint); while
//! the cache still shows that version and the fingerprint is the same, the write is known to
//! be done.
//! Any other version (the write arriving, or anyone else's change) ends the memory and the
//! cache is trusted again, as it is after `FORGET_AFTER` whatever happens.
//!
//! Entries past `FORGET_AFTER` are dropped in a sweep at most once per `FORGET_AFTER`:
//! otherwise one would stay until its object is checked again, which after a swap means every
//! child the swap updated, until its parent's next reconcile.
//!
//! Creates are not remembered: a child the cache does not show yet costs a refused create
//! and a read (see `writes::create_child`), never a second write, and a child deleted right
//! after its create must be created again at once.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long an update may stay unseen before the cache is trusted anyway. A watch shows a
/// write within milliseconds; this only bounds what a lost event could hold back.
const FORGET_AFTER: Duration = Duration::from_secs(30);

/// An object of one kind, by namespace and name.
type ObjectKey = (Option<String>, String);

/// The updates of one kind (children of one kind, or parents' status) that its cache has not
/// shown yet.
#[derive(Default)]
pub(crate) struct PendingWrites {
    updates: Mutex<Updates>,
}

struct Updates {
    by_object: HashMap<ObjectKey, Pending>,
    /// When entries past `FORGET_AFTER` were last dropped.
    swept: Instant,
}

impl Default for Updates {
    fn default() -> Self {
        Self {
            by_object: HashMap::new(),
            swept: Instant::now(),
        }
    }
}

impl Updates {
    /// Drop every entry past `FORGET_AFTER` (each would be ignored anyway), if the last sweep
    /// was that long ago, and give back the table's room once most of it is empty.
    fn sweep_if_due(&mut self) {
        if self.swept.elapsed() < FORGET_AFTER {
            return;
        }
        self.swept = Instant::now();
        self.by_object
            .retain(|_, pending| pending.written.elapsed() <= FORGET_AFTER);
        if self.by_object.capacity() > 4 * self.by_object.len().max(64) {
            self.by_object.shrink_to_fit();
        }
    }
}

struct Pending {
    /// The fingerprint of what the update wrote.
    hash: String,
    /// The object's resourceVersion the update was decided against, and any the host wrote on
    /// the way (the hand-over of a created child's fields).
    decided_at: Vec<String>,
    written: Instant,
}

impl PendingWrites {
    /// Whether an update of the object to `hash` was already written while the cache still
    /// shows `cached_version`, the version that update was decided against.
    pub fn written(&self, key: &ObjectKey, hash: &str, cached_version: &str) -> bool {
        let mut updates = crate::lock(&self.updates);
        updates.sweep_if_due();
        let Some(pending) = updates.by_object.get(key) else {
            return false;
        };
        if !pending.decided_at.iter().any(|v| v == cached_version)
            || pending.written.elapsed() > FORGET_AFTER
        {
            updates.by_object.remove(key);
            return false;
        }
        pending.hash == hash
    }

    /// Whether the host updated the object while the cache still shows `cached_version`: what
    /// the cache shows of it is older than the host's own write.
    pub fn unseen(&self, key: &ObjectKey, cached_version: &str) -> bool {
        let updates = crate::lock(&self.updates);
        updates.by_object.get(key).is_some_and(|pending| {
            pending.written.elapsed() <= FORGET_AFTER
                && pending.decided_at.iter().any(|v| v == cached_version)
        })
    }

    /// The object was updated to `hash`, decided against the first of `versions` (the others
    /// written by the host on the way).
    pub fn updated(&self, key: ObjectKey, hash: &str, versions: Vec<String>) {
        let mut updates = crate::lock(&self.updates);
        updates.sweep_if_due();
        updates.by_object.insert(
            key,
            Pending {
                hash: hash.to_owned(),
                decided_at: versions,
                written: Instant::now(),
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_update_is_unseen_until_the_cache_shows_another_version() {
        let pending = PendingWrites::default();
        assert!(!pending.unseen(&key("a"), "1"));
        pending.updated(key("a"), "h", vec!["1".into()]);
        assert!(pending.unseen(&key("a"), "1"));
        assert!(!pending.unseen(&key("a"), "2"), "the write arrived");
        assert!(!pending.unseen(&key("b"), "1"));
    }

    fn key(name: &str) -> ObjectKey {
        (Some("ns".into()), name.into())
    }

    #[test]
    fn an_update_counts_as_written_until_the_cache_moves_past_its_version() {
        let pending = PendingWrites::default();
        assert!(
            !pending.written(&key("web"), "h2", "10"),
            "nothing written yet"
        );
        pending.updated(key("web"), "h2", vec!["10".into(), "10a".into()]);
        assert!(
            pending.written(&key("web"), "h2", "10"),
            "cache still at 10"
        );
        assert!(
            pending.written(&key("web"), "h2", "10a"),
            "the cache shows the hand-over the host wrote before the update"
        );
        assert!(
            !pending.written(&key("web"), "h3", "10"),
            "another desired state needs its own write"
        );
        assert!(!pending.written(&key("other"), "h2", "10"), "another child");
        assert!(
            !pending.written(&key("web"), "h2", "11"),
            "the cache moved on: trust it"
        );
        assert!(
            !pending.written(&key("web"), "h2", "10"),
            "forgotten once the cache moved, even if asked about the old version again"
        );
    }

    #[test]
    fn an_unseen_update_is_forgotten_after_a_while() {
        let pending = PendingWrites::default();
        pending.updated(key("web"), "h2", vec!["10".into()]);
        let long_ago = Instant::now().checked_sub(FORGET_AFTER + Duration::from_secs(1));
        if let (Some(entry), Some(long_ago)) = (
            crate::lock(&pending.updates).by_object.get_mut(&key("web")),
            long_ago,
        ) {
            entry.written = long_ago;
        }
        assert!(!pending.written(&key("web"), "h2", "10"));
    }

    #[test]
    fn entries_past_their_time_are_swept_without_being_asked_about() {
        let pending = PendingWrites::default();
        pending.updated(key("old"), "h", vec!["1".into()]);
        pending.updated(key("recent"), "h", vec!["1".into()]);
        let long_ago = Instant::now()
            .checked_sub(FORGET_AFTER + Duration::from_secs(1))
            .expect("the clock is past 31 s");
        let entries = |pending: &PendingWrites| {
            let mut keys: Vec<String> = crate::lock(&pending.updates)
                .by_object
                .keys()
                .map(|(_, name)| name.clone())
                .collect();
            keys.sort();
            keys
        };
        if let Some(entry) = crate::lock(&pending.updates).by_object.get_mut(&key("old")) {
            entry.written = long_ago;
        }
        // A sweep was just done (at creation): the old entry waits for the next one.
        pending.updated(key("new"), "h", vec!["1".into()]);
        assert_eq!(entries(&pending), ["new", "old", "recent"]);

        crate::lock(&pending.updates).swept = long_ago;
        assert!(!pending.written(&key("other"), "h", "1"));
        assert_eq!(
            entries(&pending),
            ["new", "recent"],
            "the sweep drops what the cache is trusted over anyway"
        );
    }
}
