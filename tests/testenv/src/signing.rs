//! A private keyless signing authority for tests: a root CA standing in for Fulcio, issuing
//! code-signing certificates that name an email and, in Fulcio's extension, the OIDC issuer
//! that vouched for it. No public Sigstore instance is reachable from the tests.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, CustomExtension, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
};

/// Fulcio's OIDC issuer extension (v2), as OID arcs.
const ISSUER_V2: &[u64] = &[1, 3, 6, 1, 4, 1, 57264, 1, 8];

/// A root CA that issues signing certificates.
pub struct SigningCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A signing key and the certificate the CA issued for it.
pub struct Certified {
    /// The private key, PKCS#8 PEM (what `wasmctrl plugin sign --key` reads).
    pub key_pem: String,
    /// The certificate, PEM.
    pub certificate_pem: String,
}

impl SigningCa {
    /// A fresh root named `name`.
    pub fn new(name: &str) -> anyhow::Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        Ok(Self { issuer })
    }

    /// The root certificate, PEM (what `--keyless-trust-roots` reads).
    pub fn root_pem(&self) -> String {
        self.issuer.pem()
    }

    /// A code-signing certificate for `email`, vouched for by the OIDC `oidc_issuer`.
    pub fn issue(&self, email: &str, oidc_issuer: &str) -> anyhow::Result<Certified> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.subject_alt_names = vec![SanType::Rfc822Name(email.try_into()?)];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::CodeSigning];
        params.custom_extensions = vec![CustomExtension::from_oid_content(
            ISSUER_V2,
            utf8_string(oidc_issuer),
        )];
        let certificate = params.signed_by(&key, &self.issuer)?;
        Ok(Certified {
            key_pem: key.serialize_pem(),
            certificate_pem: certificate.pem(),
        })
    }
}

/// `text` as a DER UTF8String.
fn utf8_string(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut der = vec![0x0c];
    match bytes.len() {
        len @ 0..=127 => der.push(len as u8),
        len @ 128..=255 => der.extend([0x81, len as u8]),
        len => der.extend([0x82, (len >> 8) as u8, len as u8]),
    }
    der.extend_from_slice(bytes);
    der
}

/// The pinned cosign CLI (`tools/cosign`), built once into the cache.
pub fn cosign() -> anyhow::Result<std::path::PathBuf> {
    crate::tools::build("cosign")
}
