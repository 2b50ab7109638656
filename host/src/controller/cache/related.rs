//! How a policy chooses the related objects a plugin reads: every object of the kind in the
//! parent's namespace, those a label selector matches, or (`nameFrom`) only the objects a
//! field of the parent names — "the Secret named in `spec.databaseSecret`" (read on demand:
//! `named_objects`).
//!
//! And how much one parent may make the host read and send: a parent's author decides what
//! it names, so without a bound a parent naming hundreds of large objects would have the host
//! fetch, hold and copy each into every request. One field names at most
//! [`MAX_NAMES_PER_FIELD`] objects, and one request carries at most [`MAX_RELATED_BYTES`] of
//! related objects; past either the reconcile fails ([`RelatedLimit`]) before anything is
//! written.

use kube::core::{DynamicObject, Selector};
use serde_json::Value;

use crate::plugin::ObservedObject;
use crate::policy::RelatedSpec;

/// Most objects one field of a parent may name. Each is read (once per version) and sent to
/// the plugin on every reconcile; a parent that names more fails with [`RelatedLimit`].
pub(crate) const MAX_NAMES_PER_FIELD: usize = 64;

/// Most bytes of related objects (their JSON, summed) one request may carry. Every byte is
/// copied into the request and into the plugin's memory on every reconcile of the parent.
pub(crate) const MAX_RELATED_BYTES: usize = 8 << 20;

/// How the related objects of one kind are chosen.
#[derive(Debug, Clone)]
pub(crate) enum RelatedBy {
    /// Every object of the kind in the parent's namespace.
    All,
    /// Those whose labels match.
    Selector(Selector),
    /// Those a field of the parent names.
    Name(FieldPath),
}

impl RelatedBy {
    /// The choice `spec` makes, or why it cannot be used.
    pub fn of(spec: &RelatedSpec) -> Result<Self, String> {
        match (&spec.selector, &spec.name_from) {
            (Some(_), Some(_)) => Err(format!(
                "related {}: choose by selector or by nameFrom, not both",
                spec.kind
            )),
            (Some(selector), None) => Selector::try_from(selector.clone())
                .map(Self::Selector)
                .map_err(|error| format!("related {} selector: {error}", spec.kind)),
            (None, Some(path)) => FieldPath::parse(path)
                .map(Self::Name)
                .map_err(|error| format!("related {} nameFrom: {error}", spec.kind)),
            (None, None) => Ok(Self::All),
        }
    }
}

/// A dot-separated path to a field of the parent (`spec.databaseSecret`), holding a name or a
/// list of names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FieldPath {
    text: String,
    segments: Vec<String>,
}

impl FieldPath {
    /// `text` as a path, if every segment is a plain field name.
    pub fn parse(text: &str) -> Result<Self, String> {
        let segments: Vec<String> = text.split('.').map(str::to_owned).collect();
        let plain = |s: &String| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        if segments.iter().all(plain) {
            Ok(Self {
                text: text.to_owned(),
                segments,
            })
        } else {
            Err(format!(
                "{text:?} is not a dot-separated path of field names (e.g. spec.databaseSecret)"
            ))
        }
    }

    /// The names `object` (a whole object, as JSON) holds at this path: none when the field
    /// is missing or holds something else; invalid names are skipped.
    pub fn names(&self, object: &Value) -> Vec<String> {
        names_at(walk(Some(object), &self.segments))
    }

    /// The names `parent` holds at this path. Only `metadata` paths serialize the metadata;
    /// the others read the object's body where it already is.
    pub fn names_in(&self, parent: &DynamicObject) -> Vec<String> {
        let Some((first, rest)) = self.segments.split_first() else {
            return Vec::new();
        };
        if first == "metadata" {
            let metadata = serde_json::to_value(&parent.metadata).unwrap_or_default();
            names_at(walk(Some(&metadata), rest))
        } else {
            names_at(walk(parent.data.get(first), rest))
        }
    }
}

impl std::fmt::Display for FieldPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

fn walk<'a>(mut at: Option<&'a Value>, segments: &[String]) -> Option<&'a Value> {
    for segment in segments {
        at = at.and_then(|value| value.get(segment));
    }
    at
}

/// The object names in a field: a string, or the strings of a list; sorted, without
/// duplicates.
fn names_at(value: Option<&Value>) -> Vec<String> {
    let mut names: Vec<String> = match value {
        Some(Value::String(name)) => vec![name.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect(),
        _ => Vec::new(),
    };
    names.retain(|name| is_object_name(name));
    names.sort();
    names.dedup();
    names
}

/// Whether `name` can name an object in a request path: anything else (`..`, a `/`) would
/// let a parent's author point the host's read at another resource.
fn is_object_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name != "."
        && name != ".."
        && !name.contains(['/', '%'])
}

/// The key under which the parents index the objects they name through related kind
/// `position`: the object's namespace (none for a cluster-scoped kind) and name.
pub(crate) fn reference_key(position: usize, namespace: Option<&str>, name: &str) -> String {
    format!("{position}/{}/{name}", namespace.unwrap_or_default())
}

/// The object a [`reference_key`] of related kind `position` stands for (`None` for a key
/// of another kind): its namespace (none for a cluster-scoped kind) and name.
pub(crate) fn referenced_object(
    key: &str,
    position: usize,
    namespaced: bool,
) -> Option<(Option<String>, String)> {
    let (at, rest) = key.split_once('/')?;
    if at.parse::<usize>().ok()? != position {
        return None;
    }
    let (namespace, name) = rest.split_once('/')?;
    let namespace = Some(namespace.to_owned()).filter(|ns| namespaced && !ns.is_empty());
    Some((namespace, name.to_owned()))
}

/// The index keys of a parent: one per object it names through each by-name related kind
/// (`position`, path, whether the kind is namespaced). A field naming more than
/// [`MAX_NAMES_PER_FIELD`] adds none: its reconcile fails until the parent changes, which
/// no change to a named object can help, and the index stays as small as the cap.
pub(crate) fn parent_reference_keys(
    references: &[(usize, FieldPath, bool)],
    parent: &DynamicObject,
) -> Vec<String> {
    let namespace = parent.metadata.namespace.as_deref();
    references
        .iter()
        .flat_map(|(position, path, namespaced)| {
            let namespace = namespace.filter(|_| *namespaced);
            let mut names = path.names_in(parent);
            if names.len() > MAX_NAMES_PER_FIELD {
                names.clear();
            }
            names
                .into_iter()
                .map(move |name| reference_key(*position, namespace, &name))
        })
        .collect()
}

/// `names` (of `kind`, held at `path`), unless there are more than [`MAX_NAMES_PER_FIELD`].
pub(crate) fn within_name_limit(
    kind: &str,
    path: &FieldPath,
    names: Vec<String>,
) -> Result<Vec<String>, RelatedLimit> {
    if names.len() > MAX_NAMES_PER_FIELD {
        return Err(RelatedLimit::TooManyNames {
            kind: kind.to_owned(),
            path: path.to_string(),
            count: names.len(),
        });
    }
    Ok(names)
}

/// A parent asks for more related objects than one request may carry. Retrying cannot help
/// until the parent (or, for the bytes, a related object) changes.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RelatedLimit {
    #[error(
        "its {path} names {count} {kind} objects, more than the {MAX_NAMES_PER_FIELD} one field may name: name fewer"
    )]
    TooManyNames {
        kind: String,
        path: String,
        count: usize,
    },
    #[error(
        "its related objects come to more than {limit} bytes, the most one request may carry ({total} bytes up to {kind} {name}): name or select fewer or smaller objects"
    )]
    TooLarge {
        kind: String,
        name: String,
        /// The bytes counted when the limit was passed (the objects after are not read).
        total: usize,
        limit: usize,
    },
}

/// The bytes of related objects one request has taken so far.
#[derive(Debug)]
pub(crate) struct RelatedBytes {
    total: usize,
    limit: usize,
}

impl Default for RelatedBytes {
    fn default() -> Self {
        Self::with_limit(MAX_RELATED_BYTES)
    }
}

impl RelatedBytes {
    /// A request that may carry `limit` bytes of related objects.
    pub fn with_limit(limit: usize) -> Self {
        Self { total: 0, limit }
    }

    /// Count `object` into the request, or say the request would carry too much.
    pub fn take(&mut self, object: &ObservedObject) -> Result<(), RelatedLimit> {
        self.total += object.json.len();
        if self.total > self.limit {
            return Err(RelatedLimit::TooLarge {
                kind: object.kind.clone(),
                name: object.name.clone(),
                total: self.total,
                limit: self.limit,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn path(text: &str) -> FieldPath {
        FieldPath::parse(text).unwrap_or_else(|e| panic!("{e}"))
    }

    fn parent(spec: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "example.com/v1", "kind": "MyApp",
            "metadata": {"name": "web", "namespace": "a", "labels": {"db": "main"}},
            "spec": spec,
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_path_is_plain_field_names() {
        assert!(FieldPath::parse("spec.databaseSecret").is_ok());
        assert!(FieldPath::parse("spec.db-secret_name2").is_ok());
        for bad in ["", "spec.", ".spec", "spec..x", "spec[0]", "spec.a b"] {
            assert!(FieldPath::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_field_names_one_object_or_a_list_of_them() {
        let one = parent(json!({"db": {"secret": "creds"}}));
        assert_eq!(path("spec.db.secret").names_in(&one), ["creds"]);
        let many = parent(json!({"secrets": ["b", "a", "b", 3]}));
        assert_eq!(path("spec.secrets").names_in(&many), ["a", "b"]);
        let missing = parent(json!({}));
        assert!(path("spec.db.secret").names_in(&missing).is_empty());
        let not_a_name = parent(json!({"db": {"secret": {"name": "x"}}}));
        assert!(path("spec.db.secret").names_in(&not_a_name).is_empty());
        // The same answer from the whole object as JSON (what `plugin run` has).
        let value = serde_json::to_value(&many).unwrap_or_default();
        assert_eq!(path("spec.secrets").names(&value), ["a", "b"]);
    }

    #[test]
    fn metadata_fields_can_name_objects() {
        let parent = parent(json!({}));
        assert_eq!(path("metadata.name").names_in(&parent), ["web"]);
        assert_eq!(path("metadata.labels.db").names_in(&parent), ["main"]);
    }

    #[test]
    fn names_that_would_change_the_request_path_are_ignored() {
        let hostile =
            parent(json!({"refs": ["../../secrets/x", "a/b", "..", ".", "%2e", "", "ok"]}));
        assert_eq!(path("spec.refs").names_in(&hostile), ["ok"]);
    }

    #[test]
    fn parents_are_indexed_under_each_object_they_name() {
        let references = [
            (0, path("spec.configMap"), true),
            (2, path("spec.class"), false),
        ];
        let parent = parent(json!({"configMap": "env", "class": "fast"}));
        assert_eq!(
            parent_reference_keys(&references, &parent),
            [
                reference_key(0, Some("a"), "env"),
                reference_key(2, None, "fast")
            ]
        );
    }

    #[test]
    fn a_related_kind_is_chosen_one_way() {
        let spec = |value: Value| -> RelatedSpec {
            serde_json::from_value(value).unwrap_or_else(|e| panic!("{e}"))
        };
        let base = json!({"apiVersion": "v1", "kind": "Secret"});
        assert!(matches!(
            RelatedBy::of(&spec(base.clone())),
            Ok(RelatedBy::All)
        ));
        let mut by_name = base.clone();
        by_name["nameFrom"] = json!("spec.databaseSecret");
        assert!(matches!(
            RelatedBy::of(&spec(by_name.clone())),
            Ok(RelatedBy::Name(_))
        ));
        let mut both = by_name;
        both["selector"] = json!({"matchLabels": {"a": "b"}});
        let error = RelatedBy::of(&spec(both)).err().unwrap_or_default();
        assert!(error.contains("not both"), "{error}");
        let mut bad = base;
        bad["nameFrom"] = json!("spec[0]");
        let error = RelatedBy::of(&spec(bad)).err().unwrap_or_default();
        assert!(error.contains("nameFrom"), "{error}");
    }

    #[test]
    fn a_field_naming_more_than_the_limit_is_not_indexed_and_is_refused() {
        let references = [(0, path("spec.refs"), true), (1, path("spec.one"), true)];
        let at_limit: Vec<String> = (0..MAX_NAMES_PER_FIELD).map(|i| format!("n{i}")).collect();
        let parent_at = parent(json!({"refs": at_limit, "one": "x"}));
        assert_eq!(
            parent_reference_keys(&references, &parent_at).len(),
            MAX_NAMES_PER_FIELD + 1
        );
        let over: Vec<String> = (0..=MAX_NAMES_PER_FIELD).map(|i| format!("n{i}")).collect();
        let parent_over = parent(json!({"refs": over, "one": "x"}));
        assert_eq!(
            parent_reference_keys(&references, &parent_over),
            [reference_key(1, Some("a"), "x")],
            "the field over the limit names nothing; the other still does"
        );
        let names = path("spec.refs").names_in(&parent_over);
        let error = within_name_limit("ConfigMap", &path("spec.refs"), names)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            error.contains("spec.refs names 65 ConfigMap objects, more than the 64"),
            "{error}"
        );
        let names = path("spec.refs").names_in(&parent_at);
        assert!(within_name_limit("ConfigMap", &path("spec.refs"), names).is_ok());
    }

    #[test]
    fn a_reference_key_reads_back_as_the_object_of_its_kind() {
        let key = reference_key(3, Some("a"), "db");
        assert_eq!(
            referenced_object(&key, 3, true),
            Some((Some("a".to_owned()), "db".to_owned()))
        );
        assert_eq!(referenced_object(&key, 2, true), None, "another kind's");
        let cluster = reference_key(1, None, "fast");
        assert_eq!(
            referenced_object(&cluster, 1, false),
            Some((None, "fast".to_owned()))
        );
    }

    #[test]
    fn a_request_carries_related_bytes_up_to_its_limit() {
        let object = |name: &str, size: usize| ObservedObject {
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            name: name.into(),
            json: "x".repeat(size),
        };
        let mut bytes = RelatedBytes::with_limit(100);
        assert!(bytes.take(&object("a", 60)).is_ok());
        assert!(bytes.take(&object("b", 40)).is_ok(), "exactly the limit");
        let error = bytes
            .take(&object("c", 1))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            error.contains("more than 100 bytes") && error.contains("101 bytes up to ConfigMap c"),
            "{error}"
        );
    }
}
