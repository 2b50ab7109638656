//! The listener's TLS: the certificate and key from files (a Secret the chart mounts, e.g.
//! one cert-manager issues and renews; re-read when they change) or, without files, a
//! self-signed certificate made at start, as controller-runtime's secure metrics serving
//! does. Scrapers and `wasmctrl explain` reach the host through the API server or with
//! `insecureSkipVerify`, so a self-signed certificate costs them nothing; what it buys is
//! that a bearer token never crosses the network in clear text.
//!
//! Handshakes run beside the accept loop, each with a deadline, at most [`MAX_HANDSHAKES`] at
//! once and [`MAX_HANDSHAKES_PER_PEER`] per client address; a connection past either bound is
//! closed at once instead of waiting, so clients that stall in their handshakes hold up
//! neither the loop nor the kubelet's probes from its own address.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;

/// How long a client may take over its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes in flight at once; a connection past it is closed.
const MAX_HANDSHAKES: usize = 256;
/// Handshakes in flight from one client address; a connection past it is closed.
const MAX_HANDSHAKES_PER_PEER: usize = 8;
/// How often the certificate files are looked at for a change.
const RELOAD_INTERVAL: Duration = Duration::from_secs(30);

/// A certificate and its private key, PEM files.
#[derive(Debug, Clone)]
pub struct CertificateFiles {
    /// The certificate chain, leaf first (`tls.crt`).
    pub certificate: PathBuf,
    /// The private key (`tls.key`).
    pub key: PathBuf,
}

/// The server side of the listener's TLS: `files` when given, else a self-signed certificate
/// for `names` (DNS names or IP addresses).
pub fn server_config(
    files: Option<CertificateFiles>,
    names: &[String],
) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    crate::ensure_crypto_provider();
    let resolver: Arc<dyn ResolvesServerCert> = match files {
        Some(files) => Arc::new(FromFiles::load(files)?),
        None => Arc::new(Fixed(Arc::new(self_signed(names)?))),
    };
    Ok(with_resolver(resolver))
}

/// The server side of a listener whose certificate `resolver` picks.
pub(crate) fn with_resolver(resolver: Arc<dyn ResolvesServerCert>) -> Arc<rustls::ServerConfig> {
    crate::ensure_crypto_provider();
    let mut config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// A certificate chain and its key, both PEM, ready to serve.
pub(crate) fn certified_pem(chain: &[u8], key: &[u8]) -> anyhow::Result<CertifiedKey> {
    let chain = CertificateDer::pem_slice_iter(chain)
        .collect::<Result<Vec<_>, _>>()
        .context("reading the certificate chain")?;
    anyhow::ensure!(!chain.is_empty(), "the certificate chain is empty");
    let key = PrivateKeyDer::from_pem_slice(key).context("reading the private key")?;
    certified(chain, &key)
}

/// A self-signed certificate for `names`, valid from now for a year (a pod lives far less).
fn self_signed(names: &[String]) -> anyhow::Result<CertifiedKey> {
    let mut names = names.to_vec();
    if names.is_empty() {
        names.push("localhost".to_owned());
    }
    let generated = rcgen::generate_simple_self_signed(names)
        .context("making the listener's self-signed certificate")?;
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
        generated.signing_key.serialize_der(),
    ));
    certified(vec![generated.cert.der().clone()], &key)
}

fn certified(
    chain: Vec<CertificateDer<'static>>,
    key: &PrivateKeyDer<'_>,
) -> anyhow::Result<CertifiedKey> {
    let signing = rustls::crypto::ring::sign::any_supported_type(key)
        .context("the private key is not of a supported type (RSA, ECDSA or Ed25519)")?;
    Ok(CertifiedKey::new(chain, signing))
}

/// One certificate, for every client.
#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// The certificate in `files`, read again when they change (a renewed Secret), at most every
/// [`RELOAD_INTERVAL`]. A change that does not load keeps the last good certificate.
#[derive(Debug)]
struct FromFiles {
    files: CertificateFiles,
    current: ArcSwap<CertifiedKey>,
    /// When the files were last looked at, and their modification times then.
    seen: Mutex<(Instant, Option<SystemTime>)>,
}

impl FromFiles {
    fn load(files: CertificateFiles) -> anyhow::Result<Self> {
        let key = read_pair(&files)?;
        let modified = modified(&files);
        Ok(Self {
            files,
            current: ArcSwap::from_pointee(key),
            seen: Mutex::new((Instant::now(), modified)),
        })
    }

    fn reload_if_changed(&self) {
        let mut seen = crate::lock(&self.seen);
        if seen.0.elapsed() < RELOAD_INTERVAL {
            return;
        }
        let modified = modified(&self.files);
        *seen = (Instant::now(), seen.1);
        if modified == seen.1 {
            return;
        }
        match read_pair(&self.files) {
            Ok(key) => {
                self.current.store(Arc::new(key));
                seen.1 = modified;
                tracing::info!(certificate = %self.files.certificate.display(), "the listener's certificate changed; serving the new one");
            }
            Err(error) => tracing::warn!(
                error = format!("{error:#}"),
                "the listener's certificate files changed but do not load; keeping the last good one"
            ),
        }
    }
}

impl ResolvesServerCert for FromFiles {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.reload_if_changed();
        Some(self.current.load_full())
    }
}

/// The later of the two files' modification times (a Secret update swaps both).
fn modified(files: &CertificateFiles) -> Option<SystemTime> {
    let time = |path: &Path| std::fs::metadata(path).and_then(|m| m.modified()).ok();
    time(&files.certificate).max(time(&files.key))
}

fn read_pair(files: &CertificateFiles) -> anyhow::Result<CertifiedKey> {
    let chain = CertificateDer::pem_file_iter(&files.certificate)
        .and_then(|certificates| certificates.collect::<Result<Vec<_>, _>>())
        .with_context(|| {
            format!(
                "reading the certificate {} (--tls-cert-file)",
                files.certificate.display()
            )
        })?;
    anyhow::ensure!(
        !chain.is_empty(),
        "{} holds no certificate (--tls-cert-file)",
        files.certificate.display()
    );
    let key = PrivateKeyDer::from_pem_file(&files.key).with_context(|| {
        format!(
            "reading the private key {} (--tls-key-file)",
            files.key.display()
        )
    })?;
    certified(chain, &key).with_context(|| format!("loading {}", files.key.display()))
}

/// A listener that hands axum connections whose TLS handshake has completed.
pub struct TlsListener {
    local: SocketAddr,
    accepted: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    accepting: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    /// Accept on `tcp`, shaking hands with `config`.
    pub fn new(tcp: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let (send, accepted) = mpsc::channel(MAX_HANDSHAKES);
        let handshakes = Arc::new(Mutex::new(Handshakes::default()));
        let accepting = tokio::spawn(async move {
            loop {
                let (stream, peer) = match tcp.accept().await {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors and the like: wait, as axum's own loop does.
                        tracing::debug!(%error, "accepting a connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Some(slot) = Handshakes::admit(&handshakes, peer.ip()) else {
                    tracing::debug!(%peer, "too many TLS handshakes in flight; connection closed");
                    continue;
                };
                let acceptor = acceptor.clone();
                let send = send.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = send.send((tls, peer)).await;
                        }
                        Ok(Err(error)) => {
                            tracing::debug!(%peer, %error, "a TLS handshake failed");
                        }
                        Err(_) => tracing::debug!(%peer, "a TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self {
            local,
            accepted,
            accepting,
        })
    }
}

/// The handshakes in flight, in all and per client address.
#[derive(Default)]
struct Handshakes {
    total: usize,
    per_peer: std::collections::HashMap<std::net::IpAddr, usize>,
}

impl Handshakes {
    /// A slot for a handshake from `peer`, or `None` past a bound.
    fn admit(this: &Arc<Mutex<Self>>, peer: std::net::IpAddr) -> Option<HandshakeSlot> {
        let mut handshakes = crate::lock(this);
        let from_peer = handshakes.per_peer.get(&peer).copied().unwrap_or(0);
        if handshakes.total >= MAX_HANDSHAKES || from_peer >= MAX_HANDSHAKES_PER_PEER {
            return None;
        }
        handshakes.total += 1;
        handshakes.per_peer.insert(peer, from_peer + 1);
        Some(HandshakeSlot {
            handshakes: this.clone(),
            peer,
        })
    }
}

/// One handshake's place in [`Handshakes`], given back when dropped.
struct HandshakeSlot {
    handshakes: Arc<Mutex<Handshakes>>,
    peer: std::net::IpAddr,
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut handshakes = crate::lock(&self.handshakes);
        handshakes.total = handshakes.total.saturating_sub(1);
        if let Some(count) = handshakes.per_peer.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                handshakes.per_peer.remove(&self.peer);
            }
        }
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(connection) => connection,
            // The accept loop ended (its task was aborted): nothing will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_client_cannot_take_every_handshake_slot() {
        let handshakes = Arc::new(Mutex::new(Handshakes::default()));
        let attacker: std::net::IpAddr = [10, 0, 0, 9].into();
        let kubelet: std::net::IpAddr = [10, 0, 0, 1].into();
        let held: Vec<_> = std::iter::from_fn(|| Handshakes::admit(&handshakes, attacker))
            .take(MAX_HANDSHAKES)
            .collect();
        assert_eq!(held.len(), MAX_HANDSHAKES_PER_PEER);
        assert!(Handshakes::admit(&handshakes, kubelet).is_some());
        drop(held);
        let handshakes = handshakes.lock().expect("lock");
        assert_eq!(handshakes.total, 0);
        assert!(handshakes.per_peer.is_empty());
    }

    #[test]
    fn a_certificate_pair_from_files_loads_and_a_broken_one_is_named() {
        let dir = tempfile::tempdir().expect("dir");
        let generated =
            rcgen::generate_simple_self_signed(vec!["wasmctrl".to_owned()]).expect("cert");
        let files = CertificateFiles {
            certificate: dir.path().join("tls.crt"),
            key: dir.path().join("tls.key"),
        };
        std::fs::write(&files.certificate, generated.cert.pem()).expect("write");
        std::fs::write(&files.key, generated.signing_key.serialize_pem()).expect("write");
        server_config(Some(files.clone()), &[]).expect("loads");

        std::fs::write(&files.key, "not a key").expect("write");
        let error = server_config(Some(files), &[]).expect_err("refused");
        assert!(format!("{error:#}").contains("tls.key"), "{error:#}");
    }
}
