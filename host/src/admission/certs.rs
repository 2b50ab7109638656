//! The webhook listener's certificate, made and renewed by the hosts themselves: a CA and a
//! serving pair kept in one Secret in the host's namespace, which every replica reads, so
//! the API server trusts whichever replica answers through the one CA bundle in the webhook
//! configurations.
//!
//! - The first host to find no Secret makes the CA (valid 10 years) and a serving pair
//!   signed by it (valid [`SERVING_VALIDITY`]) for the listener's names, and creates the
//!   Secret; a replica that loses that race reads the winner's.
//! - A serving pair with less than a third of its validity left, or one that does not cover the
//!   names a host serves under, is renewed from the same CA by the host that notices, with
//!   the Secret's resource version as a precondition (a replica that loses that race reads
//!   the winner's). The CA does not change, so the CA bundle the API server holds stays valid
//!   and no request fails across a renewal: new connections get the new pair.
//! - The CA's key lives only in this Secret. Who may read it may mint serving pairs the API
//!   server trusts for these webhooks, so the host's grant reads and updates this Secret by
//!   name (creating one cannot be limited to a name), and nothing else in the namespace
//!   should read it.
//! - A pair that does not verify (a key that is not the certificate's, a certificate the CA
//!   did not sign) is replaced as if due; a Secret of the name that holds no CA is reported
//!   and left alone.

use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// How long a CA the hosts make is valid.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How long a serving pair is valid; it is renewed with a third of that left.
pub const SERVING_VALIDITY: Duration = Duration::from_secs(90 * 24 * 3600);

/// The keys of the Secret.
const CA_CERT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";
const TLS_CERT: &str = "tls.crt";
const TLS_KEY: &str = "tls.key";

/// The CA bundle and serving pair the listener uses, all PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct Issued {
    /// The CA's certificate: the webhook configurations' `caBundle`.
    pub ca_bundle: String,
    /// The serving certificate, signed by the CA.
    pub certificate: String,
    /// The serving certificate's key.
    pub key: String,
    /// When the serving certificate expires.
    pub not_after: SystemTime,
}

impl Issued {
    /// A pair someone else issued (cert-manager, mounted as files): the CA bundle, the
    /// serving certificate (its chain) and key, all PEM. The key must be the certificate's.
    pub fn from_pem(ca_bundle: String, certificate: String, key: String) -> anyhow::Result<Self> {
        let (_, not_after, _) = inspect(&certificate)?;
        crate::server::tls::certified_pem(certificate.as_bytes(), key.as_bytes())?
            .keys_match()
            .context("the key is not the certificate's")?;
        anyhow::ensure!(
            !ca_bundle.trim().is_empty(),
            "the CA bundle is empty: the API server would trust no certificate"
        );
        Ok(Self {
            ca_bundle,
            certificate,
            key,
            not_after,
        })
    }
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issued")
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

/// A CA and its key, PEM.
#[derive(Clone)]
struct Authority {
    certificate: String,
    key: String,
}

/// The Secret that holds the webhooks' CA and serving pair, and the names the listener
/// serves under (DNS names, or IP addresses for a host reached by address).
pub struct Certificates {
    secrets: Api<Secret>,
    name: String,
    names: Vec<String>,
    serving_validity: Duration,
    /// A pair with less than this left is renewed (a third of the validity, unless set).
    renew_within: Option<Duration>,
}

impl Certificates {
    /// The pair kept in Secret `name` (in the namespace `secrets` reaches) for `names`.
    pub fn new(secrets: Api<Secret>, name: &str, names: Vec<String>) -> Self {
        Self {
            secrets,
            name: name.to_owned(),
            names,
            serving_validity: SERVING_VALIDITY,
            renew_within: None,
        }
    }

    /// Serving pairs this host issues are valid this long.
    #[must_use]
    pub fn serving_validity(mut self, validity: Duration) -> Self {
        self.serving_validity = validity;
        self
    }

    /// Renew a pair with less than `left` of its validity left (by default a third of the
    /// validity this host issues with).
    #[must_use]
    pub fn renew_within(mut self, left: Duration) -> Self {
        self.renew_within = Some(left);
        self
    }

    /// The pair to serve with: the Secret's, made first when there is none, renewed first
    /// when it is due (see the module's docs).
    pub async fn ensure(&self) -> anyhow::Result<Issued> {
        // Two rounds at most: a lost race leaves the winner's Secret, which is then read.
        for _ in 0..3 {
            let existing = self
                .secrets
                .get_opt(&self.name)
                .await
                .with_context(|| format!("reading Secret {}", self.name))?;
            let Some(secret) = existing else {
                let authority = new_authority()?;
                let issued = self.issue(&authority)?;
                match self
                    .secrets
                    .create(&PostParams::default(), &self.secret(&authority, &issued))
                    .await
                {
                    Ok(_) => {
                        tracing::info!(secret = %self.name, "made the webhook CA and serving certificate");
                        return Ok(issued);
                    }
                    Err(kube::Error::Api(status)) if status.code == 409 => continue,
                    Err(error) => {
                        return Err(error)
                            .with_context(|| format!("creating Secret {}", self.name));
                    }
                }
            };
            let (authority, stored) = read(&secret).with_context(|| {
                format!(
                    "Secret {} does not hold a webhook CA and serving pair",
                    self.name
                )
            })?;
            if !self.due(&stored)? {
                return Ok(stored);
            }
            let issued = self.issue(&authority)?;
            anyhow::ensure!(
                verifies(&issued, &self.names),
                "the CA in Secret {} does not match its key: remove the Secret to make a new CA (and let the hosts write the new CA bundle)",
                self.name
            );
            // The Secret as it is (labels, annotations, owners others added), with the new
            // data, replaced only if no one changed it since it was read.
            let mut renewed = secret.clone();
            renewed.metadata.managed_fields = None;
            renewed.data = self.secret(&authority, &issued).data;
            match self
                .secrets
                .replace(&self.name, &PostParams::default(), &renewed)
                .await
            {
                Ok(_) => {
                    tracing::info!(secret = %self.name, "renewed the webhook serving certificate");
                    return Ok(issued);
                }
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(error) => {
                    return Err(error).with_context(|| format!("renewing Secret {}", self.name));
                }
            }
        }
        anyhow::bail!(
            "Secret {} kept changing while this host read it; it is tried again later",
            self.name
        )
    }

    /// Whether `stored` must be renewed: less than a third of the validity this host issues
    /// with left, names it does not cover, or a pair that does not verify.
    fn due(&self, stored: &Issued) -> anyhow::Result<bool> {
        let (_, not_after, covered) = inspect(&stored.certificate)?;
        let left = not_after
            .duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO);
        let renew_within = self.renew_within.unwrap_or(self.serving_validity / 3);
        let covered: Vec<String> = covered.iter().map(|name| canonical(name)).collect();
        Ok(left < renew_within
            || self
                .names
                .iter()
                .any(|name| !covered.contains(&canonical(name)))
            || !verifies(stored, &self.names))
    }

    fn issue(&self, authority: &Authority) -> anyhow::Result<Issued> {
        issue_serving(authority, &self.names, self.serving_validity)
    }

    fn secret(&self, authority: &Authority, issued: &Issued) -> Secret {
        let data = [
            (CA_CERT, &authority.certificate),
            (CA_KEY, &authority.key),
            (TLS_CERT, &issued.certificate),
            (TLS_KEY, &issued.key),
        ]
        .into_iter()
        .map(|(key, pem)| (key.to_owned(), ByteString(pem.as_bytes().to_vec())))
        .collect();
        Secret {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(
                    [(
                        "app.kubernetes.io/managed-by".to_owned(),
                        "wasmctrl".to_owned(),
                    )]
                    .into(),
                ),
                ..ObjectMeta::default()
            },
            type_: Some("kubernetes.io/tls".to_owned()),
            data: Some(data),
            ..Secret::default()
        }
    }
}

/// The CA and serving pair a Secret holds.
fn read(secret: &Secret) -> anyhow::Result<(Authority, Issued)> {
    let data = secret.data.clone().unwrap_or_default();
    let text = |key: &str| -> anyhow::Result<String> {
        let bytes = data.get(key).with_context(|| format!("no {key}"))?;
        String::from_utf8(bytes.0.clone()).with_context(|| format!("{key} is not PEM text"))
    };
    let authority = Authority {
        certificate: text(CA_CERT)?,
        key: text(CA_KEY)?,
    };
    let certificate = text(TLS_CERT)?;
    let (_, not_after, _) = inspect(&certificate)?;
    let issued = Issued {
        ca_bundle: authority.certificate.clone(),
        certificate,
        key: text(TLS_KEY)?,
        not_after,
    };
    Ok((authority, issued))
}

/// A name as certificates compare it: an IP address in its one text form, a DNS name in
/// lowercase without a trailing dot.
fn canonical(name: &str) -> String {
    match name.parse::<std::net::IpAddr>() {
        Ok(address) => address.to_string(),
        Err(_) => name.trim_end_matches('.').to_ascii_lowercase(),
    }
}

/// Whether `issued`'s key is its certificate's, and the certificate is one its CA signed for
/// the first of `names`, valid now.
fn verifies(issued: &Issued, names: &[String]) -> bool {
    use rustls::client::danger::ServerCertVerifier as _;
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    crate::ensure_crypto_provider();
    let Ok(key) =
        crate::server::tls::certified_pem(issued.certificate.as_bytes(), issued.key.as_bytes())
    else {
        return false;
    };
    if key.keys_match().is_err() {
        return false;
    }
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(issued.ca_bundle.as_bytes()) {
        let Ok(ca) = ca else { return false };
        if roots.add(ca).is_err() {
            return false;
        }
    }
    let Ok(verifier) =
        rustls::client::WebPkiServerVerifier::builder(std::sync::Arc::new(roots)).build()
    else {
        return false;
    };
    let (Some(leaf), Some(name)) = (key.cert.first(), names.first()) else {
        return false;
    };
    let Ok(name) = ServerName::try_from(name.clone()) else {
        return false;
    };
    verifier
        .verify_server_cert(leaf, &key.cert[1..], &name, &[], UnixTime::now())
        .is_ok()
}

/// When a PEM certificate starts and stops being valid, and the names it covers.
fn inspect(pem: &str) -> anyhow::Result<(SystemTime, SystemTime, Vec<String>)> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem.as_bytes())
        .map_err(|e| anyhow::anyhow!("the certificate is not PEM: {e}"))?;
    let certificate = pem
        .parse_x509()
        .map_err(|e| anyhow::anyhow!("the certificate cannot be read: {e}"))?;
    let at = |time: x509_parser::time::ASN1Time| {
        SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(time.timestamp()).unwrap_or(0))
    };
    let validity = certificate.validity();
    let mut names = Vec::new();
    if let Ok(Some(alternatives)) = certificate.subject_alternative_name() {
        for name in &alternatives.value.general_names {
            match name {
                x509_parser::extensions::GeneralName::DNSName(dns) => names.push((*dns).to_owned()),
                x509_parser::extensions::GeneralName::IPAddress(bytes) => {
                    let address = match bytes.len() {
                        4 => <[u8; 4]>::try_from(*bytes).map(std::net::IpAddr::from).ok(),
                        16 => <[u8; 16]>::try_from(*bytes)
                            .map(std::net::IpAddr::from)
                            .ok(),
                        _ => None,
                    };
                    names.extend(address.map(|a| a.to_string()));
                }
                _ => {}
            }
        }
    }
    Ok((at(validity.not_before), at(validity.not_after), names))
}

fn offset(time: SystemTime) -> anyhow::Result<time::OffsetDateTime> {
    let seconds = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .context("a time before 1970")?
        .as_secs();
    time::OffsetDateTime::from_unix_timestamp(i64::try_from(seconds)?)
        .context("a time out of range")
}

/// A new CA: its certificate and key.
fn new_authority() -> anyhow::Result<Authority> {
    let now = SystemTime::now();
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params
        .distinguished_name
        .push(DnType::CommonName, "wasmctrl webhook CA");
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = offset(now - Duration::from_secs(3600))?;
    params.not_after = offset(now + CA_VALIDITY)?;
    let key = KeyPair::generate().context("making the webhook CA's key")?;
    let certificate = params.self_signed(&key).context("making the webhook CA")?;
    Ok(Authority {
        certificate: certificate.pem(),
        key: key.serialize_pem(),
    })
}

/// A serving pair for `names`, signed by `authority`, valid for `validity` from now.
fn issue_serving(
    authority: &Authority,
    names: &[String],
    validity: Duration,
) -> anyhow::Result<Issued> {
    anyhow::ensure!(
        !names.is_empty(),
        "the webhook listener needs a name to be certified for"
    );
    let ca_key = KeyPair::from_pem(&authority.key).context("reading the webhook CA's key")?;
    let issuer = Issuer::from_ca_cert_pem(&authority.certificate, ca_key)
        .context("reading the webhook CA")?;
    let now = SystemTime::now();
    let mut params = CertificateParams::new(names.to_vec())
        .context("the listener's names are not valid certificate names")?;
    params
        .distinguished_name
        .push(DnType::CommonName, names[0].clone());
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    // Backdated an hour, as the CA: a host whose clock runs fast must not issue a pair the
    // API server sees as not valid yet.
    params.not_before = offset(now - Duration::from_secs(3600))?;
    let not_after = now + validity;
    params.not_after = offset(not_after)?;
    let key = KeyPair::generate().context("making the serving key")?;
    let certificate = params
        .signed_by(&key, &issuer)
        .context("signing the serving certificate")?;
    Ok(Issued {
        ca_bundle: authority.certificate.clone(),
        certificate: certificate.pem(),
        key: key.serialize_pem(),
        not_after,
    })
}

#[cfg(test)]
mod tests {
    use rustls::client::danger::ServerCertVerifier as _;
    use rustls::pki_types::pem::PemObject as _;

    use super::*;

    #[test]
    fn a_serving_pair_covers_its_names_and_chains_to_the_ca() {
        let authority = new_authority().expect("a CA");
        let names = vec![
            "wasmctrl-webhooks.wasmctrl.svc".to_owned(),
            "127.0.0.1".to_owned(),
        ];
        let issued = issue_serving(&authority, &names, SERVING_VALIDITY).expect("a pair");
        let (not_before, not_after, covered) = inspect(&issued.certificate).expect("reads");
        assert_eq!(covered, names);
        assert!(not_before < SystemTime::now() && not_after > SystemTime::now());
        // A TLS client that trusts the CA bundle accepts the pair for each name.
        crate::ensure_crypto_provider();
        let mut roots = rustls::RootCertStore::empty();
        for ca in rustls::pki_types::CertificateDer::pem_slice_iter(issued.ca_bundle.as_bytes()) {
            roots.add(ca.expect("a CA certificate")).expect("adds");
        }
        let verifier = rustls::client::WebPkiServerVerifier::builder(std::sync::Arc::new(roots))
            .build()
            .expect("a verifier");
        let chain: Vec<_> =
            rustls::pki_types::CertificateDer::pem_slice_iter(issued.certificate.as_bytes())
                .collect::<Result<_, _>>()
                .expect("the chain");
        for name in &names {
            verifier
                .verify_server_cert(
                    &chain[0],
                    &[],
                    &rustls::pki_types::ServerName::try_from(name.clone()).expect("a name"),
                    &[],
                    rustls::pki_types::UnixTime::now(),
                )
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let other = new_authority().expect("another CA");
        let foreign = issue_serving(&other, &names, SERVING_VALIDITY).expect("a pair");
        let chain: Vec<_> =
            rustls::pki_types::CertificateDer::pem_slice_iter(foreign.certificate.as_bytes())
                .collect::<Result<_, _>>()
                .expect("the chain");
        assert!(
            verifier
                .verify_server_cert(
                    &chain[0],
                    &[],
                    &rustls::pki_types::ServerName::try_from(names[0].clone()).expect("a name"),
                    &[],
                    rustls::pki_types::UnixTime::now(),
                )
                .is_err(),
            "a pair of another CA is not trusted"
        );
    }
}

#[cfg(test)]
mod checks {
    use super::*;

    #[test]
    fn names_compare_in_their_one_form() {
        assert_eq!(canonical("0:0::1"), "::1");
        assert_eq!(canonical("Webhooks.Wasmctrl.SVC."), "webhooks.wasmctrl.svc");
    }

    #[test]
    fn a_pair_whose_key_or_ca_is_not_its_own_does_not_verify() {
        let names = vec!["127.0.0.1".to_owned()];
        let authority = new_authority().expect("a CA");
        let good = issue_serving(&authority, &names, SERVING_VALIDITY).expect("a pair");
        assert!(verifies(&good, &names));
        let other = issue_serving(&authority, &names, SERVING_VALIDITY).expect("another");
        let mismatched = Issued {
            key: other.key.clone(),
            ..good.clone()
        };
        assert!(!verifies(&mismatched, &names), "another pair's key");
        let foreign = issue_serving(&new_authority().expect("a CA"), &names, SERVING_VALIDITY)
            .expect("a pair");
        let unsigned = Issued {
            ca_bundle: good.ca_bundle.clone(),
            ..foreign
        };
        assert!(!verifies(&unsigned, &names), "another CA's pair");
    }
}
