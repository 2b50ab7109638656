use serde::{Deserialize, Serialize};

/// A status condition in the shape Kubernetes tools understand (`kubectl wait --for=condition=…`).
///
/// Plugins have no clock, so `last_transition_time` is left empty for a condition whose status
/// changed; the host stamps it when it writes the status. Unchanged conditions keep their time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// The condition type, e.g. `Ready`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: ConditionStatus,
    /// One CamelCase word saying why.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// Human-readable details.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// When the status last changed (RFC 3339); filled in by the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    /// The parent generation this condition was computed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// The status of a condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "schemars", derive(schemars::JsonSchema))]
pub enum ConditionStatus {
    /// The condition holds.
    True,
    /// The condition does not hold.
    False,
    /// Cannot tell yet.
    #[default]
    Unknown,
}

impl ConditionStatus {
    /// `True` when `holds`, else `False`.
    pub fn from_bool(holds: bool) -> Self {
        if holds { Self::True } else { Self::False }
    }
}

impl Condition {
    /// A condition of `type_` with `status`, `reason` and `message`.
    pub fn new(
        type_: impl Into<String>,
        status: ConditionStatus,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_: type_.into(),
            status,
            reason: reason.into(),
            message: message.into(),
            ..Self::default()
        }
    }
}

/// Insert or update `condition` in `conditions` by type.
///
/// Start from the conditions in the parent's observed status: when the status of a condition
/// does not change, its `lastTransitionTime` is kept, so a steady state produces an identical
/// status and the host writes nothing.
pub fn set_condition(conditions: &mut Vec<Condition>, mut condition: Condition) {
    match conditions.iter_mut().find(|c| c.type_ == condition.type_) {
        Some(existing) => {
            if existing.status == condition.status {
                condition.last_transition_time = existing.last_transition_time.take();
            }
            *existing = condition;
        }
        None => conditions.push(condition),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unchanged_status_keeps_transition_time() {
        let mut conditions = vec![Condition {
            last_transition_time: Some("2026-01-01T00:00:00Z".into()),
            ..Condition::new("Ready", ConditionStatus::True, "Ok", "")
        }];
        set_condition(
            &mut conditions,
            Condition::new("Ready", ConditionStatus::True, "StillOk", "fine"),
        );
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].reason, "StillOk");
        assert_eq!(
            conditions[0].last_transition_time.as_deref(),
            Some("2026-01-01T00:00:00Z")
        );
    }

    #[test]
    fn changed_status_clears_transition_time_for_the_host_to_stamp() {
        let mut conditions = vec![Condition {
            last_transition_time: Some("2026-01-01T00:00:00Z".into()),
            ..Condition::new("Ready", ConditionStatus::True, "Ok", "")
        }];
        set_condition(
            &mut conditions,
            Condition::new("Ready", ConditionStatus::False, "Scaling", "1/3"),
        );
        assert_eq!(conditions[0].status, ConditionStatus::False);
        assert_eq!(conditions[0].last_transition_time, None);
    }

    #[test]
    fn new_condition_type_is_appended() {
        let mut conditions = vec![Condition::new("Ready", ConditionStatus::True, "Ok", "")];
        set_condition(
            &mut conditions,
            Condition::new("Degraded", ConditionStatus::False, "Ok", ""),
        );
        let types: Vec<_> = conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["Ready", "Degraded"]);
    }
}
