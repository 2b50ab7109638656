//! Making signatures the host (and cosign) verifies: `wasmctrl plugin keygen` and `plugin
//! sign`. Keys are ECDSA P-256, what `cosign generate-key-pair` makes; a private key is read
//! as cosign writes it (encrypted, the password from `COSIGN_PASSWORD`) or as plain PKCS#8.

use std::collections::BTreeMap;

use anyhow::Context as _;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use sigstore::cosign::payload::simple_signing::{
    CRITICAL_TYPE_NAME, Critical, Identity, Image, Optional, SimpleSigning,
};
use sigstore::crypto::signing_key::SigStoreKeyPair;
use sigstore::crypto::{SigStoreSigner, SigningScheme};

use super::cosign::BlobBundle;

/// A private key to sign with.
pub struct SigningKey {
    pair: SigStoreKeyPair,
    signer: SigStoreSigner,
}

impl SigningKey {
    /// A new ECDSA P-256 key.
    pub fn generate() -> anyhow::Result<Self> {
        let signer = SigningScheme::ECDSA_P256_SHA256_ASN1
            .create_signer()
            .map_err(|e| anyhow::anyhow!("generating a key: {e}"))?;
        let pair = signer
            .to_sigstore_keypair()
            .map_err(|e| anyhow::anyhow!("generating a key: {e}"))?;
        Self::from_pair(pair)
    }

    /// The key in `pem`: cosign's encrypted format (with `password`), or PKCS#8.
    pub fn from_pem(pem: &[u8], password: Option<&[u8]>) -> anyhow::Result<Self> {
        let text = String::from_utf8_lossy(pem);
        let pair = if text.contains("ENCRYPTED") {
            let password = password.context(
                "the key is encrypted: set COSIGN_PASSWORD to its password (empty for none)",
            )?;
            SigStoreKeyPair::from_encrypted_pem(pem, password)
                .map_err(|e| anyhow::anyhow!("decrypting the key: {e}"))?
        } else {
            SigStoreKeyPair::from_pem(pem).map_err(|e| anyhow::anyhow!("reading the key: {e}"))?
        };
        Self::from_pair(pair)
    }

    fn from_pair(pair: SigStoreKeyPair) -> anyhow::Result<Self> {
        let signer = pair
            .to_sigstore_signer(&SigningScheme::ECDSA_P256_SHA256_ASN1)
            .map_err(|e| anyhow::anyhow!("the key is not an ECDSA P-256 key: {e}"))?;
        Ok(Self { pair, signer })
    }

    /// The public key, PEM (`cosign.pub`).
    pub fn public_pem(&self) -> anyhow::Result<String> {
        self.pair
            .public_key_to_pem()
            .map_err(|e| anyhow::anyhow!("encoding the public key: {e}"))
    }

    /// The private key, encrypted as cosign does (`cosign.key`).
    pub fn encrypted_pem(&self, password: &[u8]) -> anyhow::Result<String> {
        Ok(self
            .pair
            .private_key_to_encrypted_pem(password)
            .map_err(|e| anyhow::anyhow!("encrypting the private key: {e}"))?
            .to_string())
    }

    /// How the host names this key: `sha256:` and 12 hex digits.
    pub fn fingerprint(&self) -> anyhow::Result<String> {
        let key = self
            .pair
            .to_verification_key(&SigningScheme::ECDSA_P256_SHA256_ASN1)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(super::fingerprint(&key))
    }

    /// The base64 signature of `message`.
    pub fn sign(&self, message: &[u8]) -> anyhow::Result<String> {
        let signature = self
            .signer
            .sign(message)
            .map_err(|e| anyhow::anyhow!("signing: {e}"))?;
        Ok(BASE64.encode(signature))
    }

    /// A detached signature of a component's bytes, as `cosign sign-blob --bundle` writes
    /// it; with the signer's certificate (PEM) when the key is certified.
    pub fn sign_blob(&self, bytes: &[u8], certificate: Option<&str>) -> anyhow::Result<BlobBundle> {
        Ok(BlobBundle {
            base64_signature: self.sign(bytes)?,
            cert: certificate.map(|pem| BASE64.encode(pem)),
            rekor_bundle: None,
        })
    }
}

/// The simple-signing payload for the artifact `repository`@`manifest_digest`, carrying
/// `annotations` (cosign's `-a`).
pub fn payload(
    repository: &str,
    manifest_digest: &str,
    annotations: &BTreeMap<String, String>,
) -> anyhow::Result<Vec<u8>> {
    let optional = (!annotations.is_empty()).then(|| Optional {
        creator: None,
        timestamp: None,
        extra: annotations
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect(),
    });
    let payload = SimpleSigning {
        critical: Critical {
            identity: Identity {
                docker_reference: repository.to_owned(),
            },
            image: Image {
                docker_manifest_digest: manifest_digest.to_owned(),
            },
            type_name: CRITICAL_TYPE_NAME.to_owned(),
        },
        optional,
    };
    serde_json::to_vec(&payload).context("encoding the payload")
}
