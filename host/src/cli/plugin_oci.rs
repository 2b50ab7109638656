//! `wasmctrl plugin push | pull`, and `inspect` of a remote reference: plugins in an OCI
//! registry, in the CNCF TAG-Runtime Wasm artifact layout that `oras`, `wkg` and `crane`
//! read too (config `application/vnd.wasm.config.v0+json`, one `application/wasm` layer).
//!
//! Credentials come from the standard docker configuration (`$DOCKER_CONFIG/config.json`,
//! else `~/.docker/config.json`, with its credential helpers), as `docker login` or
//! `oras login` left them, never from the command line, where they would end up in shell
//! history and process listings.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use oci_client::Reference;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::manifest::{OCI_IMAGE_MEDIA_TYPE, OciDescriptor, OciImageManifest};
use oci_client::secrets::RegistryAuth;
use serde::Serialize;
use sha2::Digest as _;

use crate::plugin::{Digest, EngineOptions, PluginEngine};
use crate::registry::{MAX_PLUGIN_BYTES, WASM_CONFIG_MEDIA_TYPE, WASM_LAYER_MEDIA_TYPE};

/// How to reach a registry.
#[derive(Debug, Clone, clap::Args)]
pub struct RegistryArgs {
    /// Talk plain HTTP to the registry (a local one), as `oras --plain-http` does.
    #[arg(long)]
    plain_http: bool,
    /// A PEM file of certificate authorities to trust besides the system's (a registry
    /// behind a private CA).
    #[arg(long, value_name = "PEM")]
    ca_file: Option<PathBuf>,
}

/// `wasmctrl plugin push`.
#[derive(Debug, clap::Args)]
pub struct PushArgs {
    /// The plugin component (.wasm).
    plugin: PathBuf,
    /// Where to: `REGISTRY/REPOSITORY:TAG`.
    reference: String,
    /// How to reach the registry.
    #[command(flatten)]
    registry: RegistryArgs,
    /// The registry login a policy names (`NAMESPACE/NAME` of its Secret), for the printed
    /// policy lines.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    secret_ref: Option<SecretRefArg>,
    /// What to print.
    #[arg(short, long, value_enum, default_value_t)]
    output: PushOutput,
}

impl PushArgs {
    /// Push, and print what was pushed.
    pub async fn run(self) -> anyhow::Result<()> {
        push(
            &self.plugin,
            &self.reference,
            &self.registry,
            self.secret_ref.as_ref(),
            self.output,
        )
        .await
    }
}

/// `wasmctrl plugin pull`.
#[derive(Debug, clap::Args)]
pub struct PullArgs {
    /// `REGISTRY/REPOSITORY:TAG` or `REGISTRY/REPOSITORY@sha256:…`.
    reference: String,
    /// Where to write the component (`-o` is the output format in every command, so a
    /// file is always `--output-<what>`).
    #[arg(long = "output-file", value_name = "FILE")]
    out: PathBuf,
    /// How to reach the registry.
    #[command(flatten)]
    registry: RegistryArgs,
}

impl PullArgs {
    /// Pull into the output file.
    pub async fn run(self) -> anyhow::Result<()> {
        pull(&self.reference, &self.out, &self.registry).await
    }
}

/// What `plugin push` prints.
#[derive(Debug, Clone, Copy, Default, clap::ValueEnum)]
pub enum PushOutput {
    /// The digests, and the policy lines that pin them.
    #[default]
    Text,
    /// The digests as JSON, for scripts.
    Json,
    /// A JSON merge patch of a ReconcilePolicy that makes the pushed plugin its active one
    /// (`kubectl patch --type merge -p …`).
    MergePatch,
}

/// What `plugin push` did: the digests a policy pins and the snippet that pins them.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pushed {
    /// The reference as given.
    pub reference: String,
    /// The reference pinned by the manifest's digest: `REGISTRY/REPOSITORY@sha256:…`.
    pub pinned_reference: String,
    /// The manifest's digest (what `oras push` prints).
    pub manifest_digest: String,
    /// The component's own digest (what `spec.plugin.digest` takes).
    pub component_digest: String,
    pub size_bytes: usize,
}

impl Pushed {
    /// A ReconcilePolicy's `spec.plugin` serving the pushed component, pinned both ways, with
    /// `secret_ref` as the registry login; `null` for the other sources, so that as a merge
    /// patch it replaces whatever source the policy had.
    fn plugin_spec(
        &self,
        plain_http: bool,
        secret_ref: Option<&SecretRefArg>,
    ) -> serde_json::Value {
        let mut oci = serde_json::json!({"reference": self.pinned_reference});
        if plain_http {
            oci["insecure"] = true.into();
        }
        if let Some(secret) = secret_ref {
            oci["secretRef"] =
                serde_json::json!({"namespace": secret.namespace, "name": secret.name});
        }
        serde_json::json!({
            "source": {"oci": oci, "file": null, "http": null, "configMap": null},
            "digest": self.component_digest,
        })
    }

    /// The lines a user pastes into a ReconcilePolicy's `spec`.
    fn policy_snippet(
        &self,
        plain_http: bool,
        secret_ref: Option<&SecretRefArg>,
    ) -> anyhow::Result<String> {
        let mut plugin = self.plugin_spec(plain_http, secret_ref);
        if let Some(source) = plugin["source"].as_object_mut() {
            source.retain(|_, value| !value.is_null());
        }
        crate::yaml::to_string(&serde_json::json!({ "plugin": plugin }))
    }
}

/// A Secret named `NAMESPACE/NAME`.
#[derive(Debug, Clone)]
pub struct SecretRefArg {
    namespace: String,
    name: String,
}

impl std::str::FromStr for SecretRefArg {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.split_once('/') {
            Some((namespace, name))
                if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
            {
                Ok(Self {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                })
            }
            _ => Err(format!("{text:?} is not NAMESPACE/NAME")),
        }
    }
}

/// Push the component at `file` to `reference`.
async fn push(
    file: &Path,
    reference: &str,
    registry: &RegistryArgs,
    secret_ref: Option<&SecretRefArg>,
    output: PushOutput,
) -> anyhow::Result<()> {
    let bytes = read_component(file)?;
    let inspection = PluginEngine::new(EngineOptions::default())?
        .inspect(&bytes)
        .with_context(|| format!("{} is not a plugin component", file.display()))?;
    if let Some(refusal) = &inspection.refusal {
        tracing::warn!(%refusal, "this wasmctrl would not load the plugin; pushing it anyway");
    }
    let target = parse_reference(reference)?;
    let client = client(registry)?;
    let auth = docker_auth(&target)?;
    client
        .auth(&target, &auth, oci_client::RegistryOperation::Push)
        .await
        .with_context(|| format!("authenticating to {}", target.resolve_registry()))?;

    let layer = descriptor(WASM_LAYER_MEDIA_TYPE, &bytes);
    let config = serde_json::to_vec(&WasmConfig {
        architecture: "wasm",
        os: "wasip2",
        layer_digests: vec![layer.digest.clone()],
        component: ComponentConfig {
            exports: inspection.exports,
            imports: inspection.imports,
            target: inspection
                .contract_version
                .map(|version| format!("wasmctrl:plugin/plugin@{version}")),
        },
    })?;
    let config_descriptor = descriptor(WASM_CONFIG_MEDIA_TYPE, &config);
    // No timestamps: pushing the same component twice gives the same manifest digest.
    let manifest = OciImageManifest {
        schema_version: 2,
        media_type: Some(OCI_IMAGE_MEDIA_TYPE.to_owned()),
        config: config_descriptor.clone(),
        layers: vec![layer.clone()],
        ..OciImageManifest::default()
    };
    let manifest_bytes = serde_json::to_vec(&manifest)?;
    let manifest_digest = sha256(&manifest_bytes);
    let pushing = |what: &str| format!("pushing the {what} to {reference}");
    client
        .push_blob(&target, config.clone(), &config_descriptor.digest)
        .await
        .with_context(|| pushing("config"))?;
    client
        .push_blob(&target, bytes.clone(), &layer.digest)
        .await
        .with_context(|| pushing("component"))?;
    client
        .push_manifest_raw(
            &target,
            manifest_bytes,
            http::HeaderValue::from_static(OCI_IMAGE_MEDIA_TYPE),
        )
        .await
        .with_context(|| pushing("manifest"))?;

    let pushed = Pushed {
        reference: reference.to_owned(),
        pinned_reference: format!(
            "{}/{}@{manifest_digest}",
            target.registry(),
            target.repository()
        ),
        manifest_digest,
        component_digest: inspection.digest.to_string(),
        size_bytes: bytes.len(),
    };
    match output {
        PushOutput::Json => println!("{}", serde_json::to_string_pretty(&pushed)?),
        PushOutput::MergePatch => println!(
            "{}",
            serde_json::json!({"spec": {"plugin": pushed.plugin_spec(registry.plain_http, secret_ref)}})
        ),
        PushOutput::Text => println!(
            "pushed {}\n  manifest:  {}\n  component: {}\n\nPin it in a ReconcilePolicy's spec:\n\n{}",
            pushed.reference,
            pushed.manifest_digest,
            pushed.component_digest,
            indent(
                &pushed.policy_snippet(registry.plain_http, secret_ref)?,
                "  "
            )
        ),
    }
    Ok(())
}

/// Pull the component `reference` names into `out`; its digest and the manifest's are
/// checked on the way.
async fn pull(reference: &str, out: &Path, registry: &RegistryArgs) -> anyhow::Result<()> {
    let pulled = fetch(reference, registry).await?;
    std::fs::write(out, &pulled.bytes).with_context(|| format!("writing {}", out.display()))?;
    println!(
        "pulled {reference} into {}\n  manifest:  {}\n  component: {}",
        out.display(),
        pulled.manifest_digest,
        Digest::of(&pulled.bytes)
    );
    Ok(())
}

/// A component read from a registry.
pub struct Pulled {
    pub bytes: Vec<u8>,
    pub manifest_digest: String,
    /// The reference pinned by the manifest's digest.
    pub pinned_reference: String,
}

/// Read the component `reference` names: the manifest (checked against the reference's
/// digest when it has one), then its one `application/wasm` layer (checked against the
/// manifest).
pub async fn fetch(reference: &str, registry: &RegistryArgs) -> anyhow::Result<Pulled> {
    let target = parse_reference(reference)?;
    let reader = reader(registry, &target)?;
    let pulled = reader
        .manifest(&target)
        .await
        .with_context(|| format!("reading the manifest of {reference}"))?;
    let mut layers = pulled
        .manifest
        .layers
        .iter()
        .filter(|layer| layer.media_type == WASM_LAYER_MEDIA_TYPE);
    let (Some(layer), None) = (layers.next(), layers.next()) else {
        bail!(
            "{reference} is not a Wasm artifact: it needs exactly one {WASM_LAYER_MEDIA_TYPE} layer"
        );
    };
    let bytes = reader
        .blob(
            &target,
            layer,
            MAX_PLUGIN_BYTES,
            &format!("the component of {reference}"),
        )
        .await?;
    let manifest_digest = pulled.digest;
    Ok(Pulled {
        bytes,
        pinned_reference: format!(
            "{}/{}@{manifest_digest}",
            target.registry(),
            target.repository()
        ),
        manifest_digest,
    })
}

/// `builder` trusting, besides the system's roots, the certificate authorities in the PEM
/// file at `ca_file` (a `--ca-file`), if one is given.
pub(super) fn trusting_ca_file(
    mut builder: reqwest::ClientBuilder,
    ca_file: Option<&Path>,
) -> anyhow::Result<reqwest::ClientBuilder> {
    if let Some(path) = ca_file {
        let pem = std::fs::read(path)
            .with_context(|| format!("reading the CA file {}", path.display()))?;
        for certificate in reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("{} is not a PEM bundle", path.display()))?
        {
            builder = builder.add_root_certificate(certificate);
        }
    }
    Ok(builder)
}

/// A bounded reader of `reference`'s registry (see [`crate::registry::OciReader`]), with the
/// docker configuration's credentials for it, trusting the system's roots and `--ca-file`.
pub(super) fn reader(
    registry: &RegistryArgs,
    reference: &Reference,
) -> anyhow::Result<crate::registry::OciReader> {
    use crate::registry::ReaderAuth;
    crate::ensure_crypto_provider();
    let builder = reqwest::Client::builder()
        .connect_timeout(std::time::Duration::from_secs(10))
        .user_agent(crate::USER_AGENT);
    let http = trusting_ca_file(builder, registry.ca_file.as_deref())?
        .build()
        .context("building the registry's HTTP client")?;
    let auth = match docker_auth(reference)? {
        RegistryAuth::Anonymous => ReaderAuth::Anonymous,
        RegistryAuth::Basic(user, password) => ReaderAuth::Basic(user, password),
        RegistryAuth::Bearer(token) => ReaderAuth::Bearer(token),
    };
    Ok(crate::registry::OciReader::new(
        http,
        registry.plain_http,
        auth,
    ))
}

/// Whether `argument` to `inspect` is a registry reference rather than a file: it is not a
/// file, and it starts with a registry host (`name.domain/…`, `host:port/…`, `localhost/…`),
/// so a mistyped path is reported as a missing file, not looked up on Docker Hub.
pub fn is_remote(argument: &str) -> bool {
    if Path::new(argument).exists() {
        return false;
    }
    argument
        .split_once('/')
        .is_some_and(|(host, _)| host == "localhost" || host.contains('.') || host.contains(':'))
}

fn read_component(file: &Path) -> anyhow::Result<Vec<u8>> {
    let size = std::fs::metadata(file)
        .with_context(|| format!("cannot read plugin {}", file.display()))?
        .len();
    if size > MAX_PLUGIN_BYTES as u64 {
        bail!(
            "{} is {size} bytes, above the {MAX_PLUGIN_BYTES}-byte plugin limit hosts load",
            file.display()
        );
    }
    std::fs::read(file).with_context(|| format!("cannot read plugin {}", file.display()))
}

pub(super) fn parse_reference(reference: &str) -> anyhow::Result<Reference> {
    reference
        .parse()
        .with_context(|| format!("{reference:?} is not an OCI reference (REGISTRY/REPOSITORY:TAG)"))
}

pub(super) fn client(registry: &RegistryArgs) -> anyhow::Result<oci_client::Client> {
    let extra_root_certificates = match &registry.ca_file {
        Some(path) => crate::registry::TrustRoots::with_extra_file(path)?.extra_for_registry(),
        None => Vec::new(),
    };
    crate::registry::oci_client(ClientConfig {
        protocol: if registry.plain_http {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        },
        extra_root_certificates,
        ..ClientConfig::default()
    })
}

/// The credentials the docker configuration holds for `reference`'s registry; anonymous
/// when it holds none (or there is no configuration).
pub(super) fn docker_auth(reference: &Reference) -> anyhow::Result<RegistryAuth> {
    let config = std::env::var_os("DOCKER_CONFIG")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".docker")))
        .map(|dir| dir.join("config.json"));
    auth_from_docker_config(config.as_deref(), reference.resolve_registry())
}

/// The credentials the docker configuration file `config` holds for `registry`.
fn auth_from_docker_config(config: Option<&Path>, registry: &str) -> anyhow::Result<RegistryAuth> {
    use docker_credential::{CredentialRetrievalError as Error, DockerCredential};
    // A missing configuration is no login, not an error (the crate would call it one).
    let Some(config) = config.filter(|config| config.exists()) else {
        return Ok(RegistryAuth::Anonymous);
    };
    // Docker Hub's entry keeps the name `docker login` gave it.
    let server = match registry {
        "index.docker.io" | "registry-1.docker.io" => "https://index.docker.io/v1/",
        other => other,
    };
    let file = std::fs::File::open(config)
        .with_context(|| format!("reading the docker configuration {}", config.display()))?;
    match docker_credential::get_credential_from_reader(std::io::BufReader::new(file), server) {
        Ok(DockerCredential::UsernamePassword(user, password)) => {
            Ok(RegistryAuth::Basic(user, password))
        }
        Ok(DockerCredential::IdentityToken(token)) => Ok(RegistryAuth::Bearer(token)),
        Err(Error::NoCredentialConfigured) => Ok(RegistryAuth::Anonymous),
        Err(error) => Err(anyhow::anyhow!("{error}")).with_context(|| {
            format!(
                "reading the docker credentials for {registry} from {}",
                config.display()
            )
        }),
    }
}

fn descriptor(media_type: &str, bytes: &[u8]) -> OciDescriptor {
    OciDescriptor {
        media_type: media_type.to_owned(),
        digest: sha256(bytes),
        size: bytes.len() as i64,
        ..OciDescriptor::default()
    }
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

fn indent(text: &str, by: &str) -> String {
    text.lines().map(|line| format!("{by}{line}\n")).collect()
}

/// The artifact's config, as the Wasm OCI artifact layout defines it.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct WasmConfig {
    architecture: &'static str,
    os: &'static str,
    layer_digests: Vec<String>,
    component: ComponentConfig,
}

#[derive(Serialize)]
struct ComponentConfig {
    exports: Vec<String>,
    imports: Vec<String>,
    /// The world the component targets.
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_registry_host_makes_an_argument_remote() {
        assert!(is_remote("ghcr.io/acme/myapp:1"));
        assert!(is_remote("127.0.0.1:5000/plugins/myapp:v1"));
        assert!(is_remote("localhost/plugins/myapp@sha256:0000"));
        assert!(
            !is_remote("target/myapp.wasm"),
            "a missing file stays a file"
        );
        assert!(!is_remote("myapp.wasm"));
        let file = tempfile::NamedTempFile::new().expect("file");
        assert!(!is_remote(&file.path().display().to_string()));
    }

    #[test]
    fn registry_logins_come_from_the_docker_configuration() {
        let dir = tempfile::tempdir().expect("dir");
        let config = dir.path().join("config.json");
        let auth = |registry: &str| auth_from_docker_config(Some(&config), registry);
        assert!(matches!(
            auth("r.example").expect("no file"),
            RegistryAuth::Anonymous
        ));
        assert!(matches!(
            auth_from_docker_config(None, "r.example").expect("no home"),
            RegistryAuth::Anonymous
        ));
        // `docker login r.example:5000` as user "bot", password "pw".
        std::fs::write(
            &config,
            r#"{"auths": {"r.example:5000": {"auth": "Ym90OnB3"}}}"#,
        )
        .expect("config");
        match auth("r.example:5000").expect("a login") {
            RegistryAuth::Basic(user, password) => {
                assert_eq!((user.as_str(), password.as_str()), ("bot", "pw"))
            }
            other => panic!("not the login: {other:?}"),
        }
        assert!(
            matches!(
                auth("r.example").expect("another registry"),
                RegistryAuth::Anonymous
            ),
            "a port is part of the registry"
        );
        std::fs::write(&config, "not json").expect("config");
        let error = auth("r.example:5000").expect_err("malformed");
        assert!(format!("{error:#}").contains("config.json"), "{error:#}");
    }

    #[test]
    fn the_snippet_pins_the_manifest_and_the_component() {
        let pushed = Pushed {
            reference: "r.example/p:1".into(),
            pinned_reference: "r.example/p@sha256:aa".into(),
            manifest_digest: "sha256:aa".into(),
            component_digest: "sha256:bb".into(),
            size_bytes: 1,
        };
        let snippet: serde_json::Value =
            serde_yaml_ng::from_str(&pushed.policy_snippet(false, None).expect("snippet"))
                .expect("YAML");
        assert_eq!(
            snippet,
            serde_json::json!({"plugin": {
                "source": {"oci": {"reference": "r.example/p@sha256:aa"}},
                "digest": "sha256:bb",
            }})
        );
        let login: SecretRefArg = "wasmctrl/login".parse().expect("a secret");
        let patch = pushed.plugin_spec(true, Some(&login));
        assert_eq!(patch["source"]["oci"]["insecure"], true);
        assert_eq!(
            patch["source"]["oci"]["secretRef"],
            serde_json::json!({"namespace": "wasmctrl", "name": "login"})
        );
        assert!(
            patch["source"]["file"].is_null() && patch["source"].get("file").is_some(),
            "a merge patch removes the old source"
        );
        assert!("login".parse::<SecretRefArg>().is_err());
        assert!("a/b/c".parse::<SecretRefArg>().is_err());
    }
}
