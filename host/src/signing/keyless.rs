//! Keyless signers: a short-lived certificate (Fulcio's, or a private CA's) binds the signing
//! key to an identity — an email or URI in the subject alternative name, and the OIDC issuer
//! that vouched for it in Fulcio's extension. The host trusts only the roots its operator
//! gives it (`--keyless-trust-roots`); there is no public Sigstore instance it must reach.

use std::time::{Duration, SystemTime};

use anyhow::{Context as _, bail};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, UnixTime};
use sigstore::crypto::CosignVerificationKey;
use x509_cert::Certificate;
use x509_cert::der::{Decode as _, Encode as _};
use x509_cert::ext::pkix::SubjectAltName;
use x509_cert::ext::pkix::name::GeneralName;

/// Fulcio's OIDC issuer extension (v2: a DER UTF8String).
const ISSUER_V2: &str = "1.3.6.1.4.1.57264.1.8";
/// Fulcio's first OIDC issuer extension (the raw string).
const ISSUER_V1: &str = "1.3.6.1.4.1.57264.1.1";
/// The extended key usage a signing certificate must have: code signing.
const CODE_SIGNING: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x03];
const SAN: &str = "2.5.29.17";

/// The roots keyless certificates must chain to. Empty: no keyless signature is accepted.
#[derive(Clone, Default)]
pub struct KeylessRoots {
    roots: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for KeylessRoots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeylessRoots({} roots)", self.roots.len())
    }
}

impl KeylessRoots {
    /// Every certificate in `pem`.
    pub fn from_pem(pem: &[u8]) -> anyhow::Result<Self> {
        let roots = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .context("the keyless trust roots are not valid PEM")?;
        if roots.is_empty() {
            bail!("the keyless trust roots hold no CERTIFICATE block");
        }
        Ok(Self { roots })
    }

    /// Whether there are any roots at all.
    pub fn is_empty(&self) -> bool {
        self.roots.is_empty()
    }

    /// The identity `certificate` (PEM) names and the key it certifies, once it chains
    /// through `chain` (PEM, optional) to one of these roots, for code signing, valid `at`.
    pub fn certify(
        &self,
        certificate: &str,
        chain: Option<&str>,
        at: SystemTime,
    ) -> anyhow::Result<Certified> {
        if self.roots.is_empty() {
            bail!("the host has no keyless trust roots (--keyless-trust-roots)");
        }
        let leaf = CertificateDer::from_pem_slice(certificate.as_bytes())
            .context("the certificate is not PEM")?;
        let intermediates = match chain {
            Some(chain) => CertificateDer::pem_slice_iter(chain.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .context("the certificate chain is not PEM")?,
            None => Vec::new(),
        };
        let anchors = self
            .roots
            .iter()
            .map(|root| webpki::anchor_from_trusted_cert(root).map(|a| a.to_owned()))
            .collect::<Result<Vec<_>, _>>()
            .context("a keyless trust root is not a usable CA certificate")?;
        let end_entity = webpki::EndEntityCert::try_from(&leaf)
            .map_err(|e| anyhow::anyhow!("the certificate cannot be parsed: {e}"))?;
        let since_epoch = at
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        end_entity
            .verify_for_usage(
                webpki::ALL_VERIFICATION_ALGS,
                &anchors,
                &intermediates,
                UnixTime::since_unix_epoch(since_epoch),
                webpki::KeyUsage::required(CODE_SIGNING),
                None,
                None,
            )
            .map_err(|e| {
                anyhow::anyhow!("the certificate does not chain to the keyless trust roots: {e}")
            })?;
        let parsed = Certificate::from_der(&leaf).context("parsing the certificate")?;
        let (subject, issuer) = identity(&parsed)?;
        let spki = parsed
            .tbs_certificate()
            .subject_public_key_info()
            .to_der()
            .context("encoding the certificate's key")?;
        let key = CosignVerificationKey::try_from_der(&spki)
            .map_err(|e| anyhow::anyhow!("the certificate's key: {e}"))?;
        Ok(Certified {
            subject,
            issuer,
            key,
            spki,
        })
    }
}

/// A certificate that chains to the roots: who it names, and the key it certifies.
pub struct Certified {
    /// The email or URI it was issued to.
    pub subject: String,
    /// The OIDC issuer that vouched for the subject.
    pub issuer: Option<String>,
    /// The signing key.
    pub key: CosignVerificationKey,
    /// The key as DER (SubjectPublicKeyInfo).
    pub spki: Vec<u8>,
}

/// The subject (the first email or URI SAN) and the OIDC issuer a certificate names.
fn identity(certificate: &Certificate) -> anyhow::Result<(String, Option<String>)> {
    let extensions = certificate
        .tbs_certificate()
        .extensions()
        .map_or(&[][..], Vec::as_slice);
    let mut subject = None;
    let mut issuer = None;
    for extension in extensions {
        let oid = extension.extn_id.to_string();
        let value = extension.extn_value.as_bytes();
        if oid == SAN {
            let names = SubjectAltName::from_der(value).context("parsing the SAN")?;
            subject = names.0.iter().find_map(|name| match name {
                GeneralName::Rfc822Name(email) => Some(email.to_string()),
                GeneralName::UniformResourceIdentifier(uri) => Some(uri.to_string()),
                _ => None,
            });
        } else if oid == ISSUER_V2 {
            let text = x509_cert::der::asn1::Utf8StringRef::from_der(value)
                .context("parsing the OIDC issuer extension")?;
            issuer = Some(text.as_str().to_owned());
        } else if oid == ISSUER_V1 && issuer.is_none() {
            issuer = Some(String::from_utf8_lossy(value).into_owned());
        }
    }
    let subject = subject.context("the certificate names no email or URI subject")?;
    Ok((subject, issuer))
}
