//! Comparing two plugins' decisions for the same request: what a candidate plugin would do
//! differently from the active one. Used by shadow runs in the host and by
//! `wasmctrl plugin diff`.

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

/// Compare the active plugin's answer with the candidate's.
pub fn compare(
    active: &Result<ReconcileResponse, CallError>,
    candidate: &Result<ReconcileResponse, CallError>,
) -> Verdict {
    match (active, candidate) {
        (_, Err(error)) => Verdict::WouldFail(error.to_string()),
        (Err(error), Ok(_)) => Verdict::WouldChange(format!(
            "the active plugin fails ({error}); the candidate succeeds"
        )),
        (Ok(active), Ok(candidate)) => {
            let text = describe(active, candidate);
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
fn describe(active: &ReconcileResponse, candidate: &ReconcileResponse) -> String {
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
                let _ = writeln!(out, "~ {key}: {}", first_change(old, object));
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
        let _ = writeln!(out, "~ status: {}", first_change(&old, &new));
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

/// The path of the first field that differs between `old` and `new`, with both values.
fn first_change(old: &Value, new: &Value) -> String {
    /// Descend while both sides are containers that differ somewhere inside; stop at the
    /// first differing leaf (or shape), returning the values found there.
    fn walk<'a>(
        old: Option<&'a Value>,
        new: Option<&'a Value>,
        path: &mut String,
    ) -> (Option<&'a Value>, Option<&'a Value>) {
        match (old, new) {
            (Some(Value::Object(a)), Some(Value::Object(b))) => {
                let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
                keys.sort();
                keys.dedup();
                for key in keys {
                    let (x, y) = (a.get(key), b.get(key));
                    if x != y {
                        path.push('.');
                        path.push_str(key);
                        return walk(x, y, path);
                    }
                }
                (old, new)
            }
            (Some(Value::Array(a)), Some(Value::Array(b))) if list_key(a, b).is_some() => {
                // Lists of named items (conditions, containers, ports) compare item by item
                // whatever their order and length: `[type=Ready]`, not "the list changed".
                let key = list_key(a, b).unwrap_or_default();
                let item = |list: &'a [Value], name: &str| {
                    list.iter().find(|v| v[key].as_str() == Some(name))
                };
                let mut names: Vec<&str> =
                    a.iter().chain(b).filter_map(|v| v[key].as_str()).collect();
                names.sort_unstable();
                names.dedup();
                for name in names {
                    let (x, y) = (item(a, name), item(b, name));
                    if x != y {
                        let _ = write!(path, "[{key}={name}]");
                        return walk(x, y, path);
                    }
                }
                (old, new)
            }
            (Some(Value::Array(a)), Some(Value::Array(b))) if a.len() == b.len() => {
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    if x != y {
                        let _ = write!(path, "[{i}]");
                        return walk(Some(x), Some(y), path);
                    }
                }
                (old, new)
            }
            _ => (old, new),
        }
    }
    let mut path = String::new();
    let (old_at, new_at) = walk(Some(old), Some(new), &mut path);
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
    let path = if path.is_empty() {
        ".".to_owned()
    } else {
        path
    };
    format!("{path} {} -> {}", shorten(old_at), shorten(new_at))
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
            first_change(&before, &after),
            r#".conditions[type=ConfigMapFound] (absent) -> {"status":"False","type":"ConfigMapFound"}"#
        );
        let env =
            |v: &str| json!({"env": [{"name": "A", "value": "1"}, {"name": "B", "value": v}]});
        assert_eq!(
            first_change(&env("2"), &env("3")),
            r#".env[name=B].value "2" -> "3""#
        );
        // Unnamed items still compare by position.
        assert_eq!(first_change(&json!([1, 2]), &json!([1, 3])), "[1] 2 -> 3");
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
