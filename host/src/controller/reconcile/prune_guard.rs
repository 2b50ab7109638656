//! The prune guard: a change that would delete much of what a policy made waits for an admin.
//!
//! A plugin that loads fine but answers no children, or a policy edit that empties a
//! selector, would otherwise prune every parent's children as fast as the controller runs.
//! So each change opens a *window* — a swap of the plugin or its config, a candidate change, a
//! new generation (which restarts the controller), the host starting or taking over — that
//! lasts until every parent has been reconciled once under it. Within a window the host
//! deletes at most `max(floor, fraction × children seen)` children in all, where the children
//! seen are those of the parents reconciled so far in the window: the share is judged on the
//! evidence as it comes, so a change that prunes everything is caught after `floor`
//! deletions, not after a fraction of the whole policy. The first reconcile that would go
//! beyond that holds its deletions, and so does every later one in the window (applies still
//! happen). The hold ends when an admin sets [`CONFIRM_ANNOTATION`] to the
//! window's token (the held deletions then proceed), or when the next change opens a new
//! window (rolling back: nothing was deleted). Outside a window — the steady state — pruning
//! is never held: a parent whose spec shrinks loses its children as asked.
//!
//! The guard is consulted by the prune step, told about every finished reconcile, and read
//! by the policy's status report; all its arithmetic is here, tested without a cluster.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use kube::runtime::reflector::ObjectRef;

use crate::controller::cache::cached::CachedObject;
use crate::lock;
use crate::policy::{PruneGuardStatus, ReconcilePolicy, SafetySpec};

/// The annotation on a ReconcilePolicy that confirms a held window: its value must be the
/// window's token (`status.pruneGuard.confirm`).
pub const CONFIRM_ANNOTATION: &str = "wasmctrl.dev/confirm-prune";

/// `spec.safety.maxPruneFraction` when unset.
pub const DEFAULT_MAX_PRUNE_FRACTION: f64 = 0.2;

/// `spec.safety.pruneFloor` when unset.
pub const DEFAULT_PRUNE_FLOOR: u64 = 5;

/// Held deletions the status names as examples.
const EXAMPLES: usize = 5;

/// How much a window may delete.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PruneLimits {
    /// The share of the policy's children, 0 to 1.
    pub max_fraction: f64,
    /// Deletions always allowed.
    pub floor: u64,
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
        }
    }

    /// Deletions a window that has seen `children` children allows: the floor, or the share
    /// of them rounded down, whichever is more.
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

/// One window: from a change until every parent was reconciled once under it.
#[derive(Debug)]
struct Window {
    /// What opened it, for the status.
    since: String,
    /// Children deleted in it.
    deleted: u64,
    /// The children each parent reconciled in it had (at its last reconcile): what the share
    /// is taken of.
    seen: HashMap<ParentKey, u64>,
    /// Their sum.
    seen_total: u64,
    /// Set once a reconcile would have gone past the limit; stays until confirmed or replaced.
    held: bool,
    /// Deletions held, by parent: `Kind name` each.
    holding: HashMap<ParentKey, Vec<String>>,
    /// Parents whose reconcile started and ended in this window.
    visited: HashSet<ParentKey>,
}

#[derive(Debug)]
struct State {
    limits: PruneLimits,
    /// Counts windows, so a reconcile that began in an earlier one is not taken as a visit.
    epoch: u64,
    /// What confirms the current window's held deletions: the policy's generation and
    /// plugin, kept in the steady state for a window opened without a change of either.
    token: String,
    /// `None` in the steady state.
    window: Option<Window>,
    /// The policy's [`CONFIRM_ANNOTATION`].
    confirmation: Option<String>,
}

impl State {
    fn confirmed(&self) -> bool {
        self.confirmation.as_deref() == Some(self.token.as_str())
    }
}

/// One policy's prune guard.
#[derive(Debug)]
pub(crate) struct PruneGuard {
    state: Mutex<State>,
}

impl PruneGuard {
    /// A guard whose first window opens now: a controller that starts does not know what the
    /// last one did, nor whether its plugin is the one that made the children.
    pub fn new(limits: PruneLimits, token: String, since: String) -> Self {
        let guard = Self {
            state: Mutex::new(State {
                limits,
                epoch: 0,
                token: String::new(),
                window: None,
                confirmation: None,
            }),
        };
        guard.open(token, since);
        guard
    }

    /// A change: open a new window, confirmed by `token`, forgetting the last one and
    /// anything it held.
    pub fn open(&self, token: String, since: String) {
        let mut state = lock(&self.state);
        state.token = token;
        state.epoch += 1;
        state.window = Some(Window {
            since,
            deleted: 0,
            seen: HashMap::new(),
            seen_total: 0,
            held: false,
            holding: HashMap::new(),
            visited: HashSet::new(),
        });
    }

    /// A change of who writes (a takeover) rather than of what decides: a new window under
    /// the same token, so a confirmation given for it still holds.
    pub fn reopen(&self, since: String) {
        let token = lock(&self.state).token.clone();
        self.open(token, since);
    }

    /// The window a reconcile starting now belongs to.
    pub fn epoch(&self) -> u64 {
        lock(&self.state).epoch
    }

    /// The policy's confirmation annotation changed (or was read at start). Whether it lets
    /// a held window's deletions proceed now.
    pub fn set_confirmation(&self, confirmation: Option<&str>) -> bool {
        let mut state = lock(&self.state);
        state.confirmation = confirmation.map(str::to_owned);
        state
            .window
            .as_ref()
            .is_some_and(|w| w.held && state.confirmed())
    }

    /// May `parent`, which has `observed` children, delete `children` of them (`Kind name`
    /// each)? Every reconcile that reaches the prune step asks, with nothing to delete too:
    /// its children are part of what the share is taken of. Counts what it lets go;
    /// remembers what it holds.
    pub fn admit(&self, parent: &ParentKey, observed: u64, children: &[String]) -> Admission {
        let mut state = lock(&self.state);
        let limits = state.limits;
        let confirmed = state.confirmed();
        let Some(window) = &mut state.window else {
            return Admission::Prune;
        };
        let before = window.seen.insert(parent.clone(), observed).unwrap_or(0);
        window.seen_total = window.seen_total - before + observed;
        if children.is_empty() {
            // Held before, wanted again now (or gone by other hands): nothing held for it, and
            // a hold with nothing left to hold is over.
            window.holding.remove(parent);
            window.held &= !window.holding.is_empty();
            return Admission::Prune;
        }
        let count = children.len() as u64;
        let within = window.deleted + count <= limits.allowed(window.seen_total);
        if confirmed || (!window.held && within) {
            window.deleted += count;
            window.holding.remove(parent);
            return Admission::Prune;
        }
        window.held = true;
        window.holding.insert(parent.clone(), children.to_vec());
        Admission::Hold
    }

    /// A reconcile of `parent` that began in window `epoch` ended (whatever its result).
    pub fn visited(&self, epoch: u64, parent: ParentKey) {
        let mut state = lock(&self.state);
        if state.epoch != epoch {
            return;
        }
        if let Some(window) = &mut state.window {
            window.visited.insert(parent);
        }
    }

    /// Close the window if every one of the `parents` that `exist` was reconciled under it,
    /// unless it holds deletions no one confirmed. Returns whether it closed.
    pub fn close_if_rolled_out(&self, exists: impl Fn(&ParentKey) -> bool, parents: usize) -> bool {
        let mut state = lock(&self.state);
        let confirmed = state.confirmed();
        let Some(window) = &mut state.window else {
            return false;
        };
        window.visited.retain(|key| exists(key));
        window.holding.retain(|key, _| exists(key));
        // Held parents were visited, but their deletions proceed only at their next reconcile
        // after the confirmation.
        if (window.held && !confirmed)
            || !window.holding.is_empty()
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
            .filter(|w| w.held && !state.confirmed())
            .map_or(0, |w| w.holding.values().map(|c| c.len() as u64).sum())
    }

    /// The window as the policy's status shows it (`None` in the steady state).
    pub fn status(&self) -> Option<PruneGuardStatus> {
        let state = lock(&self.state);
        let window = state.window.as_ref()?;
        let children = window.seen_total;
        let confirmed = state.confirmed();
        let held = window.held && !confirmed;
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
            state: match (held, confirmed) {
                (true, _) => "Held",
                (false, true) => "Confirmed",
                (false, false) => "Watching",
            }
            .to_owned(),
            since: window.since.clone(),
            confirm: state.token.clone(),
            deleted: window.deleted,
            allowed: state.limits.allowed(children),
            children_seen: children,
            held_deletions,
            held_parents,
            examples,
        })
    }

    /// The limits in force.
    pub fn limits(&self) -> PruneLimits {
        lock(&self.state).limits
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

/// The token that confirms a window: the policy's generation and the active plugin's short
/// digest, so a confirmation never carries over to a later change.
pub(crate) fn token(generation: Option<i64>, digest: &crate::plugin::Digest) -> String {
    format!("{}-{}", generation.unwrap_or_default(), digest.short())
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
        }
    }

    fn guard(max_fraction: f64, floor: u64) -> PruneGuard {
        PruneGuard::new(limits(max_fraction, floor), "3-abc".into(), "a swap".into())
    }

    fn children(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("ConfigMap c-{i}")).collect()
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
        assert_eq!(status.confirm, "3-abc");
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
    fn a_confirmation_for_this_window_lets_the_held_deletions_go() {
        let g = guard(0.0, 0);
        assert!(!g.set_confirmation(Some("3-abc")), "nothing held yet");
        assert_eq!(
            g.admit(&key("p"), 2, &children(2)),
            Admission::Prune,
            "confirmed beforehand"
        );

        let g = guard(0.0, 0);
        assert_eq!(g.admit(&key("p"), 2, &children(2)), Admission::Hold);
        assert!(!g.set_confirmation(Some("2-abc")), "another window's token");
        assert_eq!(g.admit(&key("p"), 2, &children(2)), Admission::Hold);
        assert!(g.set_confirmation(Some("3-abc")));
        assert_eq!(g.held(), 0);
        assert_eq!(g.status().expect("open").state, "Confirmed");
        assert_eq!(g.admit(&key("p"), 2, &children(2)), Admission::Prune);
        assert_eq!(g.status().expect("open").deleted, 2);

        // The next change is a window of its own: the old confirmation does not carry over.
        g.open("4-def".into(), "another swap".into());
        assert_eq!(g.admit(&key("q"), 2, &children(2)), Admission::Hold);
    }

    #[test]
    fn a_new_window_forgets_what_the_last_one_held() {
        let g = guard(0.0, 0);
        assert_eq!(g.admit(&key("p"), 3, &children(3)), Admission::Hold);
        g.open("5-old".into(), "rolled back".into());
        assert_eq!(g.held(), 0);
        let status = g.status().expect("open");
        assert_eq!((status.state.as_str(), status.deleted), ("Watching", 0));
        assert_eq!(status.children_seen, 0);
    }

    #[test]
    fn a_takeover_reopens_the_window_under_the_same_token() {
        let g = guard(0.0, 0);
        assert_eq!(g.admit(&key("p"), 1, &children(1)), Admission::Hold);
        g.reopen("took over".into());
        let status = g.status().expect("open");
        assert_eq!(
            (status.state.as_str(), status.confirm.as_str()),
            ("Watching", "3-abc")
        );
        assert_eq!(g.admit(&key("p"), 1, &children(1)), Admission::Hold);
        assert!(g.set_confirmation(Some("3-abc")));
    }

    #[test]
    fn the_window_closes_once_every_parent_was_reconciled_in_it_and_then_nothing_is_held() {
        let g = guard(0.0, 0);
        let epoch = g.epoch();
        g.visited(epoch, key("p"));
        assert!(!g.close_if_rolled_out(|_| true, 2), "q not yet");
        g.visited(epoch - 1, key("q"));
        assert!(
            !g.close_if_rolled_out(|_| true, 2),
            "a reconcile from an earlier window is no visit"
        );
        g.visited(epoch, key("gone"));
        // A visited parent that was deleted since does not count.
        assert!(!g.close_if_rolled_out(|k| k.name != "gone", 2));
        g.visited(epoch, key("q"));
        assert!(g.close_if_rolled_out(|k| k.name != "gone", 2));
        assert!(g.status().is_none(), "steady state");
        // The steady state never holds: a parent's spec may drop all its children.
        assert_eq!(g.admit(&key("p"), 10, &children(10)), Admission::Prune);
        assert_eq!(g.held(), 0);
    }

    #[test]
    fn a_held_window_stays_open_until_confirmed_and_its_parents_pruned() {
        let g = guard(0.0, 0);
        let epoch = g.epoch();
        assert_eq!(g.admit(&key("p"), 1, &children(1)), Admission::Hold);
        g.visited(epoch, key("p"));
        assert!(!g.close_if_rolled_out(|_| true, 1), "held");
        assert!(g.set_confirmation(Some("3-abc")));
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
        g.visited(epoch, key("p"));
        g.visited(epoch, key("q"));
        assert!(g.set_confirmation(Some("3-abc")));
        assert!(g.close_if_rolled_out(|k| k.name != "p", 1));
    }
}
