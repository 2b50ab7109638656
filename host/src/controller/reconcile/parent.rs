//! The parent a reconcile is for, as every step names it: kind, name, namespace and uid.

use kube::core::{ApiResource, DynamicObject};

use super::error::ReconcileError;

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
}

impl ParentIdentity {
    /// The identity of `parent`, an object of `kind`: a parent without a name or uid cannot
    /// be reconciled (nothing could be written to it safely).
    pub(crate) fn of(parent: &DynamicObject, kind: &ApiResource) -> Result<Self, ReconcileError> {
        Ok(Self {
            api_version: kind.api_version.clone(),
            kind: kind.kind.clone(),
            name: parent
                .metadata
                .name
                .clone()
                .ok_or(ReconcileError::MalformedParent("metadata.name"))?,
            namespace: parent.metadata.namespace.clone(),
            uid: parent
                .metadata
                .uid
                .clone()
                .ok_or(ReconcileError::MalformedParent("metadata.uid"))?,
        })
    }
}
