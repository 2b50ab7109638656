//! A rollout's replay gate: before a candidate serves any parent, it answers recorded cases
//! (a ConfigMap of them, or what this host recorded for the policy with `--record-dir`), and
//! each answer is compared with the one the case holds, as `wasmctrl plugin replay --expect`
//! does. The cases are read as the policy's own identity, so a policy can name only cases
//! its account may read.

use std::path::Path;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;

use crate::admission::conversion::round_trip;
use crate::case::{Case, compare_answers};
use crate::controller::reconcile::context::PolicyContext;
use crate::controller::reconcile::serving::ActivePlugin;
use crate::plugin::Verdict;
use crate::policy::{ReplayGate, ReplayResult};

/// Cases replayed when the gate does not say.
const DEFAULT_MAX_CASES: u32 = 200;
/// Cases named in the result.
const EXAMPLES: usize = 5;

/// Replay the gate's cases with `candidate`. An error means the cases could not be read:
/// the gate cannot decide yet.
///
/// `convert_to` are the versions the policy's parents are converted to (`spec.conversion`):
/// each case's parent must come back unchanged from each through the candidate's converter,
/// or the case would fail.
pub(crate) async fn replay(
    ctx: &PolicyContext,
    gate: &ReplayGate,
    namespace: Option<&str>,
    candidate: &ActivePlugin,
    convert_to: &[String],
) -> anyhow::Result<ReplayResult> {
    let max = gate.max_cases.unwrap_or(DEFAULT_MAX_CASES) as usize;
    let cases = match (&gate.config_map, gate.recorded) {
        (Some(source), _) => {
            let namespace = source
                .namespace
                .as_deref()
                .or(namespace)
                .context("replay.configMap needs a namespace")?;
            from_config_map(ctx, namespace, &source.name, max).await?
        }
        (None, true) => {
            let recorder = ctx.explain.recorder.as_ref().context(
                "replay.recorded: this host records no cases (start it with --record-dir)",
            )?;
            let dir = recorder.policy_dir(&ctx.policy);
            tokio::task::spawn_blocking(move || from_dir(&dir, max))
                .await
                .context("reading the recorded cases")??
        }
        (None, false) => anyhow::bail!("replay names no cases"),
    };
    let mut result = ReplayResult::default();
    for (name, case) in cases {
        let Some(expected) = case.expected_answer() else {
            continue;
        };
        let mut request = case.request();
        request.config = candidate.config.clone();
        let parent = serde_json::from_str::<crate::plugin::JsonObject>(&request.parent);
        let actual = candidate.plugin.reconcile(request).await;
        result.cases += 1;
        // The examples reach the policy's status.
        let mut verdict = ctx
            .redaction
            .in_status()
            .hiding(|hide| compare_answers(&expected, &actual, hide));
        if let (false, Ok(parent)) = (matches!(verdict, Verdict::WouldFail(_)), &parent) {
            for to in convert_to {
                // As its reconciles here: the gate's calls are the candidate's, untenanted.
                if let Err(problem) = round_trip(&candidate.plugin, "", parent, to).await {
                    verdict = Verdict::WouldFail(problem);
                    break;
                }
            }
        }
        let failed = match &verdict {
            Verdict::Unchanged => {
                result.unchanged += 1;
                false
            }
            Verdict::WouldChange(_) => {
                result.would_change += 1;
                gate.fail_on_change
            }
            Verdict::WouldFail(_) => {
                result.would_fail += 1;
                true
            }
        };
        if failed && result.examples.len() < EXAMPLES {
            result
                .examples
                .push(format!("{name}: {} {}", verdict.name(), verdict.detail()));
        }
    }
    Ok(result)
}

/// The versions `policy`'s parents are converted to (`spec.conversion`), which a
/// candidate's converter must round-trip them through.
pub(crate) fn convert_to(policy: &crate::policy::ReconcilePolicy) -> Vec<String> {
    policy.spec.conversion.as_ref().map_or_else(Vec::new, |c| {
        crate::admission::conversion::other_versions(&policy.spec.parent.api_version, &c.versions)
    })
}

/// Whether the candidate passed: nothing it would fail on, nor (with `failOnChange`)
/// anything it would answer differently.
pub(crate) fn passed(gate: &ReplayGate, result: &ReplayResult) -> bool {
    result.would_fail == 0 && !(gate.fail_on_change && result.would_change > 0)
}

/// Every `data` key of the ConfigMap, as a case, in key order.
async fn from_config_map(
    ctx: &PolicyContext,
    namespace: &str,
    name: &str,
    max: usize,
) -> anyhow::Result<Vec<(String, Case)>> {
    let config_map = Api::<ConfigMap>::namespaced(ctx.client.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("reading the cases in ConfigMap {namespace}/{name}"))?;
    config_map
        .data
        .unwrap_or_default()
        .into_iter()
        .take(max)
        .map(|(key, text)| {
            let case = Case::parse(&text, &format!("ConfigMap {namespace}/{name} key {key}"))?;
            Ok((key, case))
        })
        .collect()
}

/// The newest `max` cases recorded in `dir` (a policy's directory of `--record-dir`).
fn from_dir(dir: &Path, max: usize) -> anyhow::Result<Vec<(String, Case)>> {
    let mut paths: Vec<_> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    // Recorded file names start with the time: the newest sort last.
    paths.sort();
    paths
        .into_iter()
        .rev()
        .take(max)
        .map(|path| {
            let name = path
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            Ok((name, Case::read(&path)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_always_fails_the_gate_and_a_change_only_when_asked() {
        let mut gate = ReplayGate::default();
        let result = |would_change, would_fail| ReplayResult {
            cases: 10,
            would_change,
            would_fail,
            ..ReplayResult::default()
        };
        assert!(passed(&gate, &result(3, 0)));
        assert!(!passed(&gate, &result(0, 1)));
        gate.fail_on_change = true;
        assert!(!passed(&gate, &result(3, 0)));
        assert!(passed(&gate, &result(0, 0)));
    }

    #[test]
    fn recorded_cases_are_read_newest_first_and_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let case = Case::parse(
            "parent: {apiVersion: v1, kind: ConfigMap, metadata: {name: a}}\n",
            "a case",
        )
        .expect("a case");
        for name in ["0001_a.yaml", "0003_c.yaml", "0002_b.yaml", "notes.txt"] {
            std::fs::write(dir.path().join(name), case.to_yaml().expect("yaml")).expect("write");
        }
        let names: Vec<String> = from_dir(dir.path(), 2)
            .expect("read")
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        assert_eq!(names, ["0003_c.yaml", "0002_b.yaml"]);
        assert!(
            from_dir(&dir.path().join("absent"), 2)
                .expect("none")
                .is_empty()
        );
    }
}
