//! `wasmctrl rollout …` and `wasmctrl prune confirm`: a rollout and the prune guard operated by
//! commands instead of hand-written patches. Each command makes exactly the field or
//! annotation change docs/operating.md documents, as one JSON patch bound to the policy as it
//! was read (a `test` of its generation), so a spec someone changed meanwhile is refused,
//! never overwritten. Who may run them is who may patch the policy: RBAC on
//! `reconcilepolicies` (or a team's `namespacedreconcilepolicies` in its namespace).

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};

use super::output::OutputFormat;
use crate::policy::{
    CONFIRM_PRUNE_ANNOTATION as CONFIRM_ANNOTATION, RETRY_ROLLOUT_ANNOTATION as RETRY_ANNOTATION,
};

/// A policy on the command line.
#[derive(Debug, Clone, Args)]
pub struct PolicyArg {
    /// `NAME` of a ReconcilePolicy, or `NAMESPACE/NAME` of a team's NamespacedReconcilePolicy.
    policy: String,
}

/// Operate the rollout of a policy's candidate (`spec.plugin.rollout`).
#[derive(Debug, Subcommand)]
pub enum RolloutCommand {
    /// Where the rollout stands: phase, stage, what it waits for, the candidate's figures and
    /// the last transitions.
    Status {
        /// The policy.
        #[command(flatten)]
        policy: PolicyArg,
        /// `text`, or `json`/`yaml` (the policy's `status.rollout` and `status.candidate`).
        #[arg(short = 'o', long, value_enum, default_value_t)]
        output: OutputFormat,
    },
    /// Move the candidate to the active fields (source, digest, config) and end the rollout:
    /// every parent is then served by it. After a complete rollout this changes nothing. A
    /// candidate its rollout rolled back is refused unless `--force`.
    Promote {
        /// The policy.
        #[command(flatten)]
        policy: PolicyArg,
        /// Promote a candidate that its rollout rolled back.
        #[arg(long)]
        force: bool,
    },
    /// Stop the rollout where it is (`rollout.paused: true`); its gates are still measured.
    Pause(PolicyArg),
    /// Let a paused rollout move again (`rollout.paused: false`).
    Resume(PolicyArg),
    /// Remove the candidate and its rollout: the active plugin serves every parent again.
    Abort(PolicyArg),
    /// Start a rolled-back rollout over from its first stage (a new value of the
    /// `wasmctrl.dev/retry-rollout` annotation); refused unless its candidate was rolled back.
    Retry(PolicyArg),
}

/// Answer the prune guard.
#[derive(Debug, Subcommand)]
pub enum PruneCommand {
    /// Let the deletions the guard holds now proceed: the `wasmctrl.dev/confirm-prune`
    /// annotation set to the token its status shows (used once; later holds need another).
    Confirm(PolicyArg),
}

/// One change of a policy, before it is bound to the object read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Promote { force: bool },
    Pause,
    Resume,
    Abort,
    Retry,
    ConfirmPrune,
}

impl RolloutCommand {
    /// Read the policy, change it (or print its rollout), and say what was done.
    pub async fn run(self) -> anyhow::Result<()> {
        let client = kube::Client::try_default()
            .await
            .context("connecting to the cluster")?;
        self.run_with(&client).await
    }

    /// [`Self::run`] through `client`.
    pub async fn run_with(self, client: &kube::Client) -> anyhow::Result<()> {
        print!("{}", self.report_with(client).await?);
        Ok(())
    }

    /// Do what [`Self::run_with`] does, and return what it would print.
    pub async fn report_with(self, client: &kube::Client) -> anyhow::Result<String> {
        let (policy, change) = match self {
            Self::Status { policy, output } => {
                let (api, name) = policy.api(client)?;
                let object = read(&api, &name).await?;
                return status(&policy.policy, &object, output);
            }
            Self::Promote { policy, force } => (policy, Change::Promote { force }),
            Self::Pause(policy) => (policy, Change::Pause),
            Self::Resume(policy) => (policy, Change::Resume),
            Self::Abort(policy) => (policy, Change::Abort),
            Self::Retry(policy) => (policy, Change::Retry),
        };
        policy.change(client, change).await
    }
}

impl PruneCommand {
    /// Confirm the held deletions, and say so.
    pub async fn run(self) -> anyhow::Result<()> {
        let client = kube::Client::try_default()
            .await
            .context("connecting to the cluster")?;
        self.run_with(&client).await
    }

    /// [`Self::run`] through `client`.
    pub async fn run_with(self, client: &kube::Client) -> anyhow::Result<()> {
        let Self::Confirm(policy) = self;
        print!("{}", policy.change(client, Change::ConfirmPrune).await?);
        Ok(())
    }
}

impl PolicyArg {
    /// The API of the policy's kind, and its name.
    fn api(&self, client: &kube::Client) -> anyhow::Result<(Api<DynamicObject>, String)> {
        if self.policy.contains('/') {
            let (namespace, name) = super::input::namespace_and_name("POLICY", &self.policy)?;
            let resource = crate::policy::namespaced::api_resource();
            Ok((
                Api::namespaced_with(client.clone(), namespace, &resource),
                name.to_owned(),
            ))
        } else {
            let resource = kube::core::ApiResource::erase::<crate::policy::ReconcilePolicy>(&());
            Ok((
                Api::all_with(client.clone(), &resource),
                self.policy.clone(),
            ))
        }
    }

    /// Make `change`, and say what was done (a line).
    async fn change(&self, client: &kube::Client, change: Change) -> anyhow::Result<String> {
        let (api, name) = self.api(client)?;
        // A spec changed between the read and the patch fails the patch's `test`: it is read
        // again and the change made anew, a few times.
        for _ in 0..3 {
            let object = read(&api, &name).await?;
            if let Some(source) = object["metadata"]["annotations"]
                [crate::policy::namespaced::SOURCE_ANNOTATION]
                .as_str()
            {
                bail!(
                    "policy {} is made by the host from the team's policy {source}, and the host would undo this change: operate `{source}` instead",
                    self.policy
                );
            }
            let Some((ops, done)) = patch(change, &object, &unique_now())
                .with_context(|| format!("policy {}", self.policy))?
            else {
                return Ok(format!("policy {}: nothing to change\n", self.policy));
            };
            let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops))?;
            match api
                .patch(&name, &PatchParams::default(), &Patch::Json::<()>(patch))
                .await
            {
                Ok(_) => return Ok(format!("policy {}: {done}\n", self.policy)),
                // A failed `test` is a 422 without the " is invalid" of a validation error.
                Err(kube::Error::Api(status))
                    if status.code == 422 && !status.message.contains(" is invalid") => {}
                Err(kube::Error::Api(status)) if status.code == 403 => bail!(
                    "you may not change policy {}: {} (the command needs patch on it)",
                    self.policy,
                    status.message
                ),
                Err(error) => {
                    return Err(error).with_context(|| format!("changing policy {}", self.policy));
                }
            }
        }
        bail!(
            "policy {} kept changing while this command tried to change it; try again",
            self.policy
        )
    }
}

async fn read(api: &Api<DynamicObject>, name: &str) -> anyhow::Result<Value> {
    match api.get(name).await {
        Ok(object) => Ok(serde_json::to_value(object)?),
        Err(kube::Error::Api(status)) if status.code == 404 => {
            bail!("no policy {name} (a team's NamespacedReconcilePolicy is named NAMESPACE/NAME)")
        }
        Err(error) => Err(error).with_context(|| format!("reading policy {name}")),
    }
}

/// A value for the retry annotation that no earlier retry used: the time, to the nanosecond.
fn unique_now() -> String {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("{}.{:09}", since.as_secs(), since.subsec_nanos())
}

/// A JSON pointer's escaping of one path segment.
fn pointer_segment(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

/// The JSON patch that makes `change` to `policy` (bound to its generation), and what it
/// does in words; `None` when the policy already is as asked.
fn patch(
    change: Change,
    policy: &Value,
    now: &str,
) -> anyhow::Result<Option<(Vec<Value>, String)>> {
    let plugin = &policy["spec"]["plugin"];
    let candidate = &plugin["candidate"];
    let rollout = &plugin["rollout"];
    // Bound to the spec as read: its generation moves with every spec change and with no
    // status write (the host writes the status every 2 s while a stage soaks).
    let mut ops = vec![json!({
        "op": "test",
        "path": "/metadata/generation",
        "value": policy["metadata"]["generation"],
    })];
    let done = match change {
        Change::Promote { force } => promote(&mut ops, policy, force)?,
        Change::Pause | Change::Resume => {
            if rollout.is_null() {
                bail!("it has no rollout");
            }
            let paused = change == Change::Pause;
            if rollout["paused"].as_bool().unwrap_or(false) == paused {
                return Ok(None);
            }
            ops.push(json!({"op": "add", "path": "/spec/plugin/rollout/paused", "value": paused}));
            if paused {
                "rollout paused; its gates are still measured".to_owned()
            } else {
                "rollout resumed".to_owned()
            }
        }
        Change::Abort => {
            if candidate.is_null() {
                bail!("it has no candidate");
            }
            ops.push(json!({"op": "remove", "path": "/spec/plugin/candidate"}));
            if !rollout.is_null() {
                ops.push(json!({"op": "remove", "path": "/spec/plugin/rollout"}));
            }
            "the candidate is removed; the active plugin serves every parent".to_owned()
        }
        Change::Retry => {
            if rollout.is_null() {
                bail!("it has no rollout to retry");
            }
            if !rolled_back(policy) {
                let phase = policy["status"]["rollout"]["phase"]
                    .as_str()
                    .unwrap_or("not started");
                bail!(
                    "its rollout did not roll this candidate back (phase {phase}): there is nothing to start over"
                );
            }
            annotate(&mut ops, policy, RETRY_ANNOTATION, now);
            "the rollout starts over from its first stage".to_owned()
        }
        Change::ConfirmPrune => {
            let guard = &policy["status"]["pruneGuard"];
            let state = guard["state"].as_str().unwrap_or("Watching");
            let token = guard["confirm"].as_str().unwrap_or_default();
            if state != "Held" || token.is_empty() {
                bail!("its prune guard holds no deletions (state {state})");
            }
            annotate(&mut ops, policy, CONFIRM_ANNOTATION, token);
            format!(
                "the deletions held now may proceed ({} deleted of {} allowed so far)",
                guard["deleted"], guard["allowed"]
            )
        }
    };
    Ok(Some((ops, done)))
}

/// The operations that move the candidate to the active fields and end the rollout, and
/// what they do in words.
fn promote(ops: &mut Vec<Value>, policy: &Value, force: bool) -> anyhow::Result<String> {
    let plugin = &policy["spec"]["plugin"];
    let candidate = &plugin["candidate"];
    let rollout = &plugin["rollout"];
    if candidate.is_null() {
        bail!("it has no candidate to promote");
    }
    if rolled_back(policy) && !force {
        bail!(
            "its rollout rolled this candidate back ({}); promote it anyway with --force",
            policy["status"]["rollout"]["message"]
                .as_str()
                .unwrap_or("see `wasmctrl rollout status`")
        );
    }
    ops.push(json!({"op": "replace", "path": "/spec/plugin/source", "value": candidate["source"]}));
    match (&candidate["digest"], &plugin["digest"]) {
        (Value::Null, Value::Null) => {}
        (Value::Null, _) => ops.push(json!({"op": "remove", "path": "/spec/plugin/digest"})),
        (digest, _) => {
            ops.push(json!({"op": "add", "path": "/spec/plugin/digest", "value": digest}));
        }
    }
    // A candidate without a config ran with the active one, which stays.
    if !candidate["config"].is_null() {
        ops.push(json!({"op": "add", "path": "/spec/plugin/config", "value": candidate["config"]}));
    }
    ops.push(json!({"op": "remove", "path": "/spec/plugin/candidate"}));
    if !rollout.is_null() {
        ops.push(json!({"op": "remove", "path": "/spec/plugin/rollout"}));
    }
    let promoted = match candidate["digest"].as_str() {
        Some(digest) => format!("the candidate ({digest}) is the active plugin now"),
        None => "the candidate is the active plugin now".to_owned(),
    };
    Ok(if rollout.is_null() {
        promoted
    } else {
        format!("{promoted}; the rollout is over")
    })
}

/// Whether the policy's rollout rolled back the candidate its spec names now (a rollback of
/// an earlier candidate does not count).
fn rolled_back(policy: &Value) -> bool {
    let status = &policy["status"]["rollout"];
    let named = &policy["spec"]["plugin"]["candidate"]["digest"];
    status["phase"] == "RolledBack" && (named.is_null() || *named == status["digest"])
}

/// Set annotation `key` to `value`, making the annotations first if there are none.
fn annotate(ops: &mut Vec<Value>, policy: &Value, key: &str, value: &str) {
    if policy["metadata"]["annotations"].is_null() {
        ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": {}}));
    }
    ops.push(json!({
        "op": "add",
        "path": format!("/metadata/annotations/{}", pointer_segment(key)),
        "value": value,
    }));
}

/// `rollout status` of `policy` in `format`.
fn status(name: &str, policy: &Value, format: OutputFormat) -> anyhow::Result<String> {
    let status = &policy["status"];
    let shown = json!({"rollout": status["rollout"], "candidate": status["candidate"]});
    format.render(&shown, || status_text(name, policy))
}

fn status_text(name: &str, policy: &Value) -> String {
    let rollout = &policy["status"]["rollout"];
    let candidate = &policy["status"]["candidate"];
    let text = |value: &Value| value.as_str().unwrap_or("-").to_owned();
    if rollout.is_null() {
        let spec = if policy["spec"]["plugin"]["rollout"].is_null() {
            "no rollout"
        } else {
            "a rollout the host has not started yet"
        };
        return format!("policy {name}: {spec}\n");
    }
    let mut out = format!(
        "policy {name}: {} at stage {} ({}%)\n  {}\n",
        text(&rollout["phase"]),
        text(&rollout["stageName"]),
        rollout["percent"],
        text(&rollout["message"])
    );
    if !candidate.is_null() {
        out.push_str(&format!(
            "  candidate {}: serves {} parent(s); compared {}, {} would change, {} would fail\n",
            text(&candidate["digest"]),
            candidate["canaryParents"],
            candidate["evaluated"],
            candidate["wouldChange"],
            candidate["wouldFail"]
        ));
    }
    if let Some(history) = rollout["history"].as_array() {
        out.push_str("  history (newest first):\n");
        for entry in history {
            out.push_str(&format!(
                "    {} {} {}: {}\n",
                text(&entry["time"]),
                text(&entry["result"]),
                text(&entry["stage"]),
                text(&entry["reason"])
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(plugin: Value, status: Value) -> Value {
        json!({
            "metadata": {"name": "shop", "resourceVersion": "42", "generation": 3},
            "spec": {"plugin": plugin},
            "status": status,
        })
    }

    fn candidate_policy() -> Value {
        policy(
            json!({
                "source": {"oci": {"reference": "r/p@sha256:aa"}},
                "digest": "sha256:11",
                "config": {"service": true},
                "candidate": {"source": {"http": {"url": "http://x/p.wasm"}}, "digest": "sha256:22"},
                "rollout": {"stages": [{"percent": 0}]},
            }),
            Value::Null,
        )
    }

    /// Apply `ops` as the API server would, or fail as it would.
    fn applied(policy: &Value, ops: Vec<Value>) -> Value {
        let mut policy = policy.clone();
        let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops)).expect("a patch");
        json_patch::patch(&mut policy, &patch).expect("the patch applies");
        policy
    }

    #[test]
    fn promote_moves_the_candidate_to_the_active_fields_and_ends_the_rollout() {
        let before = candidate_policy();
        let (ops, _) = patch(Change::Promote { force: false }, &before, "1")
            .expect("a change")
            .expect("ops");
        let after = applied(&before, ops);
        let plugin = &after["spec"]["plugin"];
        assert_eq!(
            plugin["source"],
            json!({"http": {"url": "http://x/p.wasm"}})
        );
        assert_eq!(plugin["digest"], "sha256:22");
        assert_eq!(
            plugin["config"],
            json!({"service": true}),
            "the active config stays"
        );
        assert!(plugin["candidate"].is_null() && plugin["rollout"].is_null());
    }

    #[test]
    fn every_change_is_bound_to_the_policy_as_read() {
        let before = candidate_policy();
        let (ops, _) = patch(Change::Abort, &before, "1")
            .expect("a change")
            .expect("ops");
        let mut changed = before.clone();
        changed["metadata"]["generation"] = json!(4);
        let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops)).expect("a patch");
        assert!(json_patch::patch(&mut changed, &patch).is_err());
    }

    #[test]
    fn pause_resume_abort_and_retry_change_their_documented_fields() {
        let before = candidate_policy();
        let (ops, _) = patch(Change::Pause, &before, "1")
            .expect("a change")
            .expect("ops");
        let paused = applied(&before, ops);
        assert_eq!(paused["spec"]["plugin"]["rollout"]["paused"], true);
        assert!(
            patch(Change::Pause, &paused, "1")
                .expect("no error")
                .is_none()
        );
        let (ops, _) = patch(Change::Resume, &paused, "1")
            .expect("a change")
            .expect("ops");
        assert_eq!(
            applied(&paused, ops)["spec"]["plugin"]["rollout"]["paused"],
            false
        );

        assert!(
            patch(Change::Retry, &before, "17.5").is_err(),
            "not rolled back"
        );
        let mut rolled_back = before.clone();
        rolled_back["status"] = json!({"rollout": {"phase": "RolledBack", "digest": "sha256:22"}});
        let (ops, _) = patch(Change::Retry, &rolled_back, "17.5")
            .expect("a change")
            .expect("ops");
        assert_eq!(
            applied(&rolled_back, ops)["metadata"]["annotations"][RETRY_ANNOTATION],
            "17.5"
        );
        assert!(
            patch(Change::Promote { force: false }, &rolled_back, "1").is_err(),
            "a rolled-back candidate is promoted only with --force"
        );
        assert!(patch(Change::Promote { force: true }, &rolled_back, "1").is_ok());
        // A rollback of an earlier candidate is not this one's.
        rolled_back["status"]["rollout"]["digest"] = json!("sha256:11");
        assert!(patch(Change::Retry, &rolled_back, "17.5").is_err());
        let (ops, _) = patch(Change::Abort, &before, "1")
            .expect("a change")
            .expect("ops");
        let aborted = applied(&before, ops);
        assert!(aborted["spec"]["plugin"]["candidate"].is_null());
        assert!(aborted["spec"]["plugin"]["rollout"].is_null());
        assert_eq!(aborted["spec"]["plugin"]["digest"], "sha256:11");
        assert!(
            patch(Change::Promote { force: false }, &aborted, "1").is_err(),
            "nothing to promote"
        );
        assert!(patch(Change::Pause, &aborted, "1").is_err(), "no rollout");
    }

    #[test]
    fn a_prune_confirmation_names_the_token_the_guard_shows_and_only_while_it_holds() {
        let held = policy(
            json!({"source": {"file": {"path": "p.wasm"}}}),
            json!({"pruneGuard": {"state": "Held", "confirm": "3-ab.cd", "deleted": 5, "allowed": 5}}),
        );
        let (ops, _) = patch(Change::ConfirmPrune, &held, "1")
            .expect("a change")
            .expect("ops");
        assert_eq!(
            applied(&held, ops)["metadata"]["annotations"][CONFIRM_ANNOTATION],
            "3-ab.cd"
        );
        let watching = policy(
            json!({"source": {"file": {"path": "p.wasm"}}}),
            json!({"pruneGuard": {"state": "Watching", "confirm": "3-ab.cd"}}),
        );
        assert!(patch(Change::ConfirmPrune, &watching, "1").is_err());
    }
}
