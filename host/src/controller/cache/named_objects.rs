//! The related objects of one kind that parents name (`nameFrom`), read on demand.
//!
//! Chosen by name, the host holds no object it was not asked for: it watches the kind's
//! metadata only (what exists, at which resourceVersion: enough to trigger the parents that
//! name a changed object), and reads a named object itself the first time a reconcile needs
//! it. A namespace full of Secrets costs a few hundred bytes each, and only the named ones'
//! values are ever read or sent.
//!
//! What was read is kept while its resourceVersion is the one the metadata watch shows, in a
//! cache of at most [`READ_CACHE_BYTES`] (least recently used out first), and no longer than
//! something still calls for it: an object deleted, one no parent names any more (the
//! parents' index says so), and one a re-list of the metadata no longer shows at that
//! version (a delete missed in a watch gap) are dropped.

use std::sync::{Arc, Mutex};

use kube::api::Api;
use kube::core::{ApiResource, DynamicObject, PartialObjectMeta, TypeMeta};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt as _};

use super::read_cache::{ReadCache, ReadObject};
use super::related::{self, FieldPath, RelatedBytes, RelatedLimit};
use crate::metrics::PolicyMetrics;
use crate::plugin::ObservedObject;

/// Most bytes of read objects one related kind of one policy keeps: room for two requests
/// at [`related::MAX_RELATED_BYTES`], or a few thousand Secrets of a few KiB.
pub(crate) const READ_CACHE_BYTES: usize = 16 << 20;

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

/// Why the named objects of a parent cannot be shown to its plugin.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NamedError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    Limit(#[from] RelatedLimit),
}

/// An object's namespace (none for a cluster-scoped kind) and name.
type ObjectKey = (Option<String>, String);

/// What a related kind chosen by name is: where it sits in the policy's `related`, the field
/// of the parents that names its objects, and its resource.
pub(crate) struct NamedKind {
    pub position: usize,
    pub path: FieldPath,
    pub resource: ApiResource,
    pub namespaced: bool,
}

/// The objects of one related kind that parents name: which exist (a metadata-only watch),
/// and the ones read so far.
pub(crate) struct NamedObjects {
    kind: NamedKind,
    client: Client,
    metadata: Store<PartialObjectMeta<DynamicObject>>,
    read: Mutex<ReadCache<ObjectKey>>,
    /// Reports the bytes `read` holds (`wasmctrl_related_cache_bytes`).
    metrics: PolicyMetrics,
}

impl NamedObjects {
    /// Objects of `kind`, whose existence `metadata` tracks, read through `client`, keeping
    /// at most `cache_bytes` of them.
    pub fn new(
        kind: NamedKind,
        client: Client,
        metadata: Store<PartialObjectMeta<DynamicObject>>,
        metrics: PolicyMetrics,
        cache_bytes: usize,
    ) -> Self {
        Self {
            kind,
            client,
            metadata,
            read: Mutex::new(ReadCache::new(cache_bytes)),
            metrics,
        }
    }

    /// The metadata store, for readiness.
    pub fn metadata(&self) -> &Store<PartialObjectMeta<DynamicObject>> {
        &self.metadata
    }

    /// Drop what was read of an object that is gone.
    pub fn forget(&self, object: &PartialObjectMeta<DynamicObject>) {
        let key = (object.namespace(), object.name_any());
        self.cache(|read| read.remove(&key));
    }

    /// No parent names the object under the parents' index key `key` any more: drop what
    /// was read of it (a key of another related kind is not this one's).
    pub fn unnamed(&self, key: &str) {
        let kind = &self.kind;
        if let Some(object) = related::referenced_object(key, kind.position, kind.namespaced) {
            self.cache(|read| read.remove(&object));
        }
    }

    /// The metadata watch re-listed: keep only what was read of objects it still shows, at
    /// the version read. A delete during the watch's gap has no event of its own.
    pub fn relisted(&self) {
        self.cache(|read| {
            read.retain(|(namespace, name), version| {
                self.metadata
                    .get(&self.reference(namespace.as_deref(), name))
                    .is_some_and(|listed| listed.resource_version().as_deref() == version)
            });
        });
    }

    /// The objects `parent` names that exist, in name order, counted into `bytes`: from
    /// what was read when the metadata watch shows no change since, read now otherwise.
    /// A failed read fails the whole lookup: a plugin told "it does not exist" might delete
    /// what depends on it. Too many names fail it before any read, and so does passing the
    /// request's byte limit before the next read.
    pub async fn named_by(
        &self,
        parent: &DynamicObject,
        bytes: &mut RelatedBytes,
    ) -> Result<Vec<ObservedObject>, NamedError> {
        let kind = &self.kind;
        let names = related::within_name_limit(
            &kind.resource.kind,
            &kind.path,
            kind.path.names_in(parent),
        )?;
        let namespace = parent
            .metadata
            .namespace
            .clone()
            .filter(|_| kind.namespaced);
        let mut objects = Vec::new();
        for name in names {
            if let Some(read) = self.current(namespace.clone(), name).await? {
                bytes.take(&read.object)?;
                objects.push(read.object.clone());
            }
        }
        Ok(objects)
    }

    fn reference(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) -> ObjectRef<PartialObjectMeta<DynamicObject>> {
        let reference = ObjectRef::new_with(name, self.kind.resource.clone());
        match namespace {
            Some(namespace) => reference.within(namespace),
            None => reference,
        }
    }

    async fn current(
        &self,
        namespace: Option<String>,
        name: String,
    ) -> Result<Option<Arc<ReadObject>>, ReadError> {
        let reference = self.reference(namespace.as_deref(), &name);
        let key = (namespace, name);
        let Some(exists) = self.metadata.get(&reference) else {
            self.cache(|read| read.remove(&key));
            return Ok(None);
        };
        let version = exists.resource_version();
        if let Some(read) = self.cache(|read| read.get(&key, version.as_deref())) {
            return Ok(Some(read));
        }
        let object = self.get(&key).await?.map(Arc::new);
        self.cache(|read| match &object {
            Some(object) => read.insert(key, object.clone()),
            None => read.remove(&key),
        });
        Ok(object)
    }

    async fn get(&self, (namespace, name): &ObjectKey) -> Result<Option<ReadObject>, ReadError> {
        let resource = &self.kind.resource;
        let api: Api<DynamicObject> = match namespace {
            Some(namespace) => Api::namespaced_with(self.client.clone(), namespace, resource),
            None => Api::all_with(self.client.clone(), resource),
        };
        let read = api.get_opt(name).await.map_err(|source| ReadError {
            kind: resource.kind.clone(),
            name: name.clone(),
            path: self.kind.path.to_string(),
            source,
        })?;
        Ok(read.map(|mut object| {
            // As the watched caches hold objects: no managedFields, apiVersion and kind set.
            object.managed_fields_mut().clear();
            object.types = Some(TypeMeta {
                api_version: resource.api_version.clone(),
                kind: resource.kind.clone(),
            });
            ReadObject {
                resource_version: object.resource_version(),
                object: ObservedObject {
                    api_version: resource.api_version.clone(),
                    kind: resource.kind.clone(),
                    name: object.name_any(),
                    json: serde_json::to_string(&object).unwrap_or_default(),
                },
            }
        }))
    }

    /// Change what was read, keeping the policy's gauge of its bytes in step.
    fn cache<T>(&self, change: impl FnOnce(&mut ReadCache<ObjectKey>) -> T) -> T {
        let mut read = crate::lock(&self.read);
        let before = read.bytes();
        let out = change(&mut read);
        self.metrics.related_cache_changed(before, read.bytes());
        out
    }
}

impl Drop for NamedObjects {
    /// A stopped controller's objects leave the policy's gauge with it.
    fn drop(&mut self) {
        let read = crate::lock(&self.read);
        self.metrics.related_cache_changed(read.bytes(), 0);
    }
}

#[cfg(test)]
mod tests {
    //! A real kube client over a fake API server that answers GETs from a list of
    //! ConfigMaps (and logs them), and a real metadata store, filled as the watch fills it.

    use kube::runtime::reflector::store::Writer;
    use kube::runtime::watcher;
    use serde_json::{Value, json};

    use super::*;
    use crate::controller::testing::{self, config_maps};
    use crate::metrics::Metrics;

    fn config_map(name: &str, version: &str, size: usize) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": name, "namespace": "a", "resourceVersion": version},
               "data": {"k": "x".repeat(size)}})
    }

    /// A client whose API server holds `objects`, and the log of requests it was sent.
    fn api_server(objects: Vec<Value>) -> (Client, Arc<Mutex<Vec<String>>>) {
        testing::fake_api(move |_, uri| {
            let name = uri.path().rsplit('/').next().unwrap_or_default();
            match objects.iter().find(|o| o["metadata"]["name"] == name) {
                Some(object) => (200, object.clone()),
                None => testing::not_found(),
            }
        })
    }

    fn metadata(object: &Value) -> PartialObjectMeta<DynamicObject> {
        serde_json::from_value(json!({"metadata": object["metadata"]}))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Feed `writer` a complete list of `objects`, as a watch's (re-)list does.
    fn list(writer: &mut Writer<PartialObjectMeta<DynamicObject>>, objects: &[Value]) {
        writer.apply_watcher_event(&watcher::Event::Init);
        for object in objects {
            writer.apply_watcher_event(&watcher::Event::InitApply(metadata(object)));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
    }

    struct Fixture {
        named: NamedObjects,
        writer: Writer<PartialObjectMeta<DynamicObject>>,
        sent: Arc<Mutex<Vec<String>>>,
        metrics: Arc<Metrics>,
    }

    /// ConfigMaps named by `spec.refs`, `objects` in the cluster, keeping `cache_bytes`.
    fn fixture(objects: Vec<Value>, cache_bytes: usize) -> Fixture {
        let mut writer = Writer::new(config_maps());
        list(&mut writer, &objects);
        let (client, sent) = api_server(objects);
        let metrics = Arc::new(Metrics::new());
        let kind = NamedKind {
            position: 0,
            path: FieldPath::parse("spec.refs").unwrap_or_else(|e| panic!("{e}")),
            resource: config_maps(),
            namespaced: true,
        };
        let named = NamedObjects::new(
            kind,
            client,
            writer.as_reader(),
            metrics.policy("p"),
            cache_bytes,
        );
        Fixture {
            named,
            writer,
            sent,
            metrics,
        }
    }

    fn parent(refs: &[&str]) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "example.com/v1", "kind": "MyApp",
            "metadata": {"name": "web", "namespace": "a", "uid": "uid-web"},
            "spec": {"refs": refs},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    impl Fixture {
        async fn named_by(&self, refs: &[&str]) -> Result<Vec<String>, NamedError> {
            let mut bytes = RelatedBytes::default();
            self.named
                .named_by(&parent(refs), &mut bytes)
                .await
                .map(|objects| objects.into_iter().map(|o| o.name).collect())
        }

        fn sent(&self) -> usize {
            crate::lock(&self.sent).len()
        }

        fn kept(&self) -> usize {
            crate::lock(&self.named.read).len()
        }

        fn gauge(&self) -> i64 {
            let text = self.metrics.encode();
            text.lines()
                .find_map(|line| {
                    line.strip_prefix(r#"wasmctrl_related_cache_bytes{controller="p"} "#)?
                        .parse()
                        .ok()
                })
                .unwrap_or(0)
        }
    }

    #[tokio::test]
    async fn a_named_object_is_read_once_per_version_and_its_bytes_are_reported() {
        let objects = vec![config_map("x", "1", 100), config_map("y", "1", 100)];
        let mut f = fixture(objects, READ_CACHE_BYTES);
        let named = f.named_by(&["y", "x", "missing"]).await;
        assert_eq!(named.ok(), Some(vec!["x".to_owned(), "y".to_owned()]));
        assert_eq!(f.sent(), 2, "a name the metadata does not show is not read");
        assert!(f.named_by(&["x", "y"]).await.is_ok());
        assert_eq!(f.sent(), 2, "unchanged: served from what was read");
        let held = f.gauge();
        assert!(held > 200, "{held}");

        // `x` moves on: read again.
        list(
            &mut f.writer,
            &[config_map("x", "2", 100), config_map("y", "1", 100)],
        );
        assert!(f.named_by(&["x"]).await.is_ok());
        assert_eq!(f.sent(), 3);

        drop(f.named);
        let text = f.metrics.encode();
        assert!(
            text.contains(r#"wasmctrl_related_cache_bytes{controller="p"} 0"#),
            "a stopped controller's objects leave the gauge: {text}"
        );
    }

    #[tokio::test]
    async fn a_parent_naming_more_than_the_limit_fails_before_any_read() {
        let f = fixture(vec![config_map("x", "1", 10)], READ_CACHE_BYTES);
        let names: Vec<String> = (0..=related::MAX_NAMES_PER_FIELD)
            .map(|i| format!("n{i}"))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let failed = f.named_by(&refs).await;
        assert!(
            matches!(
                failed,
                Err(NamedError::Limit(RelatedLimit::TooManyNames {
                    count: 65,
                    ..
                }))
            ),
            "{failed:?}"
        );
        assert_eq!(f.sent(), 0);
    }

    #[tokio::test]
    async fn reading_stops_at_the_first_object_past_the_request_limit() {
        let objects: Vec<Value> = ["a", "b", "c", "d"]
            .iter()
            .map(|name| config_map(name, "1", 1000))
            .collect();
        let f = fixture(objects, READ_CACHE_BYTES);
        let mut bytes = RelatedBytes::with_limit(2500);
        let failed = f
            .named
            .named_by(&parent(&["a", "b", "c", "d"]), &mut bytes)
            .await;
        assert!(
            matches!(
                &failed,
                Err(NamedError::Limit(RelatedLimit::TooLarge { name, .. })) if name == "c"
            ),
            "{failed:?}"
        );
        assert_eq!(f.sent(), 3, "d is never read");
    }

    #[tokio::test]
    async fn the_read_objects_stay_within_their_bytes_least_recently_used_out() {
        let objects: Vec<Value> = ["a", "b", "c"]
            .iter()
            .map(|name| config_map(name, "1", 1000))
            .collect();
        // Room for two.
        let f = fixture(objects, 2500);
        assert!(f.named_by(&["a"]).await.is_ok());
        assert!(f.named_by(&["b"]).await.is_ok());
        assert!(f.named_by(&["a"]).await.is_ok());
        assert!(f.named_by(&["c"]).await.is_ok());
        assert_eq!(f.sent(), 3);
        assert_eq!(f.kept(), 2);
        assert!(f.gauge() <= 2500, "{}", f.gauge());
        // `b` was the least recently used: read again; `a` was kept.
        assert!(f.named_by(&["a"]).await.is_ok());
        assert_eq!(f.sent(), 3);
        assert!(f.named_by(&["b"]).await.is_ok());
        assert_eq!(f.sent(), 4);
    }

    #[tokio::test]
    async fn a_relist_drops_what_it_no_longer_shows_at_the_version_read() {
        let objects = vec![
            config_map("x", "1", 100),
            config_map("y", "1", 100),
            config_map("z", "1", 100),
        ];
        let mut f = fixture(objects, READ_CACHE_BYTES);
        assert!(f.named_by(&["x", "y", "z"]).await.is_ok());
        assert_eq!(f.kept(), 3);
        // During a watch gap `y` was deleted (no Delete event) and `z` changed.
        list(
            &mut f.writer,
            &[config_map("x", "1", 100), config_map("z", "2", 100)],
        );
        f.named.relisted();
        assert_eq!(f.kept(), 1, "only x is still as read");
        assert!(f.named_by(&["x"]).await.is_ok());
        assert_eq!(f.sent(), 3, "x was kept");
    }

    #[tokio::test]
    async fn what_no_parent_names_any_more_is_dropped() {
        let objects = vec![config_map("x", "1", 100), config_map("y", "1", 100)];
        let f = fixture(objects, READ_CACHE_BYTES);
        assert!(f.named_by(&["x", "y"]).await.is_ok());
        // Another related kind's key, and a key of another namespace, are not this one's.
        f.named.unnamed(&related::reference_key(1, Some("a"), "x"));
        f.named.unnamed(&related::reference_key(0, Some("b"), "x"));
        assert_eq!(f.kept(), 2);
        f.named.unnamed(&related::reference_key(0, Some("a"), "x"));
        assert_eq!(f.kept(), 1);
        let before = f.sent();
        assert!(f.named_by(&["x"]).await.is_ok());
        assert_eq!(f.sent(), before + 1, "x is read again");
    }
}
