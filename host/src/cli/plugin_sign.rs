//! `wasmctrl plugin keygen | sign | verify`, and the signatures `plugin inspect` shows:
//! cosign's formats, so `cosign verify` accepts what `plugin sign` makes and the host
//! accepts what `cosign sign` makes (see [`crate::signing::cosign`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use oci_client::client::{Config, ImageLayer};
use oci_client::manifest::OciImageManifest;
use serde::Serialize;

use super::output::OutputFormat;
use super::plugin_oci::{self, RegistryArgs};
use crate::plugin::Digest;
use crate::policy::{Signer, SignerIdentity, VerifySpec};
use crate::registry::Signatures;
use crate::signing::cosign::{self, Signed};
use crate::signing::sign::{self, SigningKey};
use crate::signing::{HostTrust, KeylessRoots, RekorKeys, Verifier};

/// `wasmctrl plugin keygen`.
#[derive(Debug, clap::Args)]
pub struct KeygenArgs {
    /// Write `PREFIX.key` (encrypted with `COSIGN_PASSWORD`, empty when unset, as cosign
    /// does) and `PREFIX.pub`.
    #[arg(long, default_value = "cosign")]
    output_prefix: PathBuf,
}

impl KeygenArgs {
    /// Generate, write both files, print the public key's fingerprint.
    pub fn run(self) -> anyhow::Result<()> {
        let key = SigningKey::generate()?;
        let password = std::env::var("COSIGN_PASSWORD").unwrap_or_default();
        let private = self.output_prefix.with_extension("key");
        let public = self.output_prefix.with_extension("pub");
        for path in [&private, &public] {
            if path.exists() {
                bail!("{} exists; not overwriting it", path.display());
            }
        }
        write_private(&private, &key.encrypted_pem(password.as_bytes())?)?;
        std::fs::write(&public, key.public_pem()?)
            .with_context(|| format!("writing {}", public.display()))?;
        println!(
            "private key: {}\npublic key:  {} ({})",
            private.display(),
            public.display(),
            key.fingerprint()?
        );
        Ok(())
    }
}

#[cfg(unix)]
fn write_private(path: &Path, pem: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    file.write_all(pem.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(not(unix))]
fn write_private(path: &Path, pem: &str) -> anyhow::Result<()> {
    std::fs::write(path, pem).with_context(|| format!("writing {}", path.display()))
}

/// `wasmctrl plugin sign`.
#[derive(Debug, clap::Args)]
pub struct SignArgs {
    /// A plugin file (the signature goes beside it, `.sig` added), or a registry reference
    /// (the signature is pushed to the same repository, as cosign does).
    target: String,
    /// The private key: cosign's encrypted format (its password in `COSIGN_PASSWORD`, empty
    /// when unset) or PKCS#8 PEM.
    #[arg(long, value_name = "FILE")]
    key: PathBuf,
    /// The key's certificate (PEM), for a keyless-style signature by a certified key.
    #[arg(long, value_name = "PEM")]
    certificate: Option<PathBuf>,
    /// The certificate's chain (PEM, intermediates then root). Registry signatures only.
    #[arg(long, value_name = "PEM", requires = "certificate")]
    certificate_chain: Option<PathBuf>,
    /// An annotation the signed payload carries (`KEY=VALUE`, repeatable). Registry
    /// signatures only.
    #[arg(short = 'a', long = "annotation", value_name = "KEY=VALUE")]
    annotations: Vec<String>,
    /// Where to write a file's signature (default: beside it, `.sig` added).
    #[arg(long, value_name = "FILE")]
    output_signature: Option<PathBuf>,
    /// How to reach the registry.
    #[command(flatten)]
    registry: RegistryArgs,
}

impl SignArgs {
    /// Sign, and say where the signature went.
    pub async fn run(self) -> anyhow::Result<()> {
        let pem = std::fs::read(&self.key)
            .with_context(|| format!("reading the key {}", self.key.display()))?;
        let password = std::env::var("COSIGN_PASSWORD").unwrap_or_default();
        let key = SigningKey::from_pem(&pem, Some(password.as_bytes()))
            .with_context(|| format!("the key {}", self.key.display()))?;
        let certificate = read_optional(self.certificate.as_deref())?;
        let chain = read_optional(self.certificate_chain.as_deref())?;
        let annotations = parse_annotations(&self.annotations)?;
        if plugin_oci::is_remote(&self.target) {
            let signed = sign_reference(
                &self.target,
                &key,
                certificate.as_deref(),
                chain.as_deref(),
                &annotations,
                &self.registry,
            )
            .await?;
            println!("{signed}");
            return Ok(());
        }
        if !annotations.is_empty() || chain.is_some() {
            bail!("--annotation and --certificate-chain apply to registry signatures only");
        }
        let bytes = std::fs::read(&self.target)
            .with_context(|| format!("reading the plugin {}", self.target))?;
        let bundle = key.sign_blob(&bytes, certificate.as_deref())?;
        let out = self
            .output_signature
            .unwrap_or_else(|| PathBuf::from(cosign::detached(&self.target)));
        let text = serde_json::to_string(&bundle).context("encoding the signature")?;
        std::fs::write(&out, text).with_context(|| format!("writing {}", out.display()))?;
        println!(
            "signed {} ({}) with key {}\nsignature: {}",
            self.target,
            Digest::of(&bytes),
            key.fingerprint()?,
            out.display()
        );
        Ok(())
    }
}

/// Sign the artifact `reference` names: a simple-signing payload naming its manifest, added
/// as a layer to the repository's `sha256-<hex>.sig` manifest (the signatures already
/// there are kept).
async fn sign_reference(
    reference: &str,
    key: &SigningKey,
    certificate: Option<&str>,
    chain: Option<&str>,
    annotations: &BTreeMap<String, String>,
    registry: &RegistryArgs,
) -> anyhow::Result<String> {
    let target = plugin_oci::parse_reference(reference)?;
    let client = plugin_oci::client(registry)?;
    let auth = plugin_oci::docker_auth(&target)?;
    // Any artifact: a plugin, an image, an image index, a chart (as `cosign sign`).
    let manifest_digest = client
        .fetch_manifest_digest(&target, &auth)
        .await
        .with_context(|| format!("reading the manifest of {reference}"))?;
    let repository = format!("{}/{}", target.registry(), target.repository());
    let payload = sign::payload(&repository, &manifest_digest, annotations)?;
    let mut layer_annotations =
        BTreeMap::from([(cosign::SIGNATURE_ANNOTATION.to_owned(), key.sign(&payload)?)]);
    if let Some(certificate) = certificate {
        layer_annotations.insert(
            cosign::CERTIFICATE_ANNOTATION.to_owned(),
            certificate.to_owned(),
        );
    }
    if let Some(chain) = chain {
        layer_annotations.insert(cosign::CHAIN_ANNOTATION.to_owned(), chain.to_owned());
    }
    let signatures = oci_client::Reference::with_tag(
        target.registry().to_owned(),
        target.repository().to_owned(),
        cosign::signature_tag(&manifest_digest),
    );
    let mut layers = existing_layers(&client, &signatures, &auth).await?;
    layers.push(ImageLayer::new(
        payload,
        cosign::SIMPLE_SIGNING_MEDIA_TYPE.to_owned(),
        Some(layer_annotations),
    ));
    let diff_ids: Vec<String> = layers.iter().map(|l| l.sha256_digest()).collect();
    let config = serde_json::json!({
        "architecture": "",
        "os": "",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let config = Config::new(
        serde_json::to_vec(&config)?,
        cosign::SIGNATURE_CONFIG_MEDIA_TYPE.to_owned(),
        None,
    );
    let manifest = OciImageManifest::build(&layers, &config, None);
    push_signature(&client, &signatures, &auth, &layers, config, &manifest)
        .await
        .with_context(|| format!("pushing the signature to {}", signatures.whole()))?;
    Ok(format!(
        "signed {repository}@{manifest_digest} with key {}\nsignature: {} ({} signature(s) there)",
        key.fingerprint()?,
        signatures.whole(),
        layers.len()
    ))
}

/// Push the blobs, then the manifest as plain JSON: the client's canonical encoding leaves
/// the newlines of a PEM certificate annotation unescaped, which registries refuse.
async fn push_signature(
    client: &oci_client::Client,
    signatures: &oci_client::Reference,
    auth: &oci_client::secrets::RegistryAuth,
    layers: &[ImageLayer],
    config: Config,
    manifest: &OciImageManifest,
) -> anyhow::Result<()> {
    client
        .auth(signatures, auth, oci_client::RegistryOperation::Push)
        .await?;
    for layer in layers {
        client
            .push_blob(signatures, layer.data.clone(), &layer.sha256_digest())
            .await?;
    }
    client
        .push_blob(signatures, config.data, &manifest.config.digest)
        .await?;
    let body = serde_json::to_vec(manifest).context("encoding the signature manifest")?;
    client
        .push_manifest_raw(
            signatures,
            body,
            oci_client::manifest::OCI_IMAGE_MEDIA_TYPE.parse()?,
        )
        .await?;
    Ok(())
}

/// The signature layers already under `signatures`, to keep them beside a new one.
async fn existing_layers(
    client: &oci_client::Client,
    signatures: &oci_client::Reference,
    auth: &oci_client::secrets::RegistryAuth,
) -> anyhow::Result<Vec<ImageLayer>> {
    let manifest = match client.pull_image_manifest(signatures, auth).await {
        Ok((manifest, _)) => manifest,
        Err(error) => {
            tracing::debug!(%error, "no signatures yet");
            return Ok(Vec::new());
        }
    };
    let mut layers = Vec::new();
    for layer in &manifest.layers {
        let mut data = Vec::new();
        client
            .pull_blob(signatures, layer, &mut data)
            .await
            .with_context(|| format!("reading a signature of {}", signatures.whole()))?;
        layers.push(ImageLayer::new(
            data,
            layer.media_type.clone(),
            layer.annotations.clone(),
        ));
    }
    Ok(layers)
}

/// `wasmctrl plugin verify`.
#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// A plugin file (its signature beside it, `.sig` added), or a registry reference.
    target: String,
    /// A public key (PEM) that may have signed it (repeatable).
    #[arg(long = "key", value_name = "PEM")]
    keys: Vec<PathBuf>,
    /// The keyless signer's subject (email or URI).
    #[arg(long, conflicts_with = "certificate_identity_regexp")]
    certificate_identity: Option<String>,
    /// The keyless signer's subject, as a regular expression.
    #[arg(long)]
    certificate_identity_regexp: Option<String>,
    /// The keyless signer's OIDC issuer.
    #[arg(long, conflicts_with = "certificate_oidc_issuer_regexp")]
    certificate_oidc_issuer: Option<String>,
    /// The keyless signer's OIDC issuer, as a regular expression.
    #[arg(long)]
    certificate_oidc_issuer_regexp: Option<String>,
    /// The roots keyless certificates must chain to (PEM).
    #[arg(long, value_name = "PEM")]
    trust_root: Option<PathBuf>,
    /// The transparency log's public keys (PEM): require its entry for each signature.
    #[arg(long, value_name = "PEM")]
    rekor_public_keys: Option<PathBuf>,
    /// An annotation the signed payload must carry (`KEY=VALUE`, repeatable).
    #[arg(short = 'a', long = "annotation", value_name = "KEY=VALUE")]
    annotations: Vec<String>,
    /// `text`, or `json`/`yaml`: the target, the digest checked and who signed, each signer
    /// by `key` (a listed key's fingerprint) or `subject` and `issuer` (a keyless signer).
    #[arg(short = 'o', long, value_enum, default_value_t)]
    output: OutputFormat,
    /// How to reach the registry.
    #[command(flatten)]
    registry: RegistryArgs,
}

/// What `plugin verify` found: who signed which bytes.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Verified {
    /// The file or reference as given.
    target: String,
    /// The component's digest, which every accepted signature covers.
    digest: String,
    /// Who signed it, among those asked for; never empty (no one is an error).
    signers: Vec<Signer>,
}

impl Verified {
    fn text(&self) -> String {
        let mut text = format!("{} ({}) is signed by:\n", self.target, self.digest);
        for signer in &self.signers {
            text.push_str(&format!("  {signer}\n"));
        }
        text
    }
}

impl VerifyArgs {
    /// Verify as the host would, and print who signed; an error when no one acceptable did.
    pub async fn run(self) -> anyhow::Result<()> {
        let mut spec = VerifySpec {
            annotations: parse_annotations(&self.annotations)?,
            ..VerifySpec::default()
        };
        for path in &self.keys {
            spec.keys.push(
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading the key {}", path.display()))?,
            );
        }
        let subject = (
            &self.certificate_identity,
            &self.certificate_identity_regexp,
        );
        let issuer = (
            &self.certificate_oidc_issuer,
            &self.certificate_oidc_issuer_regexp,
        );
        match (subject, issuer) {
            ((None, None), (None, None)) => {}
            ((None, None), _) | (_, (None, None)) => bail!(
                "a keyless signer needs both --certificate-identity[-regexp] and --certificate-oidc-issuer[-regexp]"
            ),
            ((subject, subject_reg_exp), (issuer, issuer_reg_exp)) => {
                spec.identities.push(SignerIdentity {
                    issuer: issuer.clone(),
                    issuer_reg_exp: issuer_reg_exp.clone(),
                    subject: subject.clone(),
                    subject_reg_exp: subject_reg_exp.clone(),
                });
            }
        }
        let trust = HostTrust {
            keyless_roots: match &self.trust_root {
                Some(path) => KeylessRoots::from_pem(
                    &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
                )?,
                None => KeylessRoots::default(),
            },
            rekor_keys: self
                .rekor_public_keys
                .as_ref()
                .map(|path| {
                    RekorKeys::from_pem(
                        &std::fs::read(path)
                            .with_context(|| format!("reading {}", path.display()))?,
                    )
                })
                .transpose()?,
        };
        let verifier = Verifier::new(&spec, trust)?;
        let (digest, signatures) = signatures_of(&self.target, &self.registry).await?;
        let verified = Verified {
            signers: verifier.verify(&signatures.found, &digest, &signatures.looked)?,
            digest: digest.to_string(),
            target: self.target,
        };
        print!("{}", self.output.render(&verified, || verified.text())?);
        Ok(())
    }
}

/// The component's digest and the signatures beside it, for a file or a reference.
pub async fn signatures_of(
    target: &str,
    registry: &RegistryArgs,
) -> anyhow::Result<(Digest, Signatures)> {
    if plugin_oci::is_remote(target) {
        let pulled = plugin_oci::fetch(target, registry).await?;
        let reference = plugin_oci::parse_reference(target)?;
        let reader = plugin_oci::reader(registry, &reference)?;
        let signatures =
            crate::registry::oci_signatures(&reader, &reference, &pulled.manifest_digest).await?;
        return Ok((Digest::of(&pulled.bytes), signatures));
    }
    let bytes = std::fs::read(target).with_context(|| format!("reading the plugin {target}"))?;
    let looked = cosign::detached(target);
    let found = match std::fs::read(&looked) {
        Ok(bundle) => vec![crate::signing::Found::from_blob_bundle(&bundle, &looked)?],
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {looked}")),
    };
    Ok((Digest::of(&bytes), Signatures { found, looked }))
}

/// A signature as `plugin inspect` shows it: found, not verified (`plugin verify` does that).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FoundSignature {
    /// Where it is.
    pub location: String,
    /// `payload` (a registry signature) or `component` (a detached one).
    pub signs: &'static str,
    /// Whether a certificate comes with it (a keyless signer).
    pub certificate: bool,
    /// Whether the transparency log's entry comes with it.
    pub transparency_log: bool,
    /// The payload's annotations.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// What `plugin inspect` lists of `signatures`.
pub fn summarize(signatures: &Signatures) -> Vec<FoundSignature> {
    signatures
        .found
        .iter()
        .map(|found| FoundSignature {
            location: found.location.clone(),
            signs: match found.signed {
                Signed::Payload { .. } => "payload",
                Signed::Component => "component",
            },
            certificate: found.certificate.is_some(),
            transparency_log: found.rekor.is_some(),
            annotations: match &found.signed {
                Signed::Payload { parsed, .. } => parsed
                    .optional
                    .as_ref()
                    .map(|o| {
                        o.extra
                            .iter()
                            .map(|(k, v)| {
                                (
                                    k.clone(),
                                    v.as_str().map_or_else(|| v.to_string(), str::to_owned),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                Signed::Component => BTreeMap::new(),
            },
        })
        .collect()
}

fn read_optional(path: Option<&Path>) -> anyhow::Result<Option<String>> {
    path.map(|path| {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    })
    .transpose()
}

fn parse_annotations(pairs: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    pairs
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("--annotation {pair:?} is not KEY=VALUE"))
        })
        .collect()
}
