//! One parent kind, one policy. Two policies reconciling the same parents would fight for
//! ever, each re-applying what the other changed. Policies clash when they name the same group
//! and kind, whatever the version (one object is served under every version of its kind), in
//! namespaces that may overlap; two policies naming different namespaces provably keep their
//! parents apart.
//!
//! The policy that holds the kind keeps it: a policy holds it once its controller started
//! (recorded in `status.claimedParent`) for as long as its spec names that group and kind.
//! Another policy created or edited onto the kind is refused (`ParentKindTaken`), even an
//! older one. Only a policy that holds the kind counts: one that never ran (its account does
//! not exist, its plugin does not load) keeps nobody out, however old. And a team's policy
//! (made from a NamespacedReconcilePolicy) never keeps an admin's cluster policy out: the
//! admin's takes the kind even from a team's policy that holds it, and the team's is refused
//! until the admin's goes. Of two policies of the same standing that both hold the kind
//! (started at once), the older keeps it (by creation time, then name). The check reads
//! every policy in the cluster, not only those this host runs, so hosts that split policies
//! between them agree too; the host re-checks whenever any policy changes ([`recheck`]), so
//! a refused policy starts as soon as the holder goes, and of two that started at once the
//! one that loses stops.

use std::sync::atomic::{AtomicU8, Ordering};

use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt as _};
use tokio::sync::Notify;

use crate::policy::{ParentRef, ReconcilePolicy};

/// The policy that holds or comes before `policy`'s parents, if any, among every policy in
/// the cluster (listed now, not from a cache).
pub(crate) async fn claimed_by(
    client: &Client,
    policy: &ReconcilePolicy,
) -> Result<Option<ReconcilePolicy>, kube::Error> {
    let all = Api::<ReconcilePolicy>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    // The listed copy carries the newest status: whether this policy holds its kind.
    let listed = all
        .items
        .iter()
        .find(|other| other.metadata.uid == policy.metadata.uid);
    let holds = listed.is_some_and(holds_its_kind);
    Ok(first_claim(policy, holds, all.items.iter()).cloned())
}

/// Among `others`, the policy whose parents may overlap `policy`'s and that keeps them
/// instead: one that holds the kind and outranks `policy` — an admin's over a team's
/// whatever their ages, and of the same standing the older when `policy` holds the kind too.
/// Pure, so the rule can be tested without a cluster.
pub(crate) fn first_claim<'a>(
    policy: &ReconcilePolicy,
    policy_holds: bool,
    others: impl Iterator<Item = &'a ReconcilePolicy> + Clone,
) -> Option<&'a ReconcilePolicy> {
    let team = is_teams(policy);
    others
        .filter(|other| other.metadata.uid != policy.metadata.uid)
        .filter(|other| other.metadata.deletion_timestamp.is_none())
        .filter(|other| overlap(&policy.spec.parent, &other.spec.parent))
        .filter(|other| holds_its_kind(other))
        .filter(|other| match (team, is_teams(other)) {
            // A team's policy never keeps an admin's out ...
            (false, true) => false,
            // ... and an admin's keeps a team's out, whatever their ages.
            (true, false) => true,
            _ => !policy_holds || age(other) < age(policy),
        })
        .min_by_key(|other| (is_teams(other), age(other)))
}

/// Whether `policy` was made from a team's NamespacedReconcilePolicy.
pub(crate) fn is_teams(policy: &ReconcilePolicy) -> bool {
    policy
        .annotations()
        .contains_key(crate::policy::namespaced::SOURCE_ANNOTATION)
}

/// Whether `policy`'s status records that it holds the parent kind its spec names now. A
/// policy moved to another kind holds nothing until its controller starts for the new one.
pub(crate) fn holds_its_kind(policy: &ReconcilePolicy) -> bool {
    policy
        .status
        .as_ref()
        .and_then(|status| status.claimed_parent.as_ref())
        .is_some_and(|claim| {
            same_kind(claim, &policy.spec.parent) && claim.namespace == policy.spec.parent.namespace
        })
}

/// Whether two parent refs may reach the same parents: the same group and kind, whatever the
/// version, and namespaces that may overlap.
fn overlap(a: &ParentRef, b: &ParentRef) -> bool {
    same_kind(a, b)
        && match (&a.namespace, &b.namespace) {
            (Some(x), Some(y)) => x == y,
            _ => true,
        }
}

/// The same group and kind: `example.com/v1beta1 Widget` is `example.com/v1 Widget`.
fn same_kind(a: &ParentRef, b: &ParentRef) -> bool {
    group(&a.api_version) == group(&b.api_version) && a.kind == b.kind
}

/// The group of an `apiVersion`: `example.com` of `example.com/v1`, empty for the core `v1`.
fn group(api_version: &str) -> &str {
    api_version.split_once('/').map_or("", |(group, _)| group)
}

/// Creation time, then name: a total order, so two hosts always agree on who came first.
fn age(policy: &ReconcilePolicy) -> (Option<jiff::Timestamp>, String) {
    (
        policy.metadata.creation_timestamp.as_ref().map(|t| t.0),
        policy.name_any(),
    )
}

/// Where one policy's task stands on its parent kind, shared with the host so that it can
/// re-check the claim whenever any policy changes.
#[derive(Debug, Default)]
pub(crate) struct Standing {
    stand: AtomicU8,
    /// Wakes a refused task to try again now rather than after its backoff.
    retry: Notify,
}

/// A policy task's stage, as far as its parent kind is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stand {
    /// Loading, checking, or waiting for something other than the parent kind.
    Preparing = 0,
    /// Refused with `ParentKindTaken`, waiting for the kind.
    Refused = 1,
    /// Its controller runs: it holds the kind.
    Running = 2,
}

impl Standing {
    pub fn set(&self, stand: Stand) {
        self.stand.store(stand as u8, Ordering::Relaxed);
    }

    pub fn get(&self) -> Stand {
        match self.stand.load(Ordering::Relaxed) {
            1 => Stand::Refused,
            2 => Stand::Running,
            _ => Stand::Preparing,
        }
    }

    /// Have the task try again now (a permit is kept if it is not waiting yet).
    pub fn retry_now(&self) {
        self.retry.notify_one();
    }

    /// Until [`Self::retry_now`].
    pub async fn retried(&self) {
        self.retry.notified().await;
    }
}

/// What the host does about one policy's task once any policy changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recheck {
    /// Its standing still holds.
    Keep,
    /// It runs, but another policy holds the kind and came first (two started at once):
    /// restart it, to be refused.
    Restart,
    /// It was refused, and the kind is free for it now (the holder was deleted or moved):
    /// let it try now.
    Retry,
}

/// The host's re-check of one policy task, against the newest copy of every policy (`policy`
/// among them, as the task runs it).
pub(crate) fn recheck<'a>(
    stand: Stand,
    policy: &ReconcilePolicy,
    all: impl Iterator<Item = &'a ReconcilePolicy> + Clone,
) -> Recheck {
    match stand {
        Stand::Preparing => Recheck::Keep,
        Stand::Running => match first_claim(policy, true, all) {
            Some(_) => Recheck::Restart,
            None => Recheck::Keep,
        },
        Stand::Refused => match first_claim(policy, holds_its_kind(policy), all) {
            Some(_) => Recheck::Keep,
            None => Recheck::Retry,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn policy(name: &str, second: i64, kind: &str, namespace: Option<&str>) -> ReconcilePolicy {
        versioned(name, second, "example.com/v1", kind, namespace)
    }

    fn versioned(
        name: &str,
        second: i64,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
    ) -> ReconcilePolicy {
        let mut policy: ReconcilePolicy = serde_json::from_value(serde_json::json!({
            "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
            "metadata": {"name": name, "uid": name},
            "spec": {
                "parent": {"apiVersion": api_version, "kind": kind, "namespace": namespace},
                "plugin": {"source": {"file": {"path": "p.wasm"}}},
            },
        }))
        .expect("valid policy");
        policy.metadata.creation_timestamp = Some(Time(
            jiff::Timestamp::from_second(1_700_000_000 + second).expect("in range"),
        ));
        policy
    }

    /// `policy` as its running controller records it: holding the parent it names.
    fn holding(mut policy: ReconcilePolicy) -> ReconcilePolicy {
        policy.status.get_or_insert_default().claimed_parent = Some(policy.spec.parent.clone());
        policy
    }

    /// Who keeps `policy`'s parents instead of it, by name, with its status as given.
    fn claim(policy: &ReconcilePolicy, all: &[ReconcilePolicy]) -> Option<String> {
        first_claim(policy, holds_its_kind(policy), all.iter()).map(|p| p.name_any())
    }

    /// `policy` as the host makes it from a team's NamespacedReconcilePolicy.
    fn teams(mut policy: ReconcilePolicy) -> ReconcilePolicy {
        let namespace = policy.spec.parent.namespace.clone().unwrap_or_default();
        policy.metadata.annotations.get_or_insert_default().insert(
            crate::policy::namespaced::SOURCE_ANNOTATION.to_owned(),
            format!("{namespace}/p"),
        );
        policy
    }

    #[test]
    fn a_policy_that_never_ran_keeps_nobody_out_however_old() {
        let old = policy("old", 0, "MyApp", None);
        let new = policy("new", 10, "MyApp", None);
        let all = [old.clone(), new.clone()];
        assert_eq!(claim(&new, &all), None);
        assert_eq!(claim(&old, &all), None);
        // Once one runs, it keeps the kind.
        let all = [old.clone(), holding(new.clone())];
        assert_eq!(claim(&old, &all).as_deref(), Some("new"));
    }

    #[test]
    fn a_teams_policy_never_keeps_an_admins_out_and_an_admins_keeps_a_teams_out() {
        // The team's policy came first and even holds the kind.
        let team = holding(teams(policy("team-a.p", 0, "MyApp", Some("team-a"))));
        let admin = policy("admin", 10, "MyApp", None);
        let all = [team.clone(), admin.clone()];
        assert_eq!(claim(&admin, &all), None, "the admin's runs");
        let admin = holding(admin);
        let all = [team.clone(), admin.clone()];
        assert_eq!(claim(&team, &all).as_deref(), Some("admin"));
        assert_eq!(
            recheck(Stand::Running, &team, all.iter()),
            Recheck::Restart,
            "the team's stops"
        );
        assert_eq!(recheck(Stand::Running, &admin, all.iter()), Recheck::Keep);
        // Between teams' policies the usual rule holds: a holder keeps, an idler does not.
        let other_team = teams(policy("team-b.p", 5, "MyApp", None));
        assert_eq!(
            claim(&other_team, &[team.clone(), other_team.clone()]).as_deref(),
            Some("team-a.p")
        );
        let idle = teams(policy("team-a.idle", 0, "MyApp", Some("team-a")));
        assert_eq!(claim(&other_team, &[idle, other_team.clone()]), None);
    }

    #[test]
    fn another_version_of_the_same_kind_is_the_same_kind() {
        let v1 = holding(versioned("v1", 0, "example.com/v1", "Widget", None));
        let beta = versioned("beta", 10, "example.com/v1beta1", "Widget", None);
        let other_group = versioned("other", 20, "other.example.com/v1", "Widget", None);
        let all = [v1.clone(), beta.clone(), other_group.clone()];
        assert_eq!(claim(&beta, &all).as_deref(), Some("v1"));
        assert_eq!(claim(&other_group, &all), None);
    }

    #[test]
    fn the_policy_that_holds_the_kind_keeps_it_even_from_an_older_one() {
        // `older` was edited onto the kind `running` holds.
        let older = policy("older", 0, "MyApp", None);
        let running = holding(policy("running", 10, "MyApp", None));
        let all = [older.clone(), running.clone()];
        assert_eq!(claim(&older, &all).as_deref(), Some("running"));
        assert_eq!(claim(&running, &all), None);
        assert_eq!(
            recheck(Stand::Running, &running, all.iter()),
            Recheck::Keep,
            "the running one keeps running"
        );
        assert_eq!(recheck(Stand::Refused, &older, all.iter()), Recheck::Keep);
        // A claim on the kind it held before an edit holds nothing.
        let mut moved = running.clone();
        moved.spec.parent.kind = "Other".into();
        let all = [older.clone(), moved];
        assert_eq!(claim(&older, &all), None);
        assert_eq!(recheck(Stand::Refused, &older, all.iter()), Recheck::Retry);
        // A new version of the same kind still holds it.
        let mut upgraded = running.clone();
        upgraded.spec.parent.api_version = "example.com/v2".into();
        assert_eq!(
            claim(&older, &[older.clone(), upgraded]).as_deref(),
            Some("running")
        );
    }

    #[test]
    fn of_two_that_hold_the_kind_the_older_keeps_it_and_the_newer_restarts() {
        let first = holding(policy("first", 0, "MyApp", None));
        let second = holding(policy("second", 10, "MyApp", None));
        let all = [first.clone(), second.clone()];
        assert_eq!(
            recheck(Stand::Running, &second, all.iter()),
            Recheck::Restart
        );
        assert_eq!(recheck(Stand::Running, &first, all.iter()), Recheck::Keep);
        // A task still preparing is left to its own check.
        assert_eq!(
            recheck(Stand::Preparing, &second, all.iter()),
            Recheck::Keep
        );
    }

    #[test]
    fn a_refused_policy_retries_once_the_holder_is_gone() {
        let holder = holding(policy("holder", 10, "MyApp", None));
        let refused = policy("refused", 0, "MyApp", None);
        assert_eq!(
            recheck(Stand::Refused, &refused, [holder, refused.clone()].iter()),
            Recheck::Keep
        );
        assert_eq!(
            recheck(Stand::Refused, &refused, std::iter::once(&refused)),
            Recheck::Retry
        );
    }

    #[test]
    fn different_namespaces_or_kinds_do_not_overlap_but_no_namespace_overlaps_all() {
        let a = policy("a", 0, "MyApp", Some("team-a"));
        let b = holding(policy("b", 10, "MyApp", Some("team-b")));
        let other_kind = policy("c", 20, "Other", None);
        let everywhere = policy("d", 30, "MyApp", None);
        let all = [a.clone(), b.clone(), other_kind.clone(), everywhere.clone()];
        assert_eq!(claim(&a, &all), None);
        assert_eq!(claim(&b, &all), None);
        assert_eq!(claim(&other_kind, &all), None);
        assert_eq!(claim(&everywhere, &all).as_deref(), Some("b"), "b holds");
    }

    #[test]
    fn a_policy_being_deleted_claims_nothing_and_ties_break_by_name() {
        let mut leaving = holding(policy("leaving", 0, "MyApp", None));
        leaving.metadata.deletion_timestamp = leaving.metadata.creation_timestamp.clone();
        let x = holding(policy("x", 5, "MyApp", None));
        let y = holding(policy("y", 5, "MyApp", None));
        let all = [leaving, x.clone(), y.clone()];
        assert_eq!(claim(&x, &all), None);
        assert_eq!(claim(&y, &all).as_deref(), Some("x"));
    }
}
