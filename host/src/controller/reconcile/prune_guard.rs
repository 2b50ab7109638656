//! The prune guard: deletions beyond a share of what a policy made wait for an admin.
//!
//! A plugin that loads fine but answers no children, a candidate walked through a rollout,
//! or a plugin that turns on its children long after it was swapped in would otherwise prune
//! every parent's children as fast as the controller runs. The guard counts deletions against
//! two budgets, and a deletion must fit both:
//!
//! - **Per change.** A change of what decides — the policy's generation, the active plugin,
//!   the candidate — may delete at most `max(floor, fraction × children seen)` children in
//!   all, where the children seen are those of the parents reconciled since the change: the
//!   share is judged on the evidence as it comes, so a change that prunes everything is caught
//!   after `floor` deletions. The budget is the change's, not a stage's: a rollout moving its
//!   candidate's share, a restart of the controller's window or a takeover goes on counting
//!   against it.
//! - **Over time.** In any `pruneWindowSeconds`, at most `max(floor, fraction × children
//!   known)`, the children known being those of every parent reconciled so far. A plugin that
//!   waits for the change's window to close and then prunes everything at a resync is held
//!   as a change would be.
//!
//! Each change opens a *window* that lasts until every parent was reconciled once under it;
//! going past a budget holds the deletions (in a window of its own, in the steady state).
//! The first reconcile that would go beyond holds its deletions, and so does every later one
//! in the window (applies still happen). A hold ends when an admin sets
//! [`CONFIRM_ANNOTATION`] to the window's token, which lets exactly the deletions held then
//! proceed; or when the next change opens a new window (rolling back: nothing was deleted).
//! Every window has a token of its own — the change (generation and full digests) and a
//! nonce — and a confirmation replaces it, so a confirmation is used once: it never confirms
//! a later hold, a later stage of a rollout, a restart, a takeover or another host's window.
//!
//! What a share is taken of counts each parent's children as first seen (under a change) or
//! as they stood a period ago (over time), so a plugin cannot first make children (applies
//! are never held) to enlarge the share it then prunes.
//!
//! The guard is consulted by the prune step, told about every finished reconcile, and read
//! by the policy's status report; all its arithmetic is here, tested without a cluster.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher as _, Hasher as _};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube::runtime::reflector::ObjectRef;

use crate::controller::cache::cached::CachedObject;
use crate::lock;
use crate::policy::{PruneGuardStatus, ReconcilePolicy, SafetySpec};

/// The annotation on a ReconcilePolicy that confirms a held window: its value must be the
/// window's token (`status.pruneGuard.confirm`), or, for hosts sharing the parents in
/// shards, a comma-separated list of their windows' tokens that names it.
pub const CONFIRM_ANNOTATION: &str = crate::policy::CONFIRM_PRUNE_ANNOTATION;

/// `spec.safety.maxPruneFraction` when unset.
pub const DEFAULT_MAX_PRUNE_FRACTION: f64 = 0.2;

/// `spec.safety.pruneFloor` when unset.
pub const DEFAULT_PRUNE_FLOOR: u64 = 5;

/// `spec.safety.pruneWindowSeconds` when unset.
pub const DEFAULT_PRUNE_WINDOW: Duration = Duration::from_secs(600);

/// Held deletions the status names as examples.
const EXAMPLES: usize = 5;

/// How much may be deleted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PruneLimits {
    /// The share of the policy's children, 0 to 1.
    pub max_fraction: f64,
    /// Deletions always allowed.
    pub floor: u64,
    /// The rolling period of the budget over time; zero for none.
    pub period: Duration,
}

impl PruneLimits {
    /// The limits `spec.safety` asks for, over the defaults.
    pub fn of(safety: Option<&SafetySpec>) -> Self {
        let safety = safety.cloned().unwrap_or_default();
        Self {
            max_fraction: safety
                .max_prune_fraction
                .filter(|f| f.is_finite())
                .map_or(DEFAULT_MAX_PRUNE_FRACTION, |f| f.clamp(0.0, 1.0)),
            floor: safety.prune_floor.map_or(DEFAULT_PRUNE_FLOOR, u64::from),
            period: safety
                .prune_window_seconds
                .map_or(DEFAULT_PRUNE_WINDOW, |s| Duration::from_secs(u64::from(s))),
        }
    }

    /// Deletions a budget over `children` children allows: the floor, or the share of them
    /// rounded down, whichever is more.
    pub fn allowed(&self, children: u64) -> u64 {
        // Exact for any child count a cluster holds (below 2^53).
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let share = (self.max_fraction * children as f64).floor() as u64;
        share.max(self.floor)
    }
}

/// What the guard says about one parent's prunes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Delete them.
    Prune,
    /// Keep them: the window is held.
    Hold,
}

/// A parent's key, as every policy map holds it.
type ParentKey = ObjectRef<CachedObject>;

/// A parent as the guard counts it: its namespace and name hashed with the guard's own
/// random key ([`PruneGuard::id_of`]). The guard keeps a count and a visit for every parent
/// of the policy; keyed by the parent's `ObjectRef` (its kind's shared `ApiResource`, name,
/// namespace, uid and version: ~100 bytes and two strings) they would take ~9 MiB at 10,000
/// parents. Two parents share an id with a chance of about one in 10^11 at 10,000 parents
/// (they would be counted as one), and the key is random so that no one can name parents to
/// make them share one.
pub(crate) type ParentId = u64;

/// Children by parent, and their sum: what a share is taken of. A parent's count falls at
/// once and rises only once the higher count has stood for `rise_after` (a parent seen for
/// the first time counts as it is), so a plugin cannot first make children (applies are never
/// held) to enlarge the share it then prunes.
#[derive(Debug)]
struct Tally {
    children: HashMap<ParentId, Count>,
    total: u64,
    rise_after: Duration,
    /// Rises waiting for their time, oldest first.
    rises: VecDeque<(Instant, ParentId)>,
}

#[derive(Debug, Clone, Copy)]
struct Count {
    value: u64,
    /// A higher count seen since, and when it was first seen.
    rising: Option<(u64, Instant)>,
}

impl Tally {
    fn new(rise_after: Duration) -> Self {
        Self {
            children: HashMap::new(),
            total: 0,
            rise_after,
            rises: VecDeque::new(),
        }
    }

    /// `parent` has `children` now.
    fn observe(&mut self, parent: ParentId, children: u64, now: Instant) {
        self.promote(now);
        let Some(count) = self.children.get_mut(&parent) else {
            self.children.insert(
                parent,
                Count {
                    value: children,
                    rising: None,
                },
            );
            self.total += children;
            return;
        };
        if children <= count.value || self.rise_after.is_zero() {
            self.total = self.total - count.value + children;
            *count = Count {
                value: children,
                rising: None,
            };
        } else if count.rising.is_none_or(|(value, _)| value != children) {
            count.rising = Some((children, now));
            self.rises.push_back((now, parent));
        }
    }

    /// Take the rises that have stood long enough.
    fn promote(&mut self, now: Instant) {
        while let Some((since, _)) = self.rises.front()
            && now.saturating_duration_since(*since) >= self.rise_after
        {
            let Some((since, parent)) = self.rises.pop_front() else {
                break;
            };
            if let Some(count) = self.children.get_mut(&parent)
                && let Some((value, at)) = count.rising
                && at == since
            {
                self.total = self.total - count.value + value;
                *count = Count {
                    value,
                    rising: None,
                };
            }
        }
    }

    fn retain(&mut self, exists: impl Fn(ParentId) -> bool) {
        self.children.retain(|id, _| exists(*id));
        self.rises.retain(|(_, id)| exists(*id));
        self.total = self.children.values().map(|c| c.value).sum();
    }
}

/// The change deletions in a window are counted against: its budget outlives the window, so
/// a rollout that moves its candidate's share (and so reopens the window) spends the same one.
#[derive(Debug)]
struct Change {
    /// The policy's generation and the full digests of the active plugin and the candidate.
    key: String,
    /// Children deleted in its windows.
    deleted: u64,
    /// The children each parent reconciled in its windows kept (at its last reconcile):
    /// with those deleted, what its share is taken of.
    seen: Tally,
}

impl Change {
    fn new(key: String) -> Self {
        Self {
            key,
            deleted: 0,
            // Under a change, a parent counts as first seen: no rise is ever taken.
            seen: Tally::new(Duration::MAX),
        }
    }
}

/// One window: from a change (or a hold in the steady state) until every parent was
/// reconciled once under it.
#[derive(Debug)]
struct Window {
    /// What opened it, for the status.
    since: String,
    /// What confirms its hold: the change's key and a nonce of its own, new at each
    /// confirmation.
    token: String,
    /// Deletions an admin confirmed, by parent, until the parent's next reconcile makes them.
    approved: HashMap<ParentKey, Vec<String>>,
    /// Set once a reconcile would have gone past a budget; stays until confirmed or replaced.
    held: bool,
    /// Deletions held, by parent: `Kind name` each.
    holding: HashMap<ParentKey, Vec<String>>,
    /// Parents whose reconcile started and ended in this window.
    visited: HashSet<ParentId>,
}

#[derive(Debug)]
struct State {
    limits: PruneLimits,
    /// Counts windows, so a reconcile that began in an earlier one is not taken as a visit.
    epoch: u64,
    change: Change,
    /// `None` in the steady state.
    window: Option<Window>,
    /// The children every parent reconciled so far kept: with those deleted within the
    /// period, what the budget over time is taken of.
    known: Tally,
    /// Deletions made within the last `limits.period`, oldest first.
    recent: VecDeque<(Instant, u64)>,
}

impl State {
    /// Deletions within the last period, dropping older ones.
    fn recently_deleted(&mut self, now: Instant) -> u64 {
        let period = self.limits.period;
        while self
            .recent
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= period)
        {
            self.recent.pop_front();
        }
        self.recent.iter().map(|(_, n)| n).sum()
    }

    /// Whether `count` more deletions fit the budget over time.
    fn within_period(&mut self, count: u64, now: Instant) -> bool {
        self.known.promote(now);
        let recently = self.recently_deleted(now);
        self.limits.period.is_zero()
            || recently + count <= self.limits.allowed(self.known.total + recently)
    }

    /// `count` of `parent`'s `observed` children were deleted: they no longer count as the
    /// parent's, but as deleted (so the share is taken of the same children before and after).
    fn deleted(&mut self, parent: ParentId, observed: u64, count: u64, now: Instant) {
        self.forget_deleted(parent, observed, count, now);
        if self.window.is_some() {
            self.change.deleted += count;
        }
        self.recent.push_back((now, count));
    }

    /// The parent's counts, less `count` deleted.
    fn forget_deleted(&mut self, parent: ParentId, observed: u64, count: u64, now: Instant) {
        let remaining = observed.saturating_sub(count);
        self.known.observe(parent, remaining, now);
        if self.window.is_some() {
            self.change.seen.observe(parent, remaining, now);
        }
    }

    fn open(&mut self, since: String) -> &mut Window {
        self.epoch += 1;
        self.window.insert(Window {
            since,
            token: token(&self.change.key),
            approved: HashMap::new(),
            held: false,
            holding: HashMap::new(),
            visited: HashSet::new(),
        })
    }
}

/// One policy's prune guard.
#[derive(Debug)]
pub(crate) struct PruneGuard {
    state: Mutex<State>,
    /// The key of the parents' ids.
    ids: RandomState,
}

impl PruneGuard {
    /// A guard whose first window opens now, for the change `key` ([`change_key`]): a
    /// controller that starts does not know what the last one did, nor whether its plugin is
    /// the one that made the children.
    pub fn new(limits: PruneLimits, key: String, since: String) -> Self {
        let guard = Self {
            state: Mutex::new(State {
                limits,
                epoch: 0,
                change: Change::new(key.clone()),
                window: None,
                known: Tally::new(limits.period),
                recent: VecDeque::new(),
            }),
            ids: RandomState::new(),
        };
        guard.open(key, since);
        guard
    }

    /// A change, `key`: open a new window, forgetting the last one and anything it held. A
    /// change other than the last starts a budget of its own.
    pub fn open(&self, key: String, since: String) {
        let mut state = lock(&self.state);
        if state.change.key != key {
            state.change = Change::new(key);
        }
        state.open(since);
    }

    /// A change of who writes (a takeover) or of how far a rollout reaches, rather than of
    /// what decides: a new window (with a new token), counted against the same change.
    pub fn reopen(&self, since: String) {
        let key = lock(&self.state).change.key.clone();
        self.open(key, since);
    }

    /// A rollout rolled back: the active plugin serves every parent again, and its cleanup of
    /// what the candidate made is a change of its own, not counted against the candidate's.
    pub fn roll_back(&self, since: String) {
        let key = format!("{}+rollback", lock(&self.state).change.key);
        self.open(key, since);
    }

    /// The window a reconcile starting now belongs to.
    pub fn epoch(&self) -> u64 {
        lock(&self.state).epoch
    }

    /// The policy's confirmation annotation changed (or was read at start). When it names the
    /// held window's token (alone, or among others, comma-separated), exactly the deletions held at this moment proceed (at their
    /// parents' next reconciles, against no budget); the window takes a new token, so the
    /// same value confirms nothing more, and a deletion past the budgets after it is held
    /// again. Whether it let held deletions proceed.
    pub fn set_confirmation(&self, confirmation: Option<&str>) -> bool {
        let mut state = lock(&self.state);
        let key = state.change.key.clone();
        let Some(window) = &mut state.window else {
            return false;
        };
        // Hosts sharing the parents in shards each hold their own window: the policy's
        // status offers their tokens comma-separated, and each takes its own from the list.
        let confirms =
            confirmation.is_some_and(|value| value.split(',').any(|token| token == window.token));
        if !window.held || !confirms {
            return false;
        }
        let holding = std::mem::take(&mut window.holding);
        window.approved.extend(holding);
        window.held = false;
        window.token = token(&key);
        true
    }

    /// May `parent`, which has `observed` children, delete `children` of them (`Kind name`
    /// each)? Every reconcile that reaches the prune step asks, with nothing to delete too:
    /// its children are part of what the shares are taken of. Counts what it lets go;
    /// remembers what it holds.
    pub fn admit(&self, parent: &ParentKey, observed: u64, children: &[String]) -> Admission {
        self.admit_at(parent, observed, children, Instant::now())
    }

    fn admit_at(
        &self,
        parent: &ParentKey,
        observed: u64,
        children: &[String],
        now: Instant,
    ) -> Admission {
        let id = self.id(parent);
        let mut state = lock(&self.state);
        let state = &mut *state;
        state.known.observe(id, observed, now);
        if state.window.is_some() {
            // Counted as first seen under the change: a count that rises later does not
            // enlarge the change's share.
            state.change.seen.observe(id, observed, now);
        }
        if children.is_empty() {
            // Held before, wanted again now (or gone by other hands): nothing held for it, and
            // a hold with nothing left to hold is over.
            if let Some(window) = &mut state.window {
                window.holding.remove(parent);
                window.approved.remove(parent);
                window.held &= !window.holding.is_empty();
            }
            return Admission::Prune;
        }
        let count = children.len() as u64;
        if let Some(window) = &mut state.window
            && let Some(approved) = window.approved.remove(parent)
            && children.iter().all(|c| approved.contains(c))
        {
            // Confirmed by an admin: these go, against no budget. Anything more than was
            // confirmed is judged afresh below.
            state.forget_deleted(id, observed, count, now);
            return Admission::Prune;
        }
        let within_period = state.within_period(count, now);
        let limits = state.limits;
        let within_change = state.change.deleted + count
            <= limits.allowed(state.change.seen.total + state.change.deleted);
        match &mut state.window {
            Some(window) if !window.held && within_change && within_period => {
                window.holding.remove(parent);
                state.deleted(id, observed, count, now);
                return Admission::Prune;
            }
            Some(_) => {}
            None if within_period => {
                state.deleted(id, observed, count, now);
                return Admission::Prune;
            }
            None => {
                let recently = state.recently_deleted(now);
                let since = format!(
                    "{recently} deletions, {} allowed of the {} children known within {}s",
                    limits.allowed(state.known.total + recently),
                    state.known.total + recently,
                    limits.period.as_secs()
                );
                state.open(since);
            }
        }
        let Some(window) = &mut state.window else {
            return Admission::Prune;
        };
        window.held = true;
        window.holding.insert(parent.clone(), children.to_vec());
        Admission::Hold
    }

    /// A reconcile of `parent` that began in window `epoch` ended (whatever its result).
    pub fn visited(&self, epoch: u64, parent: &ParentKey) {
        let id = self.id(parent);
        let mut state = lock(&self.state);
        if state.epoch != epoch {
            return;
        }
        if let Some(window) = &mut state.window {
            window.visited.insert(id);
        }
    }

    /// Forget parents that no longer `exist`, asked by [`ParentId`] (a sweep over everything
    /// kept per parent: call it when parents may have gone).
    pub fn forget_gone(&self, exists: impl Fn(ParentId) -> bool) {
        let mut state = lock(&self.state);
        state.known.retain(&exists);
        if let Some(window) = &mut state.window {
            window.visited.retain(|id| exists(*id));
            window.holding.retain(|key, _| exists(self.id(key)));
            window.approved.retain(|key, _| exists(self.id(key)));
        }
    }

    /// Close the window if every one of the `parents` that still `exist` (asked by
    /// [`ParentId`]) was reconciled under it, unless it holds deletions (or confirmed ones are
    /// not made yet). Returns whether it closed.
    pub fn close_if_rolled_out(&self, exists: impl Fn(ParentId) -> bool, parents: usize) -> bool {
        let mut state = lock(&self.state);
        let Some(window) = &mut state.window else {
            return false;
        };
        // Only when the window looks rolled out can a deleted parent's visit matter: one
        // that stands for a parent not yet visited must not close it.
        if window.visited.len() >= parents {
            window.visited.retain(|id| exists(*id));
        }
        if window.held
            || !window.holding.is_empty()
            || !window.approved.is_empty()
            || window.visited.len() < parents
        {
            return false;
        }
        state.window = None;
        true
    }

    /// Deletions held now.
    pub fn held(&self) -> u64 {
        let state = lock(&self.state);
        state
            .window
            .as_ref()
            .filter(|w| w.held)
            .map_or(0, |w| w.holding.values().map(|c| c.len() as u64).sum())
    }

    /// The window as the policy's status shows it (`None` in the steady state).
    pub fn status(&self) -> Option<PruneGuardStatus> {
        let mut state = lock(&self.state);
        let now = Instant::now();
        state.known.promote(now);
        let recently_deleted = state.recently_deleted(now);
        let window = state.window.as_ref()?;
        let seen = state.change.seen.total + state.change.deleted;
        let held = window.held;
        let (held_deletions, held_parents, examples) = if held {
            let mut parents: Vec<(String, &Vec<String>)> = window
                .holding
                .iter()
                .map(|(key, children)| (display(key), children))
                .collect();
            parents.sort();
            let examples = parents
                .iter()
                .flat_map(|(parent, children)| {
                    children.iter().map(move |c| format!("{parent} → {c}"))
                })
                .take(EXAMPLES)
                .collect();
            (
                window.holding.values().map(|c| c.len() as u64).sum(),
                window.holding.len() as u64,
                examples,
            )
        } else {
            (0, 0, Vec::new())
        };
        Some(PruneGuardStatus {
            state: if held {
                "Held"
            } else if window.approved.is_empty() {
                "Watching"
            } else {
                "Confirmed"
            }
            .to_owned(),
            since: window.since.clone(),
            confirm: window.token.clone(),
            deleted: state.change.deleted,
            allowed: state.limits.allowed(seen),
            children_seen: seen,
            recently_deleted,
            recently_allowed: state.limits.allowed(state.known.total + recently_deleted),
            held_deletions,
            held_parents,
            examples,
        })
    }

    /// The limits in force.
    pub fn limits(&self) -> PruneLimits {
        lock(&self.state).limits
    }

    /// The id the guard keeps the parent `name` in `namespace` under.
    pub fn id_of(&self, namespace: Option<&str>, name: &str) -> ParentId {
        self.ids.hash_one((namespace, name))
    }

    fn id(&self, parent: &ParentKey) -> ParentId {
        self.id_of(parent.namespace.as_deref(), &parent.name)
    }
}

/// The policy's [`CONFIRM_ANNOTATION`], if set.
pub(crate) fn confirmation(policy: &ReconcilePolicy) -> Option<&str> {
    policy
        .metadata
        .annotations
        .as_ref()?
        .get(CONFIRM_ANNOTATION)
        .map(String::as_str)
}

/// `namespace/name`, or `name` for a cluster-scoped parent.
fn display(key: &ParentKey) -> String {
    match &key.namespace {
        Some(namespace) => format!("{namespace}/{}", key.name),
        None => key.name.clone(),
    }
}

/// What identifies a change: the policy's generation and the full digests of the active
/// plugin and of the candidate, if one is loaded.
pub(crate) fn change_key(
    generation: Option<i64>,
    active: &crate::plugin::Digest,
    candidate: Option<&crate::plugin::Digest>,
) -> String {
    let mut key = format!("{}-{}", generation.unwrap_or_default(), active.hex());
    if let Some(candidate) = candidate {
        key.push('-');
        key.push_str(&candidate.hex());
    }
    key
}

/// A token for a window or a hold of the change `key`: the key and a nonce no earlier window
/// (of this host or any other) had.
fn token(key: &str) -> String {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.write(key.as_bytes());
    format!("{key}.{:08x}", hasher.finish() & 0xffff_ffff)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::controller::testing::myapps;

    fn key(name: &str) -> ParentKey {
        ObjectRef::new_with(name, Arc::new(myapps())).within("a")
    }

    fn limits(max_fraction: f64, floor: u64) -> PruneLimits {
        PruneLimits {
            max_fraction,
            floor,
            period: DEFAULT_PRUNE_WINDOW,
        }
    }

    fn guard(max_fraction: f64, floor: u64) -> PruneGuard {
        PruneGuard::new(limits(max_fraction, floor), "3-abc".into(), "a swap".into())
    }

    fn children(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("ConfigMap c-{i}")).collect()
    }

    fn token_of(g: &PruneGuard) -> String {
        g.status().expect("a window").confirm
    }

    /// Reconcile `parents` parents of `each` children with nothing to delete, and close the
    /// window: the steady state, knowing them all.
    fn steady(g: &PruneGuard, parents: usize, each: u64) {
        let epoch = g.epoch();
        for i in 0..parents {
            let parent = key(&format!("p-{i:03}"));
            assert_eq!(g.admit(&parent, each, &[]), Admission::Prune);
            g.visited(epoch, &parent);
        }
        assert!(g.close_if_rolled_out(|_| true, parents));
    }

    #[test]
    fn the_limit_is_the_share_rounded_down_or_the_floor_whichever_is_more() {
        let l = limits(0.2, 5);
        assert_eq!(l.allowed(0), 5);
        assert_eq!(l.allowed(24), 5, "4.8 rounds down, under the floor");
        assert_eq!(l.allowed(30), 6);
        assert_eq!(l.allowed(600), 120);
        assert_eq!(limits(0.0, 0).allowed(1000), 0);
        assert_eq!(limits(1.0, 5).allowed(1000), 1000);
    }

    #[test]
    fn unset_safety_takes_the_defaults_and_an_odd_fraction_is_clamped() {
        assert_eq!(PruneLimits::of(None), limits(0.2, 5));
        let safety = |fraction: Option<f64>, floor: Option<u32>| SafetySpec {
            max_prune_fraction: fraction,
            prune_floor: floor,
            prune_window_seconds: None,
        };
        assert_eq!(
            PruneLimits::of(Some(&safety(Some(0.5), Some(0)))),
            limits(0.5, 0)
        );
        assert_eq!(
            PruneLimits::of(Some(&safety(Some(7.0), None))),
            limits(1.0, 5)
        );
        assert_eq!(
            PruneLimits::of(Some(&safety(Some(f64::NAN), None))),
            limits(0.2, 5)
        );
        let no_period = SafetySpec {
            prune_window_seconds: Some(0),
            ..SafetySpec::default()
        };
        assert_eq!(PruneLimits::of(Some(&no_period)).period, Duration::ZERO);
    }

    #[test]
    fn a_change_that_prunes_everything_is_held_after_the_floor() {
        // 200 parents of one child each, every one pruned: 5 go, then the window holds.
        let g = guard(0.2, 5);
        let verdicts: Vec<Admission> = (0..200)
            .map(|i| g.admit(&key(&format!("p-{i:03}")), 1, &children(1)))
            .collect();
        assert!(verdicts[..5].iter().all(|v| *v == Admission::Prune));
        assert!(verdicts[5..].iter().all(|v| *v == Admission::Hold));
        assert_eq!(g.held(), 195);
        let status = g.status().expect("a window");
        assert_eq!(status.state, "Held");
        assert_eq!(
            (status.deleted, status.allowed, status.children_seen),
            (5, 40, 200)
        );
        assert_eq!((status.held_deletions, status.held_parents), (195, 195));
        assert_eq!(status.examples.len(), 5);
        assert_eq!(status.examples[0], "a/p-005 → ConfigMap c-0");
        assert!(status.confirm.starts_with("3-abc."), "{}", status.confirm);
    }

    #[test]
    fn deletions_within_the_share_of_the_children_seen_go() {
        // Parents with 10 children each, every fourth losing 2 of them: 5 % of what is seen.
        let g = guard(0.2, 0);
        for i in 0..100 {
            let doomed = if i % 4 == 0 { children(2) } else { Vec::new() };
            assert_eq!(
                g.admit(&key(&format!("p-{i}")), 10, &doomed),
                Admission::Prune,
                "parent {i}"
            );
        }
        assert_eq!(g.status().expect("open").deleted, 50);
        // A parent seen again counts its children once.
        assert_eq!(g.admit(&key("p-1"), 10, &[]), Admission::Prune);
        assert_eq!(g.status().expect("open").children_seen, 1000);
    }

    #[test]
    fn once_held_even_a_prune_that_would_fit_is_held() {
        let g = guard(0.2, 5);
        assert_eq!(g.admit(&key("p"), 6, &children(6)), Admission::Hold);
        // A bad plugin must not trickle through in small steps.
        assert_eq!(g.admit(&key("q"), 100, &children(1)), Admission::Hold);
        assert_eq!(g.held(), 7);
    }

    #[test]
    fn the_floor_lets_a_small_policy_delete_everything() {
        let g = guard(0.2, 5);
        assert_eq!(g.admit(&key("p"), 4, &children(4)), Admission::Prune);
        assert_eq!(g.admit(&key("q"), 1, &children(1)), Admission::Prune);
        assert_eq!(g.admit(&key("r"), 1, &children(1)), Admission::Hold);
    }

    #[test]
    fn a_held_parent_with_nothing_left_to_prune_is_no_longer_held() {
        let g = guard(0.0, 0);
        assert_eq!(g.admit(&key("p"), 2, &children(2)), Admission::Hold);
        assert_eq!(g.admit(&key("p"), 2, &[]), Admission::Prune);
        assert_eq!(g.held(), 0);
        assert_eq!(g.status().expect("open").state, "Watching");
    }

    #[test]
    fn a_parent_held_twice_counts_once() {
        let g = guard(0.0, 0);
        assert_eq!(g.admit(&key("p"), 2, &children(2)), Admission::Hold);
        assert_eq!(g.admit(&key("p"), 2, &children(2)), Admission::Hold);
        assert_eq!(g.held(), 2);
    }

    #[test]
    fn a_confirmation_lets_exactly_the_held_deletions_go_once() {
        let g = guard(0.0, 0);
        assert_eq!(g.admit(&key("p"), 2, &children(2)), Admission::Hold);
        assert_eq!(g.admit(&key("q"), 2, &children(2)), Admission::Hold);
        let first = token_of(&g);
        assert!(first.starts_with("3-abc."), "{first}");
        assert!(!g.set_confirmation(Some("3-abc.00000000")), "another value");
        assert!(g.set_confirmation(Some(&first)));
        assert_eq!(g.held(), 0);
        assert_eq!(g.status().expect("open").state, "Confirmed");
        assert!(!g.set_confirmation(Some(&first)), "used");
        assert_ne!(token_of(&g), first, "a new token for the next hold");
        assert_eq!(g.admit(&key("p"), 2, &children(2)), Admission::Prune);
        // Not a blank cheque: a parent not held then, or more than was held, is judged anew.
        assert_eq!(g.admit(&key("r"), 2, &children(2)), Admission::Hold);
        assert_eq!(
            g.admit(&key("q"), 3, &children(3)),
            Admission::Hold,
            "more than was confirmed"
        );
        let second = token_of(&g);
        assert!(!g.set_confirmation(Some(&first)));
        assert!(g.set_confirmation(Some(&second)));
        assert_eq!(g.admit(&key("r"), 2, &children(2)), Admission::Prune);

        // Among the tokens of other hosts' windows (sharded hosts), its own confirms it;
        // a list without it does not.
        assert_eq!(g.admit(&key("u"), 2, &children(2)), Admission::Hold);
        let third = token_of(&g);
        assert!(!g.set_confirmation(Some("3-abc.11111111,3-abc.22222222")));
        assert!(g.set_confirmation(Some(&format!("3-abc.11111111,{third}"))));
        assert_eq!(g.admit(&key("u"), 2, &children(2)), Admission::Prune);

        // A rollout's next stage, a takeover: a token of its own.
        g.reopen("the rollout of candidate abc to 50%".into());
        assert_eq!(g.admit(&key("s"), 2, &children(2)), Admission::Hold);
        assert!(!g.set_confirmation(Some(&second)));

        // The next change: no confirmation carries over.
        g.open("4-def".into(), "another swap".into());
        assert_eq!(g.admit(&key("t"), 2, &children(2)), Admission::Hold);
        assert!(token_of(&g).starts_with("4-def."));
    }

    #[test]
    fn children_made_to_enlarge_the_share_do_not_count_until_a_period_later() {
        // Ten parents of one child each, known in the steady state.
        let g = guard(0.2, 0);
        steady(&g, 10, 1);
        let start = Instant::now();
        // The plugin makes four more children per parent (applies are never held), then
        // prunes the real one of each: 1 of 5 is 20 %, but the share is of what stood before.
        let mut pruned = 0;
        for i in 0..10 {
            let parent = key(&format!("p-{i:03}"));
            g.admit_at(&parent, 5, &[], start);
            if g.admit_at(&parent, 5, &children(1), start) == Admission::Prune {
                pruned += 1;
            }
        }
        assert_eq!(pruned, 2, "20 % of the ten children that stood");
        // Counts that stood a whole period are believed: 8 parents of 5 and 2 of 4, with the
        // 2 deleted, are 50 children, and 20 % of them is 10.
        let later = start + DEFAULT_PRUNE_WINDOW;
        g.admit_at(&key("p-009"), 5, &[], later);
        assert_eq!(g.status().map(|s| s.recently_allowed), Some(10));

        // Under a change, a parent's children count as first seen.
        let g = guard(0.2, 0);
        for i in 0..5 {
            let parent = key(&format!("q-{i}"));
            g.admit(&parent, 1, &[]);
            assert_eq!(g.admit(&parent, 5, &children(1)), Admission::Hold, "{i}");
        }
    }

    #[test]
    fn a_rollback_opens_a_budget_of_its_own() {
        // The budget per change alone (the one over time still spans changes).
        let g = PruneGuard::new(
            PruneLimits {
                period: Duration::ZERO,
                ..limits(0.0, 1)
            },
            "3-abc".into(),
            "a swap".into(),
        );
        assert_eq!(g.admit(&key("p"), 1, &children(1)), Admission::Prune);
        assert_eq!(g.admit(&key("q"), 1, &children(1)), Admission::Hold);
        g.roll_back("the rollback of candidate abc".into());
        assert!(token_of(&g).starts_with("3-abc+rollback."));
        assert_eq!(g.admit(&key("q"), 1, &children(1)), Admission::Prune);
    }

    #[test]
    fn a_new_change_forgets_what_the_last_one_held_and_deleted() {
        let g = guard(0.0, 1);
        assert_eq!(g.admit(&key("o"), 1, &children(1)), Admission::Prune);
        assert_eq!(g.admit(&key("p"), 3, &children(3)), Admission::Hold);
        g.open("5-old".into(), "rolled back".into());
        assert_eq!(g.held(), 0);
        let status = g.status().expect("open");
        assert_eq!((status.state.as_str(), status.deleted), ("Watching", 0));
        assert_eq!(status.children_seen, 0);
    }

    #[test]
    fn a_rollout_stage_or_a_takeover_counts_against_the_same_change() {
        // Eight stages, each reopening the window: five deletions in all, not five a stage.
        let g = guard(0.2, 5);
        let mut pruned = 0;
        for stage in 0..8 {
            g.reopen(format!("stage {stage}"));
            for i in 0..4 {
                let parent = key(&format!("p-{stage}-{i}"));
                if g.admit(&parent, 1, &children(1)) == Admission::Prune {
                    pruned += 1;
                }
            }
        }
        assert_eq!(pruned, 5);
        let status = g.status().expect("open");
        assert_eq!((status.deleted, status.state.as_str()), (5, "Held"));
        g.reopen("this replica took over".into());
        // 33 children seen now: 6 in all may go, one more than went.
        assert_eq!(g.admit(&key("late"), 1, &children(1)), Admission::Prune);
        assert_eq!(g.admit(&key("later"), 1, &children(1)), Admission::Hold);
    }

    #[test]
    fn the_steady_state_is_held_past_the_share_per_period() {
        let g = guard(0.2, 5);
        steady(&g, 100, 1);
        assert!(g.status().is_none());
        let start = Instant::now();
        // 100 children known: 20 may go per period; the 21st opens a held window.
        for i in 0..20 {
            let parent = key(&format!("p-{i:03}"));
            assert_eq!(
                g.admit_at(&parent, 1, &children(1), start),
                Admission::Prune
            );
        }
        let parent = key("p-020");
        assert_eq!(g.admit_at(&parent, 1, &children(1), start), Admission::Hold);
        let status = g.status().expect("a hold opens a window");
        assert_eq!(status.state, "Held");
        assert_eq!((status.recently_deleted, status.recently_allowed), (20, 20));
        assert!(status.since.contains("within 600s"), "{}", status.since);
        // Confirmed: the held one goes; the window closes once every parent was seen.
        assert!(g.set_confirmation(Some(&status.confirm)));
        assert_eq!(
            g.admit_at(&parent, 1, &children(1), start),
            Admission::Prune
        );
        let epoch = g.epoch();
        for i in 0..100 {
            g.visited(epoch, &key(&format!("p-{i:03}")));
        }
        assert!(g.close_if_rolled_out(|_| true, 100));
        // A period later, the budget is whole again.
        let later = start + DEFAULT_PRUNE_WINDOW;
        assert_eq!(
            g.admit_at(&key("p-030"), 1, &children(1), later),
            Admission::Prune
        );
    }

    #[test]
    fn a_period_of_zero_never_holds_the_steady_state() {
        let g = PruneGuard::new(
            PruneLimits {
                period: Duration::ZERO,
                ..limits(0.0, 0)
            },
            "3-abc".into(),
            "start".into(),
        );
        steady(&g, 2, 10);
        assert_eq!(g.admit(&key("p-000"), 10, &children(10)), Admission::Prune);
        assert_eq!(g.held(), 0);
    }

    #[test]
    fn a_window_counts_against_the_budget_over_time_too() {
        // Changes one after another each get a budget of their own (the floor, here); the
        // period's share caps them all: half of the ten children known.
        let g = guard(0.5, 1);
        steady(&g, 10, 1);
        let mut pruned = 0;
        for change in 0..10 {
            g.open(format!("{change}-x"), format!("change {change}"));
            let parent = key(&format!("p-{change:03}"));
            if g.admit(&parent, 1, &children(1)) == Admission::Prune {
                pruned += 1;
            }
        }
        assert_eq!(pruned, 5);
    }

    #[test]
    fn the_window_closes_once_every_parent_was_reconciled_in_it() {
        let g = guard(0.0, 0);
        let epoch = g.epoch();
        g.visited(epoch, &key("p"));
        assert!(!g.close_if_rolled_out(|_| true, 2), "q not yet");
        g.visited(epoch - 1, &key("q"));
        assert!(
            !g.close_if_rolled_out(|_| true, 2),
            "a reconcile from an earlier window is no visit"
        );
        g.visited(epoch, &key("gone"));
        // A visited parent that was deleted since does not count.
        assert!(!g.close_if_rolled_out(|id| id != g.id_of(Some("a"), "gone"), 2));
        g.visited(epoch, &key("q"));
        assert!(g.close_if_rolled_out(|id| id != g.id_of(Some("a"), "gone"), 2));
        assert!(g.status().is_none(), "steady state");
    }

    #[test]
    fn a_held_window_stays_open_until_confirmed_and_its_parents_pruned() {
        let g = guard(0.0, 0);
        let epoch = g.epoch();
        assert_eq!(g.admit(&key("p"), 1, &children(1)), Admission::Hold);
        g.visited(epoch, &key("p"));
        assert!(!g.close_if_rolled_out(|_| true, 1), "held");
        assert!(g.set_confirmation(Some(&token_of(&g))));
        assert!(
            !g.close_if_rolled_out(|_| true, 1),
            "the held deletions have not gone yet"
        );
        assert_eq!(g.admit(&key("p"), 1, &children(1)), Admission::Prune);
        assert!(g.close_if_rolled_out(|_| true, 1));
    }

    #[test]
    fn a_held_parent_that_is_deleted_no_longer_keeps_the_window_open() {
        let g = guard(0.0, 0);
        let epoch = g.epoch();
        assert_eq!(g.admit(&key("p"), 1, &children(1)), Admission::Hold);
        g.visited(epoch, &key("p"));
        g.visited(epoch, &key("q"));
        assert!(g.set_confirmation(Some(&token_of(&g))));
        assert!(
            !g.close_if_rolled_out(|id| id != g.id_of(Some("a"), "p"), 1),
            "held until the guard is told parents went"
        );
        g.forget_gone(|id| id != g.id_of(Some("a"), "p"));
        assert!(g.close_if_rolled_out(|id| id != g.id_of(Some("a"), "p"), 1));
    }

    #[test]
    fn tokens_name_the_change_and_never_repeat() {
        let digest = crate::plugin::Digest::of(b"active");
        let candidate = crate::plugin::Digest::of(b"candidate");
        let key = change_key(Some(7), &digest, Some(&candidate));
        assert_eq!(key, format!("7-{}-{}", digest.hex(), candidate.hex()));
        assert_ne!(token(&key), token(&key));
    }
}
