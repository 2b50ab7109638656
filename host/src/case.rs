//! Reconcile cases: one plugin call written down, so it can be run again offline.
//!
//! A case holds what the plugin was asked (the parent, its children, the related objects, the
//! config) and, when it was recorded from a running host, what the plugin answered and which
//! plugin that was. `wasmctrl explain --save` and the host's recorder write cases;
//! `wasmctrl plugin run --case` and `wasmctrl plugin replay` read them. The format is plain
//! YAML or JSON so a person can read, trim and commit one as a regression test.
//!
//! Sensitive values are redacted before a case leaves the host (see [`Redaction`]): a case
//! shows which Secrets a plugin saw and their keys, never their values, unless the host was
//! told otherwise; and what the policy marks sensitive (related kinds, named fields) is
//! redacted always.

use std::path::Path;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::plugin::{CallError, JsonObject, ObservedObject, PluginEvent, ReconcileRequest};
use crate::plugin::{Hide, ReconcileResponse, Verdict};

/// What replaces each value of a redacted Secret.
pub const REDACTED: &str = "<redacted>";

/// One reconcile call: the request, and the recorded answer when there is one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Case {
    /// The parent object.
    pub parent: Value,
    /// The children the parent controls, as the host observed them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<Value>,
    /// The related objects the plugin could read.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub related: Vec<Value>,
    /// The policy's plugin config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<Value>,
    /// The parent was being deleted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub finalizing: bool,
    /// What the plugin must answer: a golden case for `wasmctrl plugin test`, written by hand
    /// or by `plugin test --update`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<Expected>,
    /// What the plugin answered, when the case was recorded by a host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded: Option<Recorded>,
}

/// The answer a golden case expects: the plugin's decision, or `error:` for a call that must
/// fail. Read from YAML by looking for `error` first, so a mistyped field is named in the
/// error instead of matching neither shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged, try_from = "Value")]
pub enum Expected {
    /// The call fails with this error.
    Failure {
        /// The error: `outcome` as the host labels it and the whole message.
        error: RecordedError,
    },
    /// The plugin decides this.
    Answer(RunOutput),
}

impl TryFrom<Value> for Expected {
    type Error = serde_json::Error;

    fn try_from(value: Value) -> Result<Self, Self::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Failure {
            error: RecordedError,
        }
        if value.get("error").is_some() {
            let Failure { error } = serde_json::from_value(value)?;
            Ok(Self::Failure { error })
        } else {
            serde_json::from_value(value).map(Self::Answer)
        }
    }
}

impl Expected {
    /// What the runtime would return for this expectation.
    pub fn answer(&self) -> Result<ReconcileResponse, RecordedError> {
        match self {
            Self::Failure { error } => Err(error.clone()),
            Self::Answer(output) => Ok(output.clone().into()),
        }
    }

    /// The expectation of what a plugin returned.
    pub fn of(answer: &Result<ReconcileResponse, CallError>) -> Self {
        match answer {
            Ok(response) => Self::Answer(response.clone().into()),
            Err(error) => Self::Failure {
                error: RecordedError::of(error),
            },
        }
    }
}

/// The answer a host saw for a case, and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Recorded {
    /// When the call was made (RFC 3339).
    pub at: String,
    /// The policy that made it.
    pub policy: String,
    /// The digest of the plugin that answered.
    pub plugin: String,
    /// The plugin's answer, when it gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<RunOutput>,
    /// Why the call failed, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<RecordedError>,
}

/// The JSON text of the [`Recorded`] answer `answer`, written from the answer where it is:
/// what `serde_json::to_string` of a `Recorded` holding a copy of it gives. For an answer
/// nothing of which is to be redacted, so a reconcile's record does not copy every child
/// the plugin desired only to write it out.
pub fn recorded_text(
    at: &str,
    policy: &str,
    plugin: &str,
    answer: &Result<ReconcileResponse, CallError>,
) -> Result<String, serde_json::Error> {
    /// [`RunOutput`], borrowed.
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Output<'a> {
        children: &'a [JsonObject],
        #[serde(skip_serializing_if = "Option::is_none")]
        status: Option<&'a JsonObject>,
        #[serde(skip_serializing_if = "Option::is_none")]
        requeue_after_ms: Option<u64>,
        events: &'a [PluginEvent],
        finalized: bool,
    }
    /// [`Recorded`], borrowed.
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Answer<'a> {
        at: &'a str,
        policy: &'a str,
        plugin: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        response: Option<Output<'a>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<RecordedError>,
    }
    let (response, error) = match answer {
        Ok(response) => (
            Some(Output {
                children: &response.children,
                status: response.status.as_ref(),
                requeue_after_ms: response
                    .requeue_after
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                events: &response.events,
                finalized: response.finalized,
            }),
            None,
        ),
        Err(error) => (None, Some(RecordedError::of(error))),
    };
    serde_json::to_string(&Answer {
        at,
        policy,
        plugin,
        response,
        error,
    })
}

/// `case`, the JSON text of a case without its `recorded` field, with `recorded` (the text
/// of one) as its last field.
pub fn with_recorded(mut case: String, recorded: Option<&str>) -> String {
    let Some(recorded) = recorded else {
        return case;
    };
    if case.ends_with('}') {
        case.pop();
        if !case.ends_with('{') {
            case.push(',');
        }
        case.push_str("\"recorded\":");
        case.push_str(recorded);
        case.push('}');
    }
    case
}

/// A failed plugin call, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RecordedError {
    /// How the call failed, as `wasmctrl_plugin_calls_total` labels it (`trap`, `timeout`,
    /// `reported_error`, ...).
    pub outcome: String,
    /// The error, as the host reported it.
    pub message: String,
}

impl RecordedError {
    /// The record of `error`.
    pub fn of(error: &CallError) -> Self {
        Self {
            outcome: error.outcome().to_owned(),
            message: error.to_string(),
        }
    }
}

/// A plugin's decision, as `plugin run` prints it and a case records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RunOutput {
    /// Desired children.
    #[serde(default)]
    pub children: Vec<JsonObject>,
    /// Desired parent status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<JsonObject>,
    /// Requested requeue delay in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requeue_after_ms: Option<u64>,
    /// Events to record.
    #[serde(default)]
    pub events: Vec<PluginEvent>,
    /// Clean-up complete.
    #[serde(default)]
    pub finalized: bool,
}

impl From<ReconcileResponse> for RunOutput {
    fn from(r: ReconcileResponse) -> Self {
        Self {
            children: r.children,
            status: r.status,
            requeue_after_ms: r
                .requeue_after
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            events: r.events,
            finalized: r.finalized,
        }
    }
}

impl From<RunOutput> for ReconcileResponse {
    fn from(r: RunOutput) -> Self {
        Self {
            children: r.children,
            status: r.status,
            requeue_after: r.requeue_after_ms.map(std::time::Duration::from_millis),
            events: r.events,
            finalized: r.finalized,
        }
    }
}

impl Case {
    /// The case of `request`, with what `redaction` names redacted.
    pub fn of(request: &ReconcileRequest, redaction: &Redaction) -> Self {
        let parse = |text: &str| serde_json::from_str(text).unwrap_or(Value::Null);
        let objects = |list: &[ObservedObject]| -> Vec<Value> {
            list.iter()
                .map(|o| {
                    let mut value = parse(&o.json);
                    redaction.object(&mut value);
                    value
                })
                .collect()
        };
        let mut parent = parse(&request.parent);
        redaction.object(&mut parent);
        Self {
            parent,
            children: objects(&request.children),
            related: objects(&request.related),
            config: request.config.as_deref().map(parse),
            finalizing: request.finalizing,
            expect: None,
            recorded: None,
        }
    }

    /// The JSON text of the case of `request`, answered `recorded`, written from the texts
    /// the request already holds rather than parsed and written again: for a request no
    /// object of which [`Redaction::changes`]. Reads back as [`Case::of`] with `recorded`.
    /// `recorded` is the JSON text of the [`Recorded`] answer (see [`recorded_text`]).
    pub fn text_of(
        request: &ReconcileRequest,
        recorded: Option<&str>,
    ) -> Result<String, serde_json::Error> {
        let objects =
            |list: &[ObservedObject]| -> usize { list.iter().map(|o| o.json.len() + 1).sum() };
        let mut text = String::with_capacity(
            request.parent.len()
                + objects(&request.children)
                + objects(&request.related)
                + request.config.as_ref().map_or(0, String::len)
                + 64,
        );
        text.push_str("{\"parent\":");
        text.push_str(&request.parent);
        for (field, list) in [
            ("children", &request.children),
            ("related", &request.related),
        ] {
            if list.is_empty() {
                continue;
            }
            text.push_str(",\"");
            text.push_str(field);
            text.push_str("\":[");
            for (i, object) in list.iter().enumerate() {
                if i > 0 {
                    text.push(',');
                }
                text.push_str(&object.json);
            }
            text.push(']');
        }
        if let Some(config) = &request.config {
            text.push_str(",\"config\":");
            text.push_str(config);
        }
        if request.finalizing {
            text.push_str(",\"finalizing\":true");
        }
        text.push('}');
        Ok(with_recorded(text, recorded))
    }

    /// The request this case describes, as the host would send it.
    pub fn request(&self) -> ReconcileRequest {
        ReconcileRequest {
            parent: self.parent.to_string(),
            children: self
                .children
                .iter()
                .map(ObservedObject::from_value)
                .collect(),
            related: self
                .related
                .iter()
                .map(ObservedObject::from_value)
                .collect(),
            config: self.config.as_ref().map(Value::to_string),
            finalizing: self.finalizing,
        }
    }

    /// The answer this case expects: its `expect`, or else what was recorded.
    pub fn expected_answer(&self) -> Option<Result<ReconcileResponse, RecordedError>> {
        if let Some(expected) = &self.expect {
            return Some(expected.answer());
        }
        let recorded = self.recorded.as_ref()?;
        match (&recorded.response, &recorded.error) {
            (Some(response), _) => Some(Ok(response.clone().into())),
            (None, Some(error)) => Some(Err(error.clone())),
            (None, None) => None,
        }
    }

    /// Read a case from a YAML or JSON file.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read case {}", path.display()))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// A case from YAML or JSON text; `what` names it in errors.
    pub fn parse(text: &str, what: &str) -> anyhow::Result<Self> {
        serde_yaml_ng::from_str(text).with_context(|| format!("{what} is not a reconcile case"))
    }

    /// The case as YAML, with a first line saying what the file is.
    pub fn to_yaml(&self) -> anyhow::Result<String> {
        Ok(format!(
            "# A wasmctrl reconcile case: `wasmctrl plugin run PLUGIN --case FILE` runs it,\n\
             # `wasmctrl plugin test PLUGIN FILE` checks the answer against `expect` (or what was\n\
             # recorded), `wasmctrl plugin replay PLUGIN FILE --against OLD` against another plugin.\n{}",
            crate::yaml::to_string(self)?
        ))
    }
}

/// What must not leave the host in a record or case: Secret values (unless the host is told
/// to keep them), every value of the kinds a policy marks (`spec.related[].redact`), and the
/// fields it names (`spec.redactFields`). Built once per policy run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Redaction {
    keep_secrets: bool,
    /// `(apiVersion, kind)` of the objects whose values are all redacted.
    kinds: Vec<(String, String)>,
    /// Paths redacted in every object, split at the dots.
    fields: Vec<Vec<String>>,
}

impl Redaction {
    /// Secret values only; kept when `keep_secrets` (the host's `--explain-secret-data`).
    pub fn secrets(keep_secrets: bool) -> Self {
        Self {
            keep_secrets,
            ..Self::default()
        }
    }

    /// What `policy` marks sensitive, on top of [`Redaction::secrets`].
    pub fn of_policy(policy: &crate::policy::ReconcilePolicySpec, keep_secrets: bool) -> Self {
        Self {
            keep_secrets,
            kinds: policy
                .related
                .iter()
                .filter(|related| related.redact)
                .map(|related| (related.api_version.clone(), related.kind.clone()))
                .collect(),
            fields: policy
                .redact_fields
                .iter()
                .map(|path| path.split('.').map(str::to_owned).collect())
                .filter(|path: &Vec<String>| path.iter().all(|segment| !segment.is_empty()))
                .collect(),
        }
    }

    /// This redaction with Secret values hidden whatever `--explain-secret-data` says: for
    /// text that reaches a policy's status, which whoever may read the policy reads (and a
    /// team, through the copy on its own NamespacedReconcilePolicy).
    pub fn in_status(&self) -> Self {
        Self {
            keep_secrets: false,
            ..self.clone()
        }
    }

    /// Run `compare` with a [`Hide`] that redacts children and statuses as this does.
    pub fn hiding<T>(&self, compare: impl FnOnce(Hide<'_>) -> T) -> T {
        let child = |object: &mut Value| self.object(object);
        let status = |status: &mut Value| self.status(status);
        compare(Hide {
            child: &child,
            status: &status,
        })
    }

    /// Whether [`Redaction::object`] could change an object of `api_version` `kind`.
    pub fn changes(&self, api_version: &str, kind: &str) -> bool {
        !self.kinds.is_empty()
            || !self.fields.is_empty()
            || (!self.keep_secrets && kind == "Secret" && api_version == "v1")
    }

    /// Whether [`Redaction::status`] could change a status.
    pub fn changes_status(&self) -> bool {
        self.fields
            .iter()
            .any(|path| path.len() > 1 && path[0] == "status")
    }

    /// Whether anything at all is to be redacted.
    pub fn hides_anything(&self) -> bool {
        !self.keep_secrets || !self.kinds.is_empty() || !self.fields.is_empty()
    }

    /// Redact one Kubernetes object (`apiVersion`, `kind`, `metadata`, …) in place.
    pub fn object(&self, object: &mut Value) {
        if !self.keep_secrets {
            redact_secret(object);
        }
        if !self.kinds.is_empty() || !self.fields.is_empty() {
            // `kubectl apply`'s copy of the object would repeat what is redacted.
            remove_last_applied(object);
        }
        let marked = self.kinds.iter().any(|(api_version, kind)| {
            object["apiVersion"] == **api_version && object["kind"] == **kind
        });
        if marked && let Value::Object(fields) = object {
            for (key, value) in fields.iter_mut() {
                if !matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
                    redact_leaves(value);
                }
            }
        }
        for path in &self.fields {
            redact_path(object, path);
        }
    }

    /// Redact a status as written (the named fields under `status.`).
    pub fn status(&self, status: &mut Value) {
        for path in &self.fields {
            if let [first, rest @ ..] = path.as_slice()
                && first == "status"
                && !rest.is_empty()
            {
                redact_path(status, rest);
            }
        }
    }
}

/// Replace every leaf under `value` with [`REDACTED`], keeping the keys and list lengths.
fn redact_leaves(value: &mut Value) {
    match value {
        Value::Object(fields) => fields.values_mut().for_each(redact_leaves),
        Value::Array(items) => items.iter_mut().for_each(redact_leaves),
        Value::Null => {}
        leaf => *leaf = Value::String(REDACTED.to_owned()),
    }
}

/// Replace the value at `path` with [`REDACTED`]; a list on the way applies the rest of the
/// path to each item (`spec.users.password` reaches every user's password).
fn redact_path(value: &mut Value, path: &[String]) {
    match (value, path) {
        (Value::Array(items), _) => items.iter_mut().for_each(|item| redact_path(item, path)),
        (Value::Object(fields), [last]) => {
            if let Some(found) = fields.get_mut(last.as_str())
                && !found.is_null()
            {
                *found = Value::String(REDACTED.to_owned());
            }
        }
        (Value::Object(fields), [first, rest @ ..]) => {
            if let Some(next) = fields.get_mut(first.as_str()) {
                redact_path(next, rest);
            }
        }
        _ => {}
    }
}

/// Replace every value of a core/v1 Secret's `data` and `stringData` with [`REDACTED`],
/// keeping the keys: a reader sees what a plugin was given, never the secret itself.
/// Returns whether `object` was a Secret.
pub fn redact_secret(object: &mut Value) -> bool {
    if object["kind"] != "Secret" || object["apiVersion"] != "v1" {
        return false;
    }
    for field in ["data", "stringData"] {
        match object.get_mut(field) {
            Some(Value::Object(values)) => {
                for value in values.values_mut() {
                    *value = Value::String(REDACTED.to_owned());
                }
            }
            // Not the map it should be (a malformed answer): hidden whole.
            Some(value) if !value.is_null() => *value = Value::String(REDACTED.to_owned()),
            _ => {}
        }
    }
    // The last-applied annotation repeats the data.
    remove_last_applied(object);
    true
}

/// Remove `kubectl apply`'s copy of the object from its annotations.
fn remove_last_applied(object: &mut Value) {
    if let Some(Value::Object(annotations)) = object
        .get_mut("metadata")
        .and_then(|m| m.get_mut("annotations"))
    {
        annotations.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
}

/// How a plugin's answer to a case compares with the expected one (the recorded answer, or
/// another plugin's). Differences read as a shadow run and `plugin diff` print them; the
/// same failure on both sides is unchanged, since the point is what a change would alter.
///
/// The text quotes no value `hide` redacts.
pub fn compare_answers(
    expected: &Result<ReconcileResponse, RecordedError>,
    actual: &Result<ReconcileResponse, CallError>,
    hide: Hide<'_>,
) -> Verdict {
    match (expected, actual) {
        (Ok(expected), actual) => {
            crate::plugin::compare_hiding(&Ok(expected.clone()), actual, hide)
        }
        (Err(expected), Err(actual)) if expected.message == actual.to_string() => {
            Verdict::Unchanged
        }
        (Err(expected), Err(actual)) => Verdict::WouldFail(format!(
            "{actual} (expected to fail with: {})",
            expected.message
        )),
        (Err(expected), Ok(_)) => Verdict::WouldChange(format!(
            "the expected answer fails ({}); the plugin succeeds",
            expected.message
        )),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn secret() -> Value {
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "db",
               "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{\"data\":{\"password\":\"aHVudGVyMg==\"}}"}},
               "data": {"password": "aHVudGVyMg=="}, "stringData": {"user": "admin"}})
    }

    #[test]
    fn a_case_holds_the_request_and_gives_it_back() {
        let request = ReconcileRequest {
            parent:
                json!({"apiVersion": "example.com/v1", "kind": "MyApp", "metadata": {"name": "a"}})
                    .to_string(),
            children: vec![ObservedObject::from_value(
                &json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "a"}}),
            )],
            related: vec![ObservedObject::from_value(
                &json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}),
            )],
            config: Some(json!({"service": true}).to_string()),
            finalizing: false,
        };
        let case = Case::of(&request, &Redaction::secrets(false));
        let yaml = case.to_yaml().expect("yaml");
        let read: Case = serde_yaml_ng::from_str(&yaml).expect("read back");
        assert_eq!(read, case);
        assert_eq!(read.request(), request);
    }

    #[test]
    fn a_case_written_from_the_request_s_texts_reads_back_as_the_parsed_case() {
        let recorded = Recorded {
            at: "2026-12-05T00:00:00.000Z".into(),
            policy: "p".into(),
            plugin: "sha256:aa".into(),
            response: Some(RunOutput {
                children: Vec::new(),
                status: None,
                requeue_after_ms: Some(5000),
                events: Vec::new(),
                finalized: false,
            }),
            error: None,
        };
        let object = |kind: &str, name: &str| {
            ObservedObject::from_value(&json!({"apiVersion": "v1", "kind": kind,
                "metadata": {"name": name}, "data": {"k": "v \"quoted\""}}))
        };
        let requests = [
            ReconcileRequest {
                parent: json!({"apiVersion": "example.com/v1", "kind": "MyApp",
                               "metadata": {"name": "a"}, "spec": {"replicas": 2}})
                .to_string(),
                children: vec![object("ConfigMap", "a"), object("Service", "a")],
                related: vec![object("ConfigMap", "shared")],
                config: Some(json!({"service": true}).to_string()),
                finalizing: true,
            },
            ReconcileRequest {
                parent: json!({"apiVersion": "example.com/v1", "kind": "MyApp"}).to_string(),
                ..ReconcileRequest::default()
            },
        ];
        let redaction = Redaction::secrets(false);
        for request in &requests {
            for recorded in [None, Some(recorded.clone())] {
                let recorded_text = recorded
                    .as_ref()
                    .map(|r| serde_json::to_string(r).expect("written"));
                let text = Case::text_of(request, recorded_text.as_deref()).expect("written");
                let read: Case = serde_json::from_str(&text).expect("valid JSON of a case");
                let parsed = Case {
                    recorded: recorded.clone(),
                    ..Case::of(request, &redaction)
                };
                assert_eq!(read, parsed, "{text}");
            }
        }
        assert!(!redaction.changes("v1", "ConfigMap"));
        assert!(redaction.changes("v1", "Secret"));
        assert!(!Redaction::secrets(true).changes("v1", "Secret"));
    }

    #[test]
    fn an_answer_written_where_it_is_reads_as_the_recorded_copy() {
        let response = ReconcileResponse {
            children: vec![
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"},
                       "data": {"k": "v \"quoted\" \u{e9}"}})
                .as_object()
                .cloned()
                .unwrap_or_default(),
            ],
            status: json!({"ready": true}).as_object().cloned(),
            requeue_after: Some(std::time::Duration::from_millis(1500)),
            events: vec![PluginEvent {
                type_: crate::plugin::EventType::Warning,
                reason: "Odd".into(),
                message: "m".into(),
            }],
            finalized: true,
        };
        let answers = [
            Ok(response.clone()),
            Ok(ReconcileResponse {
                status: None,
                requeue_after: None,
                ..response
            }),
            Err(CallError::Trap {
                message: "unreachable".into(),
                plugin_said: Some("panicked".into()),
            }),
        ];
        for answer in &answers {
            let copied = Recorded {
                at: "2026-12-05T00:00:00.000Z".into(),
                policy: "p".into(),
                plugin: "sha256:aa".into(),
                response: answer.as_ref().ok().map(|r| RunOutput::from(r.clone())),
                error: answer.as_ref().err().map(RecordedError::of),
            };
            let text = recorded_text(&copied.at, "p", "sha256:aa", answer).expect("written");
            assert_eq!(text, serde_json::to_string(&copied).expect("written"));
        }
        let case = Case::text_of(
            &ReconcileRequest {
                parent: "{}".into(),
                ..ReconcileRequest::default()
            },
            Some("{}"),
        )
        .expect("written");
        assert_eq!(case, r#"{"parent":{},"recorded":{}}"#);
        assert_eq!(with_recorded("{}".into(), Some("1")), r#"{"recorded":1}"#);
    }

    #[test]
    fn secret_values_are_redacted_unless_asked_for_and_other_kinds_are_untouched() {
        let request = ReconcileRequest {
            parent: "{}".into(),
            related: vec![
                ObservedObject::from_value(&secret()),
                ObservedObject::from_value(
                    &json!({"apiVersion": "v1", "kind": "ConfigMap", "data": {"password": "visible"}}),
                ),
            ],
            ..ReconcileRequest::default()
        };
        let redacted = Case::of(&request, &Redaction::secrets(false));
        let text = serde_json::to_string(&redacted).expect("json");
        assert!(!text.contains("aHVudGVyMg=="), "{text}");
        assert!(!text.contains("admin"), "{text}");
        assert_eq!(redacted.related[0]["data"]["password"], REDACTED);
        assert_eq!(redacted.related[0]["stringData"]["user"], REDACTED);
        assert_eq!(redacted.related[1]["data"]["password"], "visible");

        let kept = Case::of(&request, &Redaction::secrets(true));
        assert_eq!(kept.related[0]["data"]["password"], "aHVudGVyMg==");
    }

    #[test]
    fn a_secret_whose_data_is_not_a_map_is_hidden_whole() {
        let mut secret = serde_json::json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "s"}, "data": "c2VjcmV0", "stringData": ["secret"]});
        assert!(redact_secret(&mut secret));
        assert_eq!(secret["data"], REDACTED);
        assert_eq!(secret["stringData"], REDACTED);
    }

    #[test]
    fn what_a_policy_marks_sensitive_is_redacted_even_when_secrets_are_kept() {
        let spec: crate::policy::ReconcilePolicySpec = serde_json::from_value(json!({
            "parent": {"apiVersion": "example.com/v1", "kind": "App"},
            "plugin": {"source": {"file": {"path": "p.wasm"}}},
            "related": [{"apiVersion": "example.com/v1", "kind": "Vault", "redact": true}],
            "redactFields": ["spec.apiKey", "spec.users.password", "status.adminPassword"],
        }))
        .expect("spec");
        let redaction = Redaction::of_policy(&spec, true);
        let request = ReconcileRequest {
            parent: json!({"apiVersion": "example.com/v1", "kind": "App",
                           "metadata": {"name": "a"},
                           "spec": {"apiKey": "k-123", "replicas": 2,
                                    "users": [{"name": "u", "password": "p-456"}]}})
            .to_string(),
            related: vec![
                ObservedObject::from_value(&json!({
                    "apiVersion": "example.com/v1", "kind": "Vault",
                    "metadata": {"name": "v", "annotations": {
                        "kubectl.kubernetes.io/last-applied-configuration": "{\"spec\":{\"token\":\"t-789\"}}"}},
                    "spec": {"token": "t-789", "paths": ["a", "b"]}})),
                ObservedObject::from_value(&secret()),
            ],
            ..ReconcileRequest::default()
        };
        let case = Case::of(&request, &redaction);
        let text = serde_json::to_string(&case).expect("json");
        for secret in ["k-123", "p-456", "t-789"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        assert_eq!(case.parent["spec"]["apiKey"], REDACTED);
        assert_eq!(case.parent["spec"]["replicas"], 2, "unmarked fields stay");
        assert_eq!(case.parent["spec"]["users"][0]["name"], "u");
        assert_eq!(case.related[0]["metadata"]["name"], "v", "metadata stays");
        assert_eq!(
            case.related[0]["spec"]["paths"],
            json!([REDACTED, REDACTED])
        );
        assert_eq!(
            case.related[1]["data"]["password"], "aHVudGVyMg==",
            "Secrets are kept when the host is told to"
        );

        let mut status = json!({"adminPassword": "s-000", "ready": true});
        redaction.status(&mut status);
        assert_eq!(status, json!({"adminPassword": REDACTED, "ready": true}));
        assert_eq!(
            Redaction::of_policy(&spec, false),
            Redaction {
                keep_secrets: false,
                ..redaction
            }
        );
    }

    #[test]
    fn the_same_failure_is_unchanged_and_a_new_one_would_fail() {
        let reported = |message: &str| CallError::Reported {
            kind: crate::plugin::ReportedKind::Permanent,
            message: message.into(),
        };
        let recorded = Err(RecordedError::of(&reported("x can never work")));
        assert_eq!(
            compare_answers(
                &recorded,
                &Err(reported("x can never work")),
                Hide::nothing()
            ),
            Verdict::Unchanged
        );
        assert!(matches!(
            compare_answers(&recorded, &Err(reported("other")), Hide::nothing()),
            Verdict::WouldFail(text) if text.contains("expected to fail with")
        ));
        assert!(matches!(
            compare_answers(
                &recorded,
                &Ok(ReconcileResponse::default()),
                Hide::nothing()
            ),
            Verdict::WouldChange(_)
        ));
        assert_eq!(
            compare_answers(
                &Ok(ReconcileResponse::default()),
                &Ok(ReconcileResponse::default()),
                Hide::nothing()
            ),
            Verdict::Unchanged
        );
    }
}
