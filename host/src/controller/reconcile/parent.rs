//! The parent a reconcile is for, as every step names it: kind, name, namespace and uid.

use kube::core::{ApiResource, DynamicObject};

use std::sync::Arc;

use kube::runtime::reflector::ObjectRef;

use crate::controller::cache::cached::CachedObject;

/// The parent a set of children belongs to.
#[derive(Debug, Clone)]
pub struct ParentIdentity {
    /// The parent's `apiVersion`.
    pub api_version: String,
    /// The parent's `kind`.
    pub kind: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`; `None` for a cluster-scoped parent.
    pub namespace: Option<String>,
    /// `metadata.uid`.
    pub uid: String,
    /// Sharded, the parent's shard as its children's [`SHARD_LABEL`] says it.
    ///
    /// [`SHARD_LABEL`]: crate::controller::labels::SHARD_LABEL
    pub shard: Option<String>,
}

impl std::fmt::Display for ParentIdentity {
    /// `MyApp a/web`, as messages name a parent.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(namespace) => write!(f, "{} {namespace}/{}", self.kind, self.name),
            None => write!(f, "{} {}", self.kind, self.name),
        }
    }
}

impl ParentIdentity {
    /// The identity of `parent`, an object of `kind`, or the field it lacks: a parent without
    /// a name or uid cannot be reconciled (nothing could be written to it safely).
    pub(crate) fn of(parent: &DynamicObject, kind: &ApiResource) -> Result<Self, &'static str> {
        Ok(Self {
            api_version: kind.api_version.clone(),
            kind: kind.kind.clone(),
            name: parent.metadata.name.clone().ok_or("metadata.name")?,
            namespace: parent.metadata.namespace.clone(),
            uid: parent.metadata.uid.clone().ok_or("metadata.uid")?,
            shard: None,
        })
    }
}

/// A parent's key in the policy's maps (its outcome, its shadow verdict): the kind, namespace
/// and name only, none of the uid and resourceVersion a reference can carry, as the maps
/// hold one per parent.
pub(crate) fn parent_key(
    parent: &impl kube::Resource,
    kind: &Arc<ApiResource>,
) -> ObjectRef<CachedObject> {
    let key = ObjectRef::new_with(
        parent.meta().name.as_deref().unwrap_or_default(),
        kind.clone(),
    );
    match &parent.meta().namespace {
        Some(namespace) => key.within(namespace),
        None => key,
    }
}
