//! The webhooks a plugin may serve for its kind (validate, default, convert) as the host sees
//! them: plain data, no wasmtime types, and the contract check of every answer. The API
//! server trusts what a webhook says about every write of the kind, so nothing a plugin
//! answers is used before it is checked here: a default or a conversion that would change
//! which object it is, or reach the wrong version, is refused as invalid output.

use serde_json::Value;

use super::call::JsonObject;
use super::contract::wit_webhooks as wit;
use super::error::{CallError, ReportedKind};
use super::limits::Limits;

/// Warnings kept from one answer; the rest are counted in a last one. The API server and
/// `kubectl` show every warning to the person writing, so a plugin must not flood them, and
/// the API server itself keeps 4 KiB of warnings per request: this many at the most bytes
/// each, plus the count, fit.
pub const MAX_WARNINGS: usize = 12;
/// Bytes kept of one warning (the API server may cut longer ones).
pub const MAX_WARNING_BYTES: usize = 256;
/// Reasons kept from one denial; the rest are counted in a last one.
pub const MAX_VIOLATIONS: usize = 32;
/// Bytes kept of one reason's message (and of its field path).
pub const MAX_VIOLATION_BYTES: usize = 1024;

/// Which webhooks a plugin serves, as its `served` export answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServedWebhooks {
    /// `validate`: allows or denies writes.
    pub validate: bool,
    /// `default`: fills in what a write left out.
    pub default: bool,
    /// `convert`: rewrites objects between API versions of the kind.
    pub convert: bool,
}

impl ServedWebhooks {
    /// Whether it serves any webhook at all.
    pub fn any(&self) -> bool {
        self.validate || self.default || self.convert
    }

    /// The names of the webhooks served, in contract order, e.g. `["validate", "default"]`.
    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.validate, "validate"),
            (self.default, "default"),
            (self.convert, "convert"),
        ]
        .into_iter()
        .filter_map(|(served, name)| served.then_some(name))
        .collect()
    }
}

impl From<wit::ServedWebhooks> for ServedWebhooks {
    fn from(flags: wit::ServedWebhooks) -> Self {
        Self {
            validate: flags.contains(wit::ServedWebhooks::VALIDATE),
            default: flags.contains(wit::ServedWebhooks::DEFAULT),
            convert: flags.contains(wit::ServedWebhooks::CONVERT),
        }
    }
}

/// The kind of write being admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Operation {
    /// A new object.
    Create,
    /// A change to a stored object.
    Update,
    /// The removal of a stored object.
    Delete,
}

/// Who is writing, as the API server authenticated them.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UserInfo {
    /// The user name.
    pub username: String,
    /// The groups the user is in.
    #[serde(default)]
    pub groups: Vec<String>,
}

/// One write a plugin is asked to validate or default.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionRequest {
    /// What the write does.
    pub operation: Operation,
    /// The object as it would be stored; none for a delete.
    pub object: Option<JsonObject>,
    /// The object as stored before the write (updates and deletes).
    pub old_object: Option<JsonObject>,
    /// Who is writing, when known.
    pub user: Option<UserInfo>,
    /// The policy's plugin config as JSON.
    pub config: Option<String>,
}

impl From<AdmissionRequest> for wit::AdmissionRequest {
    fn from(r: AdmissionRequest) -> Self {
        let text = |o: JsonObject| Value::Object(o).to_string();
        Self {
            operation: match r.operation {
                Operation::Create => wit::Operation::Create,
                Operation::Update => wit::Operation::Update,
                Operation::Delete => wit::Operation::Delete,
            },
            object: r.object.map(text),
            old_object: r.old_object.map(text),
            user: r.user.map(|u| wit::UserInfo {
                username: u.username,
                groups: u.groups,
            }),
            config: r.config,
        }
    }
}

/// Why a write is refused, and where.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Violation {
    /// The field path, e.g. `spec.replicas`; empty for the object as a whole.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

/// A plugin's `validate` answer, checked and bounded.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AdmissionVerdict {
    /// Empty when the write is allowed.
    pub violations: Vec<Violation>,
    /// Shown to the client either way.
    pub warnings: Vec<String>,
}

impl AdmissionVerdict {
    /// Whether the write is allowed.
    pub fn allowed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The denial as one line, `field: message; field: message`, for an AdmissionReview's
    /// message and the CLI.
    pub fn message(&self) -> String {
        self.violations
            .iter()
            .map(|v| {
                if v.field.is_empty() {
                    v.message.clone()
                } else {
                    format!("{}: {}", v.field, v.message)
                }
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// A plugin's `default` answer: the whole object with its defaults, identity unchanged.
#[derive(Debug, Clone, PartialEq)]
pub struct Defaulted {
    /// The defaulted object.
    pub object: JsonObject,
    /// Shown to the client.
    pub warnings: Vec<String>,
}

/// The metadata a webhook may change: everything else in `metadata` (name, namespace, uid,
/// finalizers, owner references, resource version, ...) belongs to the API server, the host
/// and the garbage collector.
const WEBHOOK_METADATA: [&str; 2] = ["labels", "annotations"];

/// What a conversion must keep, besides reaching the version it was asked for: the API
/// server refuses a conversion that changes any of these (and restores the rest of the
/// metadata but labels and annotations itself, as the host does).
const KEPT_BY_CONVERSION: [&str; 4] = [
    "/kind",
    "/metadata/name",
    "/metadata/namespace",
    "/metadata/uid",
];

/// A plugin's own failure to decide, as the host reports it.
fn reported(message: String) -> CallError {
    CallError::Reported {
        kind: ReportedKind::Permanent,
        message,
    }
}

/// Check and bound a `validate` answer.
pub(crate) fn accept_verdict(
    answer: Result<wit::Verdict, String>,
    limits: &Limits,
) -> Result<AdmissionVerdict, CallError> {
    let verdict = answer.map_err(reported)?;
    let size_bytes = verdict
        .violations
        .iter()
        .map(|v| v.field.len() + v.message.len())
        .chain(verdict.warnings.iter().map(String::len))
        .sum::<usize>();
    if size_bytes > limits.max_output_bytes {
        return Err(CallError::OutputTooLarge {
            size_bytes,
            limit_bytes: limits.max_output_bytes,
        });
    }
    let total = verdict.violations.len();
    let mut violations: Vec<Violation> = verdict
        .violations
        .into_iter()
        .take(MAX_VIOLATIONS)
        .map(|v| Violation {
            field: bounded(printable(&v.field), MAX_VIOLATION_BYTES),
            message: bounded(printable(&v.message), MAX_VIOLATION_BYTES),
        })
        .collect();
    if total > MAX_VIOLATIONS {
        violations.push(Violation {
            field: String::new(),
            message: format!("and {} more", total - MAX_VIOLATIONS),
        });
    }
    Ok(AdmissionVerdict {
        violations,
        warnings: bounded_warnings(verdict.warnings),
    })
}

/// Check a `default` answer against the object it was asked to default.
pub(crate) fn accept_defaulted(
    answer: Result<wit::Defaulted, String>,
    original: &JsonObject,
    limits: &Limits,
) -> Result<Defaulted, CallError> {
    let answer = answer.map_err(reported)?;
    let object = parse_answer(&answer.object, "the defaulted object", limits)?;
    let changed = changed_field(original, &object, &["/apiVersion", "/kind", "/status"])
        .or_else(|| changed_metadata(original, &object).map(|field| format!("metadata.{field}")));
    if let Some(changed) = changed {
        return Err(CallError::InvalidOutput(format!(
            "a default may change the object's content, labels and annotations, but it changed {changed}"
        )));
    }
    Ok(Defaulted {
        object,
        warnings: bounded_warnings(answer.warnings),
    })
}

/// Check a `convert` answer against the object it was asked to convert.
pub(crate) fn accept_converted(
    answer: Result<String, String>,
    original: &JsonObject,
    desired_api_version: &str,
    limits: &Limits,
) -> Result<JsonObject, CallError> {
    let json = answer.map_err(reported)?;
    let mut object = parse_answer(&json, "the converted object", limits)?;
    let reached = object.get("apiVersion").and_then(Value::as_str);
    if reached != Some(desired_api_version) {
        return Err(CallError::InvalidOutput(format!(
            "a conversion to {desired_api_version} must answer apiVersion {desired_api_version}, but it answered {}",
            reached.map_or_else(|| "none".to_owned(), str::to_owned)
        )));
    }
    if original.contains_key("metadata") && !object.get("metadata").is_some_and(Value::is_object) {
        return Err(CallError::InvalidOutput(
            "a conversion must answer the object's metadata".into(),
        ));
    }
    if let Some(changed) = changed_field(original, &object, &KEPT_BY_CONVERSION) {
        return Err(CallError::InvalidOutput(format!(
            "a conversion must keep {changed} as it was"
        )));
    }
    restore_metadata(original, &mut object)?;
    Ok(object)
}

/// The first metadata field other than labels and annotations that differs, by name.
fn changed_metadata(before: &JsonObject, after: &JsonObject) -> Option<String> {
    let empty = JsonObject::new();
    let fields = |object: &JsonObject| match object.get("metadata") {
        Some(Value::Object(metadata)) => Some(metadata.clone()),
        None | Some(Value::Null) => Some(empty.clone()),
        Some(_) => None,
    };
    let (Some(before), Some(after)) = (fields(before), fields(after)) else {
        return Some("(the whole of it)".to_owned());
    };
    let mut names: Vec<&String> = before.keys().chain(after.keys()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter(|name| !WEBHOOK_METADATA.contains(&name.as_str()))
        .find(|name| {
            before.get(*name).unwrap_or(&Value::Null) != after.get(*name).unwrap_or(&Value::Null)
        })
        .cloned()
}

/// Put back the original's metadata, keeping the conversion's labels and annotations (which
/// must be maps of strings): what the API server does with a converted object.
fn restore_metadata(original: &JsonObject, converted: &mut JsonObject) -> Result<(), CallError> {
    let Some(Value::Object(metadata)) = original.get("metadata") else {
        return Ok(());
    };
    let mut restored = metadata.clone();
    if let Some(Value::Object(answered)) = converted.get("metadata") {
        for field in WEBHOOK_METADATA {
            match answered.get(field) {
                None | Some(Value::Null) => {
                    restored.remove(field);
                }
                Some(Value::Object(map)) if map.values().all(Value::is_string) => {
                    restored.insert(field.to_owned(), Value::Object(map.clone()));
                }
                Some(_) => {
                    return Err(CallError::InvalidOutput(format!(
                        "metadata.{field} of the converted object must map strings to strings"
                    )));
                }
            }
        }
    }
    converted.insert("metadata".to_owned(), Value::Object(restored));
    Ok(())
}

fn parse_answer(json: &str, what: &str, limits: &Limits) -> Result<JsonObject, CallError> {
    if json.len() > limits.max_output_bytes {
        return Err(CallError::OutputTooLarge {
            size_bytes: json.len(),
            limit_bytes: limits.max_output_bytes,
        });
    }
    serde_json::from_str(json)
        .map_err(|e| CallError::InvalidOutput(format!("{what} is not a JSON object: {e}")))
}

/// The first of `fields` (JSON pointers) whose value differs between the two objects, as a
/// dotted path (`metadata.name`). An absent field and `null` are the same.
fn changed_field(before: &JsonObject, after: &JsonObject, fields: &[&str]) -> Option<String> {
    fn read<'a>(object: &'a JsonObject, pointer: &str) -> &'a Value {
        let mut keys = pointer.trim_start_matches('/').split('/');
        let first = keys.next().and_then(|key| object.get(key));
        keys.fold(first, |at, key| at.and_then(|value| value.get(key)))
            .unwrap_or(&Value::Null)
    }
    fields
        .iter()
        .find(|pointer| read(before, pointer) != read(after, pointer))
        .map(|pointer| pointer.trim_start_matches('/').replace('/', "."))
}

/// At most [`MAX_WARNINGS`] warnings of at most [`MAX_WARNING_BYTES`] each; what is left
/// out is counted in the last.
pub fn bounded_warnings(warnings: Vec<String>) -> Vec<String> {
    let total = warnings.len();
    let mut kept: Vec<String> = warnings
        .into_iter()
        .take(MAX_WARNINGS)
        .map(|w| bounded(printable(&w), MAX_WARNING_BYTES))
        .collect();
    if total > MAX_WARNINGS {
        kept.push(format!("and {} more warnings", total - MAX_WARNINGS));
    }
    kept
}

/// `text` on one line, control characters as spaces, cut to at most `max` bytes (marked with
/// `…`): how a plugin's own words (a reason, a panic message) reach a client or a log line.
pub fn one_line(text: &str, max: usize) -> String {
    bounded(printable(text), max)
}

/// `text` with control characters (newlines, escapes a terminal would act on) as spaces: a
/// warning is printed as it is by `kubectl` and `wasmctrl`.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// `text` cut to at most `max` bytes on a character boundary, marked with `…` when cut.
fn bounded(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut cut = max;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn object(value: Value) -> JsonObject {
        match value {
            Value::Object(map) => map,
            other => panic!("not an object: {other}"),
        }
    }

    fn app() -> JsonObject {
        object(json!({
            "apiVersion": "example.com/v1", "kind": "MyApp",
            "metadata": {"name": "a", "namespace": "ns", "uid": "u-1",
                         "labels": {"team": "x"}, "annotations": {"note": "y"}},
            "spec": {"image": "nginx"},
        }))
    }

    fn defaulted(value: Value) -> Result<wit::Defaulted, String> {
        Ok(wit::Defaulted {
            object: value.to_string(),
            warnings: Vec::new(),
        })
    }

    #[test]
    fn a_default_that_fills_in_a_field_is_accepted() {
        let mut filled = Value::Object(app());
        filled["spec"]["replicas"] = json!(1);
        let answer =
            accept_defaulted(defaulted(filled), &app(), &Limits::default()).expect("accepted");
        assert_eq!(answer.object["spec"]["replicas"], 1);
    }

    #[test]
    fn a_default_that_renames_or_moves_the_object_is_refused() {
        for (pointer, value) in [
            ("/metadata/name", json!("b")),
            ("/metadata/namespace", json!("other")),
            ("/metadata/uid", json!("u-2")),
            ("/metadata/finalizers", json!(["x"])),
            ("/metadata/ownerReferences", json!([{"uid": "adopted"}])),
            ("/metadata/generateName", json!("web-")),
            ("/status", json!({"ready": true})),
            ("/kind", json!("Other")),
            ("/apiVersion", json!("example.com/v2")),
        ] {
            let mut changed = Value::Object(app());
            match changed.pointer_mut(pointer) {
                Some(field) => *field = value,
                None => {
                    let (parent, key) = pointer.rsplit_once('/').expect("a parent");
                    let parent = if parent.is_empty() {
                        &mut changed
                    } else {
                        changed.pointer_mut(parent).expect("parent")
                    };
                    parent[key] = value;
                }
            }
            let err = accept_defaulted(defaulted(changed), &app(), &Limits::default())
                .expect_err(pointer);
            let field = pointer.trim_start_matches('/').replace('/', ".");
            assert!(
                matches!(&err, CallError::InvalidOutput(m) if m.contains(&field)),
                "{pointer}: {err}"
            );
        }
    }

    #[test]
    fn a_default_may_set_labels_and_annotations_but_not_drop_the_metadata() {
        let mut labelled = Value::Object(app());
        labelled["metadata"]["labels"]["tier"] = json!("web");
        labelled["metadata"]["annotations"] = json!({});
        accept_defaulted(defaulted(labelled), &app(), &Limits::default()).expect("labels");
        let mut dropped = Value::Object(app());
        dropped.as_object_mut().expect("object").remove("metadata");
        let err = accept_defaulted(defaulted(dropped), &app(), &Limits::default())
            .expect_err("no metadata");
        assert!(matches!(err, CallError::InvalidOutput(_)), "{err}");
        let mut scalar = Value::Object(app());
        scalar["metadata"] = json!("gone");
        assert!(accept_defaulted(defaulted(scalar), &app(), &Limits::default()).is_err());
    }

    #[test]
    fn a_default_that_is_not_an_object_or_too_large_is_refused() {
        let err = accept_defaulted(defaulted(json!([1])), &app(), &Limits::default())
            .expect_err("a list");
        assert!(matches!(err, CallError::InvalidOutput(_)), "{err}");
        let mut huge = Value::Object(app());
        huge["spec"]["blob"] = json!("x".repeat(2048));
        let small = Limits {
            max_output_bytes: 1024,
            ..Limits::default()
        };
        let err = accept_defaulted(defaulted(huge), &app(), &small).expect_err("too large");
        assert!(matches!(err, CallError::OutputTooLarge { .. }), "{err}");
    }

    #[test]
    fn a_conversion_must_reach_the_version_asked_for() {
        let mut v2 = Value::Object(app());
        v2["apiVersion"] = json!("example.com/v2");
        let err = accept_converted(
            Ok(v2.to_string()),
            &app(),
            "example.com/v3",
            &Limits::default(),
        )
        .expect_err("wrong version");
        assert!(
            matches!(&err, CallError::InvalidOutput(m) if m.contains("example.com/v3") && m.contains("example.com/v2")),
            "{err}"
        );
        let converted = accept_converted(
            Ok(v2.to_string()),
            &app(),
            "example.com/v2",
            &Limits::default(),
        )
        .expect("reached");
        assert_eq!(converted["apiVersion"], "example.com/v2");
    }

    #[test]
    fn a_conversion_keeps_identity_and_the_host_restores_the_rest_of_the_metadata() {
        for pointer in [
            "/kind",
            "/metadata/name",
            "/metadata/namespace",
            "/metadata/uid",
        ] {
            let mut v2 = Value::Object(app());
            v2["apiVersion"] = json!("example.com/v2");
            *v2.pointer_mut(pointer).expect("field") = json!("changed");
            let err = accept_converted(
                Ok(v2.to_string()),
                &app(),
                "example.com/v2",
                &Limits::default(),
            )
            .expect_err(pointer);
            assert!(matches!(err, CallError::InvalidOutput(_)), "{pointer}");
        }
        // The spec is the conversion's to change, and so are labels and annotations (a
        // conversion may keep there what the other version has no field for); the rest of
        // the metadata comes back as it was, as the API server would put it back.
        let mut v2 = Value::Object(app());
        v2["apiVersion"] = json!("example.com/v2");
        v2["spec"] = json!({"container": {"image": "nginx"}});
        v2["metadata"]["annotations"] = json!({"example.com/v1-only": "kept"});
        v2["metadata"]
            .as_object_mut()
            .expect("map")
            .remove("labels");
        v2["metadata"]["finalizers"] = json!(["smuggled"]);
        let converted = accept_converted(
            Ok(v2.to_string()),
            &app(),
            "example.com/v2",
            &Limits::default(),
        )
        .expect("a reshaped spec is the point");
        assert_eq!(converted["spec"], v2["spec"]);
        assert_eq!(
            converted["metadata"],
            json!({"name": "a", "namespace": "ns", "uid": "u-1",
                   "annotations": {"example.com/v1-only": "kept"}})
        );
        // Metadata that is missing, or labels that are not strings, are refused.
        let mut bare = v2.clone();
        bare.as_object_mut().expect("object").remove("metadata");
        let err = accept_converted(
            Ok(bare.to_string()),
            &app(),
            "example.com/v2",
            &Limits::default(),
        )
        .expect_err("no metadata");
        assert!(matches!(err, CallError::InvalidOutput(_)), "{err}");
        let mut odd = v2;
        odd["metadata"]["labels"] = json!({"n": 1});
        let err = accept_converted(
            Ok(odd.to_string()),
            &app(),
            "example.com/v2",
            &Limits::default(),
        )
        .expect_err("labels are strings");
        assert!(matches!(err, CallError::InvalidOutput(_)), "{err}");
    }

    #[test]
    fn warnings_and_reasons_are_bounded_and_counted() {
        let verdict = accept_verdict(
            Ok(wit::Verdict {
                violations: (0..MAX_VIOLATIONS + 3)
                    .map(|i| wit::Violation {
                        field: format!("spec.f{i}"),
                        message: "é".repeat(MAX_VIOLATION_BYTES),
                    })
                    .collect(),
                warnings: (0..MAX_WARNINGS + 5).map(|i| format!("w{i}")).collect(),
            }),
            &Limits::default(),
        )
        .expect("bounded, not refused");
        assert!(!verdict.allowed());
        assert_eq!(verdict.violations.len(), MAX_VIOLATIONS + 1);
        assert_eq!(verdict.violations[MAX_VIOLATIONS].message, "and 3 more");
        assert!(verdict.violations[0].message.len() <= MAX_VIOLATION_BYTES + '…'.len_utf8());
        assert_eq!(verdict.warnings.len(), MAX_WARNINGS + 1);
        assert_eq!(verdict.warnings[MAX_WARNINGS], "and 5 more warnings");
        let long = bounded_warnings(vec!["x".repeat(MAX_WARNING_BYTES * 3)]);
        assert!(long[0].len() <= MAX_WARNING_BYTES + '…'.len_utf8());
        assert_eq!(
            bounded_warnings(vec!["a\nb\u{1b}[31m".into()]),
            ["a b [31m"]
        );
        // What the API server keeps of one request's warnings.
        let all: usize = verdict.warnings.iter().map(String::len).sum();
        assert!(all <= 4096, "{all}");
    }

    #[test]
    fn a_plugin_that_cannot_decide_is_a_reported_error() {
        let err = accept_verdict(Err("no rules loaded".into()), &Limits::default())
            .expect_err("could not decide");
        assert!(
            matches!(&err, CallError::Reported { message, .. } if message == "no rules loaded"),
            "{err}"
        );
    }

    #[test]
    fn a_denial_reads_as_one_line_with_its_fields() {
        let verdict = AdmissionVerdict {
            violations: vec![
                Violation {
                    field: "spec.replicas".into(),
                    message: "must be at most 50".into(),
                },
                Violation {
                    field: String::new(),
                    message: "bad".into(),
                },
            ],
            warnings: Vec::new(),
        };
        assert_eq!(verdict.message(), "spec.replicas: must be at most 50; bad");
    }
}
