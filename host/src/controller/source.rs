//! Fetching a policy's plugin bytes. The plugin module never sees a Kubernetes client, so
//! sources that live in the cluster (ConfigMaps, credential Secrets) are read here and the
//! component is handed over as bytes; the engine verifies the digest before compiling.

use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::{Api, Client};

use crate::policy::{HttpSource, OciSource, PluginSource};

/// Largest component the host will read from any source.
pub const MAX_PLUGIN_BYTES: usize = 64 << 20;

/// Time to connect to an HTTP source.
const HTTP_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a whole HTTP download.
const HTTP_TIMEOUT: Duration = Duration::from_secs(60);
/// Attempts per download (HTTP or registry); the delay doubles from the first one.
const HTTP_ATTEMPTS: u32 = 3;
const HTTP_FIRST_RETRY: Duration = Duration::from_millis(500);

/// Read the component `source` points at.
pub async fn fetch(client: &Client, source: &PluginSource) -> anyhow::Result<Vec<u8>> {
    match (&source.file, &source.config_map, &source.http) {
        (Some(file), None, None) => {
            let bytes = tokio::fs::read(&file.path)
                .await
                .with_context(|| format!("reading plugin file {}", file.path))?;
            check_size(bytes.len(), &file.path)?;
            Ok(bytes)
        }
        (None, Some(cm), None) => {
            let where_ = format!("ConfigMap {}/{} key {}", cm.namespace, cm.name, cm.key);
            let config_map = Api::<ConfigMap>::namespaced(client.clone(), &cm.namespace)
                .get(&cm.name)
                .await
                .with_context(|| format!("reading plugin from {where_}"))?;
            let bytes = config_map
                .binary_data
                .and_then(|mut data| data.remove(&cm.key))
                .with_context(|| format!("{where_}: no such binaryData key"))?
                .0;
            check_size(bytes.len(), &where_)?;
            Ok(bytes)
        }
        (None, None, Some(http)) if source.oci.is_none() => fetch_http(client, http).await,
        (None, None, None) if let Some(oci) = &source.oci => fetch_oci(client, oci).await,
        _ => bail!("the plugin source must name exactly one of file, configMap, http or oci"),
    }
}

/// Run `attempt` up to `HTTP_ATTEMPTS` times, doubling the delay after each retryable failure.
async fn with_retries<F, Fut>(what: &str, mut attempt: F) -> anyhow::Result<Vec<u8>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Vec<u8>, Failure>>,
{
    let mut delay = HTTP_FIRST_RETRY;
    let mut tries = 1;
    loop {
        match attempt().await {
            Ok(bytes) => return Ok(bytes),
            Err(Failure::Final(error)) => return Err(error),
            Err(Failure::Retryable(error)) if tries >= HTTP_ATTEMPTS => {
                return Err(error.context(format!("giving up after {tries} attempts")));
            }
            Err(Failure::Retryable(error)) => {
                tracing::info!(source = what, attempt = tries, error = %format!("{error:#}"), retry_in = ?delay, "plugin download failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
                tries += 1;
            }
        }
    }
}

/// The media type of the component layer in a Wasm OCI artifact.
const WASM_LAYER: &str = "application/wasm";

/// Pull a Wasm artifact: its manifest, then the `application/wasm` layer, which the client
/// checks against the layer digest. The component digest the policy pins is checked after,
/// by the engine.
async fn fetch_oci(client: &Client, source: &OciSource) -> anyhow::Result<Vec<u8>> {
    let reference: oci_client::Reference = source
        .reference
        .parse()
        .with_context(|| format!("invalid OCI reference {:?}", source.reference))?;
    let auth = match &source.secret_ref {
        Some(secret) => match credentials(client, &secret.namespace, &secret.name).await? {
            Credentials::Bearer(token) => oci_client::secrets::RegistryAuth::Bearer(token),
            Credentials::Basic(user, password) => {
                oci_client::secrets::RegistryAuth::Basic(user, password)
            }
        },
        None => oci_client::secrets::RegistryAuth::Anonymous,
    };
    ensure_crypto_provider();
    let registry = oci_client::Client::new(oci_client::client::ClientConfig {
        protocol: if source.insecure {
            oci_client::client::ClientProtocol::Http
        } else {
            oci_client::client::ClientProtocol::Https
        },
        connect_timeout: Some(HTTP_CONNECT_TIMEOUT),
        read_timeout: Some(HTTP_TIMEOUT),
        ..Default::default()
    });
    let what = source.reference.as_str();
    with_retries(what, || async {
        let retryable = |e: oci_client::errors::OciDistributionError| {
            Failure::Retryable(anyhow::Error::new(e).context(format!("pulling {what}")))
        };
        let (manifest, _) = registry
            .pull_image_manifest(&reference, &auth)
            .await
            .map_err(retryable)?;
        let layer = manifest
            .layers
            .iter()
            .find(|l| l.media_type == WASM_LAYER)
            .ok_or_else(|| {
                Failure::Final(anyhow::anyhow!(
                    "{what} has no {WASM_LAYER} layer; is it a Wasm artifact?"
                ))
            })?;
        if usize::try_from(layer.size).map_or(true, |size| size > MAX_PLUGIN_BYTES) {
            return Err(Failure::Final(anyhow::anyhow!(
                "{what}: the component layer is {} bytes, above the {MAX_PLUGIN_BYTES}-byte plugin limit",
                layer.size
            )));
        }
        let mut out = LimitedBuffer::default();
        registry
            .pull_blob(&reference, layer, &mut out)
            .await
            .map_err(retryable)?;
        Ok(out.bytes)
    })
    .await
}

/// A buffer that refuses to grow past the plugin size limit, so a registry that sends more
/// than its manifest said cannot make the host buffer it.
#[derive(Default)]
struct LimitedBuffer {
    bytes: Vec<u8>,
}

impl tokio::io::AsyncWrite for LimitedBuffer {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.bytes.len() + buf.len() > MAX_PLUGIN_BYTES {
            return std::task::Poll::Ready(Err(std::io::Error::other(
                "the component is larger than the plugin size limit",
            )));
        }
        self.bytes.extend_from_slice(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// Pick rustls' ring provider for the download clients. Both ring and aws-lc-rs end up in
/// the dependency graph (kube uses ring, the OCI client brings aws-lc-rs), and rustls refuses
/// to guess between them.
fn ensure_crypto_provider() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        // An error means another provider was installed first, which works just as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Download over HTTP(S) with timeouts, a size cap, and retries with backoff for failures
/// that may clear (connection errors, timeouts, 5xx, 429).
async fn fetch_http(client: &Client, source: &HttpSource) -> anyhow::Result<Vec<u8>> {
    let credentials = match &source.secret_ref {
        Some(secret) => Some(credentials(client, &secret.namespace, &secret.name).await?),
        None => None,
    };
    ensure_crypto_provider();
    let http = reqwest::Client::builder()
        .connect_timeout(HTTP_CONNECT_TIMEOUT)
        .timeout(HTTP_TIMEOUT)
        .user_agent(concat!("wasmctrl/", env!("CARGO_PKG_VERSION")))
        .build()
        .context("building the HTTP client")?;
    with_retries(&source.url, || {
        download(&http, source, credentials.as_ref())
    })
    .await
}

enum Failure {
    Retryable(anyhow::Error),
    Final(anyhow::Error),
}

enum Credentials {
    Bearer(String),
    Basic(String, String),
}

async fn download(
    http: &reqwest::Client,
    source: &HttpSource,
    credentials: Option<&Credentials>,
) -> Result<Vec<u8>, Failure> {
    let url = &source.url;
    let mut request = http.get(url);
    request = match credentials {
        Some(Credentials::Bearer(token)) => request.bearer_auth(token),
        Some(Credentials::Basic(user, password)) => request.basic_auth(user, Some(password)),
        None => request,
    };
    let mut response = request.send().await.map_err(|e| {
        Failure::Retryable(anyhow::Error::new(e).context(format!("fetching {url}")))
    })?;
    let status = response.status();
    if !status.is_success() {
        let error = anyhow::anyhow!("fetching {url}: HTTP {status}");
        return Err(if status.is_server_error() || status.as_u16() == 429 {
            Failure::Retryable(error)
        } else {
            Failure::Final(error)
        });
    }
    if let Some(length) = response.content_length()
        && length > MAX_PLUGIN_BYTES as u64
    {
        return Err(Failure::Final(anyhow::anyhow!(
            "{url} is {length} bytes, above the {MAX_PLUGIN_BYTES}-byte plugin limit"
        )));
    }
    let mut bytes = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| Failure::Retryable(anyhow::Error::new(e).context(format!("reading {url}"))))?
    {
        bytes.extend_from_slice(&chunk);
        // Checked as it arrives: a server that lies about (or omits) its length cannot make
        // the host buffer more than the limit.
        check_size(bytes.len(), url).map_err(Failure::Final)?;
    }
    Ok(bytes)
}

/// Read `token`, or `username` and `password`, from a Secret.
async fn credentials(client: &Client, namespace: &str, name: &str) -> anyhow::Result<Credentials> {
    let secret = Api::<Secret>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("reading credentials Secret {namespace}/{name}"))?;
    let data = secret.data.unwrap_or_default();
    let text = |key: &str| {
        data.get(key)
            .map(|v| String::from_utf8_lossy(&v.0).trim().to_owned())
    };
    match (text("token"), text("username"), text("password")) {
        (Some(token), _, _) => Ok(Credentials::Bearer(token)),
        (None, Some(user), Some(password)) => Ok(Credentials::Basic(user, password)),
        _ => bail!("Secret {namespace}/{name} has neither `token` nor `username` and `password`"),
    }
}

fn check_size(len: usize, what: &str) -> anyhow::Result<()> {
    if len > MAX_PLUGIN_BYTES {
        bail!("{what} is more than {MAX_PLUGIN_BYTES} bytes, the plugin size limit");
    }
    Ok(())
}
