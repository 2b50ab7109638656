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

use super::read_cache::{ReadBudget, ReadCache, ReadObject};
use super::related::{self, FieldPath, RelatedBytes, RelatedLimit};
use crate::metrics::PolicyMetrics;
use crate::plugin::ObservedObject;

/// Most bytes of read objects one related kind of one policy keeps: room for two requests
/// at [`related::MAX_RELATED_BYTES`], or a few thousand Secrets of a few KiB. All of them
/// together stay within the host's `--related-cache-mib`.
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
        budget: Arc<ReadBudget>,
    ) -> Self {
        Self {
            kind,
            client,
            metadata,
            read: Mutex::new(ReadCache::new(cache_bytes, budget)),
            metrics,
        }
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
    use super::*;
    use crate::controller::testing::{config_maps, offline_client};
    use kube::api::ObjectMeta;
    use kube::runtime::reflector::store::Writer;
    use kube::runtime::watcher::Event;

    fn meta(name: &str, version: &str) -> PartialObjectMeta<DynamicObject> {
        PartialObjectMeta {
            types: None,
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            _phantom: std::marker::PhantomData,
        }
    }

    fn read(name: &str, version: &str) -> Arc<ReadObject> {
        Arc::new(ReadObject {
            resource_version: Some(version.into()),
            object: ObservedObject {
                api_version: "v1".into(),
                kind: "ConfigMap".into(),
                name: name.into(),
                json: format!(
                    r#"{{"metadata":{{"name":"{name}"}},"data":{{"x":"{}"}}}}"#,
                    "x".repeat(1000)
                ),
            },
        })
    }

    /// What a reconcile read, and the metadata a watch shows: after a re-list, only what it
    /// still shows at the version read is kept, and the policy's gauge follows.
    #[tokio::test]
    async fn a_relist_keeps_only_what_it_still_shows_at_the_version_read() {
        let mut writer = Writer::new(config_maps());
        for (name, version) in [("kept", "1"), ("deleted", "1"), ("changed", "1")] {
            writer.apply_watcher_event(&Event::Apply(meta(name, version)));
        }
        let metrics = Arc::new(crate::metrics::Metrics::new()).policy("p");
        let named = NamedObjects::new(
            NamedKind {
                position: 0,
                path: FieldPath::parse("spec.configMap").expect("a path"),
                resource: config_maps(),
                namespaced: true,
            },
            offline_client(),
            writer.as_reader(),
            metrics,
            READ_CACHE_BYTES,
            Arc::new(ReadBudget::new(usize::MAX)),
        );
        for name in ["kept", "deleted", "changed"] {
            named.cache(|cache| cache.insert((Some("ns".into()), name.into()), read(name, "1")));
        }

        // The watch was down: "deleted" went and "changed" moved on, with no event for either.
        writer.apply_watcher_event(&Event::Init);
        writer.apply_watcher_event(&Event::InitApply(meta("kept", "1")));
        writer.apply_watcher_event(&Event::InitApply(meta("changed", "2")));
        writer.apply_watcher_event(&Event::InitDone);
        named.relisted();

        let key = |name: &str| (Some("ns".to_owned()), name.to_owned());
        named.cache(|cache| {
            assert!(cache.get(&key("kept"), Some("1")).is_some());
            assert!(cache.get(&key("deleted"), Some("1")).is_none());
            assert!(cache.get(&key("changed"), Some("1")).is_none());
            assert_eq!(cache.bytes(), read("kept", "1").bytes());
        });
    }
}
