//! `spec.plugin.verify`: who must have signed a policy's plugins before the host compiles
//! them, and `status.activeSigners` / `status.candidate.signers`: who did.
//!
//! A plugin runs with its policy's rights, so its digest alone (which says *what* it is) is
//! not enough for a platform team: this says *who built it*. Signatures are cosign's: a
//! signature tag (`sha256-<manifest digest>.sig`) beside an OCI artifact, or a `.sig` bundle
//! (`cosign sign-blob --bundle`) beside a file, an HTTP URL or a ConfigMap key.

use std::collections::BTreeMap;

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// The signatures a plugin must carry. One accepted signature is enough: by any of `keys`,
/// or keyless by any of `identities`. Applies to the candidate too.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("size(self.keys) > 0 || size(self.keysFrom) > 0 || size(self.identities) > 0").message("verify needs keys, keysFrom or identities: who may sign this policy's plugins"))]
pub struct VerifySpec {
    /// Public keys in PEM (`cosign.pub`, as `cosign generate-key-pair` or `wasmctrl plugin
    /// keygen` writes it).
    #[serde(default)]
    #[schemars(length(max = 16))]
    pub keys: Vec<String>,
    /// ConfigMaps of public keys: every `data` value holding a PEM public key is listed,
    /// read whenever the plugin is obtained (so a key rotated there applies at the next
    /// load). Read with the host's rights: not for NamespacedReconcilePolicies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub keys_from: Vec<KeysFrom>,
    /// Keyless signers: a certificate issued under the host's keyless trust roots
    /// (`--keyless-trust-roots`) for one of these identities.
    #[serde(default)]
    #[schemars(length(max = 16))]
    pub identities: Vec<SignerIdentity>,
    /// Annotations the signed payload must carry (`cosign sign -a KEY=VALUE`, `wasmctrl
    /// plugin sign -a`). Only registry signatures carry annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// Where more keys are.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct KeysFrom {
    /// A ConfigMap of PEM public keys.
    pub config_map: KeysConfigMap,
}

/// A ConfigMap, by namespace and name.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct KeysConfigMap {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// A keyless signer: who the certificate was issued to, and by which identity provider.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.issuer) != has(self.issuerRegExp)").message("set exactly one of issuer and issuerRegExp"))]
#[x_kube(validation = Rule::new("has(self.subject) != has(self.subjectRegExp)").message("set exactly one of subject and subjectRegExp"))]
pub struct SignerIdentity {
    /// The OIDC issuer the certificate names, exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer: Option<String>,
    /// The OIDC issuer, as a regular expression matched against all of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer_reg_exp: Option<String>,
    /// The certificate's subject (its email or URI SAN), exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// The subject, as a regular expression matched against all of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject_reg_exp: Option<String>,
}

/// Who signed a plugin, as the host verified it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "camelCase")]
pub struct Signer {
    /// The listed key that made the signature: `sha256:` and the first 12 hex digits of
    /// the hash of its public key (what `wasmctrl plugin verify` prints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The keyless signer's subject.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// The keyless signer's OIDC issuer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issuer: Option<String>,
}

impl std::fmt::Display for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.key, &self.subject, &self.issuer) {
            (Some(key), _, _) => write!(f, "key {key}"),
            (None, Some(subject), Some(issuer)) => write!(f, "{subject} (issuer {issuer})"),
            (None, Some(subject), None) => write!(f, "{subject}"),
            (None, None, _) => write!(f, "an unknown signer"),
        }
    }
}
