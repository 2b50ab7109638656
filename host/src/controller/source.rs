//! Fetching a policy's plugin bytes. The plugin module never sees a Kubernetes client, so
//! sources that live in the cluster (ConfigMaps, credential Secrets) are read here and the
//! component is handed over as bytes; the engine verifies the digest before compiling.

use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::{Api, Client};

use crate::policy::{HttpSource, PluginSource};

/// Largest component the host will read from any source.
pub const MAX_PLUGIN_BYTES: usize = 64 << 20;

/// Time to connect to an HTTP source.
const HTTP_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a whole HTTP download.
const HTTP_TIMEOUT: Duration = Duration::from_secs(60);
/// Attempts per HTTP fetch; the delay doubles from the first one.
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
        (None, None, Some(http)) => fetch_http(client, http).await,
        _ => bail!("the plugin source must name exactly one of file, configMap or http"),
    }
}

/// Download over HTTP(S) with timeouts, a size cap, and retries with backoff for failures
/// that may clear (connection errors, timeouts, 5xx, 429).
async fn fetch_http(client: &Client, source: &HttpSource) -> anyhow::Result<Vec<u8>> {
    let credentials = match &source.secret_ref {
        Some(secret) => Some(credentials(client, &secret.namespace, &secret.name).await?),
        None => None,
    };
    let http = reqwest::Client::builder()
        .connect_timeout(HTTP_CONNECT_TIMEOUT)
        .timeout(HTTP_TIMEOUT)
        .user_agent(concat!("wasmctrl/", env!("CARGO_PKG_VERSION")))
        .build()
        .context("building the HTTP client")?;
    let mut delay = HTTP_FIRST_RETRY;
    let mut attempt = 1;
    loop {
        match download(&http, source, credentials.as_ref()).await {
            Ok(bytes) => return Ok(bytes),
            Err(Failure::Final(error)) => return Err(error),
            Err(Failure::Retryable(error)) if attempt >= HTTP_ATTEMPTS => {
                return Err(error.context(format!("giving up after {attempt} attempts")));
            }
            Err(Failure::Retryable(error)) => {
                tracing::info!(url = %source.url, attempt, error = %format!("{error:#}"), retry_in = ?delay, "plugin download failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
                attempt += 1;
            }
        }
    }
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
