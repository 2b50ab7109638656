//! What a running policy reports in its status beyond `Ready`: how many parents reconcile
//! and fail, the candidate's shadow verdicts, whether its related kinds are narrowed, and
//! children of kinds it no longer manages. The counts are pure reads of the caches and the
//! bookkeeping, so they are tested without a cluster.

use std::collections::HashSet;

use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt as _};

use crate::controller::cache::cached::CachedObject;
use crate::controller::cache::related::RelatedBy;
use crate::controller::kinds::ResolvedKind;
use crate::controller::labels;
use crate::controller::policy_run::release;
use crate::controller::policy_run::status::{Counts, PolicyStatusWriter, State};
use crate::controller::reconcile::context::Outcomes;
use crate::controller::reconcile::events;
use crate::controller::reconcile::prune_guard::{
    CONFIRM_ANNOTATION, ParentId, PruneGuard, PruneLimits,
};
use crate::controller::reconcile::serving::Serving;
use crate::lock;
use crate::plugin::{Digest, Verdict};
use crate::policy::{CandidateStatus, KindRef, PruneGuardStatus, ReconcilePolicy, ShadowExample};

/// Kinds that left `spec.children` (now, or in an earlier run) and still have children: kept,
/// not pruned, and named in the `ChildrenManaged` condition until none are left.
pub(crate) async fn report_unmanaged_children(
    client: &Client,
    policy: &ReconcilePolicy,
    status: &mut PolicyStatusWriter,
    namespace: Option<&str>,
) {
    let spec = &policy.spec;
    let (managed, unmanaged) = status.child_kinds();
    let mut candidates: Vec<KindRef> = Vec::new();
    for kind in managed.iter().chain(unmanaged) {
        if !spec.children.contains(kind) && !candidates.contains(kind) {
            candidates.push(kind.clone());
        }
    }
    let label = labels::policy_label_value(&policy.name_any());
    let left = if candidates.is_empty() {
        Vec::new()
    } else {
        match release::unmanaged_children(client, &candidates, namespace, &label).await {
            Ok(left) => left,
            Err(error) => {
                // Unknown: keep reporting what was reported before.
                tracing::warn!(policy = %policy.name_any(), error = %format!("{error:#}"), "could not count children of removed kinds");
                candidates.into_iter().map(|kind| (kind, 0)).collect()
            }
        }
    };
    let condition = (!left.is_empty()).then(|| {
        let kinds = left
            .iter()
            .map(|(kind, count)| match count {
                0 => format!("{} {}", kind.api_version, kind.kind),
                n => format!("{n} {} {}", kind.api_version, kind.kind),
            })
            .collect::<Vec<_>>()
            .join(", ");
        State::failed(
            "ChildKindRemoved",
            format!(
                "{kinds} labelled {}={label} remain from kinds no longer in spec.children; the host kept them and no longer manages them (they go with their parents, or delete them yourself)",
                labels::POLICY_LABEL
            ),
        )
    });
    status.set_optional("ChildrenManaged", condition);
    status.set_child_kinds(
        spec.children.clone(),
        left.into_iter().map(|(kind, _)| kind).collect(),
    );
}

/// Whether every related kind is narrowed, by a selector or by name. One that is not makes
/// the host cache every object of that kind in the watched namespaces and hand all of them to
/// every call.
pub(crate) fn related_cost(related: &[(ResolvedKind, RelatedBy)]) -> Option<State> {
    if related.is_empty() {
        return None;
    }
    let unselected: Vec<String> = related
        .iter()
        .filter(|(_, by)| matches!(by, RelatedBy::All))
        .map(|(kind, _)| format!("{} {}", kind.resource.api_version, kind.resource.kind))
        .collect();
    Some(if unselected.is_empty() {
        State::ok(
            "Selected",
            "every related kind is chosen by a selector or by name",
        )
    } else {
        State::failed(
            "UnselectedRelatedKind",
            format!(
                "related {} without a selector: the host caches every such object in the watched namespaces and passes all of them to each call; add a selector, or nameFrom when the parent names the object",
                unselected.join(", ")
            ),
        )
    })
}

/// Count the parents; `active` is the digest of the active plugin. With `sweep`, what is
/// kept of deleted parents is dropped first.
pub(crate) fn counts(
    outcomes: &Outcomes,
    parents: &Store<CachedObject>,
    active: &Digest,
    sweep: bool,
) -> Counts {
    let exists = |key: &ObjectRef<CachedObject>| parents.get(key).is_some();
    if sweep {
        outcomes.backoff.retain(exists);
        lock(&outcomes.awaiting_change).retain(|key| exists(key));
    }
    let mut reconciled = lock(&outcomes.reconciled);
    if sweep {
        reconciled.retain(|key, _| exists(key));
    }
    Counts {
        reconciled: reconciled.len() as u64,
        failing: outcomes.backoff.failing() as u64,
        on_active: reconciled
            .values()
            .filter(|digest| digest.as_ref() == Some(active))
            .count() as u64,
    }
}

/// [`counts`] for each shard this replica holds, over that shard's parents (`kind`).
pub(crate) fn counts_per_shard(
    outcomes: &Outcomes,
    parents: &Store<CachedObject>,
    kind: &std::sync::Arc<kube::core::ApiResource>,
    active: &Digest,
    shards: &crate::shards::ShardOwnership,
) -> std::collections::BTreeMap<u32, crate::shards::ShardCounts> {
    let mut per_shard: std::collections::BTreeMap<u32, crate::shards::ShardCounts> = shards
        .held()
        .into_iter()
        .map(|shard| (shard, Default::default()))
        .collect();
    let reconciled = lock(&outcomes.reconciled);
    for parent in parents.state() {
        let shard = shards.shard_of_parent(parent.as_ref());
        let Some(counts) = per_shard.get_mut(&shard) else {
            continue;
        };
        let key = crate::controller::reconcile::parent::parent_key(parent.as_ref(), kind);
        if let Some(digest) = reconciled.get(&key) {
            counts.reconciled += 1;
            counts.on_active += u64::from(digest.as_ref() == Some(active));
        }
        counts.failing += u64::from(outcomes.backoff.is_failing(&key));
    }
    per_shard
}

/// The policy's counts over every shard, and each shard's, for its status: the sums leave
/// out the shards not counted yet.
pub(crate) fn counts_across_shards(
    reports: &[crate::shards::ShardReport],
) -> (Counts, Vec<crate::policy::ShardStatus>) {
    let mut total = crate::shards::ShardCounts::default();
    let shards = reports
        .iter()
        .map(|report| {
            let counts = report.report.as_ref().map(|r| r.counts);
            if let Some(counts) = counts {
                total += counts;
            }
            crate::policy::ShardStatus {
                shard: report.shard,
                holder: report.holder.clone(),
                parents_reconciled: counts.map(|c| c.reconciled),
                parents_failing: counts.map(|c| c.failing),
            }
        })
        .collect();
    let counts = Counts {
        reconciled: total.reconciled,
        failing: total.failing,
        on_active: total.on_active,
    };
    (counts, shards)
}

/// The prune guard's window for the policy's status: this replica's `own` (see
/// [`own_prune_window`]) and, on sharded hosts, the `others`' windows from their shard
/// reports; and, while it holds deletions, the `Ready=False, PruneHeld` state.
pub(crate) fn prune_guard(
    own: Option<PruneGuardStatus>,
    others: Vec<PruneGuardStatus>,
    policy: &ReconcilePolicy,
    limits: PruneLimits,
) -> (Option<PruneGuardStatus>, Option<State>) {
    let window = merge_prune_windows(own, others);
    let held = window
        .as_ref()
        .filter(|w| w.state == "Held")
        .map(|w| held_state(&annotate_target(policy), w, limits));
    (window, held)
}

/// This replica's own window, closed first if every parent it reconciles (those of its
/// shards, when sharded) was reconciled under it, and its caches hold them `whole`. With
/// `sweep`, the guard forgets deleted parents first.
pub(crate) fn own_prune_window(
    guard: &PruneGuard,
    parents: &Store<CachedObject>,
    policy: &ReconcilePolicy,
    sweep: bool,
    (share, whole): (Option<&crate::shards::ShardOwnership>, bool),
) -> Option<PruneGuardStatus> {
    let name = policy.name_any();
    let in_share = |parent: &CachedObject| share.is_none_or(|shards| shards.holds_parent(parent));
    // The guard keeps parents by id. One look at the cache gives both what the guard may
    // forget and how many parents the window waits for: counted at another moment, a parent
    // deleted (or a shard let go) in between would leave a visit standing for a parent
    // never reconciled under the window. Taken before the guard's lock, once per report that
    // needs it.
    let snapshot = std::cell::OnceCell::new();
    let mine = || {
        snapshot.get_or_init(|| {
            parents
                .state()
                .iter()
                .filter(|parent| in_share(parent))
                .map(|parent| {
                    let meta = &parent.metadata;
                    guard.id_of(
                        meta.namespace.as_deref(),
                        meta.name.as_deref().unwrap_or_default(),
                    )
                })
                .collect::<HashSet<ParentId>>()
        })
    };
    if share.is_some() || sweep {
        // Sharded, on every report: what is held or confirmed for the parents of a shard
        // given away would otherwise hold this window for ever. Otherwise, at a sweep.
        let mine = mine();
        guard.forget_gone(|id| mine.contains(&id));
    }
    // A shard taken whose parents are not cached yet would count as none to reconcile.
    if whole {
        let mine = mine();
        if guard.close_if_rolled_out(|id| mine.contains(&id), mine.len()) {
            tracing::info!(
                policy = %name,
                "every parent reconciled since the last change; pruning is no longer counted"
            );
        }
    }
    guard.status()
}

/// Examples of held deletions a merged window keeps, as one replica's does.
const PRUNE_EXAMPLES: usize = 5;

/// The prune guard over every replica of a sharded host: `own` window and the `others`'
/// (one per replica: the same window reported on several shards counts once). Held if any
/// holds; the token confirms every held window at once (their tokens, comma-separated);
/// the figures are sums and the examples the first few.
pub(crate) fn merge_prune_windows(
    own: Option<PruneGuardStatus>,
    others: Vec<PruneGuardStatus>,
) -> Option<PruneGuardStatus> {
    let mut windows: Vec<PruneGuardStatus> = Vec::new();
    for window in own.into_iter().chain(others) {
        if !windows.iter().any(|w| w.confirm == window.confirm) {
            windows.push(window);
        }
    }
    let mut merged = windows.first()?.clone();
    if windows.len() == 1 {
        return Some(merged);
    }
    let any = |state: &str| windows.iter().any(|w| w.state == state);
    merged.state = if any("Held") {
        "Held"
    } else if any("Confirmed") {
        "Confirmed"
    } else {
        "Watching"
    }
    .to_owned();
    let held: Vec<&str> = windows
        .iter()
        .filter(|w| w.state == "Held")
        .map(|w| w.confirm.as_str())
        .collect();
    if !held.is_empty() {
        merged.confirm = held.join(",");
    }
    merged.deleted = windows.iter().map(|w| w.deleted).sum();
    merged.allowed = windows.iter().map(|w| w.allowed).sum();
    merged.children_seen = windows.iter().map(|w| w.children_seen).sum();
    merged.recently_deleted = windows.iter().map(|w| w.recently_deleted).sum();
    merged.recently_allowed = windows.iter().map(|w| w.recently_allowed).sum();
    merged.held_deletions = windows.iter().map(|w| w.held_deletions).sum();
    merged.held_parents = windows.iter().map(|w| w.held_parents).sum();
    merged.examples = windows
        .iter()
        .flat_map(|w| w.examples.iter().cloned())
        .take(PRUNE_EXAMPLES)
        .collect();
    Some(merged)
}

/// `Ready=False, PruneHeld`: how much is held, why, a few examples, and how to answer.
/// What an admin annotates to confirm: the policy, or, for one made from a team's
/// NamespacedReconcilePolicy, the team's object (whose annotation the host carries over).
fn annotate_target(policy: &ReconcilePolicy) -> String {
    match crate::policy::namespaced::source(policy) {
        Some((namespace, name)) => format!("namespacedreconcilepolicy -n {namespace} {name}"),
        None => format!("reconcilepolicy {}", policy.name_any()),
    }
}

fn held_state(target: &str, window: &PruneGuardStatus, limits: PruneLimits) -> State {
    let examples = if window.examples.is_empty() {
        String::new()
    } else {
        format!("; e.g. {}", window.examples.join(", "))
    };
    State::failed(
        "PruneHeld",
        format!(
            "holding {} deletion(s) across {} parent(s) since {}: a change may delete {} of the {} children seen under it so far ({} deleted), and {} may go per {}s of the children of every parent ({} went in the last {}s) ({}% of them, at least {}){examples}. To let exactly the held deletions proceed: kubectl annotate {target} {CONFIRM_ANNOTATION}={} --overwrite; to cancel them, roll the change back",
            window.held_deletions,
            window.held_parents,
            window.since,
            window.allowed,
            window.children_seen,
            window.deleted,
            window.recently_allowed,
            limits.period.as_secs(),
            window.recently_deleted,
            limits.period.as_secs(),
            limits.max_fraction * 100.0,
            limits.floor,
            window.confirm,
        ),
    )
}

/// How many parents the candidate serves, and its shadow verdicts for the others, with a
/// few examples (sorted, so an unchanged picture writes nothing).
/// With `sweep`, the verdicts of deleted parents are dropped first. A sharded replica
/// counts and tallies the parents of `share`'s shards only (see [`merge_candidates`] for
/// the rest).
pub(crate) fn candidate_counts(
    serving: &Serving,
    parents: &Store<CachedObject>,
    sweep: bool,
    share: Option<&crate::shards::ShardOwnership>,
) -> Option<CandidateStatus> {
    let candidate = serving.candidate.load_full()?;
    let mut verdicts = lock(&serving.shadow);
    if sweep {
        verdicts.retain(|key, _| parents.get(key).is_some());
    }
    let in_share = |key: &ObjectRef<CachedObject>| {
        share.is_none_or(|shards| {
            parents
                .get(key)
                .is_some_and(|parent| shards.holds_parent(parent.as_ref()))
        })
    };
    let mut status = CandidateStatus {
        digest: candidate.serving.plugin.digest().to_string(),
        canary_parents: parents
            .state()
            .iter()
            .filter(|p| share.is_none_or(|shards| shards.holds_parent(p.as_ref())))
            .filter(|p| candidate.serves(&p.labels(), p.metadata.uid.as_deref()))
            .count() as u64,
        webhooks: serving.webhook_shadow(),
        ..CandidateStatus::default()
    };
    let mut examples = Vec::new();
    for (key, shadowed) in verdicts.iter().filter(|(key, _)| in_share(key)) {
        status.evaluated += 1;
        let verdict = &shadowed.verdict;
        match verdict {
            Verdict::Unchanged => {
                status.unchanged += 1;
                continue;
            }
            Verdict::WouldChange(_) => status.would_change += 1,
            Verdict::WouldFail(_) => status.would_fail += 1,
        }
        let parent = match &key.namespace {
            Some(ns) => format!("{ns}/{}", key.name),
            None => key.name.clone(),
        };
        examples.push(ShadowExample {
            parent,
            verdict: verdict.name().into(),
            detail: events::truncate(verdict.detail().to_owned(), 1024),
        });
    }
    examples.sort_by(|a, b| a.parent.cmp(&b.parent));
    examples.truncate(SHADOW_EXAMPLES);
    status.examples = examples;
    Some(status)
}

/// Shadow examples the candidate's status keeps.
const SHADOW_EXAMPLES: usize = 5;

/// The candidate over every replica of a sharded host: this replica's `own` status, with
/// the canary's parents and the verdicts the `others` (one per other replica) counted for
/// the same candidate added (each replica caches, and counts, its own shards' parents).
pub(crate) fn merge_candidates(
    own: Option<CandidateStatus>,
    others: Vec<CandidateStatus>,
) -> Option<CandidateStatus> {
    let mut merged = own?;
    for other in others.into_iter().filter(|o| o.digest == merged.digest) {
        merged.canary_parents += other.canary_parents;
        merged.evaluated += other.evaluated;
        merged.unchanged += other.unchanged;
        merged.would_change += other.would_change;
        merged.would_fail += other.would_fail;
        merged.examples.extend(other.examples);
    }
    merged.examples.sort_by(|a, b| a.parent.cmp(&b.parent));
    merged.examples.truncate(SHADOW_EXAMPLES);
    Some(merged)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::controller::reconcile::serving::{ActivePlugin, Candidate};
    use crate::controller::testing::{label_selector, myapps, parent, plugin, serving, store};

    fn key(namespace: &str, name: &str) -> ObjectRef<CachedObject> {
        ObjectRef::new_with(name, Arc::new(myapps())).within(namespace)
    }

    fn window(state: &str, confirm: &str, held: u64, examples: &[&str]) -> PruneGuardStatus {
        PruneGuardStatus {
            state: state.into(),
            since: "a swap".into(),
            confirm: confirm.into(),
            deleted: 1,
            allowed: 5,
            children_seen: 50,
            held_deletions: held,
            held_parents: held,
            examples: examples.iter().map(|e| (*e).to_owned()).collect(),
            ..PruneGuardStatus::default()
        }
    }

    /// Sharded hosts each guard their own parents: the status shows one window over all of
    /// them, held when any is, whose token confirms every held window at once, and a window
    /// reported on several shards counts once.
    #[test]
    fn the_windows_of_sharded_hosts_show_as_one() {
        assert_eq!(merge_prune_windows(None, Vec::new()), None);
        let own = window("Watching", "t-a", 0, &[]);
        assert_eq!(
            merge_prune_windows(Some(own.clone()), vec![own.clone()]),
            Some(own.clone()),
            "the same window twice"
        );
        let b = window("Held", "t-b", 3, &["ns/w-1 → ConfigMap x"]);
        let c = window("Held", "t-c", 2, &["ns/w-2 → ConfigMap y"]);
        let merged = merge_prune_windows(Some(own), vec![b.clone(), c, b]).expect("a window");
        assert_eq!(merged.state, "Held");
        assert_eq!(merged.confirm, "t-b,t-c", "the held windows' tokens");
        assert_eq!(
            (
                merged.held_deletions,
                merged.deleted,
                merged.allowed,
                merged.children_seen
            ),
            (5, 3, 15, 150)
        );
        assert_eq!(merged.examples.len(), 2);
        let held = held_state("reconcilepolicy p", &merged, PruneLimits::of(None));
        assert!(
            held.reason == "PruneHeld" && held.message.contains("confirm-prune=t-b,t-c "),
            "Ready=False, PruneHeld, naming the tokens: {}",
            held.message
        );
    }

    /// The candidate over sharded hosts: the other replicas' canary parents and tallies for
    /// the same candidate are added, with the first few examples of all; another
    /// candidate's (a replica not yet on the new one) are not.
    #[test]
    fn the_candidate_verdicts_of_sharded_hosts_add_up() {
        let tally = |digest: &str, would_fail: u64, parent: &str| CandidateStatus {
            digest: digest.into(),
            canary_parents: 7,
            evaluated: 10,
            unchanged: 10 - would_fail,
            would_fail,
            examples: vec![ShadowExample {
                parent: parent.into(),
                verdict: "WouldFail".into(),
                detail: String::new(),
            }],
            ..CandidateStatus::default()
        };
        assert_eq!(merge_candidates(None, vec![tally("d", 1, "ns/a")]), None);
        let merged = merge_candidates(
            Some(tally("d", 1, "ns/b")),
            vec![tally("d", 2, "ns/a"), tally("old", 5, "ns/c")],
        )
        .expect("a candidate");
        assert_eq!(
            (
                merged.canary_parents,
                merged.evaluated,
                merged.would_fail,
                merged.unchanged
            ),
            (14, 20, 3, 17)
        );
        let parents: Vec<&str> = merged.examples.iter().map(|e| e.parent.as_str()).collect();
        assert_eq!(parents, ["ns/a", "ns/b"]);
    }

    #[test]
    fn counts_take_only_parents_that_still_exist_and_forget_the_rest() {
        let parents = store(
            myapps(),
            vec![
                parent("a", "new-1", &[]),
                parent("a", "new-2", &[]),
                parent("a", "old", &[]),
                parent("a", "deleting", &[]),
                parent("a", "bad", &[]),
            ],
        );
        let (active, previous) = (Digest::of(b"active"), Digest::of(b"previous"));
        let outcomes = Outcomes::new(Duration::from_secs(1), Duration::from_secs(60));
        for (name, decided_by) in [
            ("new-1", Some(active)),
            ("new-2", Some(active)),
            ("old", Some(previous)),
            ("deleting", None),
            ("gone-new", Some(active)),
        ] {
            lock(&outcomes.reconciled).insert(key("a", name), decided_by);
        }
        for name in ["bad", "gone-bad"] {
            outcomes.backoff.failed(&key("a", name));
        }
        let unswept = Counts {
            reconciled: 5,
            failing: 2,
            on_active: 3,
        };
        assert_eq!(
            counts(&outcomes, &parents, &active, false),
            unswept,
            "no sweep: no parent looked up"
        );
        let expected = Counts {
            reconciled: 4,
            failing: 1,
            on_active: 2,
        };
        assert_eq!(counts(&outcomes, &parents, &active, true), expected);
        assert_eq!(
            lock(&outcomes.reconciled).len(),
            4,
            "deleted parents forgotten"
        );
        assert_eq!(outcomes.backoff.failing(), 1);
    }

    /// The guard keeps parents by id and the report names the cached ones by the same id: a
    /// window closes once every cached parent was visited, and a sweep forgets a parent that
    /// is no longer cached (here, the confirmation of its held deletion) but none that is.
    #[test]
    fn the_guards_window_closes_over_the_cached_parents_and_a_sweep_forgets_the_rest() {
        use crate::controller::reconcile::parent;
        use crate::controller::reconcile::prune_guard::{Admission, PruneLimits};
        let parents = store(
            myapps(),
            vec![parent("a", "p-1", &[]), parent("a", "p-2", &[])],
        );
        let policy: ReconcilePolicy = serde_json::from_value(serde_json::json!({
            "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
            "metadata": {"name": "p"},
            "spec": {"parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
                     "plugin": {"source": {"file": {"path": "p.wasm"}}}},
        }))
        .expect("a policy");
        let limits = PruneLimits {
            max_fraction: 0.0,
            floor: 0,
            period: Duration::from_secs(600),
        };
        let guard = PruneGuard::new(limits, "1-abc".into(), "a swap".into());
        let epoch = guard.epoch();
        let doomed = ["ConfigMap c".to_owned()];
        assert_eq!(guard.admit(&key("a", "gone"), 1, &doomed), Admission::Hold);
        // Keyed as a reconcile keys its parent.
        let kind = Arc::new(myapps());
        for cached in parents.state() {
            guard.visited(epoch, &parent::parent_key(&*cached, &kind));
        }
        guard.visited(epoch, &key("a", "gone"));
        let token = guard.status().expect("a window").confirm;
        assert!(guard.set_confirmation(Some(&token)));
        let window = |sweep| own_prune_window(&guard, &parents, &policy, sweep, (None, true));
        assert_eq!(
            window(false).map(|w| w.state),
            Some("Confirmed".to_owned()),
            "the confirmed deletion of a parent no longer cached is not made yet"
        );
        assert_eq!(
            window(true),
            None,
            "swept: both cached parents count as visited, the one gone is forgotten"
        );
    }

    #[test]
    fn without_a_candidate_there_is_nothing_to_count() {
        let state = Serving::new(ActivePlugin {
            plugin: plugin(),
            config: None,
        });
        assert!(candidate_counts(&state, &store(myapps(), vec![]), true, None).is_none());
    }

    #[test]
    fn shadow_verdicts_of_existing_parents_are_tallied_with_a_few_sorted_examples() {
        let mut objects: Vec<_> = (0..3)
            .map(|i| parent("a", &format!("canary-{i}"), &[("tier", "canary")]))
            .collect();
        objects.extend((0..8).map(|i| parent("a", &format!("p-{i}"), &[])));
        let parents = store(myapps(), objects);
        let state = Serving::new(ActivePlugin {
            plugin: plugin(),
            config: None,
        });
        state.candidate.store(Some(Arc::new(Candidate::new(
            serving("candidate"),
            Some(label_selector("tier", "canary")),
        ))));
        {
            let mut shadow = lock(&state.shadow);
            // Inserted out of order; the examples come out sorted by parent.
            for i in (0..6).rev() {
                shadow.insert(
                    key("a", &format!("p-{i}")),
                    Verdict::WouldChange(format!("~ ConfigMap p-{i}")).into(),
                );
            }
            shadow.insert(key("a", "p-6"), Verdict::WouldFail("trap".into()).into());
            shadow.insert(key("a", "p-7"), Verdict::Unchanged.into());
            shadow.insert(
                key("a", "deleted"),
                Verdict::WouldFail("gone".into()).into(),
            );
        }
        let status = candidate_counts(&state, &parents, true, None).expect("a candidate");
        assert_eq!(status.canary_parents, 3);
        assert_eq!(
            status.evaluated, 8,
            "the deleted parent's verdict is dropped"
        );
        assert_eq!(
            (status.unchanged, status.would_change, status.would_fail),
            (1, 6, 1)
        );
        let examples: Vec<_> = status.examples.iter().map(|e| e.parent.as_str()).collect();
        assert_eq!(examples, ["a/p-0", "a/p-1", "a/p-2", "a/p-3", "a/p-4"]);
        assert_eq!(status.examples[0].verdict, "WouldChange");
        assert_eq!(status.examples[0].detail, "~ ConfigMap p-0");
        assert_eq!(lock(&state.shadow).len(), 8);
    }
}
