//! `spec.conversion`: the API versions of the parent kind the policy's plugin converts
//! between, and `status.conversion`, what the hosts serve of it.
//!
//! The hosts serve the plugin's `convert` as the parent CustomResourceDefinition's
//! conversion webhook: the leader points the CRD's `spec.conversion` at the hosts' listener
//! and puts back what was there before when the policy goes or stops asking, once no stored
//! object needs the webhook to be read.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// The plugin converts the parent kind between these API versions, as the CRD's conversion
/// webhook, served by the hosts. Only a cluster policy may ask: a CRD's conversion is one
/// for every namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ConversionSpec {
    /// The versions converted between, as the CRD names them (`v1alpha1`, `v1`): every one
    /// the CRD serves, the parent's own among them.
    #[schemars(length(min = 2, max = 16), inner(length(min = 1, max = 63)))]
    #[x_kube(validation = Rule::new("self.all(v, self.exists_one(w, w == v))").message("each version may be listed once"))]
    pub versions: Vec<String>,
}

/// What the hosts serve of `spec.conversion`, in `status.conversion`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConversionStatus {
    /// The CustomResourceDefinition whose conversion the hosts serve.
    pub crd: String,
    /// The versions it converts between.
    pub versions: Vec<String>,
    /// The versions objects are stored at (the CRD's `status.storedVersions`): each but the
    /// storage version needs the webhook to be read, until `wasmctrl migrate` rewrites them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stored_versions: Vec<String>,
    /// Since when the CRD's conversion has pointed at the hosts.
    pub since: Time,
}
