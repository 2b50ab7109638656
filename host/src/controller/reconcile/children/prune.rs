//! Pruning: which observed children the plugin no longer desires. The reconciler deletes them
//! only after every apply succeeded, and only those this parent controls.

use std::collections::HashSet;

use super::validate::DesiredChild;

/// Which API resource a child kind is served as: its group and plural, without the version.
/// One object is served under every version of its resource, so two of the policy's child
/// kinds that are versions of one resource both observe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupResource<'a> {
    /// e.g. `autoscaling`; empty for the core group.
    pub group: &'a str,
    /// e.g. `horizontalpodautoscalers`.
    pub resource: &'a str,
}

/// The observed children no longer desired: the same resource and name is the same child,
/// whatever its content and whichever version it was observed or answered in, so an object
/// is never pruned because the plugin answered it under another version of its resource.
/// Each observed child is `(kind index, name)`, and `resources[i]` is the resource of the
/// policy's `i`th child kind. The result holds positions in `observed`, in order, one per
/// object even when two kinds observed it.
pub fn to_prune<'a>(
    observed: impl IntoIterator<Item = (usize, &'a str)>,
    desired: &[DesiredChild],
    resources: &[GroupResource<'_>],
) -> Vec<usize> {
    let wanted: HashSet<(GroupResource<'_>, &str)> = desired
        .iter()
        .map(|d| (resources[d.kind_index], d.name.as_str()))
        .collect();
    let mut chosen = HashSet::new();
    observed
        .into_iter()
        .enumerate()
        .filter(|(_, (index, name))| {
            let key = (resources[*index], *name);
            !wanted.contains(&key) && chosen.insert(key)
        })
        .map(|(position, _)| position)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desired(kind_index: usize, name: &str) -> DesiredChild {
        crate::controller::testing::desired_child(kind_index, name, Vec::new())
    }

    const DEPLOYMENTS: GroupResource<'static> = GroupResource {
        group: "apps",
        resource: "deployments",
    };
    const SERVICES: GroupResource<'static> = GroupResource {
        group: "",
        resource: "services",
    };
    const HPAS: GroupResource<'static> = GroupResource {
        group: "autoscaling",
        resource: "horizontalpodautoscalers",
    };

    #[test]
    fn children_no_longer_desired_are_pruned_by_kind_and_name() {
        let resources = [DEPLOYMENTS, SERVICES];
        let observed = [(0, "web"), (1, "web"), (0, "old"), (1, "gone")];
        assert_eq!(
            to_prune(
                observed,
                &[desired(0, "web"), desired(1, "web")],
                &resources
            ),
            [2, 3]
        );
        // A Service named like a desired Deployment is not that Deployment.
        assert_eq!(
            to_prune(observed, &[desired(0, "gone")], &resources),
            [0, 1, 2, 3]
        );
        assert_eq!(to_prune(observed, &[], &resources), [0, 1, 2, 3]);
        assert!(to_prune([], &[desired(0, "web")], &resources).is_empty());
    }

    #[test]
    fn a_child_answered_under_another_version_of_its_resource_is_kept() {
        // autoscaling/v1 and autoscaling/v2 HorizontalPodAutoscaler: both caches see `web`.
        let resources = [HPAS, HPAS];
        let observed = [(0, "web"), (1, "web"), (0, "old"), (1, "old")];
        assert_eq!(
            to_prune(observed, &[desired(1, "web")], &resources),
            [2],
            "web is desired in v2, so it is not pruned as a v1 object; old is deleted once"
        );
        assert_eq!(to_prune(observed, &[desired(0, "web")], &resources), [2]);
    }
}
