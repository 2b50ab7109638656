//! `spec.plugin.rollout`: the stages a candidate plugin walks by itself, from shadow through
//! canary shares to every parent, and the gates that advance it or roll it back; and
//! `status.rollout`, where the host keeps how far it got, so a new leader continues from there.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// A rollout of `spec.plugin.candidate`. The candidate serves a stable share of the parents
/// (by a hash of each parent's uid, so no parent moves back and forth) that each stage sets,
/// and shadows the others. The host moves to the next stage when the current one's gates
/// pass, waits while one cannot decide yet, and rolls back when one fails: the candidate stops
/// serving and shadowing, and the active plugin decides for every parent again. After the last
/// stage the candidate serves every parent (`Complete`); promote it in the spec (move it to
/// the active fields) when convenient, which then changes nothing.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// In order. A stage with `percent: 0` is shadow only.
    #[schemars(length(min = 1, max = 10))]
    pub stages: Vec<RolloutStage>,
    /// Hold the rollout where it is: gates are still measured and reported, but the host
    /// neither advances nor rolls back until this is unset.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// Recorded cases the candidate must answer as they were answered before it serves any
    /// parent: while they replay it serves none; a case it would fail on (or, with
    /// `failOnChange`, answer differently) rolls it back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<ReplayGate>,
}

/// Where the cases of a replay gate are.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.configMap) != self.recorded").message("replay needs exactly one of configMap and recorded"))]
pub struct ReplayGate {
    /// A ConfigMap whose every `data` key holds one case (`wasmctrl explain --save`, a
    /// recorded case, a `plugin test` case), read as the policy's own identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<ReplayConfigMap>,
    /// The cases this host recorded for the policy (`--record-dir`), newest first.
    #[serde(default)]
    pub recorded: bool,
    /// Roll back on a case the candidate would answer differently too, not only on one it
    /// would fail on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fail_on_change: bool,
    /// At most this many cases are replayed (default 200).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2000))]
    pub max_cases: Option<u32>,
}

/// A ConfigMap of cases.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ReplayConfigMap {
    /// Its namespace (a namespaced policy's own namespace, if unset there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Its name.
    pub name: String,
}

/// What the replay gate found.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ReplayResult {
    /// Cases replayed.
    #[serde(default)]
    pub cases: u64,
    /// Cases answered as before.
    #[serde(default)]
    pub unchanged: u64,
    /// Cases answered differently.
    #[serde(default)]
    pub would_change: u64,
    /// Cases the candidate failed on.
    #[serde(default)]
    pub would_fail: u64,
    /// A few of the cases that did not pass, with what differed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<String>,
}

/// One stage: the share the candidate serves, and its gates.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStage {
    /// The share of parents (0 to 100) the candidate serves; the rest stay on the active
    /// plugin and are evaluated by the candidate in shadow.
    #[schemars(range(min = 0, max = 100))]
    pub percent: u8,
    /// The stage lasts at least this long (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soak_seconds: Option<u32>,
    /// The stage ends only once this many shadowed parents were compared (default: every
    /// shadowed parent), or after `maxSeconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_parents: Option<u32>,
    /// After this long, the stage's gates decide on what was measured (default: no limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_seconds: Option<u32>,
    /// The share (0 to 1) of shadowed parents the candidate may fail on (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_would_fail: Option<f64>,
    /// The share (0 to 1) of shadowed parents whose children or status the candidate may
    /// change (default 0.5). A version meant to change every parent says so with 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_would_change: Option<f64>,
    /// The share (0 to 1) of the children the active plugin answers for the shadowed parents
    /// compared that the candidate's answers leave out, and so would prune were it serving
    /// them (default: the policy's `safety.maxPruneFraction`, at least `safety.pruneFloor`
    /// children): a candidate that empties its answers is rolled back before it serves more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_would_prune: Option<f64>,
    /// How much larger (0 to 1) the share of failing parents among those the candidate
    /// serves may be than among those the active plugin serves (default 0.05). Measured
    /// against the rest, so an outage that fails every parent does not by itself roll a
    /// candidate back; `maxFailing` is the ceiling that holds whatever the rest do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_failure_rate: Option<f64>,
    /// The share (0 to 1) of the parents the candidate serves that may fail, whatever the
    /// rest do (default 0.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_failing: Option<f64>,
    /// How much larger (0 to 1) the share of parents that are not ready among those the
    /// candidate serves may be than among the rest (default 0.1). A parent is not ready when
    /// one of its children is not, as the host judges from the child's own status (a
    /// Deployment updated and available, a StatefulSet or DaemonSet ready, a Job complete, a
    /// PVC bound, any object's `observedGeneration` current and its `Ready` or `Available`
    /// condition `True`), or when it has a `Ready` condition that is not `True`. The stage
    /// waits while the candidate's parents are less ready, and rolls back if they still are
    /// `progressDeadlineSeconds` after it began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_not_ready: Option<f64>,
    /// How long the candidate's parents have, from the stage's start, to be as ready as the
    /// rest (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub progress_deadline_seconds: Option<u32>,
}

impl RolloutStage {
    /// `shadow`, `canary 10%` or `all`.
    pub fn name(&self) -> String {
        match self.percent {
            0 => "shadow".to_owned(),
            100 => "all".to_owned(),
            n => format!("canary {n}%"),
        }
    }
}

/// How a rollout stands.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStatus {
    /// The candidate being rolled out.
    pub digest: String,
    /// `Progressing`, `Paused`, `Complete` or `RolledBack`.
    pub phase: String,
    /// The index of the current stage in `spec.plugin.rollout.stages` (the last one when
    /// `Complete`).
    #[serde(default)]
    pub stage: u32,
    /// Its name: `shadow`, `canary 10%` or `all`.
    pub stage_name: String,
    /// The share of parents the candidate serves now.
    #[serde(default)]
    pub percent: u8,
    /// When the current stage (or the rollback) began.
    pub stage_since: Time,
    /// What the gates say now, with the figures.
    #[serde(default)]
    pub message: String,
    /// When rolled back: a few of the parents that failed the gate (`explain` them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<String>,
    /// The last transitions, newest first (at most 10).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<RolloutTransition>,
    /// The `wasmctrl.dev/retry-rollout` annotation value this rollout was last started
    /// again for: a rolled-back candidate starts over when the annotation takes a new value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retried_for: Option<String>,
    /// The replay gate's result, once the candidate replayed the cases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<ReplayResult>,
}

/// One step of a rollout.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutTransition {
    /// When it happened.
    pub time: Time,
    /// The candidate's digest.
    pub digest: String,
    /// The stage entered (or `rolled back`).
    pub stage: String,
    /// `Started`, `Advanced`, `Completed` or `RolledBack`.
    pub result: String,
    /// Why.
    pub reason: String,
}
