//! Plugin signatures: which ones a plugin carries ([`cosign`]'s formats), who may have made
//! them (a policy's [`VerifySpec`], compiled into a [`Verifier`]), and making them ([`sign`]).
//!
//! Verification is split in two so that a plugin the host already holds is checked again
//! against the *current* policy without its bytes: the signatures found beside a plugin are
//! kept with its digest, and [`Verifier::verify`] needs only them and the digest. A registry
//! signature signs a payload that names the artifact's manifest (checked when it was found);
//! a detached one signs the component's bytes, whose SHA-256 is the digest, so it is checked
//! as a signature of that hash.

pub mod cosign;
mod keyless;
pub mod sign;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use regex::Regex;
use sha2::Digest as _;
use sigstore::cosign::bundle::Bundle as RekorBundle;
use sigstore::crypto::{CosignVerificationKey, Signature};

use crate::plugin::Digest;
use crate::policy::{Signer, SignerIdentity, VerifySpec};
pub use cosign::{Found, Signed};
pub use keyless::KeylessRoots;

/// What the host trusts for every policy, set by its operator.
#[derive(Clone, Debug, Default)]
pub struct HostTrust {
    /// The roots keyless certificates must chain to.
    pub keyless_roots: KeylessRoots,
    /// The transparency log's keys. When set, every signature must carry the log's signed
    /// promise that it was entered (a Rekor bundle) by one of them, and a keyless certificate
    /// must have been valid when it was; without them the log is not consulted, and a
    /// keyless certificate must be valid now.
    pub rekor_keys: Option<RekorKeys>,
}

/// Rekor's public keys, by log id (the SHA-256 of the key's DER, as Rekor names its log).
#[derive(Clone, Debug)]
pub struct RekorKeys(BTreeMap<String, CosignVerificationKey>);

impl RekorKeys {
    /// Every public key in `pem` (one or more PEM blocks).
    pub fn from_pem(pem: &[u8]) -> anyhow::Result<Self> {
        let text = std::str::from_utf8(pem).context("the Rekor keys are not PEM text")?;
        let mut keys = BTreeMap::new();
        for block in text.split_inclusive("-----END PUBLIC KEY-----") {
            if !block.contains("-----BEGIN PUBLIC KEY-----") {
                continue;
            }
            let key = CosignVerificationKey::try_from_pem(block.trim().as_bytes())
                .map_err(|e| anyhow::anyhow!("a Rekor key: {e}"))?;
            keys.insert(hex::encode(sha2::Sha256::digest(spki_of(&key))), key);
        }
        anyhow::ensure!(!keys.is_empty(), "the Rekor keys hold no PUBLIC KEY block");
        Ok(Self(keys))
    }
}

/// A policy's `verify`, compiled: keys parsed, patterns built.
#[derive(Debug, Clone)]
pub struct Verifier {
    keys: Vec<ListedKey>,
    identities: Vec<IdentityMatcher>,
    annotations: BTreeMap<String, String>,
    trust: HostTrust,
}

#[derive(Debug, Clone)]
struct ListedKey {
    fingerprint: String,
    key: CosignVerificationKey,
}

#[derive(Debug, Clone)]
struct IdentityMatcher {
    issuer: Matcher,
    subject: Matcher,
}

#[derive(Debug, Clone)]
enum Matcher {
    Exactly(String),
    Pattern(Regex),
}

impl Matcher {
    fn new(exact: Option<&String>, pattern: Option<&String>, field: &str) -> anyhow::Result<Self> {
        match (exact, pattern) {
            (Some(exact), None) => Ok(Self::Exactly(exact.clone())),
            (None, Some(pattern)) => Regex::new(&format!("^(?:{pattern})$"))
                .map(Self::Pattern)
                .with_context(|| format!("{field}RegExp {pattern:?}")),
            _ => anyhow::bail!("set exactly one of {field} and {field}RegExp"),
        }
    }

    fn matches(&self, value: &str) -> bool {
        match self {
            Self::Exactly(exact) => exact == value,
            Self::Pattern(pattern) => pattern.is_match(value),
        }
    }
}

impl std::fmt::Display for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exactly(exact) => write!(f, "{exact}"),
            Self::Pattern(pattern) => write!(f, "/{}/", pattern.as_str()),
        }
    }
}

/// Why a plugin's signatures were not accepted; [`SignatureError::reason`] is the condition
/// reason on the policy.
#[derive(Debug, thiserror::Error)]
pub enum SignatureError {
    /// No signature was found where the source keeps them.
    #[error("no signature found ({looked}); this policy wants {expected}")]
    Missing {
        /// Where the host looked.
        looked: String,
        /// Who may sign.
        expected: String,
    },
    /// Signatures were found, none by anyone the policy accepts.
    #[error("no signature by {expected}: {}", why.join("; "))]
    Invalid {
        /// Who may sign.
        expected: String,
        /// Per signature found, why it was not accepted.
        why: Vec<String>,
    },
}

impl SignatureError {
    /// `SignatureMissing` or `SignatureInvalid`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Missing { .. } => "SignatureMissing",
            Self::Invalid { .. } => "SignatureInvalid",
        }
    }
}

impl Verifier {
    /// Compile `spec` under the host's trust. A key that is not a PEM public key, or a
    /// pattern that is not a regular expression, is refused here, with its place in the spec.
    pub fn new(spec: &VerifySpec, trust: HostTrust) -> anyhow::Result<Self> {
        let keys =
            spec.keys
                .iter()
                .enumerate()
                .map(|(i, pem)| {
                    let key = CosignVerificationKey::try_from_pem(pem.trim().as_bytes()).map_err(
                        |e| anyhow::anyhow!("verify.keys[{i}] is not a PEM public key: {e}"),
                    )?;
                    Ok(ListedKey {
                        fingerprint: fingerprint(&key),
                        key,
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
        let identities = spec
            .identities
            .iter()
            .enumerate()
            .map(|(i, identity)| {
                identity_matcher(identity).with_context(|| format!("verify.identities[{i}]"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        anyhow::ensure!(
            !keys.is_empty() || !identities.is_empty(),
            "verify needs keys or identities (keysFrom named none)"
        );
        Ok(Self {
            keys,
            identities,
            annotations: spec.annotations.clone(),
            trust,
        })
    }

    /// Who may sign, for messages: `key sha256:… or alice@example.com (issuer …)`.
    pub fn expected(&self) -> String {
        let mut who: Vec<String> = self
            .keys
            .iter()
            .map(|k| format!("key {}", k.fingerprint))
            .collect();
        who.extend(
            self.identities
                .iter()
                .map(|i| format!("{} (issuer {})", i.subject, i.issuer)),
        );
        let mut expected = who.join(" or ");
        if !self.annotations.is_empty() {
            let pairs: Vec<String> = self
                .annotations
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            expected.push_str(&format!(" with annotations {}", pairs.join(",")));
        }
        expected
    }

    /// Who signed the component `digest`, of the signatures `found` beside it (where the
    /// source keeps them: `looked`). Every accepted signature names its signer; none
    /// accepted is an error that says, for each, why.
    pub fn verify(
        &self,
        found: &[Found],
        digest: &Digest,
        looked: &str,
    ) -> Result<Vec<Signer>, SignatureError> {
        if found.is_empty() {
            return Err(SignatureError::Missing {
                looked: looked.to_owned(),
                expected: self.expected(),
            });
        }
        let mut signers = Vec::new();
        let mut why = Vec::new();
        for signature in found {
            match self.accept(signature, digest) {
                Ok(signer) => signers.push(signer),
                Err(reason) => why.push(format!("{}: {reason}", signature.location)),
            }
        }
        if signers.is_empty() {
            return Err(SignatureError::Invalid {
                expected: self.expected(),
                why,
            });
        }
        signers.sort();
        signers.dedup();
        Ok(signers)
    }

    /// The signer of one signature, or why it is not accepted.
    fn accept(&self, found: &Found, digest: &Digest) -> Result<Signer, String> {
        if !self.annotations.is_empty() {
            match &found.signed {
                Signed::Payload { parsed, .. }
                    if parsed.satisfies_annotations(&self.annotations) => {}
                Signed::Payload { .. } => return Err("its annotations do not match".to_owned()),
                Signed::Component => {
                    return Err("a detached signature carries no annotations".to_owned());
                }
            }
        }
        let at = match &self.trust.rekor_keys {
            Some(keys) => {
                let bundle = found
                    .rekor
                    .as_ref()
                    .ok_or("it carries no transparency-log entry (Rekor bundle)")?;
                logged(bundle, keys, found, digest)?
            }
            None => SystemTime::now(),
        };
        for listed in &self.keys {
            if signed_by(&listed.key, found, digest).is_ok() {
                return Ok(Signer {
                    key: Some(listed.fingerprint.clone()),
                    subject: None,
                    issuer: None,
                });
            }
        }
        let Some(certificate) = &found.certificate else {
            return Err("not made by any listed key".to_owned());
        };
        if self.identities.is_empty() {
            return Err("made keylessly, and verify lists no identities".to_owned());
        }
        let certified = self
            .trust
            .keyless_roots
            .certify(certificate, found.chain.as_deref(), at)
            .map_err(|e| format!("{e:#}"))?;
        let issuer = certified.issuer.clone().unwrap_or_default();
        if !self
            .identities
            .iter()
            .any(|i| i.subject.matches(&certified.subject) && i.issuer.matches(&issuer))
        {
            return Err(format!(
                "its certificate is for {} (issuer {issuer}), which matches no listed identity",
                certified.subject
            ));
        }
        signed_by(&certified.key, found, digest)
            .map_err(|e| format!("the signature does not match its certificate's key: {e}"))?;
        Ok(Signer {
            key: None,
            subject: Some(certified.subject),
            issuer: certified.issuer,
        })
    }
}

fn identity_matcher(identity: &SignerIdentity) -> anyhow::Result<IdentityMatcher> {
    Ok(IdentityMatcher {
        issuer: Matcher::new(
            identity.issuer.as_ref(),
            identity.issuer_reg_exp.as_ref(),
            "issuer",
        )?,
        subject: Matcher::new(
            identity.subject.as_ref(),
            identity.subject_reg_exp.as_ref(),
            "subject",
        )?,
    })
}

/// `sha256:` and 12 hex digits of the hash of a key's DER: how messages and the status
/// name a key.
pub fn fingerprint(key: &CosignVerificationKey) -> String {
    let hash = hex::encode(sha2::Sha256::digest(spki_of(key)));
    format!("sha256:{}", &hash[..12])
}

fn spki_of(key: &CosignVerificationKey) -> &[u8] {
    match key {
        CosignVerificationKey::RSA_PSS_SHA256(der)
        | CosignVerificationKey::RSA_PKCS1_SHA256(der)
        | CosignVerificationKey::ECDSA_P256_SHA256_ASN1(der)
        | CosignVerificationKey::ECDSA_P384_SHA384_ASN1(der)
        | CosignVerificationKey::ECDSA_P521_SHA512_ASN1(der)
        | CosignVerificationKey::ED25519(der) => der,
    }
}

/// Whether `key` made `found`'s signature of what it signs.
fn signed_by(key: &CosignVerificationKey, found: &Found, digest: &Digest) -> Result<(), String> {
    match &found.signed {
        Signed::Payload { bytes, .. } => key
            .verify_signature(Signature::Base64Encoded(found.signature.as_bytes()), bytes)
            .map_err(|e| e.to_string()),
        Signed::Component => signed_hash(key, &found.signature, digest.as_bytes()),
    }
}

/// An ECDSA P-256 signature of a message whose SHA-256 is `hash`: what `cosign sign-blob`
/// makes of a component, checked from its digest.
fn signed_hash(key: &CosignVerificationKey, signature: &str, hash: &[u8]) -> Result<(), String> {
    use p256::ecdsa::signature::hazmat::PrehashVerifier as _;
    use p256::pkcs8::DecodePublicKey as _;
    let CosignVerificationKey::ECDSA_P256_SHA256_ASN1(der) = key else {
        return Err("detached signatures are checked with ECDSA P-256 keys only".to_owned());
    };
    let key = p256::ecdsa::VerifyingKey::from_public_key_der(der).map_err(|e| e.to_string())?;
    let signature = BASE64
        .decode(signature.trim())
        .map_err(|e| format!("the signature is not base64: {e}"))?;
    let signature =
        p256::ecdsa::DerSignature::try_from(signature.as_slice()).map_err(|e| e.to_string())?;
    key.verify_prehash(hash, &signature)
        .map_err(|_| "the signature does not verify".to_owned())
}

/// The time the transparency log entered `found`, once its bundle is signed by one of `keys`
/// and records this very signature of this very content.
fn logged(
    bundle: &RekorBundle,
    keys: &RekorKeys,
    found: &Found,
    digest: &Digest,
) -> Result<SystemTime, String> {
    let key = keys.0.get(&bundle.payload.log_id).ok_or_else(|| {
        format!(
            "its log entry is from an unknown log {}",
            bundle.payload.log_id
        )
    })?;
    let canonical = serde_json_canonicalizer::to_vec(&bundle.payload).map_err(|e| e.to_string())?;
    key.verify_signature(
        Signature::Base64Encoded(bundle.signed_entry_timestamp.as_bytes()),
        &canonical,
    )
    .map_err(|_| "its log entry's signed timestamp does not verify".to_owned())?;
    let body = BASE64
        .decode(&bundle.payload.body)
        .map_err(|e| format!("its log entry's body is not base64: {e}"))?;
    let body: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| format!("its log entry's body: {e}"))?;
    let logged_signature = body
        .pointer("/spec/signature/content")
        .and_then(|v| v.as_str());
    let logged_hash = body
        .pointer("/spec/data/hash/value")
        .and_then(|v| v.as_str());
    let hash = match &found.signed {
        Signed::Payload { bytes, .. } => hex::encode(sha2::Sha256::digest(bytes)),
        Signed::Component => digest.hex(),
    };
    if logged_signature != Some(found.signature.trim()) || logged_hash != Some(hash.as_str()) {
        return Err("its log entry records another signature or content".to_owned());
    }
    let seconds = u64::try_from(bundle.payload.integrated_time)
        .map_err(|_| "its log entry has a negative time".to_owned())?;
    Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(seconds))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use wasmctrl_testenv::signing::SigningCa;

    use super::*;
    use crate::signing::sign::{SigningKey, payload};

    const COMPONENT: &[u8] = b"\0asm a component";

    fn keys(pems: &[&SigningKey]) -> VerifySpec {
        VerifySpec {
            keys: pems.iter().map(|k| k.public_pem().expect("pem")).collect(),
            ..VerifySpec::default()
        }
    }

    fn blob(key: &SigningKey, certificate: Option<&str>) -> Found {
        let bundle = key.sign_blob(COMPONENT, certificate).expect("signed");
        let text = serde_json::to_vec(&bundle).expect("json");
        Found::from_blob_bundle(&text, "plugin.wasm.sig").expect("a bundle")
    }

    fn layer(key: &SigningKey, annotations: &BTreeMap<String, String>) -> Found {
        let payload =
            payload("registry.test/plugins/p", "sha256:aa", annotations).expect("payload");
        let signature = key.sign(&payload).expect("signed");
        let layer_annotations =
            BTreeMap::from([(cosign::SIGNATURE_ANNOTATION.to_owned(), signature)]);
        Found::from_layer(payload, &layer_annotations, "sha256:aa", "layer 0".into())
            .expect("a layer")
    }

    #[test]
    fn a_detached_signature_verifies_from_the_digest_by_the_listed_key_only() {
        let (ours, theirs) = (
            SigningKey::generate().unwrap(),
            SigningKey::generate().unwrap(),
        );
        let digest = Digest::of(COMPONENT);
        let verifier = Verifier::new(&keys(&[&ours]), HostTrust::default()).expect("verifier");

        let signers = verifier
            .verify(&[blob(&ours, None)], &digest, "plugin.wasm.sig")
            .expect("signed by our key");
        assert_eq!(signers[0].key, Some(ours.fingerprint().unwrap()));

        let error = verifier
            .verify(&[blob(&theirs, None)], &digest, "plugin.wasm.sig")
            .expect_err("another key");
        assert_eq!(error.reason(), "SignatureInvalid");
        let message = error.to_string();
        assert!(
            message.contains(&ours.fingerprint().unwrap())
                && message.contains("not made by any listed key"),
            "names the key expected and why: {message}"
        );

        // Another component, the same signature.
        let other = Digest::of(b"something else");
        let error = verifier
            .verify(&[blob(&ours, None)], &other, "plugin.wasm.sig")
            .expect_err("signs other bytes");
        assert_eq!(error.reason(), "SignatureInvalid");

        let error = verifier
            .verify(&[], &digest, "plugin.wasm.sig")
            .expect_err("none");
        assert_eq!(error.reason(), "SignatureMissing");
        assert!(error.to_string().contains("plugin.wasm.sig"), "{error}");
    }

    #[test]
    fn a_registry_signature_must_carry_the_annotations_the_policy_names() {
        let key = SigningKey::generate().unwrap();
        let digest = Digest::of(COMPONENT);
        let mut spec = keys(&[&key]);
        spec.annotations = BTreeMap::from([("team".to_owned(), "payments".to_owned())]);
        let verifier = Verifier::new(&spec, HostTrust::default()).expect("verifier");
        let right = layer(&key, &spec.annotations);
        let wrong = layer(
            &key,
            &BTreeMap::from([("team".to_owned(), "other".to_owned())]),
        );
        verifier
            .verify(&[right], &digest, "tag")
            .expect("annotated");
        let error = verifier
            .verify(&[wrong], &digest, "tag")
            .expect_err("annotations differ");
        assert!(
            error.to_string().contains("annotations do not match"),
            "{error}"
        );
        let error = verifier
            .verify(&[blob(&key, None)], &digest, "sig")
            .expect_err("a detached signature has none");
        assert!(
            error.to_string().contains("carries no annotations"),
            "{error}"
        );
    }

    #[test]
    fn a_payload_for_another_artifact_is_not_a_signature_of_this_one() {
        let key = SigningKey::generate().unwrap();
        let payload = payload("registry.test/p", "sha256:bb", &BTreeMap::new()).unwrap();
        let annotations = BTreeMap::from([(
            cosign::SIGNATURE_ANNOTATION.to_owned(),
            key.sign(&payload).unwrap(),
        )]);
        let error = Found::from_layer(payload, &annotations, "sha256:aa", "layer 0".into())
            .expect_err("another manifest");
        assert!(error.to_string().contains("sha256:bb"), "{error}");
    }

    fn keyless(identity: (&str, &str)) -> VerifySpec {
        VerifySpec {
            identities: vec![SignerIdentity {
                subject: Some(identity.0.to_owned()),
                issuer: Some(identity.1.to_owned()),
                ..SignerIdentity::default()
            }],
            ..VerifySpec::default()
        }
    }

    fn trusting(ca: &SigningCa) -> HostTrust {
        HostTrust {
            keyless_roots: KeylessRoots::from_pem(ca.root_pem().as_bytes()).expect("roots"),
            rekor_keys: None,
        }
    }

    #[test]
    fn a_keyless_signature_is_accepted_for_the_identity_and_root_listed_only() {
        let ca = SigningCa::new("test fulcio").unwrap();
        let issued = ca
            .issue("alice@example.com", "https://issuer.test")
            .unwrap();
        let key = SigningKey::from_pem(issued.key_pem.as_bytes(), None).expect("the leaf key");
        let found = blob(&key, Some(&issued.certificate_pem));
        let digest = Digest::of(COMPONENT);

        let verifier = Verifier::new(
            &keyless(("alice@example.com", "https://issuer.test")),
            trusting(&ca),
        )
        .expect("verifier");
        let signers = verifier
            .verify(std::slice::from_ref(&found), &digest, "sig")
            .expect("alice");
        assert_eq!(signers[0].subject.as_deref(), Some("alice@example.com"));
        assert_eq!(signers[0].issuer.as_deref(), Some("https://issuer.test"));

        let pattern = VerifySpec {
            identities: vec![SignerIdentity {
                subject_reg_exp: Some(".*@example\\.com".into()),
                issuer: Some("https://issuer.test".into()),
                ..SignerIdentity::default()
            }],
            ..VerifySpec::default()
        };
        Verifier::new(&pattern, trusting(&ca))
            .unwrap()
            .verify(std::slice::from_ref(&found), &digest, "sig")
            .expect("the pattern matches");

        let bob = Verifier::new(
            &keyless(("bob@example.com", "https://issuer.test")),
            trusting(&ca),
        )
        .unwrap();
        let error = bob
            .verify(std::slice::from_ref(&found), &digest, "sig")
            .expect_err("not bob");
        assert!(
            error.to_string().contains(
                "alice@example.com (issuer https://issuer.test), which matches no listed identity"
            ),
            "{error}"
        );

        let other_ca = SigningCa::new("another").unwrap();
        let error = Verifier::new(
            &keyless(("alice@example.com", "https://issuer.test")),
            trusting(&other_ca),
        )
        .unwrap()
        .verify(std::slice::from_ref(&found), &digest, "sig")
        .expect_err("another root");
        assert!(error.to_string().contains("does not chain"), "{error}");

        let error = Verifier::new(
            &keyless(("alice@example.com", "https://issuer.test")),
            HostTrust::default(),
        )
        .unwrap()
        .verify(&[found], &digest, "sig")
        .expect_err("no roots");
        assert!(
            error.to_string().contains("--keyless-trust-roots"),
            "{error}"
        );
    }

    /// A Rekor bundle for `found`, signed by `log`.
    fn logged_by(log: &SigningKey, found: &Found, digest: &Digest) -> RekorBundle {
        let body = serde_json::json!({
            "apiVersion": "0.0.1",
            "kind": "hashedrekord",
            "spec": {
                "data": {"hash": {"algorithm": "sha256", "value": digest.hex()}},
                "signature": {"content": found.signature},
            },
        });
        let log_key =
            CosignVerificationKey::try_from_pem(log.public_pem().unwrap().as_bytes()).unwrap();
        let payload = sigstore::cosign::bundle::Payload {
            body: BASE64.encode(body.to_string()),
            integrated_time: 1_700_000_000,
            log_index: 7,
            log_id: hex::encode(sha2::Sha256::digest(spki_of(&log_key))),
        };
        let canonical = serde_json_canonicalizer::to_vec(&payload).unwrap();
        RekorBundle {
            signed_entry_timestamp: log.sign(&canonical).unwrap(),
            payload,
        }
    }

    #[test]
    fn with_rekor_keys_every_signature_needs_the_logs_entry_recording_it() {
        let (key, log) = (
            SigningKey::generate().unwrap(),
            SigningKey::generate().unwrap(),
        );
        let digest = Digest::of(COMPONENT);
        let trust = HostTrust {
            rekor_keys: Some(RekorKeys::from_pem(log.public_pem().unwrap().as_bytes()).unwrap()),
            ..HostTrust::default()
        };
        let verifier = Verifier::new(&keys(&[&key]), trust).unwrap();
        let mut found = blob(&key, None);
        let error = verifier
            .verify(std::slice::from_ref(&found), &digest, "sig")
            .expect_err("unlogged");
        assert!(
            error.to_string().contains("no transparency-log entry"),
            "{error}"
        );

        found.rekor = Some(logged_by(&log, &found, &digest));
        verifier
            .verify(std::slice::from_ref(&found), &digest, "sig")
            .expect("logged");

        let elsewhere = SigningKey::generate().unwrap();
        found.rekor = Some(logged_by(&elsewhere, &found, &digest));
        let error = verifier
            .verify(std::slice::from_ref(&found), &digest, "sig")
            .expect_err("another log");
        assert!(error.to_string().contains("unknown log"), "{error}");

        let mut other = blob(&key, None);
        other.rekor = Some(logged_by(&log, &other, &Digest::of(b"other bytes")));
        let error = verifier
            .verify(&[other], &digest, "sig")
            .expect_err("records other content");
        assert!(
            error.to_string().contains("another signature or content"),
            "{error}"
        );
    }

    #[test]
    fn a_key_that_is_not_pem_is_refused_with_its_place() {
        let spec = VerifySpec {
            keys: vec!["not a key".into()],
            ..VerifySpec::default()
        };
        let error = Verifier::new(&spec, HostTrust::default()).expect_err("refused");
        assert!(error.to_string().contains("verify.keys[0]"), "{error}");
    }

    #[test]
    fn cosign_encrypted_keys_round_trip_with_their_password() {
        let key = SigningKey::generate().unwrap();
        let pem = key.encrypted_pem(b"secret").unwrap();
        let again = SigningKey::from_pem(pem.as_bytes(), Some(b"secret")).expect("decrypted");
        assert_eq!(again.fingerprint().unwrap(), key.fingerprint().unwrap());
        assert!(SigningKey::from_pem(pem.as_bytes(), Some(b"wrong")).is_err());
        assert!(SigningKey::from_pem(pem.as_bytes(), None).is_err());
    }
}
