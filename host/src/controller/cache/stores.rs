//! The caches one policy's reconciles read, per kind: children by their controller, related
//! objects by namespace or by the name a parent gives.

use std::sync::Arc;

use kube::core::ApiResource;
use kube::runtime::reflector::{ObjectRef, Store};

use super::cached::CachedObject;
use super::field_ownership::CreatedFields;
use super::named_objects::NamedObjects;
use super::pending_writes::PendingWrites;
use super::store_index::StoreIndex;

/// A child kind as one policy's reconciles see it: the cache of the children it already has.
/// Its index is its index in the policy's allowed child kinds.
pub(crate) struct ChildCache {
    pub resource: Arc<ApiResource>,
    pub store: Store<CachedObject>,
    /// The children by their controller's uid.
    pub by_controller: Arc<StoreIndex<CachedObject>>,
    /// Updates written that the cache has not shown yet.
    pub pending: PendingWrites,
    /// Children whose create-time fields must be handed over before an apply.
    pub created: Arc<CreatedFields>,
}

/// A related kind, as the policy chooses its objects.
pub(crate) enum Related {
    /// All of a namespace, or those a selector matches: the watch holds exactly those.
    Selected(RelatedCache),
    /// Those a field of the parent names, read when first needed.
    Named(Arc<NamedObjects>),
}

/// A related kind chosen by selector (or not at all): a cache of the objects the plugin may
/// read.
pub(crate) struct RelatedCache {
    pub store: Store<CachedObject>,
    /// The objects by namespace.
    pub by_namespace: Arc<StoreIndex<CachedObject>>,
}

/// The reference to the object `name` of `kind` in `namespace`, to look it up in its cache.
pub(crate) fn object_ref<K: kube::Resource<DynamicType = Arc<ApiResource>>>(
    kind: &Arc<ApiResource>,
    namespace: Option<&str>,
    name: &str,
) -> ObjectRef<K> {
    let reference = ObjectRef::new_with(name, kind.clone());
    match namespace {
        Some(namespace) => reference.within(namespace),
        None => reference,
    }
}
