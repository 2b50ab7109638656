//! The parent a reconcile is for, as every step names it: kind, name, namespace and uid.

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
