//! Fetching a policy's plugin bytes. The plugin module never sees a Kubernetes client, so
//! sources that live in the cluster (ConfigMaps, credential Secrets) are read here and the
//! component is handed over as bytes; the engine verifies the digest before compiling.
//!
//! Sources are guarded: editing a policy must not be a way to read any Secret or file the
//! host can, or to send a credential to any server. A `secretRef` may only name a Secret in
//! the host's credentials namespace, its credentials go only to the hosts the Secret names
//! ([`super::credentials`]) and only over TLS (or to a loopback address, where they never
//! leave the machine), and a `file` source must lie in one of the host's plugin directories
//! ([`PluginDirs`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{Api, Client};

use super::address::{is_loopback, registry_is_loopback};
use super::credentials::{self, Credentials};
use super::oci_reader::{OciReader, PullError, PulledManifest, RegistryAuth};
use super::plugin_dirs::PluginDirs;
use super::trust::TrustRoots;
use crate::policy::{HttpSource, OciSource, PluginSource, SecretRef};
use crate::signing;

/// Largest component the host will read from any source.
pub const MAX_PLUGIN_BYTES: usize = 64 << 20;

/// Time to connect to an HTTP source.
const HTTP_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a whole HTTP download.
const HTTP_TIMEOUT: Duration = Duration::from_secs(60);
/// Attempts per download (HTTP or registry); the delay doubles from the first one.
const HTTP_ATTEMPTS: u32 = 3;
const HTTP_FIRST_RETRY: Duration = Duration::from_millis(500);
/// Longest a whole fetch may take, retries included, so a source that hangs cannot hold a
/// policy (or its restart) for ever.
const FETCH_DEADLINE: Duration = Duration::from_secs(180);

/// What this host lets a source read, set once for the process.
#[derive(Debug, Clone, Default)]
pub struct SourceRules {
    /// The only namespace whose Secrets a `secretRef` may name; `None` refuses every one.
    pub credentials_namespace: Option<String>,
    /// Where `file` sources may be.
    pub plugin_dirs: PluginDirs,
    /// The certificate authorities HTTPS and registry sources are checked against.
    pub trust: TrustRoots,
}

/// Refuse a source this host must never read, before anything is fetched or taken from a
/// cache: not exactly one kind of source, a `secretRef` outside the credentials namespace,
/// credentials that would travel without TLS to another machine, a `file` outside the
/// plugin directories, or a source whose bytes others may replace (http, OCI, a ConfigMap)
/// without a `pinned` digest: whoever may edit a ConfigMap must not be able to swap the
/// plugin (the schema says so too; this holds for a policy applied before it did). A policy
/// naming such a source is refused even when the digest it pins is loaded already, so it
/// cannot work on one replica and fail on another.
///
/// The [`Checked`] source is what [`authorize`] takes, and its answer what [`fetch`] takes,
/// so nothing is read unchecked and nothing is checked twice.
pub fn check<'a>(
    source: &'a PluginSource,
    pinned: bool,
    rules: &SourceRules,
) -> anyhow::Result<Checked<'a>> {
    // A reference by `@sha256:` pins the manifest, and the manifest pins the layer.
    let pinned = pinned || source.oci.as_ref().is_some_and(OciSource::pins_manifest);
    if !pinned {
        let unpinned = [
            (source.config_map.is_some(), "from a ConfigMap"),
            (source.http.is_some(), "fetched over http"),
            (source.oci.is_some(), "from a registry"),
        ];
        if let Some((_, what)) = unpinned.iter().find(|(named, _)| *named) {
            bail!(
                "a plugin {what} needs a pinned digest (spec.plugin.digest{})",
                if source.oci.is_some() {
                    ", or a reference by digest: REGISTRY/REPOSITORY@sha256:…"
                } else {
                    ""
                }
            );
        }
    }
    check_source(source, rules)
}

/// A source [`check`] let through: any `secretRef` in it names the credentials namespace,
/// and a file source is resolved inside the plugin directories.
#[derive(Debug)]
pub struct Checked<'a> {
    source: &'a PluginSource,
    /// The file a `file` source names, resolved: what is read, whatever the path points at
    /// by then.
    file: Option<PathBuf>,
    /// The `secretRef`, and the host its credentials would go to.
    secret: Option<(&'a SecretRef, String)>,
}

fn check_source<'a>(source: &'a PluginSource, rules: &SourceRules) -> anyhow::Result<Checked<'a>> {
    let checked = |file: Option<PathBuf>,
                   secret: Option<(&'a SecretRef, String)>|
     -> anyhow::Result<Checked<'a>> {
        Ok(Checked {
            source,
            file,
            secret,
        })
    };
    match (&source.file, &source.config_map, &source.http, &source.oci) {
        (Some(file), None, None, None) => {
            checked(Some(rules.plugin_dirs.resolve(&file.path)?), None)
        }
        (None, Some(_), None, None) => checked(None, None),
        (None, None, Some(http), None) => {
            let Some(secret) = &http.secret_ref else {
                return checked(None, None);
            };
            let url = reqwest::Url::parse(&http.url)
                .with_context(|| format!("invalid plugin URL {:?}", http.url))?;
            let encrypted = url.scheme() == "https";
            let loopback = url.host().is_some_and(|host| is_loopback(&host));
            check_credentials_transport(&http.url, encrypted || loopback)?;
            check_secret_namespace(&secret.namespace, rules.credentials_namespace.as_deref())?;
            let host = credentials::host_of_url(&url)
                .with_context(|| format!("plugin URL {:?} names no host", http.url))?;
            checked(None, Some((secret, host)))
        }
        (None, None, None, Some(oci)) => {
            let reference: oci_client::Reference = oci
                .reference
                .parse()
                .with_context(|| format!("invalid OCI reference {:?}", oci.reference))?;
            let Some(secret) = &oci.secret_ref else {
                return checked(None, None);
            };
            let loopback = registry_is_loopback(reference.resolve_registry());
            check_credentials_transport(&oci.reference, !oci.insecure || loopback)?;
            check_secret_namespace(&secret.namespace, rules.credentials_namespace.as_deref())?;
            checked(
                None,
                Some((secret, credentials::host_of_registry(&reference))),
            )
        }
        _ => bail!("the plugin source must name exactly one of file, configMap, http or oci"),
    }
}

/// A checked source with the credentials for its host, if it names a Secret.
pub struct Authorized<'a> {
    checked: Checked<'a>,
    credentials: Option<Credentials>,
}

/// Read the credentials a checked source names, refusing them unless the Secret binds them
/// to the source's host. Nothing has been sent to the source yet.
pub async fn authorize<'a>(
    client: &Client,
    checked: Checked<'a>,
) -> Result<Authorized<'a>, credentials::Refused> {
    let credentials = match &checked.secret {
        Some((secret, host)) => Some(credentials::read(client, secret, host).await?),
        None => None,
    };
    Ok(Authorized {
        checked,
        credentials,
    })
}

/// What a fetch read.
pub struct Fetched {
    /// The component.
    pub bytes: Vec<u8>,
    /// From a registry: the digest of the manifest the component was found through, which
    /// is what `oras push` and most registries print, and not the component's own.
    pub manifest_digest: Option<String>,
    /// The signatures found beside the component, when asked for.
    pub signatures: Option<Signatures>,
}

/// The signatures a source keeps beside its component, and where they were looked for.
#[derive(Debug, Clone, Default)]
pub struct Signatures {
    /// Each signature found, not yet trusted.
    pub found: Vec<crate::signing::Found>,
    /// Where the host looked, for messages.
    pub looked: String,
}

/// The signatures of one artifact the host reads: a registry's signature manifest can hold
/// any number, each a download.
const MAX_SIGNATURES: usize = 32;

/// The largest signature (a `.sig` bundle, a signature manifest or payload) the host reads.
const MAX_SIGNATURE_BYTES: usize = 256 << 10;

/// Read the component an authorized source points at; TLS sources must present a
/// certificate `trust` vouches for.
/// With `signatures`, the signatures kept beside it are read too (see
/// [`crate::signing::cosign`] for where).
pub async fn fetch(
    client: &Client,
    authorized: Authorized<'_>,
    trust: &TrustRoots,
    signatures: bool,
) -> anyhow::Result<Fetched> {
    tokio::time::timeout(
        FETCH_DEADLINE,
        fetch_now(client, authorized, trust, signatures),
    )
    .await
    .unwrap_or_else(|_| {
        bail!(
            "fetching the plugin took longer than {}s; giving up",
            FETCH_DEADLINE.as_secs()
        )
    })
}

async fn fetch_now(
    client: &Client,
    authorized: Authorized<'_>,
    trust: &TrustRoots,
    want_signatures: bool,
) -> anyhow::Result<Fetched> {
    let Authorized {
        checked,
        credentials,
    } = authorized;
    let source = checked.source;
    let (bytes, signatures) = match (&checked.file, &source.config_map, &source.http, &source.oci) {
        (Some(file), None, None, None) => {
            let bytes = read_file_capped(file).await?;
            let signatures = if want_signatures {
                let beside = PathBuf::from(signing::cosign::detached(&file.display().to_string()));
                Some(file_signature(&beside).await?)
            } else {
                None
            };
            (bytes, signatures)
        }
        (None, Some(cm), None, None) => {
            let where_ = format!("ConfigMap {}/{} key {}", cm.namespace, cm.name, cm.key);
            let config_map = Api::<ConfigMap>::namespaced(client.clone(), &cm.namespace)
                .get(&cm.name)
                .await
                .with_context(|| format!("reading plugin from {where_}"))?;
            let signatures = want_signatures
                .then(|| config_map_signature(&config_map, &cm.key, &where_))
                .transpose()?;
            let bytes = config_map
                .binary_data
                .and_then(|mut data| data.remove(&cm.key))
                .with_context(|| format!("{where_}: no such binaryData key"))?
                .0;
            check_size(bytes.len(), &where_)?;
            (bytes, signatures)
        }
        (None, None, Some(http), None) => {
            fetch_http(http, credentials, trust, want_signatures).await?
        }
        (None, None, None, Some(oci)) => {
            return fetch_oci(oci, credentials, trust, want_signatures).await;
        }
        _ => bail!("the plugin source must name exactly one of file, configMap, http or oci"),
    };
    Ok(Fetched {
        bytes,
        manifest_digest: None,
        signatures,
    })
}

/// The `.sig` bundle at `path`, if there is one.
async fn file_signature(path: &std::path::Path) -> anyhow::Result<Signatures> {
    use tokio::io::AsyncReadExt as _;
    let looked = path.display().to_string();
    let file = match tokio::fs::File::open(path).await {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Signatures {
                found: Vec::new(),
                looked,
            });
        }
        Err(e) => return Err(e).with_context(|| format!("reading the signature {looked}")),
    };
    let mut bytes = Vec::new();
    file.take(MAX_SIGNATURE_BYTES as u64)
        .read_to_end(&mut bytes)
        .await
        .with_context(|| format!("reading the signature {looked}"))?;
    let found = signing::Found::from_blob_bundle(&bytes, &looked)?;
    Ok(Signatures {
        found: vec![found],
        looked,
    })
}

/// The `.sig` bundle kept under `key.sig` in the plugin's ConfigMap (`data` or
/// `binaryData`), if there is one.
fn config_map_signature(
    config_map: &ConfigMap,
    key: &str,
    where_: &str,
) -> anyhow::Result<Signatures> {
    let name = signing::cosign::detached(key);
    let looked = format!("{where_}.sig");
    let bytes = config_map
        .data
        .as_ref()
        .and_then(|data| data.get(&name))
        .map(|text| text.as_bytes().to_vec())
        .or_else(|| {
            config_map
                .binary_data
                .as_ref()
                .and_then(|data| data.get(&name))
                .map(|bytes| bytes.0.clone())
        });
    let found = bytes
        .map(|bytes| signing::Found::from_blob_bundle(&bytes, &looked))
        .transpose()?;
    Ok(Signatures {
        found: found.into_iter().collect(),
        looked,
    })
}

/// Run `attempt` up to `HTTP_ATTEMPTS` times, doubling the delay after each retryable failure.
async fn with_retries<T, F, Fut>(what: &str, mut attempt: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Failure>>,
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

/// The media type of the component layer in a Wasm OCI artifact (the CNCF TAG-Runtime
/// layout that `oras`, `wkg` and `crane` read).
pub const WASM_LAYER_MEDIA_TYPE: &str = "application/wasm";
/// The media type of a Wasm OCI artifact's config.
pub const WASM_CONFIG_MEDIA_TYPE: &str = "application/vnd.wasm.config.v0+json";
const WASM_LAYER: &str = WASM_LAYER_MEDIA_TYPE;

/// Pull a Wasm artifact: its manifest, then the `application/wasm` layer, checked against
/// the layer digest. A reference by digest pins the manifest, which is checked too; the
/// component digest a policy pins is checked after, by the engine. Every byte the registry
/// sends is read through a cap ([`OciReader`]).
async fn fetch_oci(
    source: &OciSource,
    credentials: Option<Credentials>,
    trust: &TrustRoots,
    want_signatures: bool,
) -> anyhow::Result<Fetched> {
    let reference: oci_client::Reference = source
        .reference
        .parse()
        .with_context(|| format!("invalid OCI reference {:?}", source.reference))?;
    let auth = match credentials {
        Some(Credentials::Bearer(token)) => RegistryAuth::Bearer(token),
        Some(Credentials::Basic(user, password)) => RegistryAuth::Basic(user, password),
        None => RegistryAuth::Anonymous,
    };
    let registry = OciReader::new(http_client(trust)?, source.insecure, auth);
    let what = source.reference.as_str();
    let failure = |error: PullError| {
        if error.is_retryable() {
            Failure::Retryable(anyhow::Error::new(error))
        } else {
            Failure::Final(anyhow::Error::new(error))
        }
    };
    with_retries(what, || async {
        let PulledManifest {
            manifest,
            digest: manifest_digest,
        } = registry.manifest(&reference).await.map_err(failure)?;
        let layer = manifest
            .layers
            .iter()
            .find(|l| l.media_type == WASM_LAYER)
            .ok_or_else(|| {
                Failure::Final(anyhow::anyhow!(
                    "{what} has no {WASM_LAYER} layer; is it a Wasm artifact?"
                ))
            })?;
        let bytes = registry
            .blob(
                &reference,
                layer,
                MAX_PLUGIN_BYTES,
                &format!("the component layer of {what}"),
            )
            .await
            .map_err(failure)?;
        let signatures = if want_signatures {
            Some(
                oci_signatures(&registry, &reference, &manifest_digest)
                    .await
                    .map_err(failure)?,
            )
        } else {
            None
        };
        Ok(Fetched {
            bytes,
            manifest_digest: Some(manifest_digest),
            signatures,
        })
    })
    .await
}

/// The signatures cosign keeps for the artifact `manifest_digest` in `reference`'s
/// repository: the layers of the manifest tagged `sha256-<hex>.sig`. A layer that is not
/// a signature of this artifact, or larger than a signature can be, is left out (and
/// logged).
pub(crate) async fn oci_signatures(
    registry: &OciReader,
    reference: &oci_client::Reference,
    manifest_digest: &str,
) -> Result<Signatures, PullError> {
    let tag = signing::cosign::signature_tag(manifest_digest);
    let signatures = oci_client::Reference::with_tag(
        reference.registry().to_owned(),
        reference.repository().to_owned(),
        tag,
    );
    let looked = signatures.whole();
    let mut found = Vec::new();
    let manifest = match registry.manifest(&signatures).await {
        Ok(pulled) => pulled.manifest,
        Err(PullError::NotFound(_)) => return Ok(Signatures { found, looked }),
        Err(e) => return Err(e),
    };
    if manifest.layers.len() > MAX_SIGNATURES {
        tracing::info!(%looked, layers = manifest.layers.len(), "more signatures than the host reads; the first {MAX_SIGNATURES} are checked");
    }
    for (i, layer) in manifest.layers.iter().enumerate().take(MAX_SIGNATURES) {
        let location = format!("{looked} layer {i}");
        if layer.media_type != signing::cosign::SIMPLE_SIGNING_MEDIA_TYPE {
            continue;
        }
        let payload = match registry
            .blob(&signatures, layer, MAX_SIGNATURE_BYTES, &location)
            .await
        {
            Ok(payload) => payload,
            Err(error @ PullError::TooLarge(_)) => {
                tracing::info!(error = %error, "signature payload too large; left out");
                continue;
            }
            Err(error) => return Err(error),
        };
        let annotations = layer.annotations.clone().unwrap_or_default();
        match signing::Found::from_layer(payload, &annotations, manifest_digest, location) {
            Ok(signature) => found.push(signature),
            Err(error) => {
                tracing::info!(error = %format!("{error:#}"), "not a signature of this artifact; left out")
            }
        }
    }
    Ok(Signatures { found, looked })
}

/// Download over HTTP(S) with timeouts, a size cap, and retries with backoff for failures
/// that may clear (connection errors, timeouts, 5xx, 429).
async fn fetch_http(
    source: &HttpSource,
    credentials: Option<Credentials>,
    trust: &TrustRoots,
    want_signatures: bool,
) -> anyhow::Result<(Vec<u8>, Option<Signatures>)> {
    let http = http_client(trust)?;
    let bytes = with_retries(&source.url, || {
        download(&http, &source.url, credentials.as_ref(), MAX_PLUGIN_BYTES)
    })
    .await?;
    if !want_signatures {
        return Ok((bytes, None));
    }
    let looked = http_signature_url(&source.url)?;
    let found = with_retries(&looked, || async {
        match download(&http, &looked, credentials.as_ref(), MAX_SIGNATURE_BYTES).await {
            Err(Failure::Final(e)) if e.is::<NotFound>() => Ok(None),
            other => other.map(Some),
        }
    })
    .await?
    .map(|bundle| signing::Found::from_blob_bundle(&bundle, &looked))
    .transpose()?;
    Ok((
        bytes,
        Some(Signatures {
            found: found.into_iter().collect(),
            looked,
        }),
    ))
}

/// The client every HTTP and registry source is read with: its timeouts, and `trust`'s roots
/// and no others.
fn http_client(trust: &TrustRoots) -> anyhow::Result<reqwest::Client> {
    crate::ensure_crypto_provider();
    let builder = reqwest::Client::builder()
        .connect_timeout(HTTP_CONNECT_TIMEOUT)
        .timeout(HTTP_TIMEOUT)
        .user_agent(crate::USER_AGENT);
    trust
        .apply_to_http(builder)?
        .build()
        .context("building the HTTP client for plugin sources")
}

/// The URL of the `.sig` bundle beside an HTTP source: `.sig` added to its path, the query
/// kept.
fn http_signature_url(url: &str) -> anyhow::Result<String> {
    let mut parsed = url::Url::parse(url).with_context(|| format!("invalid URL {url}"))?;
    let path = signing::cosign::detached(parsed.path());
    parsed.set_path(&path);
    Ok(parsed.to_string())
}

/// The server has nothing at this URL.
#[derive(Debug, thiserror::Error)]
#[error("fetching {0}: HTTP 404 Not Found")]
struct NotFound(String);

enum Failure {
    Retryable(anyhow::Error),
    Final(anyhow::Error),
}

async fn download(
    http: &reqwest::Client,
    url: &str,
    credentials: Option<&Credentials>,
    limit: usize,
) -> Result<Vec<u8>, Failure> {
    let mut request = http.get(url);
    request = match credentials {
        Some(Credentials::Bearer(token)) => request.bearer_auth(token),
        Some(Credentials::Basic(user, password)) => request.basic_auth(user, Some(password)),
        None => request,
    };
    let response = request.send().await.map_err(|e| {
        Failure::Retryable(anyhow::Error::new(e).context(format!("fetching {url}")))
    })?;
    let status = response.status();
    if status == reqwest::StatusCode::NOT_FOUND {
        return Err(Failure::Final(anyhow::Error::new(NotFound(url.to_owned()))));
    }
    if !status.is_success() {
        let error = anyhow::anyhow!("fetching {url}: HTTP {status}");
        return Err(if status.is_server_error() || status.as_u16() == 429 {
            Failure::Retryable(error)
        } else {
            Failure::Final(error)
        });
    }
    // Checked as it arrives: a server that lies about (or omits) its length cannot make
    // the host buffer more than the limit.
    super::capped::read_capped(response, limit, url)
        .await
        .map_err(|error| match error {
            too_large @ super::capped::CappedError::TooLarge(_) => Failure::Final(too_large.into()),
            too_slow @ super::capped::CappedError::TooSlow { .. } => {
                Failure::Final(too_slow.into())
            }
            transport => Failure::Retryable(transport.into()),
        })
}

/// A `secretRef` may name only the host's credentials namespace: otherwise anyone who may
/// edit a policy could have the host read any Secret in the cluster.
fn check_secret_namespace(namespace: &str, allowed: Option<&str>) -> anyhow::Result<()> {
    match allowed {
        Some(allowed) if allowed == namespace => Ok(()),
        Some(allowed) => bail!(
            "secretRef names namespace {namespace:?}; this host reads plugin credentials only from {allowed:?} (--credentials-namespace)"
        ),
        None => bail!(
            "secretRef names namespace {namespace:?}, but this host has no credentials namespace; start it with --credentials-namespace"
        ),
    }
}

/// Credentials go only over TLS or to this machine.
fn check_credentials_transport(target: &str, safe: bool) -> anyhow::Result<()> {
    if safe {
        return Ok(());
    }
    bail!(
        "refusing to send credentials to {target} without TLS; use https (or a registry without `insecure`), or drop the secretRef"
    )
}

/// Read a plugin file, refusing it as soon as it passes the size limit (a path such as
/// `/dev/zero` must not make the host read without end).
async fn read_file_capped(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt as _;
    let shown = path.display();
    let file = tokio::fs::File::open(path)
        .await
        .with_context(|| format!("reading plugin file {shown}"))?;
    let mut bytes = Vec::new();
    file.take(MAX_PLUGIN_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .await
        .with_context(|| format!("reading plugin file {shown}"))?;
    check_size(bytes.len(), &shown.to_string())?;
    Ok(bytes)
}

fn check_size(len: usize, what: &str) -> anyhow::Result<()> {
    if len > MAX_PLUGIN_BYTES {
        bail!("{what} is more than {MAX_PLUGIN_BYTES} bytes, the plugin size limit");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_read_only_from_the_credentials_namespace() {
        assert!(check_secret_namespace("wasmctrl-system", Some("wasmctrl-system")).is_ok());
        let other = check_secret_namespace("kube-system", Some("wasmctrl-system"))
            .expect_err("another namespace");
        assert!(
            other.to_string().contains("only from \"wasmctrl-system\""),
            "{other}"
        );
        assert!(check_secret_namespace("wasmctrl-system", None).is_err());
    }

    #[test]
    fn credentials_travel_only_over_tls_or_loopback() {
        let host = |url: &str| {
            let url = reqwest::Url::parse(url).expect("valid");
            url.host().is_some_and(|h| is_loopback(&h))
        };
        assert!(host("http://127.0.0.1:8080/p.wasm"));
        assert!(host("http://[::1]/p.wasm"));
        assert!(host("http://localhost/p.wasm"));
        assert!(!host("http://plugins.example.com/p.wasm"));
        assert!(!host("http://10.0.0.1/p.wasm"));
        assert!(check_credentials_transport("http://x", false).is_err());
        assert!(registry_is_loopback("127.0.0.1:5000"));
        assert!(registry_is_loopback("localhost:5000"));
        assert!(registry_is_loopback("[::1]:5000"));
        assert!(!registry_is_loopback("localhost.example.com"));
        assert!(!registry_is_loopback("registry.example.com:443"));
    }

    #[test]
    fn a_source_others_can_replace_needs_a_pinned_digest() {
        let source = |json: serde_json::Value| -> PluginSource {
            serde_json::from_value(json).expect("a source")
        };
        let rules = SourceRules::default();
        let config_map =
            source(serde_json::json!({"configMap": {"namespace": "n", "name": "p", "key": "k"}}));
        let refused = check(&config_map, false, &rules).expect_err("unpinned");
        assert!(
            refused
                .to_string()
                .contains("from a ConfigMap needs a pinned digest"),
            "{refused}"
        );
        assert!(check(&config_map, true, &rules).is_ok());
        let http = source(serde_json::json!({"http": {"url": "https://example.com/p.wasm"}}));
        assert!(check(&http, false, &rules).is_err());
        let oci = source(serde_json::json!({"oci": {"reference": "example.com/p:1"}}));
        assert!(check(&oci, false, &rules).is_err());
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.wasm");
        let file = source(serde_json::json!({"file": {"path": path}}));
        let rules = SourceRules {
            plugin_dirs: PluginDirs::new(vec![dir.path().to_owned()]),
            ..SourceRules::default()
        };
        assert!(check(&file, false, &rules).is_ok(), "the host's own files");
    }

    #[test]
    fn credentials_are_bound_to_the_host_the_source_names() {
        let source = |json: serde_json::Value| -> PluginSource {
            serde_json::from_value(json).expect("a source")
        };
        let rules = SourceRules {
            credentials_namespace: Some("wasmctrl".into()),
            ..SourceRules::default()
        };
        let secret = serde_json::json!({"namespace": "wasmctrl", "name": "registry"});
        let host = |source: &PluginSource| {
            let checked = check(source, true, &rules).expect("checked");
            checked.secret.map(|(_, host)| host)
        };
        let http = source(serde_json::json!({"http": {
            "url": "https://Plugins.Example.com:8443/p.wasm", "secretRef": secret}}));
        assert_eq!(host(&http).as_deref(), Some("plugins.example.com:8443"));
        let oci = source(serde_json::json!({"oci": {
            "reference": "ghcr.io/example/p:1", "secretRef": secret}}));
        assert_eq!(host(&oci).as_deref(), Some("ghcr.io"));
        let anonymous = source(serde_json::json!({"oci": {"reference": "ghcr.io/example/p:1"}}));
        assert_eq!(host(&anonymous), None, "no Secret, nothing to bind");
    }

    #[test]
    fn a_file_source_outside_the_plugin_dirs_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file: PluginSource =
            serde_json::from_value(serde_json::json!({"file": {"path": "/etc/hostname"}}))
                .expect("a source");
        let rules = SourceRules {
            plugin_dirs: PluginDirs::new(vec![dir.path().to_owned()]),
            ..SourceRules::default()
        };
        let refused = check(&file, true, &rules).expect_err("outside");
        assert!(
            refused.to_string().contains("outside the directories"),
            "{refused}"
        );
        let refused = check(&file, true, &SourceRules::default()).expect_err("no dirs");
        assert!(refused.to_string().contains("--plugin-dir"), "{refused}");
    }

    #[tokio::test]
    async fn a_plugin_file_is_cut_off_at_the_size_limit() {
        let error = read_file_capped(std::path::Path::new("/dev/zero"))
            .await
            .expect_err("endless");
        assert!(error.to_string().contains("size limit"), "{error}");
    }

    /// An HTTPS server on loopback whose certificate a private CA issued, answering every
    /// request with `body`; the CA's PEM and the URL.
    async fn private_ca_server(body: &'static [u8]) -> (String, String) {
        crate::ensure_crypto_provider();
        let ca_key = rcgen::KeyPair::generate().expect("CA key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).expect("CA cert");
        let key = rcgen::KeyPair::generate().expect("server key");
        let server = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .expect("server params")
            .signed_by(&key, &ca)
            .expect("server cert");
        let config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(
                vec![server.der().clone()],
                rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).expect("key"),
            )
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // A client that refuses the certificate ends the handshake here.
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut request = [0u8; 4096];
                    let _ = tls.read(&mut request).await;
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = tls.write_all(head.as_bytes()).await;
                    let _ = tls.write_all(body).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        (ca.pem(), format!("https://{address}/plugin.wasm"))
    }

    #[tokio::test]
    async fn an_https_source_behind_a_private_ca_is_trusted_only_with_that_ca_added() {
        let (ca, url) = private_ca_server(b"component bytes").await;
        let source = HttpSource {
            url: url.clone(),
            secret_ref: None,
        };
        let refused = fetch_http(&source, None, &TrustRoots::default(), false)
            .await
            .expect_err("the private CA is not among the compiled-in roots");
        assert!(
            format!("{refused:#}").contains("certificate"),
            "{refused:#}"
        );
        let trust = TrustRoots::with_extra_pem(ca.as_bytes()).expect("the CA");
        let (bytes, _) = fetch_http(&source, None, &trust, false)
            .await
            .expect("trusted");
        assert_eq!(bytes, b"component bytes");
    }
}
