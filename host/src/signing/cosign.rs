//! Cosign's formats, so that `cosign sign` and `cosign verify` interoperate with the host:
//! - beside an OCI artifact, a signature manifest tagged `sha256-<manifest hex>.sig` whose
//!   layers are simple-signing payloads (`application/vnd.dev.cosign.simplesigning.v1+json`)
//!   naming the artifact's manifest digest, the signature in an annotation, and a keyless
//!   signer's certificate and chain in two more;
//! - beside a file, an HTTP URL or a ConfigMap key, a `.sig` bundle as `cosign sign-blob
//!   --bundle` writes it: the signature of the component's bytes, and the certificate.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};
use sigstore::cosign::bundle::Bundle as RekorBundle;
use sigstore::cosign::payload::simple_signing::SimpleSigning;

/// The media type of a simple-signing payload layer.
pub const SIMPLE_SIGNING_MEDIA_TYPE: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
/// The layer annotation holding the base64 signature of the payload.
pub const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
/// The layer annotation holding a keyless signer's certificate (PEM).
pub const CERTIFICATE_ANNOTATION: &str = "dev.sigstore.cosign/certificate";
/// The layer annotation holding the certificate's chain (PEM, intermediates then root).
pub const CHAIN_ANNOTATION: &str = "dev.sigstore.cosign/chain";
/// The layer annotation holding the transparency log's bundle (JSON).
pub const BUNDLE_ANNOTATION: &str = "dev.sigstore.cosign/bundle";
/// The media type of the (empty) config of a signature manifest.
pub const SIGNATURE_CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";

/// The tag cosign keeps an artifact's signatures under, from the artifact's manifest digest.
pub fn signature_tag(manifest_digest: &str) -> String {
    format!("{}.sig", manifest_digest.replacen(':', "-", 1))
}

/// Where a detached signature of a file, URL or ConfigMap key is: beside it, `.sig` added.
pub fn detached(name: &str) -> String {
    format!("{name}.sig")
}

/// `cosign sign-blob --bundle`'s file: the signature, and the signer's certificate.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BlobBundle {
    /// The base64 signature of the blob's bytes.
    pub base64_signature: String,
    /// The signer's certificate, PEM then base64 (keyless only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert: Option<String>,
    /// The transparency log's promise of inclusion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rekor_bundle: Option<RekorBundle>,
}

/// What a signature covers.
#[derive(Debug, Clone)]
pub enum Signed {
    /// A simple-signing payload (registry signatures), already checked to name the
    /// artifact's manifest digest.
    Payload {
        /// The bytes signed.
        bytes: Vec<u8>,
        /// The same, parsed.
        parsed: Box<SimpleSigning>,
    },
    /// The component's bytes themselves (detached signatures): their SHA-256 is the
    /// component's digest.
    Component,
}

/// One signature found beside a plugin, not yet trusted.
#[derive(Debug, Clone)]
pub struct Found {
    /// What the signature covers.
    pub signed: Signed,
    /// The signature, base64 as cosign writes it.
    pub signature: String,
    /// A keyless signer's certificate (PEM).
    pub certificate: Option<String>,
    /// The certificate's chain (PEM).
    pub chain: Option<String>,
    /// The transparency log's bundle.
    pub rekor: Option<RekorBundle>,
    /// Where it was found, for messages.
    pub location: String,
}

impl Found {
    /// The signatures in a `.sig` bundle found at `location`.
    pub fn from_blob_bundle(bytes: &[u8], location: &str) -> anyhow::Result<Self> {
        let bundle: BlobBundle = serde_json::from_slice(bytes)
            .map_err(|e| anyhow::anyhow!("{location} is not a cosign signature bundle: {e}"))?;
        let certificate = bundle
            .cert
            .map(|cert| {
                let pem = BASE64
                    .decode(cert.trim())
                    .map_err(|e| anyhow::anyhow!("{location}: cert is not base64: {e}"))?;
                String::from_utf8(pem)
                    .map_err(|_| anyhow::anyhow!("{location}: cert is not a PEM certificate"))
            })
            .transpose()?;
        Ok(Self {
            signed: Signed::Component,
            signature: bundle.base64_signature,
            certificate,
            chain: None,
            rekor: bundle.rekor_bundle,
            location: location.to_owned(),
        })
    }

    /// A signature layer of a registry signature manifest: its payload must name
    /// `manifest_digest` (else it signs another artifact and is left out).
    pub fn from_layer(
        payload: Vec<u8>,
        annotations: &std::collections::BTreeMap<String, String>,
        manifest_digest: &str,
        location: String,
    ) -> anyhow::Result<Self> {
        let parsed: SimpleSigning = serde_json::from_slice(&payload)
            .map_err(|e| anyhow::anyhow!("{location} is not a simple-signing payload: {e}"))?;
        if !parsed.satisfies_manifest_digest(manifest_digest) {
            anyhow::bail!(
                "{location} signs {}, not this artifact ({manifest_digest})",
                parsed.critical.image.docker_manifest_digest
            );
        }
        let signature = annotations
            .get(SIGNATURE_ANNOTATION)
            .ok_or_else(|| anyhow::anyhow!("{location} has no {SIGNATURE_ANNOTATION}"))?
            .clone();
        let rekor = annotations
            .get(BUNDLE_ANNOTATION)
            .map(|b| serde_json::from_str(b))
            .transpose()
            .map_err(|e| anyhow::anyhow!("{location}: {BUNDLE_ANNOTATION} is not a bundle: {e}"))?;
        Ok(Self {
            signed: Signed::Payload {
                bytes: payload,
                parsed: Box::new(parsed),
            },
            signature,
            certificate: annotations.get(CERTIFICATE_ANNOTATION).cloned(),
            chain: annotations.get(CHAIN_ANNOTATION).cloned(),
            rekor,
            location,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_tag_is_cosigns() {
        assert_eq!(
            signature_tag("sha256:0123abcd"),
            "sha256-0123abcd.sig",
            "cosign triangulate"
        );
    }

    #[test]
    fn a_blob_bundle_reads_as_cosign_writes_it() {
        let pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
        let text = format!(
            r#"{{"base64Signature":"MEUC","cert":"{}"}}"#,
            BASE64.encode(pem)
        );
        let found = Found::from_blob_bundle(text.as_bytes(), "p.wasm.sig").expect("a bundle");
        assert_eq!(found.signature, "MEUC");
        assert_eq!(found.certificate.as_deref(), Some(pem));
        assert!(matches!(found.signed, Signed::Component));
        let error = Found::from_blob_bundle(b"not json", "p.wasm.sig").expect_err("refused");
        assert!(error.to_string().contains("p.wasm.sig"), "{error}");
    }
}
