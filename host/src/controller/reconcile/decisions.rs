//! What each parent's last plugin decision was made on, so that a reconcile brought by
//! nothing but the host's own writes, or by writes still arriving, asks the plugin nothing
//! and writes nothing.
//!
//! A reconcile that creates two children and writes the status brings its parent back three
//! times: the watch delivers each write. A reconcile woken by the first child's create, before
//! the second is in the cache, would ask the plugin about a world the host knows is about to
//! change (and then try to create the second child again: a refused create and a read). One
//! woken by the status write alone would show the plugin what it decided itself. At 10,000
//! parents those reconciles are a large share of the host's work.
//!
//! The memory, per parent: the versions the decision saw (the parent's and each observed
//! child's), the versions the host's own writes produced (the parent's status and finalizer;
//! each child's create, hand-over and apply, in order), and which plugin and config decided.
//! Beside it, every watch event of the parent or of a child it controls is noted by version,
//! and an event of a related object it may read marks it moved. A reconcile asks the plugin
//! again when any of these holds:
//!
//! - an event noted since the decision began is of a version neither seen nor written by it:
//!   someone else's write counts even when the host's next write overwrote it before the
//!   reconcile ran;
//! - a related object it may read moved, or a watch listed its kind again since;
//! - the caches show the parent, or a child, at a version neither seen nor written, a child
//!   the decision did not want, or a child missing whose create is not pending;
//! - another plugin, or another config, serves it now, or a candidate shadows it;
//! - every child write of the decision is in the cache: the plugin has not yet seen the
//!   children it made, and is asked once more, on the world its decision produced;
//! - the memory is older than [`HOLD_AT_MOST`] or half the requeue the decision asked for, so
//!   a plugin's requeue and the resync always reach the plugin.
//!
//! Otherwise the decision stands: nothing changed since the plugin decided but the host's own
//! status, or some of its child writes are still on their way (their events will bring the
//! parent back). The host's own status write is not news to the plugin, as status-only
//! changes of a parent never trigger a reconcile.
//!
//! Versions are compared for equality only, as the API allows, and kept as 64-bit hashes; a
//! collision between two of one parent's versions could at worst count someone else's write
//! as seen, with odds of about one in 10^18 per comparison.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::lock;
use crate::plugin::Digest;

/// The longest a decision is trusted without asking the plugin, whatever its requeue.
pub(crate) const HOLD_AT_MOST: Duration = Duration::from_secs(30);

/// Most event versions noted per parent between two checks; past it, the parent counts as
/// moved (a parent whose children churn that much is asked anyway).
const SEEN_AT_MOST: usize = 16;

/// The memory of one policy's decisions, shared by its watches (which note events) and its
/// reconciles (which decide and check).
#[derive(Default)]
pub(crate) struct Decisions {
    parents: Mutex<HashMap<u64, Entry>>,
    /// Bumped when a watch lists its kind again: a re-list can drop an object without an
    /// event, so every decision made before it is asked again.
    relists: AtomicU64,
}

#[derive(Default)]
struct Entry {
    decided: Option<Decided>,
    /// The versions of the parent's and its children's events since the last check began.
    seen: Vec<u64>,
    /// A related object changed, or more events came than `seen` holds.
    moved: bool,
}

struct Decided {
    /// The plugin and config that decided.
    plugin: u64,
    /// The parent's version the decision saw, then those the host's writes gave it.
    parent: Box<[u64]>,
    /// The children the decision wanted.
    children: Box<[Expected]>,
    /// `relists` when the decision began.
    relists: u64,
    /// Past this, the plugin is asked again.
    until: Instant,
    /// When the reconcile's requeue (the plugin's or the resync) comes due.
    requeue_at: Instant,
    /// The plugin asked for that requeue.
    requeued: bool,
}

/// A child a decision wanted.
struct Expected {
    /// Its kind, namespace and name.
    key: u64,
    /// Its version when the decision was made; none if it did not exist.
    saw: Option<u64>,
    /// The versions the host's writes gave it, in order: the last is where it ends.
    wrote: Box<[u64]>,
}

impl Decided {
    fn knows(&self, version: u64) -> bool {
        self.parent.contains(&version)
            || self
                .children
                .iter()
                .any(|c| c.saw == Some(version) || c.wrote.contains(&version))
    }
}

/// What a check takes from [`Decisions::begin`]: what was noted about the parent since the
/// previous check began.
pub(crate) struct Since {
    seen: Vec<u64>,
    moved: bool,
}

/// What a reconcile is about to decide on: the inputs that tell whether the last decision
/// still stands.
pub(crate) struct Inputs {
    plugin: u64,
    parent: u64,
    /// Each observed child's key and version.
    children: Vec<(u64, u64)>,
    relists: u64,
}

/// A decision that still stands: when the reconcile it ended comes due again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Standing {
    pub requeue_in: Duration,
    pub requeued: bool,
}

/// A child of a reconcile, by kind index, namespace and name.
pub(crate) type ChildKey<'a> = (usize, Option<&'a str>, &'a str);

/// What a reconcile decided and wrote, to be remembered.
pub(crate) struct Outcome<'a> {
    /// The children the decision wants.
    pub children: Vec<ChildKey<'a>>,
    /// What the host's writes produced.
    pub written: &'a OwnWrites,
    pub requeue: Duration,
    pub requeued: bool,
}

/// The resourceVersions one reconcile's own writes produced, per object and in order: what
/// its watches will bring back, told apart from anyone else's change.
#[derive(Debug, Default)]
pub(crate) struct OwnWrites(Mutex<Written>);

#[derive(Debug, Default)]
struct Written {
    parent: Vec<u64>,
    /// Each child's key and version, in the order written.
    children: Vec<(u64, u64)>,
}

impl OwnWrites {
    /// A write of the parent produced `version`.
    pub fn parent(&self, version: Option<&str>) {
        if let Some(version) = version {
            lock(&self.0).parent.push(fingerprint(&version));
        }
    }

    /// A write of the child `key` produced `version`.
    pub fn child(&self, key: ChildKey<'_>, version: Option<&str>) {
        if let Some(version) = version {
            lock(&self.0)
                .children
                .push((fingerprint(&key), fingerprint(&version)));
        }
    }
}

/// The memory's key of the parent `name` in `namespace`.
pub(crate) fn parent_key(namespace: Option<&str>, name: &str) -> u64 {
    fingerprint(&(namespace, name))
}

/// The fingerprint of the plugin `digest` called with `config`.
pub(crate) fn plugin_fingerprint(digest: &Digest, config: Option<&str>) -> u64 {
    fingerprint(&(digest, config))
}

fn fingerprint(value: &impl Hash) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

fn version(version: Option<&str>) -> u64 {
    fingerprint(&version.unwrap_or_default())
}

impl Inputs {
    /// The inputs of a reconcile of a parent at `parent_version`, which observes `observed`
    /// (each child's key and version) and is served by the plugin `plugin`.
    pub fn new<'a>(
        decisions: &Decisions,
        plugin: u64,
        parent_version: Option<&str>,
        observed: impl IntoIterator<Item = (ChildKey<'a>, Option<&'a str>)>,
    ) -> Self {
        Self {
            plugin,
            parent: version(parent_version),
            children: observed
                .into_iter()
                .map(|(key, v)| (fingerprint(&key), version(v)))
                .collect(),
            relists: decisions.relists.load(Ordering::Acquire),
        }
    }
}

impl Decisions {
    /// A check of `parent` begins: take what was noted since the last one began. Call it
    /// before reading the caches the check and the decision read, so an event whose object
    /// the read missed is noted for the next check.
    pub fn begin(&self, parent: u64) -> Since {
        let mut parents = lock(&self.parents);
        let entry = parents.entry(parent).or_default();
        Since {
            seen: std::mem::take(&mut entry.seen),
            moved: std::mem::take(&mut entry.moved),
        }
    }

    /// Whether the last decision for `parent` still stands for a reconcile on `inputs`, given
    /// what was noted `since`: see the module's rules.
    pub fn standing(&self, parent: u64, since: &Since, inputs: &Inputs) -> Option<Standing> {
        let parents = lock(&self.parents);
        let decided = parents.get(&parent)?.decided.as_ref()?;
        let now = Instant::now();
        let same_world = !since.moved
            && now < decided.until
            && decided.plugin == inputs.plugin
            && decided.relists == inputs.relists
            && decided.parent.contains(&inputs.parent)
            && since.seen.iter().all(|v| decided.knows(*v));
        if !same_world || !children_stand(&decided.children, &inputs.children) {
            return None;
        }
        Some(Standing {
            requeue_in: decided.requeue_at.saturating_duration_since(now),
            requeued: decided.requeued,
        })
    }

    /// `parent` was decided on `inputs` and the reconcile ended with `outcome`.
    pub fn decided(&self, parent: u64, inputs: Inputs, outcome: &Outcome<'_>) {
        let now = Instant::now();
        let written = lock(&outcome.written.0);
        let mut parent_versions = vec![inputs.parent];
        parent_versions.extend(&written.parent);
        let children = outcome
            .children
            .iter()
            .map(|key| {
                let key = fingerprint(key);
                Expected {
                    key,
                    saw: inputs
                        .children
                        .iter()
                        .find_map(|(k, v)| (*k == key).then_some(*v)),
                    wrote: written
                        .children
                        .iter()
                        .filter_map(|(k, v)| (*k == key).then_some(*v))
                        .collect(),
                }
            })
            .collect();
        let decided = Decided {
            plugin: inputs.plugin,
            parent: parent_versions.into_boxed_slice(),
            children,
            relists: inputs.relists,
            until: now + HOLD_AT_MOST.min(outcome.requeue / 2),
            requeue_at: now + outcome.requeue,
            requeued: outcome.requeued,
        };
        drop(written);
        lock(&self.parents).entry(parent).or_default().decided = Some(decided);
    }

    /// The last decision for `parent` no longer stands (its reconcile failed, or did not
    /// carry the decision out in full).
    pub fn forget(&self, parent: u64) {
        if let Some(entry) = lock(&self.parents).get_mut(&parent) {
            entry.decided = None;
        }
    }

    /// `parent` is gone.
    pub fn remove(&self, parent: u64) {
        lock(&self.parents).remove(&parent);
    }

    /// Keep only the parents `keep` names (after the parents' watch listed them again).
    pub fn retain(&self, keep: impl Fn(u64) -> bool) {
        let mut parents = lock(&self.parents);
        parents.retain(|key, _| keep(*key));
        if parents.capacity() > 4 * parents.len().max(64) {
            parents.shrink_to_fit();
        }
    }

    /// A watch event of `parent`, or of a child it controls, brought `object_version`.
    pub fn noted(&self, parent: u64, object_version: Option<&str>) {
        let mut parents = lock(&self.parents);
        // A parent never checked has no decision to hold.
        let Some(entry) = parents.get_mut(&parent) else {
            return;
        };
        if entry.seen.len() < SEEN_AT_MOST {
            entry.seen.push(version(object_version));
        } else {
            entry.moved = true;
        }
    }

    /// An object `parent` may read (a related object) changed.
    pub fn moved(&self, parent: u64) {
        if let Some(entry) = lock(&self.parents).get_mut(&parent) {
            entry.moved = true;
        }
    }

    /// A watch listed its kind again.
    pub fn relisted(&self) {
        self.relists.fetch_add(1, Ordering::AcqRel);
    }
}

/// Whether the observed children (key, version) leave the decision standing: each one wanted
/// and at a version the decision saw or wrote, none missing but one whose create is on its
/// way, and not every child write already in the cache.
fn children_stand(expected: &[Expected], observed: &[(u64, u64)]) -> bool {
    if observed
        .iter()
        .any(|(key, _)| !expected.iter().any(|e| e.key == *key))
    {
        return false;
    }
    let (mut written, mut arrived) = (0, 0);
    for child in expected {
        let now = observed
            .iter()
            .find_map(|(key, v)| (*key == child.key).then_some(*v));
        written += usize::from(!child.wrote.is_empty());
        match (now, child.wrote.last()) {
            // Its create is on its way.
            (None, Some(_)) if child.saw.is_none() => {}
            (None, _) => return false,
            (Some(now), Some(last)) if now == *last => arrived += 1,
            (Some(now), _) if Some(now) == child.saw || child.wrote.contains(&now) => {}
            (Some(_), _) => return false,
        }
    }
    written == 0 || arrived < written
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: u64 = 7;

    fn child(name: &str) -> ChildKey<'_> {
        (0, Some("ns"), name)
    }

    /// A parent at `parent_version` observing the ConfigMaps `children` (name, version).
    fn inputs(decisions: &Decisions, parent_version: &str, children: &[(&str, &str)]) -> Inputs {
        Inputs::new(
            decisions,
            1,
            Some(parent_version),
            children.iter().map(|(name, v)| (child(name), Some(*v))),
        )
    }

    fn decide(
        decisions: &Decisions,
        parent_version: &str,
        observed: &[(&str, &str)],
        wanted: &[&str],
        written: &OwnWrites,
    ) {
        let since = decisions.begin(PARENT);
        let inputs = inputs(decisions, parent_version, observed);
        drop(since);
        decisions.decided(
            PARENT,
            inputs,
            &Outcome {
                children: wanted.iter().map(|name| child(name)).collect(),
                written,
                requeue: Duration::from_secs(300),
                requeued: false,
            },
        );
    }

    /// A decision on a parent at version 10 with no children, which created `a` (11) and `b`
    /// (12) and wrote the status (13).
    fn decided_first_pass(decisions: &Decisions) {
        let written = OwnWrites::default();
        written.child(child("a"), Some("11"));
        written.child(child("b"), Some("12"));
        written.parent(Some("13"));
        decide(decisions, "10", &[], &["a", "b"], &written);
    }

    fn check(decisions: &Decisions, parent_version: &str, children: &[(&str, &str)]) -> bool {
        let since = decisions.begin(PARENT);
        let inputs = inputs(decisions, parent_version, children);
        decisions.standing(PARENT, &since, &inputs).is_some()
    }

    #[test]
    fn a_decision_stands_while_its_own_writes_are_still_arriving() {
        let decisions = Decisions::default();
        decided_first_pass(&decisions);
        decisions.noted(PARENT, Some("11"));
        assert!(
            check(&decisions, "10", &[("a", "11")]),
            "b's create on its way"
        );
        decisions.noted(PARENT, Some("13"));
        assert!(check(&decisions, "13", &[("a", "11")]), "and the status");
        let since = decisions.begin(PARENT);
        let standing = decisions
            .standing(PARENT, &since, &inputs(&decisions, "13", &[]))
            .expect("nothing arrived yet");
        assert!(!standing.requeued);
        assert!(standing.requeue_in <= Duration::from_secs(300));
        assert!(standing.requeue_in > Duration::from_secs(290));
    }

    #[test]
    fn once_every_child_it_wrote_arrived_the_plugin_is_asked_once_more_then_not_again() {
        let decisions = Decisions::default();
        decided_first_pass(&decisions);
        decisions.noted(PARENT, Some("11"));
        decisions.noted(PARENT, Some("12"));
        let converged = [("a", "11"), ("b", "12")];
        assert!(!check(&decisions, "13", &converged));
        // The second decision writes nothing: its world is the one it saw.
        decide(
            &decisions,
            "13",
            &converged,
            &["a", "b"],
            &OwnWrites::default(),
        );
        assert!(check(&decisions, "13", &converged));
    }

    #[test]
    fn someone_else_s_version_in_the_cache_asks_the_plugin() {
        let decisions = Decisions::default();
        decided_first_pass(&decisions);
        assert!(!check(&decisions, "13", &[("a", "11"), ("b", "20")]));
        assert!(!check(&decisions, "20", &[("a", "11")]));
        // The parent never shows a child's version.
        assert!(!check(&decisions, "11", &[("a", "11")]));
    }

    #[test]
    fn someone_else_s_write_the_host_then_overwrote_still_asks_the_plugin() {
        let decisions = Decisions::default();
        decided_first_pass(&decisions);
        decisions.noted(PARENT, Some("14"));
        // By the time the reconcile reads the cache, the parent shows the host's status write.
        decisions.noted(PARENT, Some("13"));
        assert!(!check(&decisions, "13", &[("a", "11")]));
    }

    #[test]
    fn a_child_unwanted_or_gone_asks_the_plugin() {
        let decisions = Decisions::default();
        let written = OwnWrites::default();
        decide(&decisions, "10", &[("a", "5")], &["a"], &written);
        assert!(check(&decisions, "10", &[("a", "5")]));
        assert!(!check(&decisions, "10", &[]), "a deleted by someone");
        assert!(!check(&decisions, "10", &[("a", "5"), ("c", "5")]));
    }

    #[test]
    fn a_related_change_a_relist_a_swap_or_a_flood_asks_the_plugin() {
        let decisions = Decisions::default();
        let arriving = [("a", "11")];
        decided_first_pass(&decisions);
        decisions.moved(PARENT);
        assert!(
            !check(&decisions, "13", &arriving),
            "a related object moved"
        );

        decided_first_pass(&decisions);
        decisions.relisted();
        assert!(!check(&decisions, "13", &arriving), "a watch listed again");

        decided_first_pass(&decisions);
        let since = decisions.begin(PARENT);
        let other_plugin = Inputs {
            plugin: 2,
            ..inputs(&decisions, "13", &arriving)
        };
        assert_eq!(decisions.standing(PARENT, &since, &other_plugin), None);

        decided_first_pass(&decisions);
        for _ in 0..=SEEN_AT_MOST {
            decisions.noted(PARENT, Some("11"));
        }
        assert!(
            !check(&decisions, "13", &arriving),
            "more events than noted"
        );
    }

    #[test]
    fn an_event_noted_after_a_check_began_waits_for_the_next_check() {
        let decisions = Decisions::default();
        decided_first_pass(&decisions);
        let arriving = [("a", "11")];
        let since = decisions.begin(PARENT);
        decisions.noted(PARENT, Some("30"));
        assert!(
            decisions
                .standing(PARENT, &since, &inputs(&decisions, "13", &arriving))
                .is_some()
        );
        assert!(!check(&decisions, "13", &arriving));
    }

    #[test]
    fn an_update_stands_until_it_arrives_through_its_hand_over() {
        let decisions = Decisions::default();
        let written = OwnWrites::default();
        written.child(child("a"), Some("6"));
        written.child(child("a"), Some("7"));
        decide(&decisions, "10", &[("a", "5")], &["a"], &written);
        assert!(check(&decisions, "10", &[("a", "5")]));
        assert!(check(&decisions, "10", &[("a", "6")]), "the hand-over");
        assert!(
            !check(&decisions, "10", &[("a", "7")]),
            "arrived: ask again"
        );
    }

    #[test]
    fn a_forgotten_or_expired_decision_stands_no_more() {
        let decisions = Decisions::default();
        let arriving = [("a", "11")];
        decided_first_pass(&decisions);
        decisions.forget(PARENT);
        assert!(!check(&decisions, "13", &arriving));

        decided_first_pass(&decisions);
        if let Some(decided) = lock(&decisions.parents)
            .get_mut(&PARENT)
            .and_then(|e| e.decided.as_mut())
        {
            decided.until = Instant::now();
        }
        assert!(!check(&decisions, "13", &arriving));

        decided_first_pass(&decisions);
        decisions.remove(PARENT);
        assert!(!check(&decisions, "13", &arriving));
    }

    #[test]
    fn a_short_requeue_holds_the_decision_half_as_long() {
        let decisions = Decisions::default();
        let inputs = inputs(&decisions, "10", &[]);
        decisions.decided(
            PARENT,
            inputs,
            &Outcome {
                children: Vec::new(),
                written: &OwnWrites::default(),
                requeue: Duration::from_secs(2),
                requeued: true,
            },
        );
        let held = lock(&decisions.parents)
            .get(&PARENT)
            .and_then(|e| e.decided.as_ref())
            .map(|d| d.until.saturating_duration_since(Instant::now()));
        assert!(held.is_some_and(|held| held <= Duration::from_secs(1)));
    }

    #[test]
    fn events_of_a_parent_never_checked_are_not_kept() {
        let decisions = Decisions::default();
        decisions.noted(PARENT, Some("1"));
        decisions.moved(PARENT);
        assert!(lock(&decisions.parents).is_empty());
    }
}
