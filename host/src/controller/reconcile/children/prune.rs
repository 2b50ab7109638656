//! Pruning: which observed children the plugin no longer desires. The reconciler deletes them
//! only after every apply succeeded, and only those this parent controls.

use std::collections::HashSet;

use super::validate::DesiredChild;

/// The observed children no longer desired: same kind and name is the same child, whatever
/// its content. Each observed child is `(kind index, name)`; the result holds their positions
/// in `observed`, in order.
pub fn to_prune<'a>(
    observed: impl IntoIterator<Item = (usize, &'a str)>,
    desired: &[DesiredChild],
) -> Vec<usize> {
    let wanted: HashSet<(usize, &str)> = desired
        .iter()
        .map(|d| (d.kind_index, d.name.as_str()))
        .collect();
    observed
        .into_iter()
        .enumerate()
        .filter(|(_, child)| !wanted.contains(child))
        .map(|(position, _)| position)
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn children_no_longer_desired_are_pruned_by_kind_and_name() {
        let desired = |kind_index: usize, name: &str| DesiredChild {
            kind_index,
            name: name.to_owned(),
            namespace: Some("a".into()),
            object: json!({}),
            hash: String::new(),
        };
        let observed = [(0, "web"), (1, "web"), (0, "old"), (1, "gone")];
        assert_eq!(
            to_prune(observed, &[desired(0, "web"), desired(1, "web")]),
            [2, 3]
        );
        // A Service named like a desired Deployment is not that Deployment.
        assert_eq!(to_prune(observed, &[desired(0, "gone")]), [0, 1, 2, 3]);
        assert_eq!(to_prune(observed, &[]), [0, 1, 2, 3]);
        assert!(to_prune([], &[desired(0, "web")]).is_empty());
    }
}
