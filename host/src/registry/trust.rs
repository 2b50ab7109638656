//! The certificate authorities plugin fetches trust: the Mozilla roots compiled into the
//! binary, plus any the operator adds (`--extra-ca-file`, the chart's `extraCA`).
//!
//! Compiled-in roots, not the system store, so that what the host trusts is the same on
//! every node and in every image, whatever `/etc/ssl` holds (the shipped image carries the
//! same roots as a bundle only for libraries that insist on a system store). A registry
//! behind a private CA is then trusted by mounting that CA, nothing else.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;

/// Trust roots for plugin sources fetched over TLS. Cheap to clone.
#[derive(Clone)]
pub struct TrustRoots {
    /// DER certificates: the compiled-in roots, then the extra ones.
    roots: Arc<Vec<CertificateDer<'static>>>,
    /// How many of `roots` came from the operator.
    extra: usize,
}

impl Default for TrustRoots {
    /// The compiled-in roots only.
    fn default() -> Self {
        Self {
            roots: Arc::new(webpki_root_certs::TLS_SERVER_ROOT_CERTS.to_vec()),
            extra: 0,
        }
    }
}

impl std::fmt::Debug for TrustRoots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrustRoots")
            .field("roots", &self.roots.len())
            .field("extra", &self.extra)
            .finish()
    }
}

impl TrustRoots {
    /// The compiled-in roots plus every certificate in the PEM file at `path`. The file is
    /// read once, at start: a CA bundle that cannot be read, or holds no certificate, stops
    /// the host rather than leaving it to fail every fetch later.
    pub fn with_extra_file(path: &Path) -> anyhow::Result<Self> {
        let pem = std::fs::read(path)
            .with_context(|| format!("reading the extra CA file {}", path.display()))?;
        Self::with_extra_pem(&pem).with_context(|| format!("in {}", path.display()))
    }

    /// The compiled-in roots plus every certificate in `pem`.
    pub fn with_extra_pem(pem: &[u8]) -> anyhow::Result<Self> {
        let extra = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .context("the extra CA bundle is not valid PEM")?;
        if extra.is_empty() {
            bail!("the extra CA bundle holds no CERTIFICATE block");
        }
        let mut roots = webpki_root_certs::TLS_SERVER_ROOT_CERTS.to_vec();
        let count = extra.len();
        roots.extend(extra);
        Ok(Self {
            roots: Arc::new(roots),
            extra: count,
        })
    }

    /// How many roots the operator added.
    pub fn extra_count(&self) -> usize {
        self.extra
    }

    /// The roots as the registry client takes them: these and no others, so it never falls
    /// back to a system store that the image does not have.
    pub fn for_registry(&self) -> Vec<oci_client::client::Certificate> {
        registry_certificates(&self.roots)
    }

    /// Only the roots the operator added, for a client that keeps the system's too (the
    /// CLI on a workstation).
    pub fn extra_for_registry(&self) -> Vec<oci_client::client::Certificate> {
        registry_certificates(&self.roots[self.roots.len() - self.extra..])
    }

    /// `builder` trusting these roots and no others.
    pub fn apply_to_http(
        &self,
        builder: reqwest::ClientBuilder,
    ) -> anyhow::Result<reqwest::ClientBuilder> {
        let mut builder = builder.tls_built_in_root_certs(false);
        for der in self.roots.iter() {
            let certificate = reqwest::Certificate::from_der(der)
                .context("a trust root is not a valid certificate")?;
            builder = builder.add_root_certificate(certificate);
        }
        Ok(builder)
    }
}

/// An OCI registry client for `config`, or why there can be none.
///
/// `oci_client::Client::new` falls back to a default configuration when `config` is
/// refused, which would drop the roots chosen here; `try_from` reports the error instead.
/// Both also build a default HTTP client beside the configured one, and that one panics
/// where the system store holds no certificate at all (an image without a CA bundle), so
/// that is checked first and reported as an error.
pub(crate) fn oci_client(
    config: oci_client::client::ClientConfig,
) -> anyhow::Result<oci_client::Client> {
    crate::ensure_crypto_provider();
    static SYSTEM_ROOTS: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    SYSTEM_ROOTS
        .get_or_init(|| {
            reqwest::Client::builder()
                .build()
                .map(drop)
                .map_err(|e| format!("{e:#}"))
        })
        .clone()
        .map_err(|e| {
            anyhow::anyhow!(
                "the OCI client needs a system CA bundle (SSL_CERT_FILE, or \
                 /etc/ssl/certs/ca-certificates.crt), and this system has none: {e}"
            )
        })?;
    oci_client::Client::try_from(config).context("configuring the OCI registry client")
}

fn registry_certificates(roots: &[CertificateDer<'_>]) -> Vec<oci_client::client::Certificate> {
    roots
        .iter()
        .map(|der| oci_client::client::Certificate {
            encoding: oci_client::client::CertificateEncoding::Der,
            data: der.to_vec(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca_pem() -> String {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.self_signed(&key).expect("certificate").pem()
    }

    #[test]
    fn extra_certificates_are_added_to_the_compiled_in_roots() {
        let builtin = TrustRoots::default();
        assert!(builtin.for_registry().len() > 100, "the Mozilla roots");
        assert_eq!(builtin.extra_count(), 0);
        let bundle = format!("{}{}", ca_pem(), ca_pem());
        let trust = TrustRoots::with_extra_pem(bundle.as_bytes()).expect("bundle");
        assert_eq!(trust.extra_count(), 2);
        assert_eq!(trust.for_registry().len(), builtin.for_registry().len() + 2);
        assert_eq!(trust.extra_for_registry().len(), 2);
        assert!(builtin.extra_for_registry().is_empty());
    }

    #[test]
    fn a_bundle_without_certificates_or_a_missing_file_is_refused() {
        let error = TrustRoots::with_extra_pem(b"not a certificate\n").expect_err("no PEM");
        assert!(format!("{error:#}").contains("no CERTIFICATE"), "{error:#}");
        let error = TrustRoots::with_extra_file(Path::new("/nonexistent/ca.pem"))
            .expect_err("missing file");
        assert!(
            format!("{error:#}").contains("/nonexistent/ca.pem"),
            "{error:#}"
        );
    }
}
