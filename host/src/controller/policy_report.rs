//! What a running policy reports in its status beyond `Ready`: how many parents reconcile
//! and fail, the candidate's shadow verdicts, whether its related kinds are narrowed, and
//! children of kinds it no longer manages. The counts are pure reads of the caches and the
//! bookkeeping, so they are tested without a cluster.

use kube::core::{DynamicObject, Selector};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt as _};

use super::children;
use super::context::{PolicyContext, lock};
use super::events;
use super::kinds::ResolvedKind;
use super::policy_status::{PolicyStatusWriter, State};
use super::release;
use crate::plugin::Verdict;
use crate::policy::{CandidateStatus, KindRef, ReconcilePolicy, ShadowExample};

/// Kinds that left `spec.children` (now, or in an earlier run) and still have children: kept,
/// not pruned, and named in the `ChildrenManaged` condition until none are left.
pub(super) async fn report_unmanaged_children(
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
    let label = children::policy_label_value(&policy.name_any());
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
                children::POLICY_LABEL
            ),
        )
    });
    status.set_optional("ChildrenManaged", condition);
    status.set_child_kinds(
        spec.children.clone(),
        left.into_iter().map(|(kind, _)| kind).collect(),
    );
}

/// Whether every related kind is narrowed by a selector. One that is not makes the host cache
/// every object of that kind in the watched namespaces and hand all of them to every call.
pub(super) fn related_cost(related: &[(ResolvedKind, Option<Selector>)]) -> Option<State> {
    if related.is_empty() {
        return None;
    }
    let unselected: Vec<String> = related
        .iter()
        .filter(|(_, selector)| selector.is_none())
        .map(|(kind, _)| format!("{} {}", kind.resource.api_version, kind.resource.kind))
        .collect();
    Some(if unselected.is_empty() {
        State::ok("Selected", "every related kind has a selector")
    } else {
        State::failed(
            "UnselectedRelatedKind",
            format!(
                "related {} without a selector: the host caches every such object in the watched namespaces and passes all of them to each call; add a selector",
                unselected.join(", ")
            ),
        )
    })
}

/// Parents whose last reconcile succeeded and failed, among those that still exist.
pub(super) fn counts(ctx: &PolicyContext, parents: &Store<DynamicObject>) -> (u64, u64) {
    let exists = |key: &ObjectRef<DynamicObject>| parents.get(key).is_some();
    ctx.outcomes.backoff.retain(exists);
    for cache in &ctx.caches.children {
        cache.created.retain(|namespace, name| {
            let key = ObjectRef::new_with(name, cache.resource.clone());
            let key = match namespace {
                Some(namespace) => key.within(namespace),
                None => key,
            };
            cache.store.get(&key).is_some()
        });
    }
    let mut reconciled = lock(&ctx.outcomes.reconciled);
    reconciled.retain(exists);
    (
        reconciled.len() as u64,
        ctx.outcomes.backoff.failing() as u64,
    )
}

/// How many parents the candidate serves, and its shadow verdicts for the others, with a
/// few examples (sorted, so an unchanged picture writes nothing).
pub(super) fn candidate_counts(
    ctx: &PolicyContext,
    parents: &Store<DynamicObject>,
) -> Option<CandidateStatus> {
    use kube::core::SelectorExt as _;
    const EXAMPLES: usize = 5;
    let candidate = ctx.serving.candidate.load_full()?;
    let mut verdicts = lock(&ctx.serving.shadow);
    verdicts.retain(|key, _| parents.get(key).is_some());
    let mut status = CandidateStatus {
        digest: candidate.serving.plugin.digest().to_string(),
        canary_parents: candidate.canary.as_ref().map_or(0, |selector| {
            parents
                .state()
                .iter()
                .filter(|p| selector.matches(p.labels()))
                .count() as u64
        }),
        evaluated: verdicts.len() as u64,
        ..CandidateStatus::default()
    };
    let mut examples = Vec::new();
    for (key, verdict) in verdicts.iter() {
        let parent = match &key.namespace {
            Some(ns) => format!("{ns}/{}", key.name),
            None => key.name.clone(),
        };
        match verdict {
            Verdict::Unchanged => status.unchanged += 1,
            Verdict::WouldChange(detail) => {
                status.would_change += 1;
                examples.push(ShadowExample {
                    parent,
                    verdict: "WouldChange".into(),
                    detail: events::truncate(detail.clone(), 1024),
                });
            }
            Verdict::WouldFail(detail) => {
                status.would_fail += 1;
                examples.push(ShadowExample {
                    parent,
                    verdict: "WouldFail".into(),
                    detail: events::truncate(detail.clone(), 1024),
                });
            }
        }
    }
    examples.sort_by(|a, b| a.parent.cmp(&b.parent));
    examples.truncate(EXAMPLES);
    status.examples = examples;
    Some(status)
}
