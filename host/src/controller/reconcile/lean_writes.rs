//! Writes whose answer the host needs only the new `resourceVersion` of (for
//! [`decisions`](super::decisions)), and nothing else of the object.
//!
//! By default the API server answers a create or a patch with the whole object, which it
//! encodes and the host decodes into a `DynamicObject` only to drop it. Asked for
//! `PartialObjectMetadata`, it encodes the metadata alone: less work on both sides of every
//! write, at no cost in what the write does.
//!
//! A server that cannot answer that way (an aggregated API server not built on
//! k8s.io/apiserver) would refuse the write with `406 Not Acceptable`; plain JSON is offered
//! after it, as client-go's metadata client does, so such a server answers with the whole
//! object, whose metadata is read all the same.

use http::HeaderValue;
use kube::api::{Patch, PatchParams, PostParams};
use kube::core::{ApiResource, DynamicObject, Request};
use kube::{Client, Resource as _};

/// The answer a write asks for: the object's metadata, as `PartialObjectMetadata`, or else
/// the object.
const METADATA_ONLY: HeaderValue = HeaderValue::from_static(
    "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1, application/json",
);

fn request(resource: &ApiResource, namespace: Option<&str>) -> Request {
    Request::new(DynamicObject::url_path(resource, namespace))
}

/// What the host reads of a write's answer: the object's new `resourceVersion`. The rest of
/// the metadata (its `managedFields` above all, which describe the whole object) is skipped
/// as it is read, not decoded into a tree and dropped.
#[derive(Debug, serde::Deserialize)]
pub(crate) struct Written {
    metadata: WrittenMetadata,
}

#[derive(Debug, serde::Deserialize)]
struct WrittenMetadata {
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
}

impl Written {
    /// The version the write produced.
    pub fn resource_version(&self) -> Option<&str> {
        self.metadata.resource_version.as_deref()
    }

    /// The version the write produced, owned.
    pub fn into_resource_version(self) -> Option<String> {
        self.metadata.resource_version
    }
}

async fn metadata_of(
    client: &Client,
    mut request: http::Request<Vec<u8>>,
) -> Result<Written, kube::Error> {
    request
        .headers_mut()
        .insert(http::header::ACCEPT, METADATA_ONLY);
    client.request(request).await
}

/// Create `object` (the whole object, as JSON) of `resource` in `namespace`.
pub(crate) async fn create(
    client: &Client,
    resource: &ApiResource,
    namespace: Option<&str>,
    params: &PostParams,
    object: &impl serde::Serialize,
) -> Result<Written, kube::Error> {
    let body = serde_json::to_vec(object).map_err(kube::Error::SerdeError)?;
    let request = request(resource, namespace)
        .create(params, body)
        .map_err(kube::Error::BuildRequest)?;
    metadata_of(client, request).await
}

/// Patch the object `name` of `resource` in `namespace`.
pub(crate) async fn patch<P: serde::Serialize>(
    client: &Client,
    resource: &ApiResource,
    namespace: Option<&str>,
    name: &str,
    params: &PatchParams,
    patch: &Patch<P>,
) -> Result<Written, kube::Error> {
    let request = request(resource, namespace)
        .patch(name, params, patch)
        .map_err(kube::Error::BuildRequest)?;
    metadata_of(client, request).await
}

/// Patch the status of the object `name` of `resource` in `namespace`.
pub(crate) async fn patch_status<P: serde::Serialize>(
    client: &Client,
    resource: &ApiResource,
    namespace: Option<&str>,
    name: &str,
    params: &PatchParams,
    patch: &Patch<P>,
) -> Result<Written, kube::Error> {
    let request = request(resource, namespace)
        .patch_subresource("status", name, params, patch)
        .map_err(kube::Error::BuildRequest)?;
    metadata_of(client, request).await
}
