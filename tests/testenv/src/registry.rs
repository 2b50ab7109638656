//! A real OCI registry (CNCF distribution, built from `tools/registry`) on loopback, for
//! tests that push plugins and have the host pull them.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

/// A running registry; stopped when dropped.
pub struct Registry {
    /// `127.0.0.1:<port>`.
    pub address: String,
    /// For a secured registry: the PEM of the private CA that issued its certificate.
    pub ca_pem: Option<String>,
    child: Child,
    _storage: tempfile::TempDir,
}

/// Who may use a secured registry.
pub struct Login<'a> {
    pub username: &'a str,
    pub password: &'a str,
}

impl Registry {
    /// Build the registry if the cache lacks it, and start one with its own storage, over
    /// plain HTTP and open to anyone.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(None)
    }

    /// A registry as a private one is: TLS with a certificate from a CA of its own (not one
    /// any client trusts by default), and only `login` may pull or push.
    pub fn start_secured(login: Login<'_>) -> anyhow::Result<Self> {
        Self::start_with(Some(login))
    }

    fn start_with(login: Option<Login<'_>>) -> anyhow::Result<Self> {
        let binary = build()?;
        let storage = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let address = format!("127.0.0.1:{port}");
        let mut config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {address}\n",
            storage.path().join("data").display()
        );
        let ca_pem = match login {
            None => None,
            Some(login) => {
                let (ca, cert, key) = private_ca_and_serving_certificate()?;
                let dir = storage.path();
                std::fs::write(dir.join("tls.crt"), cert)?;
                std::fs::write(dir.join("tls.key"), key)?;
                let hash = bcrypt::hash(login.password, 5).context("hashing the password")?;
                std::fs::write(dir.join("htpasswd"), format!("{}:{hash}\n", login.username))?;
                config.push_str(&format!(
                    "  tls:\n    certificate: {0}/tls.crt\n    key: {0}/tls.key\nauth:\n  htpasswd:\n    realm: wasmctrl-test\n    path: {0}/htpasswd\n",
                    dir.display()
                ));
                Some(ca)
            }
        };
        let config_path = storage.path().join("config.yml");
        std::fs::write(&config_path, config)?;
        let child = Command::new(&binary)
            .arg("serve")
            .arg(&config_path)
            .env("OTEL_TRACES_EXPORTER", "none")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let registry = Self {
            address,
            ca_pem,
            child,
            _storage: storage,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&registry.address).is_err() {
            if Instant::now() > deadline {
                bail!(
                    "the registry did not listen on {} within 30 s",
                    registry.address
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(registry)
    }
}

/// A CA of the registry's own and a serving certificate it issued for 127.0.0.1: the CA's
/// PEM, the certificate's and its key's.
fn private_ca_and_serving_certificate() -> anyhow::Result<(String, String, String)> {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "wasmctrl-test-registry-ca");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])?
        .signed_by(&key, &ca)?;
    Ok((ca.pem(), cert.pem(), key.serialize_pem()))
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn build() -> anyhow::Result<PathBuf> {
    crate::tools::build("registry")
}
