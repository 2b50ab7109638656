//! Which desired children wait. A child that depends on others (see
//! [`children::order`](super::children::order)) is applied only once each of them exists, the
//! cache shows it as the host last wrote it, and the host judges it ready
//! ([`children::readiness`](super::children::readiness)). Children are visited with what
//! they depend on first, so a whole chain is decided in one pass; a waiting child is neither
//! written nor pruned, and its dependency's own watch event brings the parent back.

use std::collections::HashMap;
use std::sync::Arc;

use super::children::DesiredChild;
use super::children::readiness;
use super::request::Observed;
use crate::controller::cache::cached::CachedObject;
use crate::controller::cache::stores::ChildCache;

/// Where one child stands in this pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not visited yet.
    Pending,
    /// Applied; `wrote` when that changed it, so the cache does not show it yet.
    Applied { wrote: bool },
    /// Not applied: it waits.
    Held,
}

/// Why one child waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Wait {
    /// The waiting child, by position in the answer.
    pub child: usize,
    /// The dependency it waits for, by position in the answer.
    pub on: usize,
    /// What the dependency lacks, e.g. `readyReplicas 0 of 1`.
    pub why: String,
    /// Seconds since the dependency was created, when it exists.
    pub for_seconds: Option<i64>,
}

/// The waits of one reconcile's apply.
pub(crate) struct Waits<'a> {
    desired: &'a [DesiredChild],
    observed: HashMap<(usize, &'a str), &'a Arc<CachedObject>>,
    caches: &'a [ChildCache],
    state: Vec<State>,
}

impl<'a> Waits<'a> {
    pub fn new(
        desired: &'a [DesiredChild],
        observed: &'a [Observed],
        caches: &'a [ChildCache],
    ) -> Self {
        // An unordered answer never looks a child up: no map for it.
        let ordered = desired.iter().any(|child| !child.depends_on.is_empty());
        let observed = observed
            .iter()
            .filter(|_| ordered)
            .map(|(index, child)| {
                (
                    (*index, child.metadata.name.as_deref().unwrap_or_default()),
                    child,
                )
            })
            .collect();
        Self {
            desired,
            observed,
            caches,
            state: vec![State::Pending; desired.len()],
        }
    }

    /// Whether any child of the answer depends on another: an unordered answer is applied as
    /// it always was, with no look at readiness.
    pub fn ordered(&self) -> bool {
        self.desired
            .iter()
            .any(|child| !child.depends_on.is_empty())
    }

    /// The positions of the answer in apply order: each child after what it depends on,
    /// otherwise in the answer's order. The answer was checked for cycles.
    pub fn apply_order(&self) -> Vec<usize> {
        if !self.ordered() {
            return (0..self.desired.len()).collect();
        }
        let mut placed = vec![false; self.desired.len()];
        let mut order = Vec::with_capacity(self.desired.len());
        for start in 0..self.desired.len() {
            // Depth first, dependencies before dependents; iterative for long chains.
            let mut stack = vec![(start, 0)];
            while let Some(&mut (node, ref mut next)) = stack.last_mut() {
                if placed[node] {
                    stack.pop();
                    continue;
                }
                if let Some(&dependency) = self.desired[node].depends_on.get(*next) {
                    *next += 1;
                    if !placed[dependency] {
                        stack.push((dependency, 0));
                    }
                } else {
                    placed[node] = true;
                    order.push(node);
                    stack.pop();
                }
            }
        }
        order
    }

    /// What the child at `position` waits for, if anything: the first of its dependencies
    /// that is not there, not yet seen as written, or not ready.
    pub fn blocked(&self, position: usize) -> Option<Wait> {
        self.desired[position].depends_on.iter().find_map(|&on| {
            let (why, for_seconds) = self.not_ready(on)?;
            Some(Wait {
                child: position,
                on,
                why,
                for_seconds,
            })
        })
    }

    fn not_ready(&self, on: usize) -> Option<(String, Option<i64>)> {
        let dependency = &self.desired[on];
        match self.state[on] {
            State::Held => return Some(("is not applied yet: it waits too".to_owned(), None)),
            State::Applied { wrote: true } => {
                return Some(("was just applied, not yet observed".to_owned(), None));
            }
            State::Pending | State::Applied { wrote: false } => {}
        }
        let Some(observed) = self
            .observed
            .get(&(dependency.kind_index, dependency.name.as_str()))
        else {
            return Some(("does not exist yet".to_owned(), None));
        };
        let meta = &observed.metadata;
        if meta.deletion_timestamp.is_some() {
            return Some(("is being deleted".to_owned(), None));
        }
        let age = meta
            .creation_timestamp
            .as_ref()
            .map(|created| (jiff::Timestamp::now() - created.0).get_seconds().max(0));
        observed_not_ready(&self.caches[dependency.kind_index], observed).map(|why| (why, age))
    }

    /// The first child of the answer, once applied, that is not ready, in words (`Job
    /// shop-migrate: not complete`); `None` when every one is. `kinds` names the policy's
    /// child kinds.
    pub fn first_not_ready(&self, kinds: &[&str]) -> Option<String> {
        (0..self.desired.len()).find_map(|position| {
            let (why, _) = self.not_ready(position)?;
            let child = &self.desired[position];
            Some(format!("{} {}: {why}", kinds[child.kind_index], child.name))
        })
    }

    /// The child at `position` was applied (`wrote` when that changed it).
    pub fn applied(&mut self, position: usize, wrote: bool) {
        self.state[position] = State::Applied { wrote };
    }

    /// The child at `position` waits and was not applied.
    pub fn held(&mut self, position: usize) {
        self.state[position] = State::Held;
    }
}

/// Why `child`, as `cache` shows it, is not ready by the host's judgement, or `None` when
/// it is: still the version before the host's own update, or not ready by its status (see
/// [`readiness`]). What ordering and the rollout gate both ask of a child.
pub(crate) fn observed_not_ready(cache: &ChildCache, child: &CachedObject) -> Option<String> {
    let version = child
        .metadata
        .resource_version
        .as_deref()
        .unwrap_or_default();
    let name = child.metadata.name.clone().unwrap_or_default();
    if cache
        .pending
        .unseen(&(child.metadata.namespace.clone(), name), version)
    {
        return Some("updated, not yet observed".to_owned());
    }
    readiness::not_ready(&child.to_value())
}

/// The parent's `Progressing` message for `waits`: the first wait whose dependency is not
/// itself waiting (what the chain is really held by), e.g. `Deployment app waits for Job
/// migrate: not complete, for 42 s`.
pub(crate) fn describe(waits: &[Wait], desired: &[DesiredChild], kinds: &[&str]) -> Option<String> {
    let held: Vec<usize> = waits.iter().map(|w| w.child).collect();
    let root = waits
        .iter()
        .find(|w| !held.contains(&w.on))
        .or_else(|| waits.first())?;
    let name = |position: usize| {
        let child = &desired[position];
        format!("{} {}", kinds[child.kind_index], child.name)
    };
    let mut message = format!(
        "{} waits for {}: {}",
        name(root.child),
        name(root.on),
        root.why
    );
    if let Some(seconds) = root.for_seconds {
        message.push_str(&format!(", for {seconds} s"));
    }
    if waits.len() > 1 {
        message.push_str(&format!(" ({} children wait)", waits.len()));
    }
    Some(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::controller::testing::desired_child as child;

    #[test]
    fn dependencies_come_first_and_an_unordered_answer_keeps_its_order() {
        let unordered = [child(0, "a", vec![]), child(0, "b", vec![])];
        let waits = Waits::new(&unordered, &[], &[]);
        assert!(!waits.ordered());
        assert_eq!(waits.apply_order(), vec![0, 1]);
        // app → migrate → db, service alone.
        let stack = [
            child(0, "app", vec![2]),
            child(1, "db", vec![]),
            child(2, "migrate", vec![1, 3]),
            child(3, "db-svc", vec![]),
        ];
        let waits = Waits::new(&stack, &[], &[]);
        assert!(waits.ordered());
        assert_eq!(waits.apply_order(), vec![1, 3, 2, 0]);
    }

    #[test]
    fn a_missing_or_just_written_dependency_holds_its_dependents() {
        let stack = [
            child(0, "db", vec![]),
            child(1, "migrate", vec![0]),
            child(2, "app", vec![1]),
        ];
        let mut waits = Waits::new(&stack, &[], &[]);
        assert_eq!(waits.blocked(0), None);
        waits.applied(0, true);
        let wait = waits.blocked(1).expect("waits for db");
        assert_eq!(
            (wait.on, wait.why.as_str()),
            (0, "was just applied, not yet observed")
        );
        waits.held(1);
        let chained = waits.blocked(2).expect("waits for migrate");
        assert_eq!(chained.on, 1);
        let kinds = ["StatefulSet", "Job", "Deployment"];
        assert_eq!(
            describe(&[wait, chained], &stack, &kinds).as_deref(),
            Some(
                "Job migrate waits for StatefulSet db: was just applied, not yet observed (2 children wait)"
            )
        );
        let mut fresh = Waits::new(&stack, &[], &[]);
        fresh.applied(0, false);
        assert_eq!(
            fresh.blocked(1).map(|w| w.why),
            Some("does not exist yet".to_owned())
        );
        assert_eq!(
            fresh.first_not_ready(&kinds).as_deref(),
            Some("StatefulSet db: does not exist yet")
        );
    }
}
