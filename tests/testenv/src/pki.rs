//! Certificates for the local control plane: one CA, a serving certificate for the API server,
//! a `system:masters` client certificate for the admin kubeconfig, and the service-account
//! signing key. Generated fresh for every cluster; nothing here is meant to outlive it.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// File names inside the PKI directory.
pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
pub const SERVING_CERT: &str = "apiserver.crt";
pub const SERVING_KEY: &str = "apiserver.key";
pub const ADMIN_CERT: &str = "admin.crt";
pub const ADMIN_KEY: &str = "admin.key";
pub const SERVICE_ACCOUNT_KEY: &str = "sa.key";
pub const SERVICE_ACCOUNT_PUB: &str = "sa.pub";

/// Write a complete PKI into `dir`.
pub fn generate(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let write = |name: &str, contents: String| {
        std::fs::write(dir.join(name), contents).with_context(|| format!("writing {name}"))
    };

    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "wasmctrl-local-ca");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate()?;
    write(CA_KEY, ca_key.serialize_pem())?;
    let ca = CertifiedIssuer::self_signed(ca_params, ca_key)?;
    write(CA_CERT, ca.pem())?;

    let mut serving = CertificateParams::new(vec![
        "localhost".to_owned(),
        "kubernetes".to_owned(),
        "kubernetes.default".to_owned(),
        "kubernetes.default.svc".to_owned(),
        "kubernetes.default.svc.cluster.local".to_owned(),
    ])?;
    serving
        .subject_alt_names
        .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    serving
        .subject_alt_names
        .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1))));
    serving
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let serving_key = KeyPair::generate()?;
    write(SERVING_CERT, serving.signed_by(&serving_key, &ca)?.pem())?;
    write(SERVING_KEY, serving_key.serialize_pem())?;

    let mut admin = CertificateParams::new(Vec::<String>::new())?;
    admin.distinguished_name.push(DnType::CommonName, "admin");
    admin
        .distinguished_name
        .push(DnType::OrganizationName, "system:masters");
    admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let admin_key = KeyPair::generate()?;
    write(ADMIN_CERT, admin.signed_by(&admin_key, &ca)?.pem())?;
    write(ADMIN_KEY, admin_key.serialize_pem())?;

    let service_account = KeyPair::generate()?;
    write(SERVICE_ACCOUNT_KEY, service_account.serialize_pem())?;
    write(SERVICE_ACCOUNT_PUB, service_account.public_key_pem())?;
    Ok(())
}
