//! What each parent's last plugin decision was made on, so that a reconcile brought by
//! nothing but the host's own writes, or by writes still arriving, asks the plugin nothing
//! and writes nothing.
//!
//! A reconcile that creates two children and writes the status brings its parent back: the
//! watch delivers each write. A reconcile woken by the first child's create, before the
//! second is in the cache, would ask the plugin about a world the host knows is about to
//! change (and then try to create the second child again: a refused create and a read). One
//! woken by the host's own writes alone would show the plugin what it decided itself. Under
//! load, when the watches lag the writes, those reconciles are a large share of the work.
//!
//! The memory, per parent: the versions the decision saw (the parent's and each observed
//! child's), the versions the host's own writes produced (the parent's status and finalizer;
//! each child's create, hand-over and apply, in order), and which plugin and config decided.
//! Beside it, the watches note the version of every event of the parent, and of every child
//! whose controller it is, since the last check began; an event of a related object it may
//! read marks it moved. A reconcile asks the plugin again when any of these holds:
//!
//! - an event noted since the last check began is of a version that object neither had when
//!   the decision was made nor got from the host's writes: someone else's write counts even
//!   when the host's next write overwrote it before the reconcile ran;
//! - the parent the reconcile was handed is not the parent's latest event, nor is that
//!   event one of this reconcile's own writes (the decision, or the check, could be made on
//!   an old copy);
//! - a related object it may read moved, or a watch listed its kind again;
//! - the caches show the parent, or a child, at a version neither seen nor written, a child
//!   the decision did not want, a child missing that existed, or a child whose create is
//!   pending that exists without this parent as its controller;
//! - another plugin, or another config, serves it now, or a candidate shadows it;
//! - every child write of the decision is in the cache: the plugin has not yet seen the
//!   children it made, and is asked once more, on the world its decision produced;
//! - the memory is older than [`HOLD_AT_MOST`] or half the requeue the decision asked for, so
//!   a plugin's requeue always reaches the plugin, and so does a resync (one timer per
//!   policy, `policy_run::resync`) that comes later than that after the decision.
//!
//! Otherwise the decision stands: nothing changed since the plugin decided but the host's own
//! status, or some of its child writes are still on their way (their events will bring the
//! parent back). The host's own status write is not news to the plugin, as status-only
//! changes of a parent never trigger a reconcile.
//!
//! One more case asks the plugin nothing *yet*: someone else changed something while children
//! the decision created are still on their way (no event of theirs has come, and the caches
//! hold no object of that name). The plugin would be asked about a world the host knows is
//! about to change, and would want the missing child again (a refused create and a read); the
//! create's own event brings the parent back within moments, and that check asks the plugin,
//! as the change is marked on the parent until a decision is made. This is the expectations
//! rule of Kubernetes' ReplicaSet controller, bounded the same way: the wait ends after
//! [`AWAIT_CREATES_AT_MOST`], so a create whose object was deleted before the host saw it
//! holds nothing for longer.
//!
//! Versions are compared per object and for equality only, as the API allows, and kept as
//! 64-bit hashes: two of one object's versions colliding (odds about 5 in 10^20 per
//! comparison) could count someone else's write as seen.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::lock;
use crate::plugin::Digest;

/// The longest a decision is trusted without asking the plugin, whatever its requeue.
pub(crate) const HOLD_AT_MOST: Duration = Duration::from_secs(30);

/// The longest someone else's change waits for the children a decision created to arrive
/// before the plugin is asked anyway.
pub(crate) const AWAIT_CREATES_AT_MOST: Duration = Duration::from_secs(10);

/// Most event versions noted per parent between two checks; past it, the parent counts as
/// moved (a parent whose children churn that much is asked anyway).
const SEEN_AT_MOST: usize = 16;

/// The parent's own place among the objects whose events are noted (children are keyed by
/// the hash of their kind, namespace and name).
const THE_PARENT: u64 = 0;

/// The memory of one policy's decisions, shared by its watches (which note events) and its
/// reconciles (which decide and check).
pub(crate) struct Decisions {
    parents: Mutex<Parents>,
    /// Bumped when a watch has listed its kind again (after its cache took the list): a
    /// re-list can drop an object without an event, so every decision made on the caches
    /// before it is asked again.
    relists: AtomicU64,
}

impl Default for Decisions {
    fn default() -> Self {
        Self {
            parents: Mutex::new(Parents {
                by_key: HashMap::new(),
                swept: Instant::now(),
            }),
            relists: AtomicU64::new(0),
        }
    }
}

/// A new entry's mark, so a decision is kept only in the entry its check began in (not in
/// one a sweep or a deletion replaced meanwhile, which missed what the old one noted).
static BORN: AtomicU64 = AtomicU64::new(0);

struct Parents {
    by_key: HashMap<u64, Entry>,
    /// When entries idle past [`HOLD_AT_MOST`] were last dropped.
    swept: Instant,
}

impl Parents {
    /// Drop, at most once per [`HOLD_AT_MOST`], the entries nothing touched for that long
    /// whose decision (if any) no longer stands: a parent deleted while a reconcile of it
    /// ran, say, whose entry that reconcile brought back.
    fn sweep_if_due(&mut self, now: Instant) {
        if now.duration_since(self.swept) < HOLD_AT_MOST {
            return;
        }
        self.swept = now;
        self.by_key.retain(|_, entry| {
            now.duration_since(entry.touched) < HOLD_AT_MOST
                || entry.decided.as_ref().is_some_and(|d| now < d.until)
        });
        if self.by_key.capacity() > 4 * self.by_key.len().max(64) {
            self.by_key.shrink_to_fit();
        }
    }
}

struct Entry {
    decided: Option<Decided>,
    /// The events (object, version) of the parent and its children since the last check
    /// began.
    seen: Vec<(u64, u64)>,
    /// A related object changed, or more events came than `seen` holds.
    moved: bool,
    /// The version of the parent's latest event.
    latest_parent: Option<u64>,
    /// When the entry was last noted, marked moved, checked or decided.
    touched: Instant,
    /// Which entry this is, as [`BORN`] numbered it.
    born: u64,
    /// Plugin calls since the parent last settled: what [`Decisions::ended`] reports once
    /// it settles again after a reconcile that did not.
    converging: u32,
    /// A reconcile since the last settled one did not settle.
    unsettled: bool,
}

impl Entry {
    fn new(now: Instant) -> Self {
        Self {
            decided: None,
            seen: Vec::new(),
            moved: false,
            latest_parent: None,
            touched: now,
            born: BORN.fetch_add(1, Ordering::Relaxed),
            converging: 0,
            unsettled: false,
        }
    }

    fn note(&mut self, object: u64, version: u64) {
        if self.seen.len() < SEEN_AT_MOST {
            self.seen.push((object, version));
        } else {
            self.moved = true;
        }
    }
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
    /// When the plugin's requeue comes due (without one, a resync period after the decision).
    requeue_at: Instant,
    /// The plugin asked for that requeue.
    requeued: bool,
    /// Until when someone else's change waits for the children this decision created.
    creates_due: Instant,
}

/// A child a decision wanted.
struct Expected {
    /// Its kind, namespace and name, hashed.
    key: u64,
    /// The same, for a child the decision created: to tell a create still on its way from a
    /// child that arrived under another controller, or none.
    created: Option<(usize, Option<Box<str>>, Box<str>)>,
    /// Its version when the decision was made; none if it did not exist.
    saw: Option<u64>,
    /// The versions the host's writes gave it, in order: the last is where it ends.
    wrote: Box<[u64]>,
    /// An event of it came after the decision: a child it created has arrived (or come and
    /// gone), so it is on its way no more.
    heard: bool,
}

impl Expected {
    /// A child this decision created whose create has not come back through the watch: no
    /// event of it yet, and no object of its name in the caches (`exists`).
    fn on_its_way(
        &self,
        observed: &[(u64, u64)],
        exists: impl Fn(usize, Option<&str>, &str) -> bool,
    ) -> bool {
        let Some((index, namespace, name)) = &self.created else {
            return false;
        };
        !self.wrote.is_empty()
            && !self.heard
            && !observed.iter().any(|(key, _)| *key == self.key)
            && !exists(*index, namespace.as_deref(), name)
    }
}

impl Decided {
    /// Note which of the children this decision created have had an event since.
    fn hear(&mut self, seen: &[(u64, u64)]) {
        for child in self.children.iter_mut().filter(|c| c.created.is_some()) {
            child.heard |= seen.iter().any(|(object, _)| *object == child.key);
        }
    }

    /// Whether `object` had `version` when the decision was made, or got it from the host.
    fn knows(&self, object: u64, version: u64) -> bool {
        if object == THE_PARENT {
            return self.parent.contains(&version);
        }
        self.children
            .iter()
            .find(|c| c.key == object)
            .is_some_and(|c| c.saw == Some(version) || c.wrote.contains(&version))
    }
}

/// What a check takes from [`Decisions::begin`]: what was noted about the parent since the
/// previous check began, and what the watches had brought when this one began.
pub(crate) struct Since {
    seen: Vec<(u64, u64)>,
    moved: bool,
    latest_parent: Option<u64>,
    relists: u64,
    born: u64,
}

/// What a reconcile is about to decide on: the inputs that tell whether the last decision
/// still stands.
pub(crate) struct Inputs {
    plugin: u64,
    parent: u64,
    /// The parent handed to the reconcile is older than its latest event.
    stale: bool,
    /// Each observed child's key and version.
    children: Vec<(u64, u64)>,
    relists: u64,
    born: u64,
}

/// A decision that still stands: when the reconcile it ended comes due again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Standing {
    pub requeue_in: Duration,
    pub requeued: bool,
    /// Someone else changed something, and the plugin will be asked once the children the
    /// decision created have arrived (or the wait for them ends).
    pub awaiting_creates: bool,
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
                .push((child_key(key), fingerprint(&version)));
        }
    }
}

/// The memory's key of the parent `name` in `namespace`.
pub(crate) fn parent_key(namespace: Option<&str>, name: &str) -> u64 {
    fingerprint(&(namespace, name))
}

/// How a child's events are noted: its kind index, namespace and name, hashed.
pub(crate) fn child_key(key: ChildKey<'_>) -> u64 {
    fingerprint(&key)
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
    /// The inputs of a reconcile that began `since` and wrote `own` so far, of a parent
    /// handed to it at `parent_version`, which observes `observed` (each child's key and
    /// version) and is served by the plugin `plugin`.
    pub fn new<'a>(
        since: &Since,
        own: &OwnWrites,
        plugin: u64,
        parent_version: Option<&str>,
        observed: impl IntoIterator<Item = (ChildKey<'a>, Option<&'a str>)>,
    ) -> Self {
        let parent = version(parent_version);
        // The latest event may be the reconcile's own finalizer write, made on the copy it
        // holds (the patch tests that copy's version): not a newer world.
        let stale = since
            .latest_parent
            .is_some_and(|latest| latest != parent && !lock(&own.0).parent.contains(&latest));
        Self {
            plugin,
            parent,
            stale,
            children: observed
                .into_iter()
                .map(|(key, v)| (child_key(key), version(v)))
                .collect(),
            relists: since.relists,
            born: since.born,
        }
    }
}

impl Decisions {
    /// A check of `parent` begins: take what was noted since the last one began. Call it
    /// before reading the caches the check and the decision read, so an event whose object
    /// the read missed is noted for the next check.
    pub fn begin(&self, parent: u64) -> Since {
        let now = Instant::now();
        let mut parents = lock(&self.parents);
        parents.sweep_if_due(now);
        let entry = parents
            .by_key
            .entry(parent)
            .or_insert_with(|| Entry::new(now));
        entry.touched = now;
        Since {
            seen: std::mem::take(&mut entry.seen),
            moved: std::mem::take(&mut entry.moved),
            latest_parent: entry.latest_parent,
            relists: self.relists.load(Ordering::Acquire),
            born: entry.born,
        }
    }

    /// Whether the last decision for `parent` still stands for a reconcile on `inputs`, given
    /// what was noted `since`: see the module's rules. `exists` tells whether the caches hold
    /// a child of that kind, namespace and name, whatever its controller.
    pub fn standing(
        &self,
        parent: u64,
        since: &Since,
        inputs: &Inputs,
        exists: impl Fn(usize, Option<&str>, &str) -> bool,
    ) -> Option<Standing> {
        let mut parents = lock(&self.parents);
        let entry = parents.by_key.get_mut(&parent)?;
        let decided = entry.decided.as_mut()?;
        decided.hear(&since.seen);
        let now = Instant::now();
        let same_world = !since.moved
            && !inputs.stale
            && now < decided.until
            && decided.plugin == inputs.plugin
            && decided.relists == inputs.relists
            && decided.parent.contains(&inputs.parent)
            && since.seen.iter().all(|(o, v)| decided.knows(*o, *v));
        if same_world && children_stand(&decided.children, &inputs.children, &exists) {
            return Some(Standing {
                requeue_in: decided.requeue_at.saturating_duration_since(now),
                requeued: decided.requeued,
                awaiting_creates: false,
            });
        }
        let awaiting = now < decided.creates_due.min(decided.until)
            && decided.plugin == inputs.plugin
            && decided
                .children
                .iter()
                .any(|c| c.on_its_way(&inputs.children, &exists));
        if !awaiting {
            return None;
        }
        // What changed stays marked: the check the creates bring back asks the plugin.
        entry.moved = true;
        Some(Standing {
            requeue_in: decided
                .requeue_at
                .min(decided.creates_due)
                .saturating_duration_since(now),
            requeued: decided.requeued,
            awaiting_creates: true,
        })
    }

    /// The serving plugin is being asked about `parent`.
    pub fn calling(&self, parent: u64) {
        if let Some(entry) = lock(&self.parents).by_key.get_mut(&parent) {
            entry.converging = entry.converging.saturating_add(1);
        }
    }

    /// A reconcile of `parent` that asked the plugin ended, `settled` (it wrote, deleted and
    /// held back no child, and did not fail) or not. When it settles after one that did not,
    /// returns the plugin calls since the parent last settled: what a change (its creation,
    /// a spec edit, someone else's edit of a child) took to converge.
    pub fn ended(&self, parent: u64, settled: bool) -> Option<u32> {
        let mut parents = lock(&self.parents);
        let entry = parents.by_key.get_mut(&parent)?;
        if !settled {
            // A reconcile that failed before asking the plugin has no call to count.
            entry.unsettled |= entry.converging > 0;
            return None;
        }
        let calls = std::mem::take(&mut entry.converging);
        std::mem::take(&mut entry.unsettled).then_some(calls)
    }

    /// `parent` was decided on `inputs` and the reconcile ended with `outcome`. Not kept when
    /// made on an old copy of the parent, or when the entry its check began in was swept
    /// or removed meanwhile.
    pub fn decided(&self, parent: u64, inputs: Inputs, outcome: &Outcome<'_>) {
        let now = Instant::now();
        let mut parents = lock(&self.parents);
        // Gone meanwhile (deleted): nothing to keep.
        let Some(entry) = parents.by_key.get_mut(&parent) else {
            return;
        };
        entry.touched = now;
        if inputs.stale || entry.born != inputs.born {
            entry.decided = None;
            return;
        }
        let written = lock(&outcome.written.0);
        let mut parent_versions = vec![inputs.parent];
        parent_versions.extend(&written.parent);
        let children = outcome
            .children
            .iter()
            .map(|&(index, namespace, name)| {
                let key = child_key((index, namespace, name));
                let saw = inputs
                    .children
                    .iter()
                    .find_map(|(k, v)| (*k == key).then_some(*v));
                Expected {
                    key,
                    created: saw
                        .is_none()
                        .then(|| (index, namespace.map(Box::from), Box::from(name))),
                    saw,
                    wrote: written
                        .children
                        .iter()
                        .filter_map(|(k, v)| (*k == key).then_some(*v))
                        .collect(),
                    heard: false,
                }
            })
            .collect();
        entry.decided = Some(Decided {
            plugin: inputs.plugin,
            parent: parent_versions.into_boxed_slice(),
            children,
            relists: inputs.relists,
            until: now + HOLD_AT_MOST.min(outcome.requeue / 2),
            requeue_at: now + outcome.requeue,
            requeued: outcome.requeued,
            creates_due: now + AWAIT_CREATES_AT_MOST.min(outcome.requeue / 2),
        });
    }

    /// The last decision for `parent` no longer stands (its reconcile failed, or did not
    /// carry the decision out in full).
    pub fn forget(&self, parent: u64) {
        if let Some(entry) = lock(&self.parents).by_key.get_mut(&parent) {
            entry.decided = None;
        }
    }

    /// `parent` is gone.
    pub fn remove(&self, parent: u64) {
        lock(&self.parents).by_key.remove(&parent);
    }

    /// Keep only the parents `keep` names (after the parents' watch listed them again).
    pub fn retain(&self, keep: impl Fn(u64) -> bool) {
        let mut parents = lock(&self.parents);
        parents.by_key.retain(|key, _| keep(*key));
        if parents.by_key.capacity() > 4 * parents.by_key.len().max(64) {
            parents.by_key.shrink_to_fit();
        }
    }

    /// A watch event of `parent` brought `object_version`.
    pub fn noted_parent(&self, parent: u64, object_version: Option<&str>) {
        let now = Instant::now();
        let mut parents = lock(&self.parents);
        // Even before its first check: the first decision must know it had an old copy.
        let entry = parents
            .by_key
            .entry(parent)
            .or_insert_with(|| Entry::new(now));
        let version = version(object_version);
        entry.latest_parent = Some(version);
        entry.touched = now;
        entry.note(THE_PARENT, version);
    }

    /// A watch event of the child `child` (see [`child_key`]), whose controller is `parent`,
    /// brought `object_version`.
    pub fn noted_child(&self, parent: u64, child: u64, object_version: Option<&str>) {
        let mut parents = lock(&self.parents);
        // A parent never checked has no decision to hold.
        if let Some(entry) = parents.by_key.get_mut(&parent) {
            entry.touched = Instant::now();
            entry.note(child, version(object_version));
        }
    }

    /// An object `parent` may read (a related object) changed.
    pub fn moved(&self, parent: u64) {
        if let Some(entry) = lock(&self.parents).by_key.get_mut(&parent) {
            entry.moved = true;
            entry.touched = Instant::now();
        }
    }

    /// A watch listed its kind again, and its cache holds the list.
    pub fn relisted(&self) {
        self.relists.fetch_add(1, Ordering::AcqRel);
    }
}

/// Whether the observed children (key, version) leave the decision standing: each one wanted
/// and at a version the decision saw or wrote; none missing but one whose create is on its
/// way (not in the caches under any controller: `exists`); and not every child write
/// already in the cache.
fn children_stand(
    expected: &[Expected],
    observed: &[(u64, u64)],
    exists: impl Fn(usize, Option<&str>, &str) -> bool,
) -> bool {
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
        match (now, child.wrote.last(), &child.created) {
            // Its create is on its way, unless it arrived under another controller.
            (None, Some(_), Some((index, namespace, name))) => {
                if exists(*index, namespace.as_deref(), name) {
                    return false;
                }
            }
            (None, _, _) => return false,
            (Some(now), Some(last), _) if now == *last => arrived += 1,
            (Some(now), _, _) if Some(now) == child.saw || child.wrote.contains(&now) => {}
            (Some(_), _, _) => return false,
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

    fn nowhere(_: usize, _: Option<&str>, _: &str) -> bool {
        false
    }

    /// A parent handed over at `parent_version` observing the ConfigMaps `children` (name,
    /// version), as a check that begins now sees it.
    fn inputs(since: &Since, parent_version: &str, children: &[(&str, &str)]) -> Inputs {
        Inputs::new(
            since,
            &OwnWrites::default(),
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
        let inputs = inputs(&since, parent_version, observed);
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

    /// A decision on a parent at version 10 observing `a` (5) and `b` (6), which updated
    /// `a` (11) and `b` (12) and wrote the status (13): no create on its way.
    fn decided_update_pass(decisions: &Decisions) {
        let written = OwnWrites::default();
        written.child(child("a"), Some("11"));
        written.child(child("b"), Some("12"));
        written.parent(Some("13"));
        decide(
            decisions,
            "10",
            &[("a", "5"), ("b", "6")],
            &["a", "b"],
            &written,
        );
    }

    /// What a check that begins now makes of the last decision.
    #[derive(Debug, PartialEq, Eq)]
    enum Verdict {
        Stands,
        AwaitsCreates,
        Asks,
    }

    fn verdict(decisions: &Decisions, parent_version: &str, children: &[(&str, &str)]) -> Verdict {
        let since = decisions.begin(PARENT);
        let inputs = inputs(&since, parent_version, children);
        match decisions.standing(PARENT, &since, &inputs, nowhere) {
            None => Verdict::Asks,
            Some(standing) if standing.awaiting_creates => Verdict::AwaitsCreates,
            Some(_) => Verdict::Stands,
        }
    }

    fn check_with(
        decisions: &Decisions,
        parent_version: &str,
        children: &[(&str, &str)],
        exists: impl Fn(usize, Option<&str>, &str) -> bool,
    ) -> bool {
        let since = decisions.begin(PARENT);
        let inputs = inputs(&since, parent_version, children);
        decisions
            .standing(PARENT, &since, &inputs, exists)
            .is_some()
    }

    fn check(decisions: &Decisions, parent_version: &str, children: &[(&str, &str)]) -> bool {
        check_with(decisions, parent_version, children, nowhere)
    }

    fn noted(decisions: &Decisions, name: &str, version: &str) {
        decisions.noted_child(PARENT, child_key(child(name)), Some(version));
    }

    #[test]
    fn a_decision_stands_while_its_own_writes_are_still_arriving() {
        let decisions = Decisions::default();
        decided_first_pass(&decisions);
        noted(&decisions, "a", "11");
        assert!(
            check(&decisions, "10", &[("a", "11")]),
            "b's create on its way"
        );
        decisions.noted_parent(PARENT, Some("13"));
        assert!(check(&decisions, "13", &[("a", "11")]), "and the status");
        let since = decisions.begin(PARENT);
        let standing = decisions
            .standing(PARENT, &since, &inputs(&since, "13", &[]), nowhere)
            .expect("nothing arrived yet");
        assert!(!standing.requeued);
        assert!(standing.requeue_in <= Duration::from_secs(300));
        assert!(standing.requeue_in > Duration::from_secs(290));
    }

    #[test]
    fn once_every_child_it_wrote_arrived_the_plugin_is_asked_once_more_then_not_again() {
        let decisions = Decisions::default();
        decided_first_pass(&decisions);
        noted(&decisions, "a", "11");
        noted(&decisions, "b", "12");
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
        decided_update_pass(&decisions);
        assert!(check(&decisions, "13", &[("a", "11"), ("b", "6")]));
        assert!(!check(&decisions, "13", &[("a", "11"), ("b", "20")]));
        assert!(!check(&decisions, "20", &[("a", "11"), ("b", "6")]));
        // Versions are known per object: the parent never has a child's, nor b a's.
        assert!(!check(&decisions, "11", &[("a", "11"), ("b", "6")]));
        assert!(!check(&decisions, "13", &[("a", "11"), ("b", "11")]));
    }

    #[test]
    fn someone_else_s_write_the_host_then_overwrote_still_asks_the_plugin() {
        let arriving = [("a", "11"), ("b", "6")];
        let decisions = Decisions::default();
        decided_update_pass(&decisions);
        decisions.noted_parent(PARENT, Some("14"));
        // By the time the reconcile reads the cache, the parent shows the host's status write.
        decisions.noted_parent(PARENT, Some("13"));
        assert!(!check(&decisions, "13", &arriving));

        let decisions = Decisions::default();
        decided_update_pass(&decisions);
        noted(&decisions, "a", "15");
        noted(&decisions, "a", "11");
        assert!(!check(&decisions, "13", &arriving));
    }

    #[test]
    fn a_parent_handed_over_older_than_its_latest_event_neither_stands_nor_is_kept() {
        let decisions = Decisions::default();
        decided_update_pass(&decisions);
        // Someone's edit (20) arrived before the check began; the reconcile has the old copy.
        decisions.noted_parent(PARENT, Some("20"));
        assert!(!check(&decisions, "13", &[("a", "11"), ("b", "6")]));

        // A decision made on that old copy, whose status write landed on top of the edit (21).
        let written = OwnWrites::default();
        written.parent(Some("21"));
        decide(
            &decisions,
            "13",
            &[("a", "11"), ("b", "12")],
            &["a", "b"],
            &written,
        );
        decisions.noted_parent(PARENT, Some("21"));
        assert!(
            !check(&decisions, "21", &[("a", "11"), ("b", "12")]),
            "not kept: the edit was never shown to the plugin"
        );
    }

    #[test]
    fn the_reconcile_s_own_finalizer_write_as_the_latest_event_is_no_old_copy() {
        let decisions = Decisions::default();
        let since = decisions.begin(PARENT);
        let own = OwnWrites::default();
        own.parent(Some("11"));
        decisions.noted_parent(PARENT, Some("11"));
        let since_echo = decisions.begin(PARENT);
        let inputs = Inputs::new(&since_echo, &own, 1, Some("10"), std::iter::empty());
        assert!(!inputs.stale, "the finalizer patch was made on version 10");
        let foreign = Inputs::new(
            &since_echo,
            &OwnWrites::default(),
            1,
            Some("10"),
            std::iter::empty(),
        );
        assert!(foreign.stale);
        drop(since);
    }

    #[test]
    fn a_decision_whose_entry_was_swept_or_removed_meanwhile_is_not_kept() {
        let decisions = Decisions::default();
        let since = decisions.begin(PARENT);
        let inputs = inputs(&since, "10", &[]);
        // A related change lands, then the entry goes (a sweep during a slow reconcile) and
        // the host's own status echo makes a new one.
        decisions.moved(PARENT);
        decisions.remove(PARENT);
        decisions.noted_parent(PARENT, Some("10"));
        decisions.decided(
            PARENT,
            inputs,
            &Outcome {
                children: Vec::new(),
                written: &OwnWrites::default(),
                requeue: Duration::from_secs(300),
                requeued: false,
            },
        );
        assert!(
            !check(&decisions, "10", &[]),
            "what the old entry noted is lost"
        );
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
    fn a_created_child_that_arrived_under_another_controller_asks_the_plugin() {
        let decisions = Decisions::default();
        decided_first_pass(&decisions);
        let b_exists = |index: usize, namespace: Option<&str>, name: &str| {
            (index, namespace, name) == (0, Some("ns"), "b")
        };
        assert!(!check_with(&decisions, "13", &[("a", "11")], b_exists));
        assert!(check(&decisions, "13", &[("a", "11")]));
    }

    #[test]
    fn a_related_change_a_relist_a_swap_or_a_flood_asks_the_plugin() {
        let decisions = Decisions::default();
        let arriving = [("a", "11"), ("b", "6")];
        decided_update_pass(&decisions);
        decisions.moved(PARENT);
        assert!(
            !check(&decisions, "13", &arriving),
            "a related object moved"
        );

        decided_update_pass(&decisions);
        decisions.relisted();
        assert!(!check(&decisions, "13", &arriving), "a watch listed again");

        decided_update_pass(&decisions);
        let since = decisions.begin(PARENT);
        let other_plugin = Inputs {
            plugin: 2,
            ..inputs(&since, "13", &arriving)
        };
        assert_eq!(
            decisions.standing(PARENT, &since, &other_plugin, nowhere),
            None
        );

        decided_update_pass(&decisions);
        for _ in 0..=SEEN_AT_MOST {
            noted(&decisions, "a", "11");
        }
        assert!(
            !check(&decisions, "13", &arriving),
            "more events than noted"
        );
    }

    #[test]
    fn an_event_noted_after_a_check_began_waits_for_the_next_check() {
        let decisions = Decisions::default();
        decided_update_pass(&decisions);
        let arriving = [("a", "11"), ("b", "6")];
        let since = decisions.begin(PARENT);
        noted(&decisions, "a", "30");
        assert!(
            decisions
                .standing(PARENT, &since, &inputs(&since, "13", &arriving), nowhere)
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
    fn a_forgotten_expired_or_removed_decision_stands_no_more_and_is_not_brought_back() {
        let decisions = Decisions::default();
        let arriving = [("a", "11"), ("b", "6")];
        decided_update_pass(&decisions);
        decisions.forget(PARENT);
        assert!(!check(&decisions, "13", &arriving));

        decided_update_pass(&decisions);
        if let Some(decided) = lock(&decisions.parents)
            .by_key
            .get_mut(&PARENT)
            .and_then(|e| e.decided.as_mut())
        {
            decided.until = Instant::now();
        }
        assert!(!check(&decisions, "13", &arriving));

        // Removed while a reconcile ran: its decision does not bring the entry back.
        let since = decisions.begin(PARENT);
        decisions.remove(PARENT);
        decisions.decided(
            PARENT,
            inputs(&since, "10", &[]),
            &Outcome {
                children: Vec::new(),
                written: &OwnWrites::default(),
                requeue: Duration::from_secs(300),
                requeued: false,
            },
        );
        assert!(lock(&decisions.parents).by_key.is_empty());
    }

    #[test]
    fn idle_entries_without_a_standing_decision_are_swept() {
        let decisions = Decisions::default();
        decided_first_pass(&decisions);
        decisions.noted_parent(8, Some("1"));
        let long_ago = Instant::now()
            .checked_sub(HOLD_AT_MOST + Duration::from_secs(1))
            .expect("the clock is past 31 s");
        {
            let mut parents = lock(&decisions.parents);
            parents.swept = long_ago;
            for entry in parents.by_key.values_mut() {
                entry.touched = long_ago;
            }
        }
        decisions.begin(9);
        let kept: Vec<u64> = lock(&decisions.parents).by_key.keys().copied().collect();
        assert!(kept.contains(&PARENT), "its decision still stands");
        assert!(kept.contains(&9), "just checked");
        assert!(!kept.contains(&8), "idle, with no decision");
    }

    #[test]
    fn a_short_requeue_holds_the_decision_half_as_long() {
        let decisions = Decisions::default();
        let since = decisions.begin(PARENT);
        decisions.decided(
            PARENT,
            inputs(&since, "10", &[]),
            &Outcome {
                children: Vec::new(),
                written: &OwnWrites::default(),
                requeue: Duration::from_secs(2),
                requeued: true,
            },
        );
        let held = lock(&decisions.parents)
            .by_key
            .get(&PARENT)
            .and_then(|e| e.decided.as_ref())
            .map(|d| d.until.saturating_duration_since(Instant::now()));
        assert!(held.is_some_and(|held| held <= Duration::from_secs(1)));
    }

    #[test]
    fn child_and_related_events_of_a_parent_never_checked_are_not_kept() {
        let decisions = Decisions::default();
        noted(&decisions, "a", "1");
        decisions.moved(PARENT);
        assert!(lock(&decisions.parents).by_key.is_empty());
    }
    #[test]
    fn someone_else_s_change_while_creates_are_on_their_way_waits_for_them_then_asks() {
        let decisions = Decisions::default();
        decided_first_pass(&decisions);
        noted(&decisions, "a", "11");
        // The controller-manager writes a's status before b's create comes back.
        noted(&decisions, "a", "15");
        let since = decisions.begin(PARENT);
        let standing = decisions
            .standing(
                PARENT,
                &since,
                &inputs(&since, "13", &[("a", "15")]),
                nowhere,
            )
            .expect("b is on its way");
        assert!(standing.awaiting_creates);
        assert!(standing.requeue_in <= AWAIT_CREATES_AT_MOST);
        noted(&decisions, "b", "12");
        assert_eq!(
            verdict(&decisions, "13", &[("a", "15"), ("b", "12")]),
            Verdict::Asks
        );
    }

    #[test]
    fn a_change_that_waited_for_creates_is_not_forgotten_when_they_arrive() {
        // A decision that updated a (5 -> 11) and created b (12): a related object moves while
        // both are on their way; then b arrives while a's update is still on its way, which
        // alone would let the decision stand.
        let decisions = Decisions::default();
        let written = OwnWrites::default();
        written.child(child("a"), Some("11"));
        written.child(child("b"), Some("12"));
        decide(&decisions, "10", &[("a", "5")], &["a", "b"], &written);
        decisions.moved(PARENT);
        assert_eq!(
            verdict(&decisions, "10", &[("a", "5")]),
            Verdict::AwaitsCreates
        );
        noted(&decisions, "b", "12");
        assert_eq!(
            verdict(&decisions, "10", &[("a", "5"), ("b", "12")]),
            Verdict::Asks,
            "the related change is still owed to the plugin"
        );
    }

    #[test]
    fn the_wait_for_creates_ends_when_they_come_and_go_or_take_too_long() {
        let decisions = Decisions::default();
        decided_first_pass(&decisions);
        noted(&decisions, "a", "11");
        noted(&decisions, "b", "12");
        noted(&decisions, "b", "14");
        decisions.moved(PARENT);
        assert_eq!(
            verdict(&decisions, "13", &[("a", "11")]),
            Verdict::Asks,
            "b was created and deleted before the check: not on its way"
        );

        decided_first_pass(&decisions);
        decisions.moved(PARENT);
        assert_eq!(
            verdict(&decisions, "13", &[("a", "11")]),
            Verdict::AwaitsCreates
        );
        if let Some(decided) = lock(&decisions.parents)
            .by_key
            .get_mut(&PARENT)
            .and_then(|e| e.decided.as_mut())
        {
            decided.creates_due = Instant::now();
        }
        assert_eq!(verdict(&decisions, "13", &[("a", "11")]), Verdict::Asks);

        decided_first_pass(&decisions);
        let since = decisions.begin(PARENT);
        let other_plugin = Inputs {
            plugin: 2,
            ..inputs(&since, "13", &[("a", "11")])
        };
        assert_eq!(
            decisions.standing(PARENT, &since, &other_plugin, nowhere),
            None,
            "another plugin is asked at once"
        );
    }

    #[test]
    fn calls_to_converge_are_counted_from_a_reconcile_that_did_not_settle() {
        let decisions = Decisions::default();
        let _ = decisions.begin(PARENT);
        // Create: children written; then the call on the world it made settles.
        decisions.calling(PARENT);
        assert_eq!(decisions.ended(PARENT, false), None);
        decisions.calling(PARENT);
        assert_eq!(decisions.ended(PARENT, true), Some(2));
        // A resync that finds everything as it should be is no convergence.
        decisions.calling(PARENT);
        assert_eq!(decisions.ended(PARENT, true), None);
        // One that fails before asking counts nothing, and does not start a count.
        assert_eq!(decisions.ended(PARENT, false), None);
        decisions.calling(PARENT);
        assert_eq!(decisions.ended(PARENT, true), None);
        // A failed reconcile counts its call too.
        decisions.calling(PARENT);
        assert_eq!(decisions.ended(PARENT, false), None);
        decisions.calling(PARENT);
        assert_eq!(decisions.ended(PARENT, false), None);
        decisions.calling(PARENT);
        assert_eq!(decisions.ended(PARENT, true), Some(3));
    }
}
