//! The parent's status as the host writes it: the plugin's status, plus `observedGeneration`
//! and a `Reconciled` condition, with `lastTransitionTime` stamped by the host (plugins have
//! no clock) and kept when a condition's status has not changed, so a steady state produces
//! an identical status and no write.

use serde_json::{Value, json};

use crate::plugin::JsonObject;

/// The condition the host owns on every parent.
pub const RECONCILED: &str = "Reconciled";
/// The condition the host owns on a parent whose children are ordered: whether some of
/// them still wait for what they depend on.
pub const PROGRESSING: &str = "Progressing";
/// The parent's readiness: the plugin's, but for ordered children judged by the host too.
pub const READY: &str = "Ready";

/// The outcome the `Reconciled` condition reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// `True` when the reconcile succeeded.
    pub success: bool,
    /// CamelCase reason.
    pub reason: String,
    /// What happened, for a human.
    pub message: String,
    /// Where the apply of ordered children stands; `None` for an answer without order (its
    /// parent gets no `Progressing` condition from the host) and for a failure.
    pub progress: Option<Progress>,
    /// For an answer with ordered children, whether every child is ready by the host's
    /// judgement: `Some(None)` when it is, `Some(Some(why))` when one is not. It decides the
    /// parent's `Ready` condition when the plugin sets none, and overrides a plugin's
    /// `Ready=True` its children do not bear out.
    pub children_ready: Option<Option<String>>,
}

/// Where the apply of an answer with ordered children stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Some children wait; what holds them, in words.
    Waiting(String),
    /// Every child is applied.
    Applied,
}

impl Outcome {
    /// A successful reconcile that desired `children` children.
    pub fn success(children: usize) -> Self {
        Self {
            success: true,
            reason: "Reconciled".into(),
            message: format!("{children} children desired"),
            progress: None,
            children_ready: None,
        }
    }

    /// A failed reconcile, for `reason`.
    pub fn failure(reason: impl Into<String>, message: String) -> Self {
        Self {
            success: false,
            reason: reason.into(),
            message,
            progress: None,
            children_ready: None,
        }
    }

    /// The same outcome, reporting where ordered children stand.
    #[must_use]
    pub fn with_progress(self, progress: Option<Progress>) -> Self {
        Self { progress, ..self }
    }

    /// The same outcome, with the host's judgement of the children's readiness (see
    /// [`Outcome::children_ready`]).
    #[must_use]
    pub fn with_children_ready(self, children_ready: Option<Option<String>>) -> Self {
        Self {
            children_ready,
            ..self
        }
    }
}

/// The status to write after a successful reconcile: the plugin's status with
/// `observedGeneration` and the `Reconciled` condition added, and transition times stamped.
pub fn after_success(
    plugin_status: Option<JsonObject>,
    generation: Option<i64>,
    observed_status: Option<&Value>,
    outcome: &Outcome,
    now: &str,
) -> JsonObject {
    let mut status = plugin_status.unwrap_or_default();
    if let Some(generation) = generation {
        status.insert("observedGeneration".into(), json!(generation));
    }
    let conditions = match status.remove("conditions") {
        Some(Value::Array(conditions)) => conditions,
        _ => Vec::new(),
    };
    let conditions = with_reconciled(conditions, generation, observed_status, outcome, now);
    status.insert("conditions".into(), Value::Array(conditions));
    status
}

/// The conditions to write after a failed reconcile: the observed ones, with `Reconciled`
/// replaced. Everything else in the status is left as it was, so a failure never erases what
/// the last success reported.
pub fn after_failure(
    generation: Option<i64>,
    observed_status: Option<&Value>,
    outcome: &Outcome,
    now: &str,
) -> Vec<Value> {
    let observed = observed_status
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    with_reconciled(observed, generation, observed_status, outcome, now)
}

fn with_reconciled(
    mut conditions: Vec<Value>,
    generation: Option<i64>,
    observed_status: Option<&Value>,
    outcome: &Outcome,
    now: &str,
) -> Vec<Value> {
    conditions.retain(|c| c.get("type").and_then(Value::as_str) != Some(RECONCILED));
    let mut reconciled = json!({
        "type": RECONCILED,
        "status": if outcome.success { "True" } else { "False" },
        "reason": outcome.reason,
        "message": outcome.message,
    });
    if let Some(generation) = generation {
        reconciled["observedGeneration"] = json!(generation);
    }
    if let Some(progress) = &outcome.progress {
        // The host's word on ordered children replaces whatever the plugin said.
        conditions.retain(|c| c.get("type").and_then(Value::as_str) != Some(PROGRESSING));
        let (state, reason, message) = match progress {
            Progress::Waiting(message) => ("True", "WaitingFor", message.as_str()),
            Progress::Applied => (
                "False",
                "Applied",
                "every child is applied, each after what it depends on was ready",
            ),
        };
        let mut progressing = json!({
            "type": PROGRESSING, "status": state, "reason": reason, "message": message,
        });
        if let Some(generation) = generation {
            progressing["observedGeneration"] = json!(generation);
        }
        conditions.push(progressing);
    }
    if let Some(children_ready) = &outcome.children_ready {
        judge_ready(&mut conditions, children_ready.as_deref(), generation);
    }
    conditions.push(reconciled);
    for condition in &mut conditions {
        stamp_transition(condition, observed_status, now);
    }
    conditions
}

/// The parent's `Ready` by its children's readiness: set when the plugin sets none, and
/// turned to `False` when the plugin claims `True` while a child is not ready. A plugin's
/// own `False` stands.
fn judge_ready(conditions: &mut Vec<Value>, not_ready: Option<&str>, generation: Option<i64>) {
    let plugins = conditions
        .iter()
        .position(|c| c.get("type").and_then(Value::as_str) == Some(READY));
    let claims = plugins.map(|at| conditions[at]["status"] == "True");
    let mut judged = match (not_ready, claims) {
        (None, None) => json!({"type": READY, "status": "True", "reason": "ChildrenReady",
            "message": "every child is ready"}),
        (Some(why), None | Some(true)) => json!({"type": READY, "status": "False",
            "reason": "ChildNotReady", "message": why}),
        (None | Some(_), Some(_)) => return,
    };
    if let Some(generation) = generation {
        judged["observedGeneration"] = json!(generation);
    }
    match plugins {
        Some(at) => conditions[at] = judged,
        None => conditions.push(judged),
    }
}

/// Give `condition` a `lastTransitionTime`: the observed one if the status did not change,
/// otherwise `now`. A plugin cannot know either, so whatever it sent is replaced.
fn stamp_transition(condition: &mut Value, observed_status: Option<&Value>, now: &str) {
    let Value::Object(fields) = condition else {
        return;
    };
    let kind = fields.get("type").and_then(Value::as_str);
    let state = fields.get("status").and_then(Value::as_str);
    let previous = observed_status
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .and_then(|observed| {
            observed.iter().find(|o| {
                o.get("type").and_then(Value::as_str) == kind
                    && o.get("status").and_then(Value::as_str) == state
            })
        })
        .and_then(|o| o.get("lastTransitionTime"))
        .and_then(Value::as_str);
    fields.insert("lastTransitionTime".into(), json!(previous.unwrap_or(now)));
}

/// A fingerprint of `desired` that leaves out the conditions' transition times: a status
/// decided again from the same stale version differs from the one written only in those
/// (stamped with the time of each decision), and is the same status.
pub fn fingerprint(desired: &JsonObject) -> String {
    use std::hash::{Hash as _, Hasher as _};
    let mut status = desired.clone();
    if let Some(Value::Array(conditions)) = status.get_mut("conditions") {
        for condition in conditions.iter_mut().filter_map(Value::as_object_mut) {
            condition.remove("lastTransitionTime");
        }
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    Value::Object(status).to_string().hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

/// The current time as Kubernetes writes it (RFC 3339, seconds).
pub(crate) fn now() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .map_or_else(|_| jiff::Timestamp::now().to_string(), |t| t.to_string())
}

/// Whether writing `desired` would change the observed status.
pub fn is_unchanged(desired: &JsonObject, observed_status: Option<&Value>) -> bool {
    match observed_status {
        Some(Value::Object(observed)) => {
            crate::controller::reconcile::children::is_subset(
                &Value::Object(desired.clone()),
                &Value::Object(observed.clone()),
            ) && observed.keys().all(|k| desired.contains_key(k))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> Outcome {
        Outcome {
            message: "2 children".into(),
            ..Outcome::success(2)
        }
    }

    fn plugin_status() -> JsonObject {
        let Value::Object(status) = json!({
            "readyReplicas": 3,
            "conditions": [{"type": "Ready", "status": "True", "reason": "AllReady", "message": ""}],
        }) else {
            unreachable!()
        };
        status
    }

    #[test]
    fn adds_generation_and_reconciled_and_stamps_times() {
        let status = after_success(Some(plugin_status()), Some(4), None, &ok(), "T1");
        assert_eq!(status["observedGeneration"], 4);
        assert_eq!(status["readyReplicas"], 3);
        let conditions = status["conditions"].as_array().expect("list");
        assert_eq!(conditions.len(), 2);
        assert_eq!(conditions[1]["type"], RECONCILED);
        assert_eq!(conditions[1]["status"], "True");
        assert_eq!(conditions[1]["observedGeneration"], 4);
        assert!(conditions.iter().all(|c| c["lastTransitionTime"] == "T1"));
    }

    #[test]
    fn a_steady_state_is_an_identical_status() {
        let first = after_success(Some(plugin_status()), Some(4), None, &ok(), "T1");
        let observed = Value::Object(first.clone());
        let second = after_success(Some(plugin_status()), Some(4), Some(&observed), &ok(), "T2");
        assert_eq!(first, second);
        assert!(is_unchanged(&second, Some(&observed)));
    }

    #[test]
    fn a_changed_condition_gets_a_new_transition_time() {
        let first = Value::Object(after_success(
            Some(plugin_status()),
            Some(4),
            None,
            &ok(),
            "T1",
        ));
        let failed = Outcome::failure("PluginFailed", "trap".into());
        let conditions = after_failure(Some(5), Some(&first), &failed, "T2");
        assert_eq!(conditions[0]["type"], "Ready");
        assert_eq!(
            conditions[0]["lastTransitionTime"], "T1",
            "Ready did not change"
        );
        assert_eq!(conditions[1]["status"], "False");
        assert_eq!(conditions[1]["lastTransitionTime"], "T2");
        assert_eq!(conditions[1]["message"], "trap");
    }

    #[test]
    fn the_fingerprint_is_the_status_but_for_transition_times() {
        let at_t1 = after_success(Some(plugin_status()), Some(4), None, &ok(), "T1");
        let at_t2 = after_success(Some(plugin_status()), Some(4), None, &ok(), "T2");
        assert_ne!(at_t1, at_t2);
        assert_eq!(fingerprint(&at_t1), fingerprint(&at_t2));
        let mut fewer_ready = plugin_status();
        fewer_ready.insert("readyReplicas".into(), json!(2));
        let changed = after_success(Some(fewer_ready), Some(4), None, &ok(), "T1");
        assert_ne!(fingerprint(&at_t1), fingerprint(&changed));
    }

    #[test]
    fn ordered_children_report_progressing_and_replace_the_plugins() {
        let mut plugin = plugin_status();
        plugin.insert(
            "conditions".into(),
            json!([{"type": "Progressing", "status": "False", "reason": "Mine"}]),
        );
        let waiting = ok().with_progress(Some(Progress::Waiting("Deployment app waits".into())));
        let status = after_success(Some(plugin), Some(4), None, &waiting, "T1");
        let conditions = status["conditions"].as_array().expect("list");
        assert_eq!(conditions.len(), 2, "{conditions:?}");
        assert_eq!(conditions[0]["type"], PROGRESSING);
        assert_eq!(conditions[0]["status"], "True");
        assert_eq!(conditions[0]["reason"], "WaitingFor");
        assert_eq!(conditions[0]["message"], "Deployment app waits");
        let applied = ok().with_progress(Some(Progress::Applied));
        let status = after_success(Some(plugin_status()), Some(4), None, &applied, "T2");
        assert_eq!(status["conditions"][1]["reason"], "Applied");
        // An unordered answer gets no Progressing from the host.
        let unordered = after_success(Some(plugin_status()), Some(4), None, &ok(), "T1");
        assert!(
            unordered["conditions"]
                .as_array()
                .expect("list")
                .iter()
                .all(|c| c["type"] != PROGRESSING)
        );
    }

    #[test]
    fn ordered_children_decide_ready_unless_the_plugin_says_not_ready() {
        let judged = |plugin: Option<&str>, not_ready: Option<&str>| {
            let mut status = JsonObject::new();
            if let Some(claim) = plugin {
                status.insert(
                    "conditions".into(),
                    json!([{"type": "Ready", "status": claim, "reason": "Mine"}]),
                );
            }
            let outcome = ok().with_children_ready(Some(not_ready.map(str::to_owned)));
            let status = after_success(Some(status), Some(1), None, &outcome, "T1");
            let ready = status["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == READY).cloned())
                .expect("a Ready condition");
            (
                ready["status"].as_str().unwrap_or_default().to_owned(),
                ready["reason"].as_str().unwrap_or_default().to_owned(),
            )
        };
        let pair = |s: &str, r: &str| (s.to_owned(), r.to_owned());
        assert_eq!(judged(None, None), pair("True", "ChildrenReady"));
        assert_eq!(
            judged(None, Some("Job j: not complete")),
            pair("False", "ChildNotReady")
        );
        assert_eq!(
            judged(Some("True"), Some("Job j: not complete")),
            pair("False", "ChildNotReady")
        );
        assert_eq!(judged(Some("True"), None), pair("True", "Mine"));
        assert_eq!(judged(Some("False"), None), pair("False", "Mine"));
        // An unordered answer: the plugin's word alone.
        let plain = after_success(Some(plugin_status()), Some(4), None, &ok(), "T1");
        assert_eq!(plain["conditions"][0]["reason"], "AllReady");
    }

    #[test]
    fn a_dropped_field_is_a_change() {
        let mut observed = after_success(Some(plugin_status()), Some(4), None, &ok(), "T1");
        let desired = observed.clone();
        observed.insert("extra".into(), json!(1));
        assert!(!is_unchanged(&desired, Some(&Value::Object(observed))));
        assert!(!is_unchanged(&desired, None));
    }
}
