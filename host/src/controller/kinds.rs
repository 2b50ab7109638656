//! Kinds resolved through discovery. A policy names kinds by `apiVersion` and `kind`; the
//! resource (plural) and scope come from the API server, never from guessing.

use std::sync::Arc;

use kube::Client;
use kube::core::{ApiResource, GroupVersionKind};
use kube::discovery::{self, Scope};

use crate::policy::KindRef;

/// A kind the API server serves.
#[derive(Debug, Clone)]
pub struct ResolvedKind {
    /// Group, version, kind and plural; shared by every cached object's references.
    pub resource: Arc<ApiResource>,
    /// Whether objects of the kind live in a namespace.
    pub namespaced: bool,
}

/// Why a kind could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum KindError {
    /// The API server does not serve it (yet): a CRD may still be on its way.
    #[error("{api_version} {kind} is not served by the API server (is its CRD installed?)")]
    NotFound {
        /// As the policy names it.
        api_version: String,
        /// As the policy names it.
        kind: String,
    },
    /// Discovery itself failed.
    #[error("discovering {api_version} {kind}: {source}")]
    Discovery {
        /// As the policy names it.
        api_version: String,
        /// As the policy names it.
        kind: String,
        /// What the client reported.
        #[source]
        source: kube::Error,
    },
}

/// Resolve one kind.
pub async fn resolve(client: &Client, kind: &KindRef) -> Result<ResolvedKind, KindError> {
    let (group, version) = match kind.api_version.split_once('/') {
        Some((group, version)) => (group, version),
        None => ("", kind.api_version.as_str()),
    };
    let gvk = GroupVersionKind::gvk(group, version, &kind.kind);
    match discovery::pinned_kind(client, &gvk).await {
        Ok((resource, capabilities)) => Ok(ResolvedKind {
            resource: Arc::new(resource),
            namespaced: capabilities.scope == Scope::Namespaced,
        }),
        Err(kube::Error::Discovery(_)) => Err(not_found(kind)),
        Err(kube::Error::Api(status)) if status.code == 404 => Err(not_found(kind)),
        Err(source) => Err(KindError::Discovery {
            api_version: kind.api_version.clone(),
            kind: kind.kind.clone(),
            source,
        }),
    }
}

fn not_found(kind: &KindRef) -> KindError {
    KindError::NotFound {
        api_version: kind.api_version.clone(),
        kind: kind.kind.clone(),
    }
}
