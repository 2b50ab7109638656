//! Reading Wasm artifacts and their signatures from an OCI registry, every byte bounded.
//!
//! The registry is a server a team names, so nothing it sends is trusted to end: manifests
//! and index documents are read up to [`MAX_MANIFEST_BYTES`], token responses up to
//! [`MAX_TOKEN_BYTES`], error bodies up to [`MAX_ERROR_BYTES`], and a blob up to the smaller
//! of the caller's limit and the size its descriptor claims (a layer that sends more than
//! its descriptor said is cut off there). The OCI client crate reads each of these whole,
//! which is why this reader speaks the distribution protocol itself: a manifest, a blob, and
//! the token handshake in front of both.
//!
//! Authentication follows the registry's challenge: the first request goes without (or with
//! a static bearer token), and a `401` naming a token service is answered by fetching a pull
//! token for the repository from it, or, for a `Basic` challenge, by sending the user and
//! password. Credentials reach a token service only over TLS or on this machine.

use oci_client::Reference;
use oci_client::manifest::{
    IMAGE_MANIFEST_LIST_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_INDEX_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE, OciDescriptor, OciImageManifest,
};
use reqwest::StatusCode;
use reqwest::header::{ACCEPT, CONTENT_TYPE, WWW_AUTHENTICATE};
use sha2::Digest as _;
use tokio::sync::Mutex;

use super::capped::{self, CappedError};

/// The largest manifest or index the host reads (what registries commonly accept).
pub const MAX_MANIFEST_BYTES: usize = 4 << 20;
/// The largest token response the host reads; real ones are a few kilobytes.
pub const MAX_TOKEN_BYTES: usize = 64 << 10;
/// How much of an error body the host keeps for its message.
const MAX_ERROR_BYTES: usize = 8 << 10;

/// What the reader presents to the registry.
#[derive(Clone)]
pub enum RegistryAuth {
    /// Nothing; a token service may still hand out an anonymous pull token.
    Anonymous,
    /// A user and password, for a token service or a `Basic` challenge.
    Basic(String, String),
    /// A token sent as it is, with every request.
    Bearer(String),
}

impl std::fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Anonymous => "Anonymous",
            Self::Basic(..) => "Basic(..)",
            Self::Bearer(_) => "Bearer(..)",
        })
    }
}

/// Why a read from a registry failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The registry has no such manifest or blob.
    #[error("{0}: not found")]
    NotFound(String),
    /// What the registry sent passed its cap.
    #[error(transparent)]
    TooLarge(#[from] capped::TooLarge),
    /// The bytes do not hash to the digest that names them.
    #[error("{what} hashes to {actual}, not to the {expected} that names it")]
    DigestMismatch {
        what: String,
        expected: String,
        actual: String,
    },
    /// The registry answered with an error status.
    #[error("{what}: HTTP {status}{}", if message.is_empty() { String::new() } else { format!(": {message}") })]
    Status {
        what: String,
        status: StatusCode,
        message: String,
    },
    /// What the registry sent came too slowly.
    #[error("{0}")]
    TooSlow(String),
    /// The connection failed.
    #[error("{what}")]
    Transport {
        what: String,
        #[source]
        source: reqwest::Error,
    },
    /// What the registry sent is not what the protocol says it sends.
    #[error("{0}")]
    Invalid(String),
}

impl PullError {
    /// Whether trying again may help: connection failures, a registry's 5xx or 429.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Transport { .. } => true,
            Self::Status { status, .. } => {
                status.is_server_error() || *status == StatusCode::TOO_MANY_REQUESTS
            }
            Self::NotFound(_)
            | Self::TooLarge(_)
            | Self::TooSlow(_)
            | Self::DigestMismatch { .. }
            | Self::Invalid(_) => false,
        }
    }
}

impl From<CappedError> for PullError {
    fn from(error: CappedError) -> Self {
        match error {
            CappedError::TooLarge(too_large) => Self::TooLarge(too_large),
            slow @ CappedError::TooSlow { .. } => Self::TooSlow(slow.to_string()),
            CappedError::Transport { what, source } => Self::Transport { what, source },
        }
    }
}

/// A manifest read from a registry, with the digest of its bytes.
#[derive(Debug, Clone)]
pub struct PulledManifest {
    pub manifest: OciImageManifest,
    /// `sha256:…` of the manifest's bytes (of the image manifest an index led to).
    pub digest: String,
}

/// A reader of one registry, for one set of credentials. It keeps the pull token it was
/// given for a repository, so reading the manifest, the layer and the signatures asks the
/// token service once.
pub struct OciReader {
    http: reqwest::Client,
    scheme: &'static str,
    auth: RegistryAuth,
    /// The token for `repository`, once a challenge asked for one.
    token: Mutex<Option<(String, String)>>,
}

/// The challenge of a `401`: where to get a token, or that a password is wanted.
#[derive(Debug, PartialEq, Eq)]
enum Challenge {
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
    Basic,
}

impl OciReader {
    /// A reader over `http` (its trust roots and timeouts are the caller's), speaking plain
    /// HTTP when `plain_http`.
    pub fn new(http: reqwest::Client, plain_http: bool, auth: RegistryAuth) -> Self {
        Self {
            http,
            scheme: if plain_http { "http" } else { "https" },
            auth,
            token: Mutex::new(None),
        }
    }

    /// The image manifest `reference` names, read through [`MAX_MANIFEST_BYTES`] and checked
    /// against the reference's digest when it has one. An index leads to its one Wasm
    /// entry (an entry whose platform is `wasm`/`wasi*`, or its only entry).
    pub async fn manifest(&self, reference: &Reference) -> Result<PulledManifest, PullError> {
        let what = format!("the manifest of {}", reference.whole());
        let target = reference
            .digest()
            .or(reference.tag())
            .unwrap_or("latest")
            .to_owned();
        let (media_type, bytes, digest) = self
            .manifest_bytes(reference, &target, reference.digest(), &what)
            .await?;
        if !is_index(&media_type, &bytes) {
            return Ok(PulledManifest {
                manifest: parse_manifest(&bytes, &what)?,
                digest,
            });
        }
        let entry = wasm_entry(&bytes, &what)?;
        let what = format!("{what} (index entry {entry})");
        let (media_type, bytes, digest) = self
            .manifest_bytes(reference, &entry, Some(&entry), &what)
            .await?;
        if is_index(&media_type, &bytes) {
            return Err(PullError::Invalid(format!(
                "{what} is another index; the host follows one level"
            )));
        }
        Ok(PulledManifest {
            manifest: parse_manifest(&bytes, &what)?,
            digest,
        })
    }

    /// The blob `descriptor` names in `reference`'s repository: at most `limit` bytes and
    /// never more than the descriptor claims, checked against its digest.
    pub async fn blob(
        &self,
        reference: &Reference,
        descriptor: &OciDescriptor,
        limit: usize,
        what: &str,
    ) -> Result<Vec<u8>, PullError> {
        let claimed = usize::try_from(descriptor.size).map_err(|_| {
            PullError::Invalid(format!("{what}: a negative size in its descriptor"))
        })?;
        if claimed > limit {
            return Err(capped::TooLarge {
                what: what.to_owned(),
                limit,
            }
            .into());
        }
        let url = format!(
            "{}/blobs/{}",
            self.repository_url(reference),
            descriptor.digest
        );
        let response = self.get(reference, &url, None, what).await?;
        let bytes =
            capped::read_capped(response, claimed, what)
                .await
                .map_err(|error| match error {
                    // Past what the descriptor claims: name the claim, not only the cap.
                    CappedError::TooLarge(_) => PullError::Invalid(format!(
                        "{what} sent more than the {claimed} bytes its descriptor claims"
                    )),
                    other => other.into(),
                })?;
        if bytes.len() != claimed {
            return Err(PullError::Invalid(format!(
                "{what} is {} bytes, not the {claimed} its descriptor claims",
                bytes.len()
            )));
        }
        check_digest(&bytes, &descriptor.digest, what)?;
        Ok(bytes)
    }

    /// The bytes of the manifest `target` (a tag or digest), its media type, and its digest;
    /// checked against `pinned` when given.
    async fn manifest_bytes(
        &self,
        reference: &Reference,
        target: &str,
        pinned: Option<&str>,
        what: &str,
    ) -> Result<(String, Vec<u8>, String), PullError> {
        let url = format!("{}/manifests/{target}", self.repository_url(reference));
        let accept = [
            OCI_IMAGE_MEDIA_TYPE,
            OCI_IMAGE_INDEX_MEDIA_TYPE,
            IMAGE_MANIFEST_MEDIA_TYPE,
            IMAGE_MANIFEST_LIST_MEDIA_TYPE,
        ]
        .join(", ");
        let response = self.get(reference, &url, Some(&accept), what).await?;
        let media_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or_default().trim().to_owned())
            .unwrap_or_default();
        let bytes = capped::read_capped(response, MAX_MANIFEST_BYTES, what).await?;
        let digest = sha256_digest(&bytes);
        if let Some(pinned) = pinned
            && pinned != digest
        {
            return Err(PullError::DigestMismatch {
                what: what.to_owned(),
                expected: pinned.to_owned(),
                actual: digest,
            });
        }
        Ok((media_type, bytes, digest))
    }

    fn repository_url(&self, reference: &Reference) -> String {
        format!(
            "{}://{}/v2/{}",
            self.scheme,
            reference.resolve_registry(),
            reference.repository()
        )
    }

    /// GET `url`, answering the registry's challenge once; a success, or why not.
    async fn get(
        &self,
        reference: &Reference,
        url: &str,
        accept: Option<&str>,
        what: &str,
    ) -> Result<reqwest::Response, PullError> {
        let send = |authorization: Option<Authorization>| {
            let mut request = self.http.get(url);
            if let Some(accept) = accept {
                request = request.header(ACCEPT, accept);
            }
            request = match authorization {
                Some(Authorization::Bearer(token)) => request.bearer_auth(token),
                Some(Authorization::Basic(user, password)) => {
                    request.basic_auth(user, Some(password))
                }
                None => request,
            };
            request.send()
        };
        let transport = |source| PullError::Transport {
            what: what.to_owned(),
            source,
        };
        let repository = reference.repository();
        let mut response = send(self.authorization(repository).await)
            .await
            .map_err(transport)?;
        if response.status() == StatusCode::UNAUTHORIZED
            && !matches!(self.auth, RegistryAuth::Bearer(_))
            && let Some(challenge) = challenge(&response)
        {
            let authorization = match challenge {
                Challenge::Bearer {
                    realm,
                    service,
                    scope,
                } => {
                    let scope = scope.unwrap_or_else(|| format!("repository:{repository}:pull"));
                    let token = self
                        .token_for(&realm, service.as_deref(), &scope, what)
                        .await?;
                    *self.token.lock().await = Some((repository.to_owned(), token.clone()));
                    Authorization::Bearer(token)
                }
                Challenge::Basic => match &self.auth {
                    RegistryAuth::Basic(user, password) => {
                        Authorization::Basic(user.clone(), password.clone())
                    }
                    _ => return Err(status_error(response, what).await),
                },
            };
            response = send(Some(authorization)).await.map_err(transport)?;
        }
        if response.status().is_success() {
            return Ok(response);
        }
        if response.status() == StatusCode::NOT_FOUND {
            return Err(PullError::NotFound(what.to_owned()));
        }
        Err(status_error(response, what).await)
    }

    /// What to send before the registry asked for anything: a static token, or the pull
    /// token a challenge got for this repository.
    async fn authorization(&self, repository: &str) -> Option<Authorization> {
        if let RegistryAuth::Bearer(token) = &self.auth {
            return Some(Authorization::Bearer(token.clone()));
        }
        match &*self.token.lock().await {
            Some((for_repository, token)) if for_repository == repository => {
                Some(Authorization::Bearer(token.clone()))
            }
            _ => None,
        }
    }

    /// A pull token from the token service `realm`, its response read through
    /// [`MAX_TOKEN_BYTES`].
    async fn token_for(
        &self,
        realm: &str,
        service: Option<&str>,
        scope: &str,
        what: &str,
    ) -> Result<String, PullError> {
        let asking = format!("a token for {what} from {realm}");
        let realm_url = url::Url::parse(realm)
            .map_err(|e| PullError::Invalid(format!("{asking}: the realm is no URL: {e}")))?;
        let mut request = self.http.get(realm_url.clone());
        let mut query = vec![("scope", scope)];
        if let Some(service) = service {
            query.push(("service", service));
        }
        request = request.query(&query);
        if let RegistryAuth::Basic(user, password) = &self.auth {
            let safe = realm_url.scheme() == "https"
                || realm_url
                    .host()
                    .is_some_and(|host| super::address::is_loopback(&host));
            if !safe {
                return Err(PullError::Invalid(format!(
                    "{asking}: refusing to send credentials to a token service without TLS"
                )));
            }
            request = request.basic_auth(user, Some(password));
        }
        let response = request
            .send()
            .await
            .map_err(|source| PullError::Transport {
                what: asking.clone(),
                source,
            })?;
        if !response.status().is_success() {
            return Err(status_error(response, &asking).await);
        }
        let body = capped::read_capped(response, MAX_TOKEN_BYTES, &asking).await?;
        #[derive(serde::Deserialize)]
        struct TokenResponse {
            token: Option<String>,
            access_token: Option<String>,
        }
        let answer: TokenResponse = serde_json::from_slice(&body)
            .map_err(|e| PullError::Invalid(format!("{asking}: not a token response: {e}")))?;
        answer
            .token
            .or(answer.access_token)
            .filter(|token| !token.is_empty())
            .ok_or_else(|| PullError::Invalid(format!("{asking}: the response holds no token")))
    }
}

enum Authorization {
    Bearer(String),
    Basic(String, String),
}

/// The error for a response that did not succeed, with the start of its body.
async fn status_error(response: reqwest::Response, what: &str) -> PullError {
    let status = response.status();
    PullError::Status {
        what: what.to_owned(),
        status,
        message: capped::error_text(response, MAX_ERROR_BYTES).await,
    }
}

/// The challenge a `401` carries, if it is one the reader answers.
fn challenge(response: &reqwest::Response) -> Option<Challenge> {
    response
        .headers()
        .get_all(WWW_AUTHENTICATE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .find_map(parse_challenge)
}

/// `Bearer realm="…",service="…",scope="…"` or `Basic realm="…"`.
fn parse_challenge(header: &str) -> Option<Challenge> {
    let (scheme, params) = header.trim().split_once(' ').unwrap_or((header.trim(), ""));
    if scheme.eq_ignore_ascii_case("basic") {
        return Some(Challenge::Basic);
    }
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let mut realm = None;
    let mut service = None;
    let mut scope = None;
    let mut rest = params.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let key = key.trim().to_ascii_lowercase();
        let after = after.trim_start();
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            let end = quoted.find('"')?;
            (&quoted[..end], &quoted[end + 1..])
        } else {
            after.split_once(',').map_or((after, ""), |(v, n)| (v, n))
        };
        match key.as_str() {
            "realm" => realm = Some(value.to_owned()),
            "service" => service = Some(value.to_owned()),
            "scope" => scope = Some(value.to_owned()),
            _ => {}
        }
        rest = next.trim_start().trim_start_matches(',').trim_start();
    }
    Some(Challenge::Bearer {
        realm: realm?,
        service,
        scope,
    })
}

fn is_index(media_type: &str, bytes: &[u8]) -> bool {
    let index = |t: &str| t == OCI_IMAGE_INDEX_MEDIA_TYPE || t == IMAGE_MANIFEST_LIST_MEDIA_TYPE;
    if index(media_type) {
        return true;
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Typed {
        media_type: Option<String>,
        manifests: Option<serde::de::IgnoredAny>,
    }
    serde_json::from_slice::<Typed>(bytes).is_ok_and(|typed| {
        typed.media_type.as_deref().is_some_and(index) || typed.manifests.is_some()
    })
}

fn parse_manifest(bytes: &[u8], what: &str) -> Result<OciImageManifest, PullError> {
    serde_json::from_slice(bytes)
        .map_err(|e| PullError::Invalid(format!("{what} is not an image manifest: {e}")))
}

/// The digest of the Wasm entry of an index: one whose platform says Wasm, or its only one.
fn wasm_entry(bytes: &[u8], what: &str) -> Result<String, PullError> {
    #[derive(serde::Deserialize)]
    struct Index {
        manifests: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        digest: String,
        platform: Option<Platform>,
    }
    #[derive(serde::Deserialize)]
    struct Platform {
        #[serde(default)]
        architecture: String,
        #[serde(default)]
        os: String,
    }
    let index: Index = serde_json::from_slice(bytes)
        .map_err(|e| PullError::Invalid(format!("{what} is not an image index: {e}")))?;
    let wasm = |entry: &&Entry| {
        entry
            .platform
            .as_ref()
            .is_some_and(|p| p.architecture == "wasm" || p.os.starts_with("wasi"))
    };
    let chosen = match index.manifests.as_slice() {
        [only] => Some(only),
        entries => entries.iter().find(wasm),
    };
    chosen
        .map(|entry| entry.digest.clone())
        .ok_or_else(|| {
            PullError::Invalid(format!(
                "{what} is an image index with {} entries and none for Wasm (platform architecture wasm or os wasi*)",
                index.manifests.len()
            ))
        })
}

fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

fn check_digest(bytes: &[u8], expected: &str, what: &str) -> Result<(), PullError> {
    let Some(hex) = expected.strip_prefix("sha256:") else {
        return Err(PullError::Invalid(format!(
            "{what}: the host checks sha256 digests only, not {expected}"
        )));
    };
    let actual = hex::encode(sha2::Sha256::digest(bytes));
    if actual != hex {
        return Err(PullError::DigestMismatch {
            what: what.to_owned(),
            expected: expected.to_owned(),
            actual: format!("sha256:{actual}"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_are_read_as_registries_send_them() {
        assert_eq!(
            parse_challenge(
                r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/p:pull""#
            ),
            Some(Challenge::Bearer {
                realm: "https://auth.docker.io/token".to_owned(),
                service: Some("registry.docker.io".to_owned()),
                scope: Some("repository:library/p:pull".to_owned()),
            })
        );
        assert_eq!(
            parse_challenge(r#"bearer realm="http://127.0.0.1:5000/token""#),
            Some(Challenge::Bearer {
                realm: "http://127.0.0.1:5000/token".to_owned(),
                service: None,
                scope: None,
            })
        );
        assert_eq!(
            parse_challenge(r#"Basic realm="Registry Realm""#),
            Some(Challenge::Basic)
        );
        assert_eq!(parse_challenge(r#"Bearer service="no-realm""#), None);
        assert_eq!(parse_challenge("Negotiate"), None);
    }

    #[test]
    fn an_index_leads_to_its_wasm_entry_or_its_only_one() {
        let index = |entries: &str| format!(r#"{{"schemaVersion":2,"manifests":[{entries}]}}"#);
        let entry = |digest: &str, arch: &str, os: &str| {
            format!(
                r#"{{"mediaType":"{OCI_IMAGE_MEDIA_TYPE}","digest":"{digest}","size":1,"platform":{{"architecture":"{arch}","os":"{os}"}}}}"#
            )
        };
        let two = index(&format!(
            "{},{}",
            entry("sha256:aa", "amd64", "linux"),
            entry("sha256:bb", "wasm", "wasip2")
        ));
        assert!(is_index("", two.as_bytes()));
        assert_eq!(wasm_entry(two.as_bytes(), "x").expect("wasm"), "sha256:bb");
        let one = index(&entry("sha256:cc", "amd64", "linux"));
        assert_eq!(wasm_entry(one.as_bytes(), "x").expect("only"), "sha256:cc");
        let none = index(&format!(
            "{},{}",
            entry("sha256:aa", "amd64", "linux"),
            entry("sha256:dd", "arm64", "linux")
        ));
        let error = wasm_entry(none.as_bytes(), "x").expect_err("no wasm entry");
        assert!(error.to_string().contains("none for Wasm"), "{error}");
        let manifest =
            format!(r#"{{"schemaVersion":2,"mediaType":"{OCI_IMAGE_MEDIA_TYPE}","layers":[]}}"#);
        assert!(!is_index("", manifest.as_bytes()));
        assert!(is_index(OCI_IMAGE_INDEX_MEDIA_TYPE, b"{}"));
    }

    #[test]
    fn bytes_must_hash_to_the_digest_that_names_them() {
        let digest = sha256_digest(b"component");
        assert!(check_digest(b"component", &digest, "x").is_ok());
        assert!(matches!(
            check_digest(b"another", &digest, "x"),
            Err(PullError::DigestMismatch { .. })
        ));
        assert!(matches!(
            check_digest(b"component", "sha512:00", "x"),
            Err(PullError::Invalid(_))
        ));
    }
}
