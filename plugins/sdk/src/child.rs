//! Children in order: which child waits for which, and when a child counts as ready.
//!
//! The host applies a child only once every child it comes [`after`](Child::after) exists and
//! is ready, reports on the parent what it waits for (`Progressing=True`, reason
//! `WaitingFor`), and deletes in reverse: a child goes only once every child that came after
//! it is gone, even when this plugin is later broken or replaced. Readiness is judged by the
//! host from the child's own status (a Deployment available, a Job complete, a
//! StatefulSet's replicas ready, a PersistentVolumeClaim bound, any object with a current
//! `observedGeneration` and a `Ready` or `Available` condition `True`), or by a CEL
//! expression you give with [`ready_when`](Child::ready_when).
//!
//! ```
//! use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
//! use k8s_openapi::api::batch::v1::Job;
//! use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
//! use wasmctrl_plugin_sdk::{Child, Response};
//!
//! let named = |name: &str| ObjectMeta { name: Some(name.to_owned()), ..Default::default() };
//! let db = Child::new(&StatefulSet { metadata: named("db"), ..Default::default() })?;
//! let migrate = Child::new(&Job { metadata: named("migrate"), ..Default::default() })?.after(&db);
//! let app = Child::new(&Deployment { metadata: named("app"), ..Default::default() })?
//!     .after(&migrate)
//!     .ready_when("has(self.status.availableReplicas) && self.status.availableReplicas >= 1");
//!
//! let mut response = Response::new();
//! response.add_child(&db)?.add_child(&migrate)?.add_child(&app)?;
//! # Ok::<(), wasmctrl_plugin_sdk::Error>(())
//! ```
//!
//! The order travels on the children as two annotations, [`DEPENDS_ON`] and [`READY_WHEN`],
//! and stays on them in the cluster: that is how the host keeps the teardown order without
//! the plugin. A child may only come after children of the same answer, and the order may
//! not go in a circle; the host refuses such an answer and says which child is wrong.

use serde::Serialize;
use serde_json::Value;

use crate::Error;

/// Annotation naming the children a child comes after: `Kind/name, Kind/name`.
pub const DEPENDS_ON: &str = "wasmctrl.dev/depends-on";
/// Annotation holding the CEL expression, over the child as stored (`self`), that says it
/// is ready.
pub const READY_WHEN: &str = "wasmctrl.dev/ready-when";

/// A desired child with its place in the order: build it from any serializable manifest,
/// chain [`after`](Self::after) and [`ready_when`](Self::ready_when), and add it to the
/// [`Response`](crate::Response) with `add_child` like any other child.
#[derive(Debug, Clone, PartialEq)]
pub struct Child {
    object: Value,
    kind: String,
    name: String,
}

impl Child {
    /// A child from a manifest with `kind` and `metadata.name` (k8s-openapi types serialize
    /// their `apiVersion` and `kind` themselves).
    pub fn new<T: Serialize + ?Sized>(manifest: &T) -> Result<Self, Error> {
        let object = serde_json::to_value(manifest)?;
        let text = |value: &Value| value.as_str().filter(|s| !s.is_empty()).map(str::to_owned);
        let kind = text(&object["kind"])
            .ok_or_else(|| Error::permanent("a child needs a kind to be ordered"))?;
        let name = text(&object["metadata"]["name"]).ok_or_else(|| {
            Error::permanent(format!("a {kind} child needs a name to be ordered"))
        })?;
        Ok(Self { object, kind, name })
    }

    /// Apply this child only once `dependency` exists and is ready, and delete it before
    /// `dependency`. Call it once per dependency.
    #[must_use]
    pub fn after(mut self, dependency: &Child) -> Self {
        let entry = format!("{}/{}", dependency.kind, dependency.name);
        let annotations = self.annotations();
        let listed = match annotations.get(DEPENDS_ON).and_then(Value::as_str) {
            Some(existing) if existing.split(',').any(|e| e.trim() == entry) => existing.to_owned(),
            Some(existing) if !existing.trim().is_empty() => format!("{existing}, {entry}"),
            _ => entry,
        };
        annotations.insert(DEPENDS_ON.to_owned(), Value::String(listed));
        self
    }

    /// Count this child as ready when the CEL `expression` over it, as stored (`self`), is
    /// true, instead of by the host's rule for its kind: e.g.
    /// `self.status.phase == 'Running'`. An expression that fails (a field not there yet)
    /// leaves the child not ready; use `has(...)` for fields that may be missing.
    #[must_use]
    pub fn ready_when(mut self, expression: impl Into<String>) -> Self {
        self.annotations()
            .insert(READY_WHEN.to_owned(), Value::String(expression.into()));
        self
    }

    /// The child's kind.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The child's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn annotations(&mut self) -> &mut serde_json::Map<String, Value> {
        let metadata = &mut self.object["metadata"];
        if !metadata["annotations"].is_object() {
            metadata["annotations"] = Value::Object(serde_json::Map::new());
        }
        match &mut metadata["annotations"] {
            Value::Object(annotations) => annotations,
            _ => unreachable!("just made an object"),
        }
    }
}

impl Serialize for Child {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.object.serialize(serializer)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn after_and_ready_when_become_annotations() {
        let db = Child::new(&json!({"kind": "StatefulSet", "metadata": {"name": "db"}}))
            .expect("a child");
        let svc =
            Child::new(&json!({"kind": "Service", "metadata": {"name": "db"}})).expect("a child");
        let app = Child::new(&json!({"kind": "Deployment",
                "metadata": {"name": "app", "annotations": {"keep": "me"}}}))
        .expect("a child")
        .after(&db)
        .after(&svc)
        .after(&db)
        .ready_when("self.status.ready");
        let annotations = &serde_json::to_value(&app).expect("json")["metadata"]["annotations"];
        assert_eq!(annotations[DEPENDS_ON], "StatefulSet/db, Service/db");
        assert_eq!(annotations[READY_WHEN], "self.status.ready");
        assert_eq!(annotations["keep"], "me");
        assert_eq!((app.kind(), app.name()), ("Deployment", "app"));
    }

    #[test]
    fn a_child_without_kind_or_name_cannot_be_ordered() {
        assert!(Child::new(&json!({"metadata": {"name": "x"}})).is_err());
        assert!(Child::new(&json!({"kind": "Job", "metadata": {}})).is_err());
    }
}
