//! One parent kind, one policy. Two policies reconciling the same parents would fight for
//! ever, each re-applying what the other changed. The older policy keeps the kind; a newer
//! one is refused (`ParentKindTaken`) unless both name different namespaces, which provably
//! keeps their parents apart. The check reads every policy in the cluster, not only those
//! this host runs, so hosts that split policies between them agree too.

use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt as _};

use crate::policy::ReconcilePolicy;

/// The older policy that already reconciles `policy`'s parents, if any.
pub(crate) async fn claimed_by(
    client: &Client,
    policy: &ReconcilePolicy,
) -> Result<Option<String>, kube::Error> {
    let all = Api::<ReconcilePolicy>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    Ok(first_claim(policy, &all.items))
}

/// Among `others`, the oldest live policy whose parents may overlap `policy`'s and that came
/// first. Pure, so the rule can be tested without a cluster.
pub(crate) fn first_claim(policy: &ReconcilePolicy, others: &[ReconcilePolicy]) -> Option<String> {
    others
        .iter()
        .filter(|other| other.metadata.uid != policy.metadata.uid)
        .filter(|other| other.metadata.deletion_timestamp.is_none())
        .filter(|other| overlap(policy, other))
        .filter(|other| age(other) < age(policy))
        .min_by_key(|other| age(other))
        .map(|other| other.name_any())
}

/// Whether two policies may reconcile the same parents.
fn overlap(a: &ReconcilePolicy, b: &ReconcilePolicy) -> bool {
    let (a, b) = (&a.spec.parent, &b.spec.parent);
    a.api_version == b.api_version
        && a.kind == b.kind
        && match (&a.namespace, &b.namespace) {
            (Some(x), Some(y)) => x == y,
            _ => true,
        }
}

/// Creation time, then name: a total order, so two hosts always agree on who came first.
fn age(policy: &ReconcilePolicy) -> (Option<jiff::Timestamp>, String) {
    (
        policy.metadata.creation_timestamp.as_ref().map(|t| t.0),
        policy.name_any(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn policy(name: &str, second: i64, kind: &str, namespace: Option<&str>) -> ReconcilePolicy {
        let mut policy: ReconcilePolicy = serde_json::from_value(serde_json::json!({
            "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
            "metadata": {"name": name, "uid": name},
            "spec": {
                "parent": {"apiVersion": "example.com/v1", "kind": kind, "namespace": namespace},
                "plugin": {"source": {"file": {"path": "p.wasm"}}},
            },
        }))
        .expect("valid policy");
        policy.metadata.creation_timestamp = Some(Time(
            jiff::Timestamp::from_second(1_700_000_000 + second).expect("in range"),
        ));
        policy
    }

    #[test]
    fn the_older_policy_keeps_the_kind() {
        let old = policy("old", 0, "MyApp", None);
        let new = policy("new", 10, "MyApp", None);
        let all = [old.clone(), new.clone()];
        assert_eq!(first_claim(&new, &all).as_deref(), Some("old"));
        assert_eq!(first_claim(&old, &all), None);
    }

    #[test]
    fn different_namespaces_or_kinds_do_not_overlap_but_no_namespace_overlaps_all() {
        let a = policy("a", 0, "MyApp", Some("team-a"));
        let b = policy("b", 10, "MyApp", Some("team-b"));
        let other_kind = policy("c", 20, "Other", None);
        let everywhere = policy("d", 30, "MyApp", None);
        let all = [a.clone(), b.clone(), other_kind.clone(), everywhere.clone()];
        assert_eq!(first_claim(&b, &all), None);
        assert_eq!(first_claim(&other_kind, &all), None);
        assert_eq!(first_claim(&everywhere, &all).as_deref(), Some("a"));
    }

    #[test]
    fn a_policy_being_deleted_claims_nothing_and_ties_break_by_name() {
        let mut leaving = policy("leaving", 0, "MyApp", None);
        leaving.metadata.deletion_timestamp = leaving.metadata.creation_timestamp.clone();
        let x = policy("x", 5, "MyApp", None);
        let y = policy("y", 5, "MyApp", None);
        let all = [leaving, x.clone(), y.clone()];
        assert_eq!(first_claim(&x, &all), None);
        assert_eq!(first_claim(&y, &all).as_deref(), Some("x"));
    }
}
