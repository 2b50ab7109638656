//! Whether a child is ready, judged by the host from the child's own status: what a rollout's
//! readiness gate reads, so a plugin cannot pass it by writing `Ready=True` on its parent.
//!
//! The rules follow what each kind's controller reports (and what `kubectl rollout status`
//! reads): a Deployment is ready once its controller saw its latest spec and every replica
//! is updated and available; a StatefulSet or a DaemonSet once every replica is ready and
//! those its update strategy updates (none with `OnDelete`, those at or above a partition)
//! are updated; a Job once complete; a PersistentVolumeClaim once bound; a Pod once `Ready`
//! (or `Succeeded`); a
//! CustomResourceDefinition once established; a Service of type `LoadBalancer` once it has
//! an address (any other Service once it exists: whether its pods are ready is the
//! workload's readiness, which a child depends on directly). Any other object is ready
//! unless its status says otherwise: an `observedGeneration` behind its
//! `metadata.generation`, or a `Ready` or `Available` condition that is not `True`. An
//! object with no status at all (a ConfigMap, a Secret) is ready.
//!
//! A child that carries a CEL expression in its `wasmctrl.dev/ready-when` annotation is
//! ready when that expression, over the child as stored (`self`), is `true`, whatever its
//! kind: for the kinds these rules do not know, or a readiness of the plugin's own.

use serde_json::Value;

use super::order;

/// Longest `ready-when` expression: a readiness rule is a line, not a program.
const MAX_EXPRESSION_BYTES: usize = 1024;

/// Most comprehensions (`all`, `exists`, `exists_one`, `map`, `filter`) in one expression.
/// The host evaluates it outside any sandbox, on each look at the child; nested
/// comprehensions multiply, so a plugin could otherwise spend the host's CPU.
const MAX_COMPREHENSIONS: usize = 2;

/// A `ready-when` expression, compiled, or why it cannot be.
pub(crate) fn compile(expression: &str) -> Result<cel::Program, String> {
    if expression.len() > MAX_EXPRESSION_BYTES {
        return Err(format!(
            "the expression is {} bytes, above the {MAX_EXPRESSION_BYTES}-byte limit",
            expression.len()
        ));
    }
    let comprehensions = [".all(", ".exists(", ".exists_one(", ".map(", ".filter("]
        .iter()
        .map(|macro_| expression.matches(macro_).count())
        .sum::<usize>();
    if comprehensions > MAX_COMPREHENSIONS {
        return Err(format!(
            "the expression has {comprehensions} comprehensions (all, exists, map, filter), above the limit of {MAX_COMPREHENSIONS}"
        ));
    }
    cel::Program::compile(expression)
        .map_err(|error| format!("{expression:?} is not a CEL expression: {error}"))
}

/// Why `child` is not ready by the CEL `expression` over it, or `None` when it is. An
/// expression that fails (a field not there yet, say) leaves the child not ready.
fn not_ready_by(child: &Value, expression: &str) -> Option<String> {
    let program = match compile(expression) {
        Ok(program) => program,
        Err(error) => return Some(error),
    };
    let mut context = cel::Context::default();
    if let Err(error) = context.add_variable("self", child) {
        return Some(format!("{expression} could not read the object: {error}"));
    }
    match program.execute(&context) {
        Ok(cel::Value::Bool(true)) => None,
        Ok(cel::Value::Bool(false)) => Some(format!("{expression} is false")),
        Ok(other) => Some(format!("{expression} gave {other:?}, not true or false")),
        Err(error) => Some(format!("{expression} failed: {error}")),
    }
}

/// Why a child is not ready, or `None` when it is.
pub(crate) fn not_ready(child: &Value) -> Option<String> {
    if let Some(expression) = order::ready_when(child) {
        return not_ready_by(child, expression);
    }
    let api_version = child["apiVersion"].as_str().unwrap_or_default();
    let group = api_version.rsplit_once('/').map_or("", |(group, _)| group);
    let kind = child["kind"].as_str().unwrap_or_default();
    let status = &child["status"];
    if let Some(behind) = generation_behind(child) {
        return Some(behind);
    }
    match (group, kind) {
        ("apps", "Deployment") => replicas(child, &["updatedReplicas", "availableReplicas"])
            .or_else(|| {
                // Old replicas still running: the rollout is not over.
                let total = count(&status["replicas"]);
                let updated = count(&status["updatedReplicas"]);
                (total > updated)
                    .then(|| format!("{} old replica(s) still running", total - updated))
            }),
        ("apps", "StatefulSet") => {
            // As `kubectl rollout status`: with OnDelete, updates wait for someone to delete
            // pods; with a partition, only the pods at or above it are updated.
            let strategy = &child["spec"]["updateStrategy"];
            let desired = child["spec"]["replicas"].as_u64().unwrap_or(1);
            let partition = strategy["rollingUpdate"]["partition"].as_u64().unwrap_or(0);
            let updated_needed = if strategy["type"] == "OnDelete" {
                0
            } else {
                desired.saturating_sub(partition)
            };
            if count(&status["readyReplicas"]) < desired {
                Some(format!(
                    "readyReplicas {} of {desired}",
                    count(&status["readyReplicas"])
                ))
            } else if count(&status["updatedReplicas"]) < updated_needed {
                Some(format!(
                    "updatedReplicas {} of {updated_needed}",
                    count(&status["updatedReplicas"])
                ))
            } else {
                None
            }
        }
        ("apps", "DaemonSet") => {
            let desired = count(&status["desiredNumberScheduled"]);
            let on_delete = child["spec"]["updateStrategy"]["type"] == "OnDelete";
            ["updatedNumberScheduled", "numberReady"]
                .into_iter()
                .filter(|field| !(on_delete && *field == "updatedNumberScheduled"))
                .find(|field| count(&status[*field]) < desired)
                .map(|field| format!("{field} {} of {desired}", count(&status[field])))
        }
        ("batch", "Job") => (!condition_true(status, "Complete")).then(|| {
            if condition_true(status, "Failed") {
                "failed".to_owned()
            } else {
                "not complete".to_owned()
            }
        }),
        ("", "PersistentVolumeClaim") => {
            let phase = status["phase"].as_str().unwrap_or("Pending");
            (phase != "Bound").then(|| format!("phase {phase}"))
        }
        // A Pod that ran to completion is done, not failing.
        ("", "Pod") => (status["phase"] != "Succeeded" && !condition_true(status, "Ready"))
            .then(|| "not Ready".to_owned()),
        ("", "Service") => {
            let addressed = status["loadBalancer"]["ingress"]
                .as_array()
                .is_some_and(|ingress| !ingress.is_empty());
            (child["spec"]["type"] == "LoadBalancer" && !addressed)
                .then(|| "no load balancer address".to_owned())
        }
        ("apiextensions.k8s.io", "CustomResourceDefinition") => {
            (!condition_true(status, "Established")).then(|| "not Established".to_owned())
        }
        _ => ["Ready", "Available"].into_iter().find_map(|type_| {
            let condition = find_condition(status, type_)?;
            (condition["status"] != "True").then(|| {
                format!(
                    "{type_}={}",
                    condition["status"].as_str().unwrap_or("Unknown")
                )
            })
        }),
    }
}

/// `observedGeneration N behind generation M`, when the status is about an older spec.
fn generation_behind(child: &Value) -> Option<String> {
    let generation = child["metadata"]["generation"].as_i64()?;
    let observed = child["status"]["observedGeneration"].as_i64();
    let workload = matches!(
        child["kind"].as_str(),
        Some("Deployment" | "StatefulSet" | "DaemonSet")
    );
    match observed {
        Some(observed) if observed < generation => Some(format!(
            "status.observedGeneration {observed} is behind generation {generation}"
        )),
        // A workload's controller always reports what it saw; nothing yet is not ready.
        None if workload => Some("its controller has not reported on it yet".to_owned()),
        _ => None,
    }
}

/// The first of `fields` of the status below the desired replicas (`spec.replicas`, 1 when
/// unset), in words.
fn replicas(child: &Value, fields: &[&str]) -> Option<String> {
    let desired = child["spec"]["replicas"].as_u64().unwrap_or(1);
    fields
        .iter()
        .find(|field| count(&child["status"][**field]) < desired)
        .map(|field| format!("{field} {} of {desired}", count(&child["status"][*field])))
}

fn count(value: &Value) -> u64 {
    value.as_u64().unwrap_or(0)
}

fn find_condition<'a>(status: &'a Value, type_: &str) -> Option<&'a Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

fn condition_true(status: &Value, type_: &str) -> bool {
    find_condition(status, type_).is_some_and(|c| c["status"] == "True")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn deployment(generation: i64, status: Value) -> Value {
        json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d", "generation": generation},
            "spec": {"replicas": 2}, "status": status})
    }

    #[test]
    fn a_deployment_is_ready_once_its_latest_spec_is_updated_and_available() {
        let available = json!({"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2,
            "availableReplicas": 2});
        assert_eq!(not_ready(&deployment(3, available.clone())), None);
        let behind = not_ready(&deployment(4, available)).expect("a newer spec");
        assert!(behind.contains("behind generation 4"), "{behind}");
        let unavailable = json!({"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2,
            "availableReplicas": 1});
        assert_eq!(
            not_ready(&deployment(3, unavailable)).as_deref(),
            Some("availableReplicas 1 of 2")
        );
        let rolling = json!({"observedGeneration": 3, "replicas": 3, "updatedReplicas": 2,
            "availableReplicas": 2});
        assert_eq!(
            not_ready(&deployment(3, rolling)).as_deref(),
            Some("1 old replica(s) still running")
        );
        assert!(
            not_ready(&deployment(1, Value::Null)).is_some(),
            "never reported"
        );
    }

    #[test]
    fn jobs_claims_pods_and_crds_have_their_own_rule() {
        let job = |conditions: Value| {
            json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
                "status": {"conditions": conditions}})
        };
        assert_eq!(
            not_ready(&job(json!([{"type": "Complete", "status": "True"}]))),
            None
        );
        assert_eq!(
            not_ready(&job(json!([{"type": "Failed", "status": "True"}]))).as_deref(),
            Some("failed")
        );
        let claim = |phase: &str| {
            json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": "c"}, "status": {"phase": phase}})
        };
        assert_eq!(not_ready(&claim("Bound")), None);
        assert_eq!(
            not_ready(&claim("Pending")).as_deref(),
            Some("phase Pending")
        );
        let crd = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "x"}, "status": {"conditions": [{"type": "Established", "status": "False"}]}});
        assert_eq!(not_ready(&crd).as_deref(), Some("not Established"));
    }

    #[test]
    fn a_statefulset_follows_its_update_strategy() {
        let set = |strategy: Value, updated: u64| {
            json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
                "metadata": {"name": "s", "generation": 2},
                "spec": {"replicas": 3, "updateStrategy": strategy},
                "status": {"observedGeneration": 2, "readyReplicas": 3, "updatedReplicas": updated}})
        };
        assert!(not_ready(&set(json!({"type": "RollingUpdate"}), 2)).is_some());
        assert_eq!(
            not_ready(&set(
                json!({"type": "RollingUpdate", "rollingUpdate": {"partition": 2}}),
                1
            )),
            None
        );
        assert_eq!(not_ready(&set(json!({"type": "OnDelete"}), 0)), None);
        let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "status": {"phase": "Succeeded"}});
        assert_eq!(not_ready(&pod), None);
    }

    #[test]
    fn a_ready_when_expression_decides_over_the_kinds_rule() {
        let database = |ready_when: &str, status: Value| {
            json!({"apiVersion": "example.com/v1", "kind": "Database",
                "metadata": {"name": "db", "annotations": {
                    crate::controller::labels::READY_WHEN_ANNOTATION: ready_when}},
                "status": status})
        };
        let rule = "self.status.phase == 'Running' && self.status.replicas >= 2";
        assert_eq!(
            not_ready(&database(rule, json!({"phase": "Running", "replicas": 2}))),
            None
        );
        assert_eq!(
            not_ready(&database(rule, json!({"phase": "Running", "replicas": 1}))).as_deref(),
            Some("self.status.phase == 'Running' && self.status.replicas >= 2 is false")
        );
        let missing = not_ready(&database(rule, json!({}))).expect("not ready");
        assert!(missing.contains("failed"), "{missing}");
        let not_bool = not_ready(&database("self.status", json!({}))).expect("not ready");
        assert!(not_bool.contains("not true or false"), "{not_bool}");
        // Over the kind's own rule: a Job is ready when the plugin says so.
        let mut job = json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "j", "annotations": {
                crate::controller::labels::READY_WHEN_ANNOTATION: "has(self.status.active)"}},
            "status": {"active": 1}});
        assert_eq!(not_ready(&job), None);
        job["metadata"]["annotations"] = json!({});
        assert_eq!(not_ready(&job).as_deref(), Some("not complete"));
        assert!(compile("self.status.(").is_err());
        let nested = "[1,2].all(a, [1,2].all(b, [1,2].all(c, true)))";
        assert!(
            compile(nested)
                .expect_err("too many")
                .contains("comprehensions")
        );
        assert!(compile("[1,2].all(a, [1,2].exists(b, a == b))").is_ok());
        assert!(compile(&format!("true{}", " && true".repeat(200))).is_err());
    }

    #[test]
    fn a_load_balancer_is_ready_once_addressed() {
        let service = |type_: &str, status: Value| {
            json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
                "spec": {"type": type_}, "status": status})
        };
        assert!(not_ready(&service("LoadBalancer", json!({"loadBalancer": {}}))).is_some());
        assert_eq!(
            not_ready(&service(
                "LoadBalancer",
                json!({"loadBalancer": {"ingress": [{"ip": "10.0.0.9"}]}})
            )),
            None
        );
        assert_eq!(not_ready(&service("ClusterIP", json!({}))), None);
    }

    #[test]
    fn any_other_object_is_ready_unless_its_status_says_otherwise() {
        let config_map =
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}});
        assert_eq!(not_ready(&config_map), None);
        let custom = |generation: i64, observed: i64, ready: &str| {
            json!({"apiVersion": "example.com/v1", "kind": "Database",
                "metadata": {"name": "db", "generation": generation},
                "status": {"observedGeneration": observed,
                    "conditions": [{"type": "Ready", "status": ready}]}})
        };
        assert_eq!(not_ready(&custom(2, 2, "True")), None);
        assert_eq!(
            not_ready(&custom(2, 2, "False")).as_deref(),
            Some("Ready=False")
        );
        assert!(not_ready(&custom(3, 2, "True")).is_some());
    }
}
