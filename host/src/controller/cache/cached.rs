//! How the host holds the parents, children and related objects it caches: the metadata
//! typed (what ownership checks, indexes, predicates and prunes read) and everything else as
//! compact JSON text.
//!
//! A `DynamicObject` keeps its body as a `serde_json::Value` tree, about six times the size
//! of its JSON: a 2 KB Deployment held 13 KB. With 10,000 parents and 20,000 children the
//! trees alone were most of the host's memory. The body is only ever sent to a plugin (as
//! text) or compared with a desired object (parsed then, once per reconcile that applies),
//! so it is kept as the text it arrived as. A parent's body is parsed when its reconcile
//! starts and dropped when it ends.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, ObjectMeta};
use kube::core::{ApiResource, DynamicResourceScope, TypeMeta};
use serde::de::Error as _;
use serde_json::Value;
use serde_json::value::RawValue;

/// A cached object: `apiVersion`/`kind`, typed metadata, and the other top-level fields as
/// the JSON text of one object (`{"spec":…,"status":…}`).
///
/// The labels and annotations are kept as text too, so `metadata.labels` and
/// `metadata.annotations` are always `None`: a typed map costs a ~540-byte B-tree node per
/// object however few entries it holds, and every child carries the host's labels and its
/// desired-state hash. Read them with [`Self::labels`] (which shadows kube's
/// `ResourceExt::labels`, so a caller cannot read the empty field by mistake) and
/// [`Self::annotations_text`]; plugins get them in [`Self::to_json`], reconciles in
/// [`Self::to_dynamic`] and [`Self::to_value`].
#[derive(Clone, Debug)]
pub(crate) struct CachedObject {
    pub types: Option<TypeMeta>,
    pub metadata: ObjectMeta,
    /// `metadata.labels` as JSON text, if the object has any.
    labels: Option<Box<str>>,
    /// `metadata.annotations` as JSON text, if the object has any.
    annotations: Option<Box<str>>,
    body: Box<str>,
}

impl CachedObject {
    /// The whole object as JSON text, as the API server serves it (without `managedFields`,
    /// which the watches drop).
    pub fn to_json(&self) -> String {
        let mut metadata = serde_json::to_string(&self.metadata).unwrap_or_else(|_| "{}".into());
        for (field, text) in self.maps() {
            metadata.pop(); // the closing brace
            if metadata.len() > 1 {
                metadata.push(',');
            }
            metadata.push('"');
            metadata.push_str(field);
            metadata.push_str("\":");
            metadata.push_str(text);
            metadata.push('}');
        }
        let mut json = String::with_capacity(self.body.len() + metadata.len() + 64);
        json.push('{');
        if let Some(types) = &self.types {
            json.push_str("\"apiVersion\":");
            json.push_str(&Value::from(types.api_version.as_str()).to_string());
            json.push_str(",\"kind\":");
            json.push_str(&Value::from(types.kind.as_str()).to_string());
            json.push(',');
        }
        json.push_str("\"metadata\":");
        json.push_str(&metadata);
        let fields = self.body[1..self.body.len() - 1].trim();
        if !fields.is_empty() {
            json.push(',');
            json.push_str(fields);
        }
        json.push('}');
        json
    }

    /// The whole object as a JSON value, built from its parts: the body parsed, the
    /// metadata converted (not written out as text and parsed back, as going through
    /// [`Self::to_json`] would; this runs for every child a reconcile applies).
    pub fn to_value(&self) -> Value {
        let mut object: serde_json::Map<String, Value> =
            serde_json::from_str(&self.body).unwrap_or_default();
        if let Some(types) = &self.types {
            object.insert("apiVersion".into(), types.api_version.clone().into());
            object.insert("kind".into(), types.kind.clone().into());
        }
        let mut metadata = serde_json::to_value(&self.metadata)
            .unwrap_or_else(|_| Value::Object(Default::default()));
        if let Some(metadata) = metadata.as_object_mut() {
            for (field, text) in self.maps() {
                if let Some(map) = parse_map::<Value>(text) {
                    metadata.insert(field.into(), map);
                }
            }
        }
        object.insert("metadata".into(), metadata);
        Value::Object(object)
    }

    /// The labels, parsed from the text they are held as (empty when there are none).
    pub fn labels(&self) -> BTreeMap<String, String> {
        self.labels
            .as_deref()
            .and_then(parse_map)
            .unwrap_or_default()
    }

    /// The labels as JSON text (`{"key":"value",…}`), if the object has any: what tells
    /// whether they changed.
    pub fn labels_text(&self) -> Option<&str> {
        self.labels.as_deref()
    }

    /// The annotations as JSON text (`{"key":"value",…}`), if the object has any: what tells
    /// whether they changed.
    pub fn annotations_text(&self) -> Option<&str> {
        self.annotations.as_deref()
    }

    /// The metadata maps held as text, by field name, for the ones the object has.
    fn maps(&self) -> impl Iterator<Item = (&'static str, &str)> {
        [("labels", &self.labels), ("annotations", &self.annotations)]
            .into_iter()
            .filter_map(|(field, text)| Some((field, text.as_deref()?)))
    }

    /// The object as a `DynamicObject`, for the reconcile of a cached parent: the metadata
    /// cloned, the body parsed (once per reconcile, not held between them).
    pub fn to_dynamic(&self) -> kube::core::DynamicObject {
        let mut metadata = self.metadata.clone();
        metadata.labels = self.labels.as_deref().and_then(parse_map);
        metadata.annotations = self.annotations.as_deref().and_then(parse_map);
        kube::core::DynamicObject {
            types: self.types.clone(),
            metadata,
            data: serde_json::from_str(&self.body)
                .unwrap_or_else(|_| Value::Object(Default::default())),
        }
    }

    /// The object `value` holds, as the same object's text would decode (see the
    /// `Deserialize` impl); an error if it is not a JSON object or its metadata does not
    /// decode.
    pub fn from_value(value: Value) -> Result<Self, serde_json::Error> {
        <Self as serde::Deserialize>::deserialize(value)
    }
}

/// A metadata map held as text, parsed back as a JSON value or a typed map.
fn parse_map<T: serde::de::DeserializeOwned>(text: &str) -> Option<T> {
    serde_json::from_str(text).ok()
}

/// Decoded straight from the text the API server sent (every watch event and list item of a
/// cache comes this way): the body's fields, the labels and the annotations are copied as
/// the JSON text they arrive as, and each managed-fields entry is read without its
/// `fieldsV1`, which is about as large as the object it describes and which no cache keeps
/// (the watches read who manages the object, then drop the entries). Building a JSON tree
/// of every event and writing it back out as text was most of what an event cost the host.
///
/// Text is captured only where serde_json reads the input itself: a watch event must name
/// its `type` before its `object` (as the API server writes it), or serde would buffer the
/// object and refuse the capture. An object nested deeper than [`MAX_NESTING`] is refused,
/// as a JSON tree refused it: cached, it would parse to an empty body in a reconcile.
impl<'de> serde::Deserialize<'de> for CachedObject {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ObjectVisitor)
    }
}

struct ObjectVisitor;

impl<'de> serde::de::Visitor<'de> for ObjectVisitor {
    type Value = CachedObject;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object must be a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<CachedObject, A::Error> {
        let (mut api_version, mut kind) = (None, None);
        let mut parts = MetadataParts::default();
        let mut body = String::from("{");
        while let Some(field) = map.next_key::<String>()? {
            match field.as_str() {
                "apiVersion" => api_version = map.next_value::<Option<Value>>()?,
                "kind" => kind = map.next_value::<Option<Value>>()?,
                "metadata" => {
                    parts = map
                        .next_value::<Option<MetadataParts>>()?
                        .unwrap_or_default();
                }
                _ => push_field(&mut body, &field, &nested_at_most(map.next_value()?)?),
            }
        }
        body.push('}');
        let text = |v: Option<Value>| match v {
            Some(Value::String(s)) => Some(s),
            _ => None,
        };
        let types = match (text(api_version), text(kind)) {
            (Some(api_version), Some(kind)) => Some(TypeMeta { api_version, kind }),
            _ => None,
        };
        Ok(CachedObject {
            types,
            metadata: parts.metadata,
            labels: parts.labels,
            annotations: parts.annotations,
            body: body.into_boxed_str(),
        })
    }
}

/// Most levels of arrays and objects a field of a cached object may nest. A reconcile parses
/// the body again, whole (`to_value`, `to_dynamic`), and serde_json parses at most 127
/// levels; the body's own braces are one.
const MAX_NESTING: usize = 126;

/// `value`, unless its arrays and objects nest deeper than [`MAX_NESTING`].
fn nested_at_most<E: serde::de::Error>(value: Box<RawValue>) -> Result<Box<RawValue>, E> {
    if nesting(value.get()) > MAX_NESTING {
        return Err(E::custom(format_args!(
            "a field nests arrays and objects deeper than {MAX_NESTING} levels"
        )));
    }
    Ok(value)
}

/// How deep arrays and objects nest in `text` (valid JSON): 0 for a scalar, 1 for `[]`.
fn nesting(text: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for byte in text.bytes() {
        if in_string {
            match (escaped, byte) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// Append `"field":value` to an object's text being built (opened with `{`, not yet closed).
fn push_field(object: &mut String, field: &str, value: &RawValue) {
    if object.len() > 1 {
        object.push(',');
    }
    // A key is a string: written as JSON, it cannot fail.
    object.push_str(&serde_json::to_string(field).unwrap_or_default());
    object.push(':');
    object.push_str(value.get());
}

/// An object's metadata as a cache holds it: typed, with the labels and annotations apart as
/// text (none when empty), and the managed-fields entries without their `fieldsV1`.
#[derive(Default)]
struct MetadataParts {
    metadata: ObjectMeta,
    labels: Option<Box<str>>,
    annotations: Option<Box<str>>,
}

impl<'de> serde::Deserialize<'de> for MetadataParts {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(MetadataVisitor)
    }
}

struct MetadataVisitor;

impl<'de> serde::de::Visitor<'de> for MetadataVisitor {
    type Value = MetadataParts;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object's metadata")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> Result<MetadataParts, A::Error> {
        let (mut labels, mut annotations, mut managed_fields) = (None, None, None);
        // The other fields, few and small, are read into `ObjectMeta` from their own text.
        let mut rest = String::from("{");
        while let Some(field) = map.next_key::<String>()? {
            match field.as_str() {
                "labels" => labels = map_text(map.next_value()?)?,
                "annotations" => annotations = map_text(map.next_value()?)?,
                "managedFields" => {
                    managed_fields = map
                        .next_value::<Option<Vec<ManagedBy>>>()?
                        .map(|entries| entries.into_iter().map(ManagedBy::entry).collect());
                }
                _ => push_field(&mut rest, &field, &map.next_value::<Box<RawValue>>()?),
            }
        }
        rest.push('}');
        let mut metadata: ObjectMeta = serde_json::from_str(&rest).map_err(A::Error::custom)?;
        metadata.managed_fields = managed_fields;
        Ok(MetadataParts {
            metadata,
            labels,
            annotations,
        })
    }
}

/// A label or annotation map's text, unless it is null, not an object or holds nothing; an
/// error if it nests deeper than [`MAX_NESTING`].
fn map_text<E: serde::de::Error>(map: Option<Box<RawValue>>) -> Result<Option<Box<str>>, E> {
    let Some(map) = map.map(nested_at_most).transpose()? else {
        return Ok(None);
    };
    let text = map.get().trim();
    let holds_entries = text
        .strip_prefix('{')
        .and_then(|text| text.strip_suffix('}'))
        .is_some_and(|inner| !inner.trim().is_empty());
    Ok(holds_entries.then(|| Box::<str>::from(map)))
}

/// A managed-fields entry without `fieldsV1`: who manages the object, and how.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ManagedBy {
    api_version: Option<String>,
    fields_type: Option<String>,
    manager: Option<String>,
    operation: Option<String>,
    subresource: Option<String>,
    time: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
}

impl ManagedBy {
    fn entry(self) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            api_version: self.api_version,
            fields_type: self.fields_type,
            fields_v1: None,
            manager: self.manager,
            operation: self.operation,
            subresource: self.subresource,
            time: self.time,
        }
    }
}

/// The kind shared by every reference to a cached object: kube-runtime keeps one
/// `ObjectRef` per object in its store, two per scheduled reconcile, and the host one per
/// parent in each of its own maps; an `ApiResource` in each (five strings) cost ~200 bytes a
/// reference, a shared one 8.
impl kube::Resource for CachedObject {
    type DynamicType = Arc<ApiResource>;
    type Scope = DynamicResourceScope;

    fn kind(dt: &Arc<ApiResource>) -> Cow<'_, str> {
        dt.kind.as_str().into()
    }

    fn group(dt: &Arc<ApiResource>) -> Cow<'_, str> {
        dt.group.as_str().into()
    }

    fn version(dt: &Arc<ApiResource>) -> Cow<'_, str> {
        dt.version.as_str().into()
    }

    fn api_version(dt: &Arc<ApiResource>) -> Cow<'_, str> {
        dt.api_version.as_str().into()
    }

    fn plural(dt: &Arc<ApiResource>) -> Cow<'_, str> {
        dt.plural.as_str().into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What the watches need of any cached kind: the `apiVersion`/`kind` a list response leaves
/// out, put back.
pub(crate) trait HasTypes {
    fn types_mut(&mut self) -> &mut Option<TypeMeta>;
}

/// A label of a cached object, however its cache holds labels.
pub(crate) trait HasLabels {
    fn label(&self, key: &str) -> Option<String>;
}

impl HasLabels for CachedObject {
    fn label(&self, key: &str) -> Option<String> {
        self.labels().remove(key)
    }
}

impl HasLabels for kube::core::DynamicObject {
    fn label(&self, key: &str) -> Option<String> {
        self.metadata.labels.as_ref()?.get(key).cloned()
    }
}

impl HasTypes for CachedObject {
    fn types_mut(&mut self) -> &mut Option<TypeMeta> {
        &mut self.types
    }
}

impl HasTypes for kube::core::DynamicObject {
    fn types_mut(&mut self) -> &mut Option<TypeMeta> {
        &mut self.types
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn deployment() -> Value {
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web", "namespace": "a", "uid": "u1",
                         "labels": {"app": "web"},
                         "annotations": {"wasmctrl.dev/desired-hash": "abc", "note": "\"quoted\""},
                         "ownerReferences": [{"apiVersion": "example.com/v1", "kind": "MyApp",
                                              "name": "web", "uid": "p1", "controller": true}]},
            "spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "c", "image": "nginx:1.27 \"quoted\""}]}}},
            "status": {"readyReplicas": 2},
        })
    }

    #[test]
    fn an_object_reads_back_exactly() {
        let object: CachedObject =
            serde_json::from_value(deployment()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(object.to_value(), deployment());
        assert_eq!(
            object.metadata.owner_references.as_ref().map(Vec::len),
            Some(1)
        );
        let text: Value = serde_json::from_str(&object.to_json()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(text, deployment());
    }

    #[test]
    fn annotations_are_held_as_text_and_come_back_everywhere() {
        let object: CachedObject =
            serde_json::from_value(deployment()).unwrap_or_else(|e| panic!("{e}"));
        assert!(object.metadata.annotations.is_none());
        let text: Value = serde_json::from_str(object.annotations_text().unwrap_or_default())
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(text, deployment()["metadata"]["annotations"]);
        assert_eq!(
            object.to_dynamic().metadata.annotations.map(|a| a.len()),
            Some(2)
        );
        // An empty map is no annotations, and reads back as none.
        let mut bare = deployment();
        bare["metadata"]["annotations"] = json!({});
        let object: CachedObject = serde_json::from_value(bare).unwrap_or_else(|e| panic!("{e}"));
        assert!(object.annotations_text().is_none());
        assert!(object.to_value()["metadata"].get("annotations").is_none());
    }

    #[test]
    fn labels_are_held_as_text_and_come_back_everywhere() {
        let object: CachedObject =
            serde_json::from_value(deployment()).unwrap_or_else(|e| panic!("{e}"));
        // The typed field stays empty, and kube's `ResourceExt::labels` is shadowed by the
        // accessor that reads the text, so no caller sees an object without its labels.
        assert!(object.metadata.labels.is_none());
        let expected = BTreeMap::from([("app".to_owned(), "web".to_owned())]);
        assert_eq!(object.labels(), expected);
        assert_eq!(object.labels_text(), Some(r#"{"app":"web"}"#));
        assert_eq!(object.to_dynamic().metadata.labels, Some(expected));
        let text: Value = serde_json::from_str(&object.to_json()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            text["metadata"]["labels"],
            deployment()["metadata"]["labels"]
        );
        // No labels: none held, none given back.
        let mut bare = deployment();
        bare["metadata"]["labels"] = json!({});
        let object: CachedObject = serde_json::from_value(bare).unwrap_or_else(|e| panic!("{e}"));
        assert!(object.labels().is_empty() && object.labels_text().is_none());
        assert!(object.to_value()["metadata"].get("labels").is_none());
    }

    #[test]
    fn a_parent_becomes_the_dynamic_object_it_was() {
        let object: CachedObject =
            serde_json::from_value(deployment()).unwrap_or_else(|e| panic!("{e}"));
        let dynamic = object.to_dynamic();
        let expected: kube::core::DynamicObject =
            serde_json::from_value(deployment()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(dynamic, expected);
    }

    #[test]
    fn a_listed_object_gets_its_types_back() {
        let mut listed = deployment();
        let map = listed.as_object_mut().unwrap_or_else(|| panic!("object"));
        map.remove("apiVersion");
        map.remove("kind");
        let mut object: CachedObject =
            serde_json::from_value(listed).unwrap_or_else(|e| panic!("{e}"));
        assert!(object.types.is_none());
        *object.types_mut() = Some(TypeMeta {
            api_version: "apps/v1".into(),
            kind: "Deployment".into(),
        });
        assert_eq!(object.to_value(), deployment());
    }

    #[test]
    fn an_object_with_metadata_only_reads_back() {
        let bare = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}});
        let object: CachedObject =
            serde_json::from_value(bare.clone()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(object.to_value(), bare);
    }

    #[test]
    fn it_holds_far_less_than_a_value_tree() {
        // The body is text: the same size as the JSON, not several times it.
        let object: CachedObject =
            serde_json::from_value(deployment()).unwrap_or_else(|e| panic!("{e}"));
        let body = serde_json::to_string(&deployment()["spec"])
            .unwrap_or_default()
            .len()
            + serde_json::to_string(&deployment()["status"])
                .unwrap_or_default()
                .len();
        assert!(
            object.body.len() < body + 32,
            "{} vs {body}",
            object.body.len()
        );
    }

    /// The text a watch event carries, decoded as kube decodes it.
    fn decoded(value: &Value) -> CachedObject {
        serde_json::from_str(&value.to_string()).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn text_decodes_as_the_value_it_holds() {
        let mut live = deployment();
        live["metadata"]["generation"] = json!(3);
        live["metadata"]["creationTimestamp"] = json!("2026-12-07T10:00:00Z");
        live["metadata"]["finalizers"] = json!(["wasmctrl.dev/x"]);
        // A field name a body may carry written with an escape.
        live["weird \"key\""] = json!({"a": [1, 2.5, null, true, "\u{e9}"]});
        for object in [
            decoded(&live),
            CachedObject::from_value(live.clone()).unwrap_or_else(|e| panic!("{e}")),
        ] {
            assert_eq!(object.to_value(), live);
            let text: Value =
                serde_json::from_str(&object.to_json()).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(text, live);
            assert_eq!(object.metadata.generation, Some(3));
            assert_eq!(object.labels_text(), Some(r#"{"app":"web"}"#));
        }
        // A null or empty map is none; so is metadata that is null.
        let mut bare = deployment();
        bare["metadata"]["labels"] = Value::Null;
        bare["metadata"]["annotations"] = json!({});
        let object = decoded(&bare);
        assert!(object.labels_text().is_none() && object.annotations_text().is_none());
        let object = decoded(&json!({"kind": "ConfigMap", "metadata": null}));
        assert_eq!(object.metadata, ObjectMeta::default());
        assert!(object.types.is_none());
    }

    #[test]
    fn managed_fields_are_read_without_the_fields_they_list() {
        let mut live = deployment();
        live["metadata"]["managedFields"] = json!([
            {"manager": "wasmctrl/p", "operation": "Update", "apiVersion": "apps/v1",
             "time": "2026-12-07T10:00:00Z", "fieldsType": "FieldsV1",
             "fieldsV1": {"f:spec": {"f:replicas": {}}}},
            {"manager": "kube-controller-manager", "operation": "Update",
             "subresource": "status", "fieldsV1": {"f:status": {}}},
        ]);
        let object = decoded(&live);
        let entries = object.metadata.managed_fields.unwrap_or_default();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].manager.as_deref(), Some("wasmctrl/p"));
        assert_eq!(entries[0].operation.as_deref(), Some("Update"));
        assert_eq!(entries[0].fields_type.as_deref(), Some("FieldsV1"));
        assert!(entries[0].time.is_some());
        assert_eq!(entries[1].subresource.as_deref(), Some("status"));
        assert!(entries.iter().all(|entry| entry.fields_v1.is_none()));
    }

    #[test]
    fn what_is_not_an_object_is_refused() {
        for text in [
            "[]",
            "\"x\"",
            "null",
            r#"{"metadata": []}"#,
            r#"{"metadata": {"name": 1}}"#,
        ] {
            assert!(
                serde_json::from_str::<CachedObject>(text).is_err(),
                "{text}"
            );
        }
    }

    /// `levels` arrays, one inside the other, around `1`.
    fn nested(levels: usize) -> String {
        format!("{}1{}", "[".repeat(levels), "]".repeat(levels))
    }

    #[test]
    fn nesting_counts_arrays_and_objects_outside_strings() {
        assert_eq!(nesting("1"), 0);
        assert_eq!(nesting(r#""[{""#), 0);
        assert_eq!(nesting(r#"{"a":[1,{"b":"]}\"[["}]}"#), 3);
        assert_eq!(nesting(&nested(5)), 5);
    }

    #[test]
    fn an_object_nested_deeper_than_a_reconcile_can_parse_is_refused() {
        let text = |levels| {
            format!(
                r#"{{"kind":"X","metadata":{{"name":"x"}},"spec":{}}}"#,
                nested(levels)
            )
        };
        let object: CachedObject =
            serde_json::from_str(&text(MAX_NESTING)).unwrap_or_else(|e| panic!("{e}"));
        // The deepest object cached still parses whole where a reconcile reads it.
        assert_eq!(
            object.to_value()["spec"],
            serde_json::from_str::<Value>(&nested(MAX_NESTING)).unwrap_or_else(|e| panic!("{e}"))
        );
        let error = serde_json::from_str::<CachedObject>(&text(MAX_NESTING + 1)).err();
        assert!(error.is_some_and(|e| e.to_string().contains("deeper than")));
        let labels = format!(
            r#"{{"metadata":{{"name":"x","labels":{{"a":{}}}}}}}"#,
            nested(MAX_NESTING)
        );
        assert!(serde_json::from_str::<CachedObject>(&labels).is_err());
    }

    #[test]
    fn text_in_any_order_and_spacing_decodes_the_same() {
        let text = r#" { "spec" : {"replicas": 2, "template": {"spec": {"containers": [{"name": "c", "image": "nginx:1.27 \"quoted\""}]}}},
            "status":{"readyReplicas":2}, "kind":"Deployment",
            "metadata" : { "labels" : { "app" : "web" }, "name":"web", "namespace":"a", "uid":"u1",
                "annotations": {"wasmctrl.dev/desired-hash": "abc", "note": "\"quoted\""},
                "ownerReferences": [{"apiVersion": "example.com/v1", "kind": "MyApp", "name": "web", "uid": "p1", "controller": true}] },
            "apiVersion" : "apps/v1" } "#;
        let object: CachedObject = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(object.to_value(), deployment());
        assert_eq!(
            object.labels(),
            BTreeMap::from([("app".to_owned(), "web".to_owned())])
        );
        let whole: Value =
            serde_json::from_str(&object.to_json()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(whole, deployment());
        // A map that is not an object is no map, as before.
        let object: CachedObject = serde_json::from_str(
            r#"{"metadata":{"name":"x","labels":"app=web","annotations":[]}}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(object.labels_text().is_none() && object.annotations_text().is_none());
    }

    #[test]
    fn a_watch_event_decodes_as_the_api_server_writes_it() {
        let line = format!(r#"{{"type":"MODIFIED","object":{}}}"#, deployment());
        let event: kube::core::WatchEvent<CachedObject> =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}"));
        let kube::core::WatchEvent::Modified(object) = event else {
            panic!("a modification");
        };
        assert_eq!(object.to_value(), deployment());
    }
}
