//! Comparing two plugins' decisions for the same request: what a candidate plugin would do
//! differently from the active one. Used by shadow runs in the host and by
//! `wasmctrl plugin diff`.
//!
//! A difference is described by the path of its first differing field and the values on
//! both sides. Where the text is shown to others (a policy's status, which a team's own
//! object copies), the caller says what must not be quoted ([`Hide`]): the comparison is made
//! on the real answers, and the values quoted are taken from redacted copies, so a changed
//! Secret shows where it changed but never what it held.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

use super::call::{JsonObject, ReconcileResponse};
use super::error::CallError;

/// How a candidate's decision compares with the active plugin's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Same children, same status.
    Unchanged,
    /// The candidate would change children or status; the text says how.
    WouldChange(String),
    /// The candidate fails where the active plugin does not (or both fail).
    WouldFail(String),
}

impl Verdict {
    /// `Unchanged`, `WouldChange` or `WouldFail`, as statuses and reports name it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Unchanged => "Unchanged",
            Self::WouldChange(_) => "WouldChange",
            Self::WouldFail(_) => "WouldFail",
        }
    }

    /// What would change or fail; empty when unchanged.
    pub fn detail(&self) -> &str {
        match self {
            Self::Unchanged => "",
            Self::WouldChange(detail) | Self::WouldFail(detail) => detail,
        }
    }
}

/// What a verdict's text must not quote: each redacts a copy of what it is given in place
/// (keeping its shape, as the host's record redaction does).
#[derive(Clone, Copy)]
pub struct Hide<'a> {
    /// Applied to each child, a whole Kubernetes object.
    pub child: &'a dyn Fn(&mut Value),
    /// Applied to the parent's status.
    pub status: &'a dyn Fn(&mut Value),
}

impl Hide<'_> {
    /// Quote every value as it is (a plugin author's own tools).
    pub fn nothing() -> Hide<'static> {
        Hide {
            child: &|_| {},
            status: &|_| {},
        }
    }
}

impl std::fmt::Debug for Hide<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hide")
    }
}

/// Compare the active plugin's answer with the candidate's, quoting every value.
pub fn compare(
    active: &Result<ReconcileResponse, CallError>,
    candidate: &Result<ReconcileResponse, CallError>,
) -> Verdict {
    compare_hiding(active, candidate, Hide::nothing())
}

/// Compare the active plugin's answer with the candidate's, quoting no value that `hide`
/// redacts.
pub fn compare_hiding(
    active: &Result<ReconcileResponse, CallError>,
    candidate: &Result<ReconcileResponse, CallError>,
    hide: Hide<'_>,
) -> Verdict {
    match (active, candidate) {
        (_, Err(error)) => Verdict::WouldFail(error.to_string()),
        (Err(error), Ok(_)) => Verdict::WouldChange(format!(
            "the active plugin fails ({error}); the candidate succeeds"
        )),
        (Ok(active), Ok(candidate)) => {
            let text = describe(active, candidate, hide);
            if text.is_empty() {
                Verdict::Unchanged
            } else {
                Verdict::WouldChange(text)
            }
        }
    }
}

/// A line per difference: children added, removed or changed (with the first differing
/// field), and the status.
fn describe(active: &ReconcileResponse, candidate: &ReconcileResponse, hide: Hide<'_>) -> String {
    let index = |children: &[JsonObject]| -> BTreeMap<String, Value> {
        children
            .iter()
            .map(|c| {
                let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
                let key = format!(
                    "{} {}",
                    text(c.get("kind").unwrap_or(&Value::Null)),
                    text(&c.get("metadata").cloned().unwrap_or_default()["name"])
                );
                (key, Value::Object(c.clone()))
            })
            .collect()
    };
    let (before, after) = (index(&active.children), index(&candidate.children));
    let mut out = String::new();
    for (key, object) in &after {
        match before.get(key) {
            None => {
                let _ = writeln!(out, "+ {key}");
            }
            Some(old) if old != object => {
                let _ = writeln!(out, "~ {key}: {}", first_change(old, object, hide.child));
            }
            Some(_) => {}
        }
    }
    for key in before.keys().filter(|k| !after.contains_key(*k)) {
        let _ = writeln!(out, "- {key}");
    }
    let status = |s: &Option<JsonObject>| s.clone().map(Value::Object).unwrap_or(Value::Null);
    let (old, new) = (status(&active.status), status(&candidate.status));
    if old != new {
        let _ = writeln!(out, "~ status: {}", first_change(&old, &new, hide.status));
    }
    out.truncate(out.trim_end().len());
    out
}

/// The field that names the items of both lists, if every item is an object with a distinct
/// string under it: `type` (conditions) or `name` (containers, ports, env).
fn list_key(a: &[Value], b: &[Value]) -> Option<&'static str> {
    ["type", "name"].into_iter().find(|key| {
        [a, b].iter().all(|list| {
            let mut names: Vec<&str> = list.iter().filter_map(|v| v[*key].as_str()).collect();
            let all = names.len() == list.len();
            names.sort_unstable();
            names.dedup();
            all && names.len() == list.len()
        }) && !(a.is_empty() && b.is_empty())
    })
}

/// One step down into a JSON value.
#[derive(Debug)]
enum Step {
    Key(String),
    /// The item of a list of named items whose `key` field is `name`, at its index in the
    /// old list and in the new one (where it is there). A redaction keeps a list's length
    /// and order, so the index finds the item in a redacted copy, whose name may be hidden.
    Named {
        key: &'static str,
        name: String,
        old: Option<usize>,
        new: Option<usize>,
    },
    Index(usize),
}

/// Which side of a comparison a value is on.
#[derive(Clone, Copy)]
enum Side {
    Old,
    New,
}

/// The item of `list` whose `key` field is `name`.
fn named<'a>(list: &'a [Value], key: &str, name: &str) -> Option<&'a Value> {
    list.iter().find(|v| v[key].as_str() == Some(name))
}

impl Step {
    fn follow<'a>(&self, value: &'a Value, side: Side) -> Option<&'a Value> {
        match (self, value) {
            (Self::Key(key), Value::Object(fields)) => fields.get(key),
            (Self::Named { old, new, .. }, Value::Array(items)) => {
                let index = match side {
                    Side::Old => *old,
                    Side::New => *new,
                };
                items.get(index?)
            }
            (Self::Index(i), Value::Array(items)) => items.get(*i),
            _ => None,
        }
    }
}

/// The text of the path `steps`, told from the redacted copies too: an item whose name is
/// hidden there is named by its index.
fn render_path(steps: &[Step], shown_old: &Value, shown_new: &Value) -> String {
    let mut path = String::new();
    let (mut here_old, mut here_new) = (Some(shown_old), Some(shown_new));
    for step in steps {
        let _ = match step {
            Step::Key(key) => write!(path, ".{key}"),
            Step::Named {
                key,
                name,
                old,
                new,
            } => {
                let shown = |here: Option<&Value>, index: Option<usize>| {
                    index.is_none_or(|i| {
                        here.and_then(|list| list.get(i))
                            .is_some_and(|item| item[*key].as_str() == Some(name.as_str()))
                    })
                };
                if shown(here_old, *old) && shown(here_new, *new) {
                    write!(path, "[{key}={name}]")
                } else {
                    write!(path, "[{}]", new.or(*old).unwrap_or_default())
                }
            }
            Step::Index(i) => write!(path, "[{i}]"),
        };
        here_old = here_old.and_then(|v| step.follow(v, Side::Old));
        here_new = here_new.and_then(|v| step.follow(v, Side::New));
    }
    path
}

/// The path of the first field that differs between `old` and `new`, with both values as
/// `redact`ed copies of `old` and `new` hold them there.
fn first_change(old: &Value, new: &Value, redact: &dyn Fn(&mut Value)) -> String {
    /// Descend while both sides are containers that differ somewhere inside; stop at the
    /// first differing leaf (or shape), recording the way there.
    fn walk(old: Option<&Value>, new: Option<&Value>, steps: &mut Vec<Step>) {
        match (old, new) {
            (Some(Value::Object(a)), Some(Value::Object(b))) => {
                let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
                keys.sort();
                keys.dedup();
                if let Some(key) = keys.into_iter().find(|key| a.get(*key) != b.get(*key)) {
                    steps.push(Step::Key(key.clone()));
                    walk(a.get(key), b.get(key), steps);
                }
            }
            (Some(Value::Array(a)), Some(Value::Array(b))) if list_key(a, b).is_some() => {
                // Lists of named items (conditions, containers, ports) compare item by item
                // whatever their order and length: `[type=Ready]`, not "the list changed".
                let key = list_key(a, b).unwrap_or_default();
                let mut names: Vec<&str> =
                    a.iter().chain(b).filter_map(|v| v[key].as_str()).collect();
                names.sort_unstable();
                names.dedup();
                let found = names
                    .into_iter()
                    .find(|name| named(a, key, name) != named(b, key, name));
                if let Some(name) = found {
                    let position =
                        |list: &[Value]| list.iter().position(|v| v[key].as_str() == Some(name));
                    let (old, new) = (position(a), position(b));
                    steps.push(Step::Named {
                        key,
                        name: name.to_owned(),
                        old,
                        new,
                    });
                    walk(
                        old.and_then(|i| a.get(i)),
                        new.and_then(|i| b.get(i)),
                        steps,
                    );
                }
            }
            (Some(Value::Array(a)), Some(Value::Array(b))) if a.len() == b.len() => {
                if let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) {
                    steps.push(Step::Index(i));
                    walk(a.get(i), b.get(i), steps);
                }
            }
            _ => {}
        }
    }
    /// The value at the end of `steps` in `value`, or the last one reached on the way (a
    /// redaction may have replaced a whole subtree).
    fn at<'a>(value: &'a Value, steps: &[Step], side: Side) -> Option<&'a Value> {
        let mut here = value;
        for step in steps {
            match step.follow(here, side) {
                Some(next) => here = next,
                None => {
                    return (!matches!(here, Value::Object(_) | Value::Array(_))).then_some(here);
                }
            }
        }
        Some(here)
    }
    let mut steps = Vec::new();
    walk(Some(old), Some(new), &mut steps);
    let (mut shown_old, mut shown_new) = (old.clone(), new.clone());
    redact(&mut shown_old);
    redact(&mut shown_new);
    let shorten = |v: Option<&Value>| {
        let text = v
            .filter(|v| !v.is_null())
            .map_or_else(|| "(absent)".to_owned(), Value::to_string);
        if text.len() > 80 {
            format!("{}…", &text[..text.floor_char_boundary(80)])
        } else {
            text
        }
    };
    let mut path = render_path(&steps, &shown_old, &shown_new);
    if path.is_empty() {
        path.push('.');
    }
    format!(
        "{path} {} -> {}",
        shorten(at(&shown_old, &steps, Side::Old)),
        shorten(at(&shown_new, &steps, Side::New))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn response(children: Value, status: Value) -> ReconcileResponse {
        let object = |v: &Value| v.as_object().cloned().unwrap_or_default();
        ReconcileResponse {
            children: children
                .as_array()
                .map(|a| a.iter().map(object).collect())
                .unwrap_or_default(),
            status: status.as_object().cloned(),
            ..ReconcileResponse::default()
        }
    }

    #[test]
    fn named_list_items_are_compared_by_name() {
        let ready = json!({"type": "Ready", "status": "True"});
        let found = json!({"type": "ConfigMapFound", "status": "False"});
        let before = json!({"conditions": [ready]});
        let after = json!({"conditions": [ready, found]});
        assert_eq!(
            first_change(&before, &after, &|_| {}),
            r#".conditions[type=ConfigMapFound] (absent) -> {"status":"False","type":"ConfigMapFound"}"#
        );
        let env =
            |v: &str| json!({"env": [{"name": "A", "value": "1"}, {"name": "B", "value": v}]});
        assert_eq!(
            first_change(&env("2"), &env("3"), &|_| {}),
            r#".env[name=B].value "2" -> "3""#
        );
        // Unnamed items still compare by position.
        assert_eq!(
            first_change(&json!([1, 2]), &json!([1, 3]), &|_| {}),
            "[1] 2 -> 3"
        );
    }

    #[test]
    fn hidden_values_are_never_quoted_but_their_place_is() {
        let secret = |data: Value| json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "data": data});
        let redact = |child: &mut Value| {
            if child["kind"] == "Secret" {
                for value in child["data"]
                    .as_object_mut()
                    .into_iter()
                    .flat_map(|d| d.values_mut())
                {
                    *value = json!("(redacted)");
                }
            }
        };
        let hide = Hide {
            child: &redact,
            status: &|status| status["token"] = json!("(redacted)"),
        };
        let active = Ok(response(
            json!([secret(json!({"k": "b2xkLXZhbHVl", "same": "eA=="}))]),
            json!({"token": "old-token", "ready": true}),
        ));
        // A changed value, a value added under a new key, and a status field.
        let candidate = Ok(response(
            json!([secret(
                json!({"k": "bmV3LXZhbHVl", "same": "eA==", "added": "YWRkZWQ="})
            )]),
            json!({"token": "new-token", "ready": true}),
        ));
        let Verdict::WouldChange(text) = compare_hiding(&active, &candidate, hide) else {
            panic!("a change")
        };
        assert_eq!(
            text,
            "~ Secret s: .data.added (absent) -> \"(redacted)\"\n~ status: .token \"(redacted)\" -> \"(redacted)\""
        );
        // Where a whole subtree appears, its keys show and its values do not.
        let without = Ok(response(json!([secret(Value::Null)]), Value::Null));
        let with = Ok(response(
            json!([secret(json!({"k": "c2VjcmV0"}))]),
            Value::Null,
        ));
        let Verdict::WouldChange(text) = compare_hiding(&without, &with, hide) else {
            panic!("a change")
        };
        assert_eq!(text, "~ Secret s: .data (absent) -> {\"k\":\"(redacted)\"}");
        // A named list item whose name is hidden is named by its index, and its values are
        // read from the redacted copy by that index.
        let users = |password: &str| json!({"users": [{"name": "bob", "password": "x"}, {"name": "alice", "password": password}]});
        let hide_users = Hide {
            child: &|_| {},
            status: &|status| {
                for user in status["users"].as_array_mut().into_iter().flatten() {
                    user["name"] = json!("(redacted)");
                    user["password"] = json!("(redacted)");
                }
            },
        };
        let Verdict::WouldChange(text) = compare_hiding(
            &Ok(response(json!([]), users("old-pw"))),
            &Ok(response(json!([]), users("new-pw"))),
            hide_users,
        ) else {
            panic!("a change")
        };
        assert_eq!(
            text,
            "~ status: .users[1].password \"(redacted)\" -> \"(redacted)\""
        );
        // Unhidden, the same comparison quotes the values.
        let Verdict::WouldChange(text) = compare(&active, &candidate) else {
            panic!("a change")
        };
        assert!(text.contains("YWRkZWQ="), "{text}");
    }

    #[test]
    fn unchanged_changed_added_removed_and_failing() {
        let deployment = |replicas: i64, label: Option<&str>| {
            let mut d = json!({"kind": "Deployment", "metadata": {"name": "web", "labels": {}}, "spec": {"replicas": replicas}});
            if let Some(label) = label {
                d["metadata"]["labels"]["v"] = json!(label);
            }
            d
        };
        let service = json!({"kind": "Service", "metadata": {"name": "web"}});
        let active = Ok(response(
            json!([deployment(3, None), service.clone()]),
            json!({"ready": "3/3"}),
        ));
        let same = Ok(response(
            json!([deployment(3, None), service.clone()]),
            json!({"ready": "3/3"}),
        ));
        assert_eq!(compare(&active, &same), Verdict::Unchanged);

        let candidate = Ok(response(
            json!([deployment(3, Some("v2"))]),
            json!({"ready": "3/3"}),
        ));
        let Verdict::WouldChange(text) = compare(&active, &candidate) else {
            panic!("a change")
        };
        assert_eq!(
            text,
            "~ Deployment web: .metadata.labels.v (absent) -> \"v2\"\n- Service web"
        );

        let status_only = Ok(response(
            json!([deployment(3, None), service]),
            json!({"ready": "2/3"}),
        ));
        let Verdict::WouldChange(text) = compare(&active, &status_only) else {
            panic!("a change")
        };
        assert_eq!(text, "~ status: .ready \"3/3\" -> \"2/3\"");

        let failing = Err(CallError::Reported {
            kind: super::super::error::ReportedKind::Transient,
            message: "down".into(),
        });
        assert!(matches!(compare(&active, &failing), Verdict::WouldFail(m) if m.contains("down")));
    }
}
