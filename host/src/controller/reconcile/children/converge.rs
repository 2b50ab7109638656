//! Convergence: whether a child in the cache already is what the plugin desires (then a
//! resync costs no write), and which fields differ when it is not (for the reconcile's record).

use serde_json::Value;

use super::validate::DesiredChild;
use crate::controller::labels::DESIRED_HASH_ANNOTATION;

/// Whether the observed child already is what the plugin desires: it carries the fingerprint
/// of this exact desired object (so no field was dropped from the desire since the last
/// apply), and every desired field has the desired value (so nobody edited it by hand).
pub fn is_converged(desired: &DesiredChild, observed: &Value) -> bool {
    observed["metadata"]["annotations"][DESIRED_HASH_ANNOTATION].as_str()
        == Some(desired.hash.as_str())
        && is_subset(&desired.object, observed)
}

/// The paths of the desired fields whose observed value differs, at most `limit`, in key
/// order (`.spec.replicas`, `.metadata.labels.app (missing)`).
pub fn differences(desired: &Value, observed: &Value, limit: usize) -> Vec<String> {
    fn walk(
        desired: &Value,
        observed: &Value,
        path: &mut String,
        limit: usize,
        found: &mut Vec<String>,
    ) {
        match (desired, observed) {
            (Value::Object(want), Value::Object(have)) => {
                for (key, value) in want {
                    if found.len() >= limit {
                        return;
                    }
                    let len = path.len();
                    path.push('.');
                    path.push_str(key);
                    match have.get(key) {
                        Some(found_value) if key == "finalizers" => {
                            if !finalizers_held(value, found_value) {
                                found.push(path.clone());
                            }
                        }
                        Some(found_value) => walk(value, found_value, path, limit, found),
                        None if value.is_null() => {}
                        None => found.push(format!("{path} (missing)")),
                    }
                    path.truncate(len);
                }
            }
            (Value::Array(want), Value::Array(have)) if want.len() == have.len() => {
                for (i, (w, h)) in want.iter().zip(have).enumerate() {
                    if found.len() >= limit {
                        return;
                    }
                    let len = path.len();
                    path.push_str(&format!("[{i}]"));
                    walk(w, h, path, limit, found);
                    path.truncate(len);
                }
            }
            _ if is_subset(desired, observed) => {}
            _ => found.push(path.clone()),
        }
    }
    let mut found = Vec::new();
    walk(desired, observed, &mut String::new(), limit, &mut found);
    found
}

/// Whether every field of `desired` is in `observed` with an equal value. Fields the server
/// adds (defaults, status, other managers' fields) are ignored; a desired `null` matches an
/// absent field; numbers compare by value, so `1` equals `1.0`. A `finalizers` list is a
/// set others add to (the API server's `kubernetes.io/pvc-protection`, a load balancer's
/// cleanup, an operator's own): it matches when it holds every desired entry.
pub fn is_subset(desired: &Value, observed: &Value) -> bool {
    match (desired, observed) {
        (Value::Object(want), Value::Object(have)) => {
            want.iter().all(|(key, value)| match have.get(key) {
                Some(found) if key == "finalizers" => finalizers_held(value, found),
                Some(found) => is_subset(value, found),
                None => value.is_null(),
            })
        }
        (Value::Array(want), Value::Array(have)) => {
            want.len() == have.len() && want.iter().zip(have).all(|(w, h)| is_subset(w, h))
        }
        (Value::Number(want), Value::Number(have)) => {
            want == have || want.as_f64().is_some_and(|w| Some(w) == have.as_f64())
        }
        (Value::Null, Value::Null) => true,
        (want, have) => want == have,
    }
}

/// Whether the `observed` finalizers hold every `desired` one, whatever else they hold.
fn finalizers_held(desired: &Value, observed: &Value) -> bool {
    match (desired, observed) {
        (Value::Array(want), Value::Array(have)) => want.iter().all(|w| have.contains(w)),
        (want, have) => is_subset(want, have),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::controller::reconcile::children::validate::prepare;
    use crate::controller::testing::{
        allowed_kinds as allowed, deployment, team_a_parent as parent,
    };

    #[test]
    fn finalizers_others_add_leave_a_child_converged() {
        let mut held = deployment("db");
        held["metadata"]["finalizers"] = json!(["wasmctrl.dev/teardown-order"]);
        let child = prepare(vec![held], &allowed(), &parent(), "p")
            .expect("ok")
            .remove(0);
        let mut observed = child.object.clone();
        observed["metadata"]["finalizers"] = json!([
            "kubernetes.io/pvc-protection",
            "wasmctrl.dev/teardown-order"
        ]);
        assert!(is_converged(&child, &observed));
        assert!(differences(&child.object, &observed, 8).is_empty());
        observed["metadata"]["finalizers"] = json!(["kubernetes.io/pvc-protection"]);
        assert!(!is_converged(&child, &observed), "ours is gone");
        assert_eq!(
            differences(&child.object, &observed, 8),
            [".metadata.finalizers"]
        );
    }

    #[test]
    fn converged_means_same_hash_and_no_hand_edits() {
        let child = prepare(vec![deployment("web")], &allowed(), &parent(), "p")
            .expect("ok")
            .remove(0);
        let mut observed = child.object.clone();
        observed["metadata"]["resourceVersion"] = json!("42");
        observed["spec"]["strategy"] = json!({"type": "RollingUpdate"});
        observed["status"] = json!({"readyReplicas": 3});
        assert!(is_converged(&child, &observed));

        let mut edited = observed.clone();
        edited["spec"]["replicas"] = json!(1);
        assert!(
            !is_converged(&child, &edited),
            "a hand edit must be corrected"
        );

        let mut stale = observed;
        stale["metadata"]["annotations"][DESIRED_HASH_ANNOTATION] = json!("old");
        assert!(
            !is_converged(&child, &stale),
            "a dropped field must be applied away"
        );
    }

    #[test]
    fn the_first_difference_is_named_by_path() {
        let first_difference = |d: &Value, o: &Value| differences(d, o, 1).into_iter().next();
        let desired = json!({"spec": {"replicas": 3, "ports": [{"port": 80}]}});
        let observed = json!({"spec": {"replicas": 3, "ports": [{"port": 81}]}});
        assert_eq!(
            first_difference(&desired, &observed).as_deref(),
            Some(".spec.ports[0].port")
        );
        assert_eq!(first_difference(&desired, &desired), None);
        assert_eq!(
            first_difference(&json!({"a": 1}), &json!({})).as_deref(),
            Some(".a (missing)")
        );
    }

    #[test]
    fn every_difference_is_named_up_to_the_limit() {
        let desired =
            json!({"spec": {"replicas": 3, "image": "b", "ports": [{"port": 80}]}, "x": null});
        let observed =
            json!({"spec": {"replicas": 2, "image": "a", "ports": [{"port": 81}], "extra": 1}});
        assert_eq!(
            differences(&desired, &observed, 10),
            [".spec.image", ".spec.ports[0].port", ".spec.replicas"],
            "fields the server added and desired nulls are not differences"
        );
        assert_eq!(differences(&desired, &observed, 2).len(), 2);
        assert!(differences(&desired, &desired, 10).is_empty());
    }

    #[test]
    fn subset_rules() {
        assert!(is_subset(&json!({"a": 1}), &json!({"a": 1.0, "b": 2})));
        assert!(is_subset(&json!({"a": null}), &json!({})));
        assert!(!is_subset(&json!({"a": [1, 2]}), &json!({"a": [1]})));
        assert!(is_subset(
            &json!([{"port": 80}]),
            &json!([{"port": 80, "protocol": "TCP"}])
        ));
        assert!(!is_subset(&json!({"a": "1"}), &json!({"a": 1})));
    }
}
