//! The host's OCI image, built without a daemon and without a base image (none can be pulled
//! here, and none is needed): one layer holding a static `wasmctrl` (musl), an `/etc/passwd`
//! naming the non-root user, and the directories the host may write to. It is assembled as
//! an OCI image layout on disk and pushed with `oci-client`, the same registry client the
//! host pulls plugins with. `deploy/Containerfile` says the same thing for `docker build`.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};
use serde_json::json;
use sha2::{Digest as _, Sha256};

/// The target of the static binary.
pub const TARGET: &str = "x86_64-unknown-linux-musl";
/// The user the image runs as (distroless' `nonroot`).
pub const USER: u32 = 65532;
/// Where the binary lives in the image.
pub const ENTRYPOINT: &str = "/usr/local/bin/wasmctrl";
/// The precompiled-plugin cache directory (mount an emptyDir there).
pub const CACHE_DIR: &str = "/var/cache/wasmctrl";
/// The system CA bundle, where Debian and OpenSSL look for it.
pub const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";

/// A built image: its blobs, and the OCI layout they were written to.
pub struct Image {
    /// The OCI image layout directory (`oci-layout`, `index.json`, `blobs/`).
    pub layout: PathBuf,
    /// The image config.
    pub config: Vec<u8>,
    /// The one layer, gzipped.
    pub layer: Vec<u8>,
    /// The image manifest.
    pub manifest: Vec<u8>,
}

impl Image {
    /// `sha256:…` of the manifest: the image's digest.
    pub fn digest(&self) -> String {
        sha256(&self.manifest)
    }

    /// What a pull transfers: manifest, config and the compressed layer.
    pub fn compressed_size(&self) -> usize {
        self.manifest.len() + self.config.len() + self.layer.len()
    }
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Build the static binary with cargo `profile` and assemble the image in `out`.
pub fn build(profile: &str, out: &Path) -> anyhow::Result<Image> {
    let binary = build_static_binary(profile)?;
    assemble(&binary, out)
}

/// Build the static `wasmctrl` ([`TARGET`]) with cargo `profile`, installing the target and
/// a musl C compiler first if they are missing, and return where cargo put it. The image and
/// `cargo xtask dist`'s archive both hold this binary.
pub fn build_static_binary(profile: &str) -> anyhow::Result<PathBuf> {
    build_static_binary_for(TARGET, profile)
}

/// [`build_static_binary`] for another musl `target`. [`TARGET`] builds with musl-gcc;
/// any other is cross-compiled with cargo-zigbuild (`tools/cargo-zigbuild`), Zig being its
/// C compiler and linker.
pub fn build_static_binary_for(target: &str, profile: &str) -> anyhow::Result<PathBuf> {
    ensure_target(target)?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(cargo);
    if target == TARGET {
        if Command::new("musl-gcc").arg("--version").output().is_err() {
            crate::tools::debian_package("musl-tools", "a musl C compiler: ring compiles C")?;
        }
        command.arg("build");
    } else {
        // cargo-zigbuild is a cargo subcommand; its venv holds Zig (`python3 -m ziglang`).
        let bin = crate::tools::build("cargo-zigbuild")?;
        let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        )))?;
        // The linker strips it: the host's `strip` reads only its own architecture.
        let profile_var = format!(
            "CARGO_PROFILE_{}_STRIP",
            profile.to_uppercase().replace('-', "_")
        );
        command
            .env("PATH", path)
            .env(profile_var, "symbols")
            .arg("zigbuild");
    }
    run(command.current_dir(crate::repo_root()).args([
        "--profile",
        profile,
        "--target",
        target,
        "-p",
        "wasmctrl",
        "--bin",
        "wasmctrl",
    ]))?;
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::repo_root().join("target"));
    let dir = if profile == "dev" { "debug" } else { profile };
    Ok(target_dir.join(target).join(dir).join("wasmctrl"))
}

/// The Rust `target`, installed with rustup if missing.
fn ensure_target(target: &str) -> anyhow::Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.trim() == target)
        })
        .unwrap_or(false);
    if !installed {
        run(Command::new("rustup").args(["target", "add", target]))
            .with_context(|| format!("installing the {target} target"))?;
    }
    Ok(())
}

fn run(command: &mut Command) -> anyhow::Result<()> {
    let status = command
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .status()
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed ({status})");
    }
    Ok(())
}

/// The bytes of `binary` without its symbols when `strip` exists (as they are otherwise):
/// symbols are a third of the binary and no use in a container or a release archive.
/// `scratch` is a file path the stripped copy may be written to (and is removed from).
pub fn stripped(binary: &Path, scratch: &Path) -> anyhow::Result<Vec<u8>> {
    if let Some(parent) = scratch.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let strip = Command::new("strip")
        .arg("-o")
        .arg(scratch)
        .arg(binary)
        .status();
    let executable = if strip.is_ok_and(|s| s.success()) {
        std::fs::read(scratch)?
    } else {
        std::fs::read(binary).with_context(|| format!("reading {}", binary.display()))?
    };
    let _ = std::fs::remove_file(scratch);
    Ok(executable)
}

/// Assemble the image from a static `binary` into the OCI layout `out`.
pub fn assemble(binary: &Path, out: &Path) -> anyhow::Result<Image> {
    assemble_for(binary, out, "amd64")
}

/// [`assemble`] for a binary of another `architecture` (OCI's name: `amd64`, `arm64`).
pub fn assemble_for(binary: &Path, out: &Path, architecture: &str) -> anyhow::Result<Image> {
    let executable = stripped(binary, &out.with_extension("wasmctrl.stripped"))?;

    let tar = layer_tar(&executable)?;
    let diff_id = sha256(&tar);
    let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gzip.write_all(&tar)?;
    let layer = gzip.finish()?;

    let config = serde_json::to_vec(&json!({
        "architecture": architecture,
        "os": "linux",
        "config": {
            "User": format!("{USER}:{USER}"),
            "Entrypoint": [ENTRYPOINT],
            "Cmd": ["run"],
            "Env": [
                format!("WASMCTRL_CACHE_DIR={CACHE_DIR}"),
                format!("SSL_CERT_FILE={CA_BUNDLE}"),
                "PATH=/usr/local/bin".to_owned(),
            ],
            "WorkingDir": "/",
            "ExposedPorts": {"8443/tcp": {}},
            "Labels": {
                "org.opencontainers.image.title": "wasmctrl",
                "org.opencontainers.image.source": "https://github.com/wasmctrl/wasmctrl",
            },
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "wasmctrl-testenv image::assemble (static musl binary, no base image)"}],
    }))?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": sha256(&config), "size": config.len()},
        "layers": [{"mediaType": LAYER_MEDIA_TYPE, "digest": sha256(&layer), "size": layer.len()}],
    }))?;

    let _ = std::fs::remove_dir_all(out);
    let blobs = out.join("blobs/sha256");
    std::fs::create_dir_all(&blobs)?;
    for blob in [&config, &layer, &manifest] {
        let digest = sha256(blob);
        std::fs::write(blobs.join(digest.trim_start_matches("sha256:")), blob)?;
    }
    std::fs::write(out.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    std::fs::write(
        out.join("index.json"),
        serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": MANIFEST_MEDIA_TYPE,
                "digest": sha256(&manifest),
                "size": manifest.len(),
                "annotations": {"org.opencontainers.image.ref.name": "latest"},
            }],
        }))?,
    )?;
    Ok(Image {
        layout: out.to_owned(),
        config,
        layer,
        manifest,
    })
}

/// The Mozilla roots the binary compiles in, as the PEM bundle libraries look for in the
/// system store. The host's own fetches never read it; a library that builds a default TLS
/// client does (`oci-client` builds one beside the configured one, and that one panics on
/// a system with no roots at all).
fn ca_bundle() -> String {
    let certificates: Vec<pem::Pem> = webpki_root_certs::TLS_SERVER_ROOT_CERTS
        .iter()
        .map(|der| pem::Pem::new("CERTIFICATE", der.to_vec()))
        .collect();
    pem::encode_many(&certificates)
}

/// The layer: every entry owned by root except the cache directory, times at zero, so the
/// same binary always gives the same digest.
fn layer_tar(executable: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    let mut entry = |path: &str, mode: u32, owner: u32, contents: Option<&[u8]>| {
        let mut header = tar::Header::new_gnu();
        header.set_mode(mode);
        header.set_uid(owner.into());
        header.set_gid(owner.into());
        header.set_mtime(0);
        match contents {
            Some(bytes) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_size(bytes.len() as u64);
                tar.append_data(&mut header, path, bytes)
            }
            None => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_size(0);
                tar.append_data(&mut header, path, std::io::empty())
            }
        }
    };
    let passwd = format!(
        "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:{USER}:{USER}:nonroot:/home/nonroot:/sbin/nologin\n"
    );
    let group = format!("root:x:0:\nnonroot:x:{USER}:\n");
    for dir in [
        "etc",
        "home",
        "tmp",
        "usr",
        "usr/local",
        "usr/local/bin",
        "var",
        "var/cache",
    ] {
        entry(dir, if dir == "tmp" { 0o1777 } else { 0o755 }, 0, None)?;
    }
    entry("home/nonroot", 0o700, USER, None)?;
    entry(CACHE_DIR.trim_start_matches('/'), 0o700, USER, None)?;
    entry("etc/passwd", 0o644, 0, Some(passwd.as_bytes()))?;
    entry("etc/ssl", 0o755, 0, None)?;
    entry("etc/ssl/certs", 0o755, 0, None)?;
    entry(
        CA_BUNDLE.trim_start_matches('/'),
        0o644,
        0,
        Some(ca_bundle().as_bytes()),
    )?;
    entry("etc/group", 0o644, 0, Some(group.as_bytes()))?;
    entry(
        ENTRYPOINT.trim_start_matches('/'),
        0o755,
        0,
        Some(executable),
    )?;
    Ok(tar.into_inner()?)
}

/// A registry client; `oci-client` is built without a TLS crypto provider, so install ring's
/// (as the host does) unless one is installed already. `ca_pem` is trusted besides the
/// system's roots.
fn registry_client(insecure: bool, ca_pem: Option<&str>) -> anyhow::Result<oci_client::Client> {
    use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
    let _ = rustls::crypto::ring::default_provider().install_default();
    Ok(oci_client::Client::new(ClientConfig {
        protocol: if insecure {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        },
        extra_root_certificates: ca_pem
            .map(|pem| Certificate {
                encoding: CertificateEncoding::Pem,
                data: pem.as_bytes().to_vec(),
            })
            .into_iter()
            .collect(),
        ..ClientConfig::default()
    }))
}

/// Push `image` to `reference` (`host:port/repository:tag`) over plain HTTP when `insecure`,
/// with the credentials `docker login` stored for its registry (anonymously without).
pub async fn push(image: &Image, reference: &str, insecure: bool) -> anyhow::Result<String> {
    use oci_client::client::{Config, ImageLayer};
    use oci_client::manifest::OciImageManifest;
    let client = registry_client(insecure, None)?;
    let layer = ImageLayer::new(image.layer.clone(), LAYER_MEDIA_TYPE.into(), None);
    let config = Config::new(image.config.clone(), CONFIG_MEDIA_TYPE.into(), None);
    let manifest: OciImageManifest = serde_json::from_slice(&image.manifest)?;
    let reference: oci_client::Reference = reference.parse()?;
    let auth = docker_auth(&reference)?;
    let response = client
        .push(&reference, &[layer], config, &auth, Some(manifest))
        .await
        .with_context(|| format!("pushing the image to {reference}"))?;
    Ok(response.manifest_url)
}

/// Push each of `images` (by digest) and an OCI image index of them, each entry naming its
/// architecture (`amd64`, `arm64`) on linux, to `reference` (`host:port/repository:tag`);
/// the index's digest. Credentials and `insecure` as [`push`].
pub async fn push_index(
    images: &[(&str, &Image)],
    reference: &str,
    insecure: bool,
) -> anyhow::Result<String> {
    use oci_client::client::{Config, ImageLayer};
    use oci_client::manifest::OciImageManifest;
    let client = registry_client(insecure, None)?;
    let index_ref: oci_client::Reference = reference.parse()?;
    let auth = docker_auth(&index_ref)?;
    let mut entries = Vec::new();
    for (architecture, image) in images {
        let by_digest = oci_client::Reference::with_digest(
            index_ref.registry().to_owned(),
            index_ref.repository().to_owned(),
            image.digest(),
        );
        let layer = ImageLayer::new(image.layer.clone(), LAYER_MEDIA_TYPE.into(), None);
        let config = Config::new(image.config.clone(), CONFIG_MEDIA_TYPE.into(), None);
        let manifest: OciImageManifest = serde_json::from_slice(&image.manifest)?;
        client
            .push(&by_digest, &[layer], config, &auth, Some(manifest))
            .await
            .with_context(|| format!("pushing the {architecture} image to {by_digest}"))?;
        entries.push(json!({
            "mediaType": MANIFEST_MEDIA_TYPE,
            "digest": image.digest(),
            "size": image.manifest.len(),
            "platform": {"architecture": architecture, "os": "linux"},
        }));
    }
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": entries,
    }))?;
    let digest = sha256(&index);
    client
        .push_manifest_raw(&index_ref, index, INDEX_MEDIA_TYPE.parse()?)
        .await
        .with_context(|| format!("pushing the image index to {index_ref}"))?;
    Ok(digest)
}

/// Whether the registry has a manifest at `reference` (a tag), with the docker
/// configuration's credentials; plain HTTP when `insecure`.
pub async fn manifest_exists(reference: &str, insecure: bool) -> anyhow::Result<bool> {
    use oci_client::errors::{OciDistributionError, OciErrorCode};
    let client = registry_client(insecure, None)?;
    let reference: oci_client::Reference = reference.parse()?;
    let auth = docker_auth(&reference)?;
    match client.fetch_manifest_digest(&reference, &auth).await {
        Ok(_) => Ok(true),
        Err(OciDistributionError::RegistryError { envelope, .. })
            if envelope.errors.iter().any(|e| {
                matches!(
                    e.code,
                    OciErrorCode::ManifestUnknown | OciErrorCode::NameUnknown
                )
            }) =>
        {
            Ok(false)
        }
        Err(OciDistributionError::ImageManifestNotFoundError(_))
        | Err(OciDistributionError::ServerError { code: 404, .. }) => Ok(false),
        Err(error) => Err(error).with_context(|| format!("asking the registry for {reference}")),
    }
}

/// The credentials the docker configuration (`$DOCKER_CONFIG`, else `~/.docker`, with its
/// credential helpers) holds for `reference`'s registry; anonymous when it holds none.
fn docker_auth(
    reference: &oci_client::Reference,
) -> anyhow::Result<oci_client::secrets::RegistryAuth> {
    use docker_credential::{CredentialRetrievalError as Error, DockerCredential};
    use oci_client::secrets::RegistryAuth;
    let registry = reference.resolve_registry();
    let server = match registry {
        "index.docker.io" | "registry-1.docker.io" => "https://index.docker.io/v1/",
        other => other,
    };
    // A missing configuration is no login, not an error (the crate would call it one).
    let Some(config) = std::env::var_os("DOCKER_CONFIG")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|home| std::path::Path::new(&home).join(".docker"))
        })
        .map(|dir| dir.join("config.json"))
        .filter(|config| config.exists())
    else {
        return Ok(RegistryAuth::Anonymous);
    };
    let file = std::fs::File::open(&config)
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

/// Pull `reference` over plain HTTP and unpack its layers into `rootfs`: what a container
/// runtime does before it starts the image.
pub async fn pull_into(reference: &str, rootfs: &Path) -> anyhow::Result<()> {
    pull_with(
        reference,
        rootfs,
        &Access {
            insecure: true,
            ca_pem: None,
            auth: oci_client::secrets::RegistryAuth::Anonymous,
        },
    )
    .await
}

/// How to reach a registry: what a kubelet knows from its trust store and a pod's
/// `imagePullSecrets`.
pub struct Access<'a> {
    /// Plain HTTP.
    pub insecure: bool,
    /// A CA to trust besides the system's.
    pub ca_pem: Option<&'a str>,
    /// The login.
    pub auth: oci_client::secrets::RegistryAuth,
}

/// [`pull_into`] with `access`.
pub async fn pull_with(reference: &str, rootfs: &Path, access: &Access<'_>) -> anyhow::Result<()> {
    let client = registry_client(access.insecure, access.ca_pem)?;
    let image = client
        .pull(&reference.parse()?, &access.auth, vec![LAYER_MEDIA_TYPE])
        .await
        .with_context(|| format!("pulling {reference}"))?;
    std::fs::create_dir_all(rootfs)?;
    for layer in image.layers {
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(&layer.data[..]));
        archive.set_preserve_permissions(true);
        archive.set_preserve_ownerships(true);
        archive.unpack(rootfs).context("unpacking a layer")?;
    }
    Ok(())
}
