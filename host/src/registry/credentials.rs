//! Registry credentials, bound to the hosts they belong to.
//!
//! A policy editor chooses the URL a plugin is fetched from, and may name a credentials Secret
//! for it. Were the Secret's credentials sent wherever the policy points, editing a policy
//! would be a way to hand any registry's password to a server of one's choosing. So every
//! credential names its hosts, in the Secret itself (which the policy editor cannot change),
//! and is sent to those hosts only:
//! - a `kubernetes.io/dockerconfigjson` Secret (what `kubectl create secret docker-registry`
//!   makes, and what registries hand out) holds one entry per registry host: the entry for
//!   the source's host is used, and a host without an entry gets nothing;
//! - a Secret with `token`, or `username` and `password`, names its hosts in the
//!   [`HOSTS_ANNOTATION`] annotation; without the annotation it goes nowhere.
//!
//! The check is made on the Secret as read, before a single request goes to the source.

use std::collections::BTreeMap;

use anyhow::{Context as _, bail};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};

use crate::policy::SecretRef;

/// The annotation of a `token` or `username`/`password` Secret that names the registry hosts
/// (`host` or `host:port`, comma-separated) its credentials are for.
pub const HOSTS_ANNOTATION: &str = "wasmctrl.dev/registry-hosts";

/// The key of a `kubernetes.io/dockerconfigjson` Secret.
const DOCKER_CONFIG_KEY: &str = ".dockerconfigjson";

/// What is sent to a source's host.
pub(super) enum Credentials {
    /// `Authorization: Bearer <token>`.
    Bearer(String),
    /// HTTP basic authentication (the OCI client trades it for a token where the registry
    /// asks it to).
    Basic(String, String),
}

/// Why no credentials go to a source.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refused {
    /// The Secret could not be read (missing, or the host may not get it).
    #[error("{0:#}")]
    Unreadable(anyhow::Error),
    /// The Secret is not for this host, or holds nothing usable.
    #[error("{0:#}")]
    NotForHost(anyhow::Error),
}

/// The credentials the Secret `secret` holds for `host` (`host` or `host:port`, lowercase, as
/// [`host_of_url`] and [`host_of_registry`] give it).
pub(super) async fn read(
    client: &Client,
    secret: &SecretRef,
    host: &str,
) -> Result<Credentials, Refused> {
    let (namespace, name) = (&secret.namespace, &secret.name);
    let secret = Api::<Secret>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .with_context(|| format!("reading credentials Secret {namespace}/{name}"))
        .map_err(Refused::Unreadable)?;
    for_host(&secret, host).map_err(Refused::NotForHost)
}

/// The credentials in `secret` that are bound to `host`.
fn for_host(secret: &Secret, host: &str) -> anyhow::Result<Credentials> {
    let empty = BTreeMap::new();
    let data = secret.data.as_ref().unwrap_or(&empty);
    let name = format!(
        "{}/{}",
        secret.metadata.namespace.as_deref().unwrap_or_default(),
        secret.metadata.name.as_deref().unwrap_or_default()
    );
    if let Some(config) = data.get(DOCKER_CONFIG_KEY) {
        return from_docker_config(&config.0, host)
            .with_context(|| format!("Secret {name} ({DOCKER_CONFIG_KEY})"));
    }
    let annotation = secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|annotations| annotations.get(HOSTS_ANNOTATION));
    let Some(annotation) = annotation else {
        bail!(
            "Secret {name} does not say which registry hosts its credentials are for, so they are sent nowhere; annotate it with {HOSTS_ANNOTATION}=\"{host}\" (comma-separate several hosts), or use a kubernetes.io/dockerconfigjson Secret (kubectl create secret docker-registry)"
        );
    };
    let hosts: Vec<String> = annotation
        .split([',', ' ', '\n'])
        .filter(|h| !h.is_empty())
        .map(normalize_host)
        .collect();
    if !hosts.iter().any(|bound| bound == host) {
        bail!(
            "Secret {name} holds credentials for {hosts:?} (its {HOSTS_ANNOTATION} annotation), not for {host:?}; refusing to send them there"
        );
    }
    let text = |key: &str| {
        data.get(key)
            .map(|v| String::from_utf8_lossy(&v.0).trim().to_owned())
    };
    match (text("token"), text("username"), text("password")) {
        (Some(token), _, _) => Ok(Credentials::Bearer(token)),
        (None, Some(user), Some(password)) => Ok(Credentials::Basic(user, password)),
        _ => bail!(
            "Secret {name} has neither `token` nor `username` and `password` (nor {DOCKER_CONFIG_KEY})"
        ),
    }
}

/// A Docker config file: credentials by registry.
#[derive(serde::Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, DockerAuth>,
}

/// One registry's entry, as `docker login` and `kubectl create secret docker-registry` write it.
#[derive(serde::Deserialize)]
struct DockerAuth {
    /// base64 of `username:password` (a `ByteString` decodes base64 as it deserializes).
    auth: Option<ByteString>,
    username: Option<String>,
    password: Option<String>,
    /// A bearer token for the registry itself.
    registrytoken: Option<String>,
}

/// The credentials of the entry for `host` in a `.dockerconfigjson`.
fn from_docker_config(config: &[u8], host: &str) -> anyhow::Result<Credentials> {
    let config: DockerConfig =
        serde_json::from_slice(config).context("not a Docker config ({\"auths\": {...}})")?;
    let Some(entry) = config
        .auths
        .iter()
        .find_map(|(key, entry)| (normalize_host(key) == host).then_some(entry))
    else {
        let known: Vec<String> = config.auths.keys().map(|k| normalize_host(k)).collect();
        bail!(
            "no credentials for registry {host:?} (it has them for {known:?}); refusing to send any there. Make a Secret for {host} (kubectl create secret docker-registry NAME --docker-server={host} ...)"
        );
    };
    if let Some(auth) = &entry.auth
        && !auth.0.is_empty()
    {
        let auth = String::from_utf8_lossy(&auth.0);
        let (user, password) = auth
            .split_once(':')
            .with_context(|| format!("the `auth` of {host:?} is not base64 of user:password"))?;
        return Ok(Credentials::Basic(user.to_owned(), password.to_owned()));
    }
    match (&entry.username, &entry.password, &entry.registrytoken) {
        (Some(user), Some(password), _) => Ok(Credentials::Basic(user.clone(), password.clone())),
        (_, _, Some(token)) => Ok(Credentials::Bearer(token.clone())),
        _ => bail!(
            "the entry for {host:?} has no `auth`, `username` and `password`, or `registrytoken` (an `identitytoken` alone is not supported)"
        ),
    }
}

/// A registry host as Docker config keys and the annotation may write it — `host`,
/// `host:port`, or a URL such as `https://host/v1/` — reduced to lowercase `host[:port]`,
/// Docker Hub's several names to the one its references resolve to.
fn normalize_host(key: &str) -> String {
    let key = key.trim();
    let without_scheme = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = without_scheme
        .split('/')
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase();
    match host.as_str() {
        "docker.io" | "registry-1.docker.io" => "index.docker.io".to_owned(),
        _ => host,
    }
}

/// The host credentials for `url` must be bound to: `host`, or `host:port` when the URL
/// names a port other than its scheme's default.
pub(super) fn host_of_url(url: &url::Url) -> Option<String> {
    let host = url.host_str()?.to_ascii_lowercase();
    Some(match url.port() {
        Some(port) => format!("{host}:{port}"),
        None => host,
    })
}

/// The host credentials for a registry must be bound to.
pub(super) fn host_of_registry(reference: &oci_client::Reference) -> String {
    normalize_host(reference.resolve_registry())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn secret(annotation: Option<&str>, data: &[(&str, &[u8])]) -> Secret {
        Secret {
            metadata: ObjectMeta {
                namespace: Some("wasmctrl".into()),
                name: Some("registry".into()),
                annotations: annotation
                    .map(|hosts| BTreeMap::from([(HOSTS_ANNOTATION.to_owned(), hosts.to_owned())])),
                ..ObjectMeta::default()
            },
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), ByteString(v.to_vec())))
                    .collect(),
            ),
            ..Secret::default()
        }
    }

    fn docker_config(auths: serde_json::Value) -> Secret {
        let config = serde_json::json!({ "auths": auths }).to_string();
        secret(None, &[(DOCKER_CONFIG_KEY, config.as_bytes())])
    }

    fn basic(credentials: anyhow::Result<Credentials>) -> (String, String) {
        match credentials.expect("credentials") {
            Credentials::Basic(user, password) => (user, password),
            Credentials::Bearer(_) => panic!("a bearer token, not basic auth"),
        }
    }

    fn refusal(credentials: anyhow::Result<Credentials>) -> String {
        match credentials {
            Ok(_) => panic!("credentials were handed out"),
            Err(error) => format!("{error:#}"),
        }
    }

    #[test]
    fn a_docker_config_gives_the_entry_for_the_sources_host_and_port() {
        // "dXNlcjpwYXNz" is base64 of "user:pass", as `kubectl create secret docker-registry` writes it.
        let secret = docker_config(serde_json::json!({
            "registry.example.com:5000": {"auth": "dXNlcjpwYXNz"},
            "ghcr.io": {"username": "bot", "password": "ghp"},
        }));
        assert_eq!(
            basic(for_host(&secret, "registry.example.com:5000")),
            ("user".into(), "pass".into())
        );
        assert_eq!(
            basic(for_host(&secret, "ghcr.io")),
            ("bot".into(), "ghp".into())
        );
        // The port is part of the host: the same name on another port is another server.
        let other_port = refusal(for_host(&secret, "registry.example.com"));
        assert!(
            other_port.contains("no credentials for registry \"registry.example.com\""),
            "{other_port}"
        );
        assert!(refusal(for_host(&secret, "ghcr.io:8443")).contains("no credentials"));
    }

    #[test]
    fn docker_config_keys_may_be_urls_as_docker_writes_them() {
        let secret = docker_config(serde_json::json!({
            "https://index.docker.io/v1/": {"username": "hub", "password": "p"},
            "https://Registry.Example.com:5000/v2/": {"registrytoken": "t"},
        }));
        let hub: oci_client::Reference = "docker.io/library/p:1".parse().expect("a reference");
        assert_eq!(
            basic(for_host(&secret, &host_of_registry(&hub))),
            ("hub".into(), "p".into())
        );
        assert!(matches!(
            for_host(&secret, "registry.example.com:5000"),
            Ok(Credentials::Bearer(token)) if token == "t"
        ));
    }

    #[test]
    fn a_host_without_an_entry_gets_nothing_and_is_told_how_to_add_one() {
        let secret = docker_config(serde_json::json!({"ghcr.io": {"auth": "dXNlcjpwYXNz"}}));
        let refused = refusal(for_host(&secret, "attacker.example"));
        assert!(refused.contains("Secret wasmctrl/registry"), "{refused}");
        assert!(refused.contains("[\"ghcr.io\"]"), "{refused}");
        assert!(
            refused.contains("--docker-server=attacker.example"),
            "{refused}"
        );
        let empty = docker_config(serde_json::json!({"ghcr.io": {}}));
        assert!(refusal(for_host(&empty, "ghcr.io")).contains("no `auth`"));
    }

    #[test]
    fn a_token_secret_goes_only_to_the_hosts_its_annotation_names() {
        let token: &[(&str, &[u8])] = &[("token", b"s3cret\n")];
        let bound = secret(Some("ghcr.io, https://registry.example.com:5000/"), token);
        assert!(matches!(for_host(&bound, "ghcr.io"), Ok(Credentials::Bearer(t)) if t == "s3cret"));
        assert!(for_host(&bound, "registry.example.com:5000").is_ok());
        let wrong = refusal(for_host(&bound, "plugins.example.com"));
        assert!(
            wrong.contains("not for \"plugins.example.com\"") && wrong.contains(HOSTS_ANNOTATION),
            "{wrong}"
        );
        assert!(refusal(for_host(&bound, "registry.example.com")).contains("not for"));

        let unbound = secret(None, token);
        let refused = refusal(for_host(&unbound, "ghcr.io"));
        assert!(
            refused.contains(&format!("annotate it with {HOSTS_ANNOTATION}=\"ghcr.io\"")),
            "{refused}"
        );
        let password = secret(
            Some("ghcr.io"),
            &[("username", b"bot"), ("password", b"pw")],
        );
        assert_eq!(
            basic(for_host(&password, "ghcr.io")),
            ("bot".into(), "pw".into())
        );
    }

    #[test]
    fn the_host_of_a_source_keeps_a_port_other_than_the_default() {
        let host = |url: &str| host_of_url(&url::Url::parse(url).expect("a URL"));
        assert_eq!(
            host("https://Plugins.Example.com/p.wasm").as_deref(),
            Some("plugins.example.com")
        );
        assert_eq!(
            host("https://plugins.example.com:443/p.wasm").as_deref(),
            Some("plugins.example.com")
        );
        assert_eq!(
            host("https://plugins.example.com:8443/p.wasm").as_deref(),
            Some("plugins.example.com:8443")
        );
        assert_eq!(
            host("http://127.0.0.1:8080/p.wasm").as_deref(),
            Some("127.0.0.1:8080")
        );
        assert_eq!(
            host("http://[::1]:8080/p.wasm").as_deref(),
            Some("[::1]:8080")
        );
        let registry: oci_client::Reference = "localhost:5000/plugins/myapp:1"
            .parse()
            .expect("a reference");
        assert_eq!(host_of_registry(&registry), "localhost:5000");
    }
}
