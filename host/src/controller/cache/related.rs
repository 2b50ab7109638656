//! How a policy chooses the related objects a plugin reads: every object of the kind in the
//! parent's namespace, those a label selector matches, or (`nameFrom`) only the objects a
//! field of the parent names — "the Secret named in `spec.databaseSecret`".
//!
//! Chosen by name, the host holds no object it was not asked for: it watches the kind's
//! metadata only (what exists, at which resourceVersion: enough to trigger the parents that
//! name a changed object), and reads a named object itself the first time a reconcile needs
//! it, keeping it until its resourceVersion moves. A namespace full of Secrets costs a few
//! hundred bytes each, and only the named ones' values are ever read or sent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kube::api::Api;
use kube::core::{ApiResource, DynamicObject, PartialObjectMeta, Selector, TypeMeta};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt as _};
use serde_json::Value;

use crate::policy::RelatedSpec;

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

/// The index keys of a parent: one per object it names through each by-name related kind
/// (`position`, path, whether the kind is namespaced).
pub(crate) fn parent_reference_keys(
    references: &[(usize, FieldPath, bool)],
    parent: &DynamicObject,
) -> Vec<String> {
    let namespace = parent.metadata.namespace.as_deref();
    references
        .iter()
        .flat_map(|(position, path, namespaced)| {
            let namespace = namespace.filter(|_| *namespaced);
            path.names_in(parent)
                .into_iter()
                .map(move |name| reference_key(*position, namespace, &name))
        })
        .collect()
}

/// A read of a named object failed (not: the object does not exist).
#[derive(Debug, thiserror::Error)]
#[error("reading {kind} {name:?} (named by the parent's {path}): {source}")]
pub(crate) struct ReadError {
    kind: String,
    name: String,
    path: String,
    #[source]
    source: kube::Error,
}

/// An object's namespace (none for a cluster-scoped kind) and name.
type ObjectKey = (Option<String>, String);

/// The objects of one related kind that parents name: which exist (a metadata-only watch),
/// and the ones read so far.
pub(crate) struct NamedObjects {
    pub path: FieldPath,
    resource: ApiResource,
    namespaced: bool,
    client: Client,
    metadata: Store<PartialObjectMeta<DynamicObject>>,
    /// Objects read, by namespace and name; each is current while its resourceVersion is
    /// the one the metadata watch shows.
    read: Mutex<HashMap<ObjectKey, Arc<DynamicObject>>>,
}

impl NamedObjects {
    /// Objects of `resource` chosen by `path`, whose existence `metadata` tracks.
    pub fn new(
        path: FieldPath,
        resource: ApiResource,
        namespaced: bool,
        client: Client,
        metadata: Store<PartialObjectMeta<DynamicObject>>,
    ) -> Self {
        Self {
            path,
            resource,
            namespaced,
            client,
            metadata,
            read: Mutex::default(),
        }
    }

    /// The metadata store, for readiness.
    pub fn metadata(&self) -> &Store<PartialObjectMeta<DynamicObject>> {
        &self.metadata
    }

    /// Drop what was read of an object that is gone.
    pub fn forget(&self, object: &PartialObjectMeta<DynamicObject>) {
        let key = (object.namespace(), object.name_any());
        crate::lock(&self.read).remove(&key);
    }

    /// The objects `parent` names that exist, in name order: from what was read when the
    /// metadata watch shows no change since, read now otherwise. A failed read fails the
    /// whole lookup: a plugin told "it does not exist" might delete what depends on it.
    pub async fn named_by(
        &self,
        parent: &DynamicObject,
    ) -> Result<Vec<Arc<DynamicObject>>, ReadError> {
        let namespace = parent
            .metadata
            .namespace
            .clone()
            .filter(|_| self.namespaced);
        let mut objects = Vec::new();
        for name in self.path.names_in(parent) {
            if let Some(object) = self.current(namespace.clone(), name).await? {
                objects.push(object);
            }
        }
        Ok(objects)
    }

    async fn current(
        &self,
        namespace: Option<String>,
        name: String,
    ) -> Result<Option<Arc<DynamicObject>>, ReadError> {
        let mut reference = ObjectRef::new_with(&name, self.resource.clone());
        if let Some(namespace) = &namespace {
            reference = reference.within(namespace);
        }
        let key = (namespace, name);
        let Some(exists) = self.metadata.get(&reference) else {
            crate::lock(&self.read).remove(&key);
            return Ok(None);
        };
        let version = exists.resource_version();
        if let Some(read) = crate::lock(&self.read).get(&key)
            && read.resource_version() == version
        {
            return Ok(Some(read.clone()));
        }
        let object = self.get(&key).await?;
        let mut read = crate::lock(&self.read);
        match &object {
            Some(object) => read.insert(key, object.clone()),
            None => read.remove(&key),
        };
        Ok(object)
    }

    async fn get(
        &self,
        (namespace, name): &ObjectKey,
    ) -> Result<Option<Arc<DynamicObject>>, ReadError> {
        let api: Api<DynamicObject> = match namespace {
            Some(namespace) => Api::namespaced_with(self.client.clone(), namespace, &self.resource),
            None => Api::all_with(self.client.clone(), &self.resource),
        };
        let read = api.get_opt(name).await.map_err(|source| ReadError {
            kind: self.resource.kind.clone(),
            name: name.clone(),
            path: self.path.to_string(),
            source,
        })?;
        Ok(read.map(|mut object| {
            // As the watched caches hold objects: no managedFields, apiVersion and kind set.
            object.managed_fields_mut().clear();
            if object.types.is_none() {
                object.types = Some(TypeMeta {
                    api_version: self.resource.api_version.clone(),
                    kind: self.resource.kind.clone(),
                });
            }
            Arc::new(object)
        }))
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
}
