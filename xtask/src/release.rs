//! `cargo xtask release`: everything a release ships, built, pushed to one registry and
//! signed with the release key, so that nothing has to be built from source to install it:
//!
//! - the host image as an OCI image index, one image per platform (`linux/amd64`,
//!   `linux/arm64`): `REGISTRY/wasmctrl:VERSION`;
//! - the Helm chart as an OCI artifact whose image is that index, pinned by its digest:
//!   `helm install wasmctrl oci://REGISTRY/charts/wasmctrl --version VERSION`;
//! - the MyApp example plugin as a Wasm OCI artifact: `REGISTRY/plugins/myapp:VERSION`;
//! - the CLI archives, one per platform, and the chart's package, listed with their SHA-256
//!   in `SHA256SUMS`, in the output directory.
//!
//! Signatures are cosign's, made with the release key (`wasmctrl plugin keygen`; its password
//! in `COSIGN_PASSWORD`): the index, the chart and the plugin carry one in their
//! repositories (`cosign verify --key release.pub REF`), `SHA256SUMS` a bundle beside it
//! (`SHA256SUMS.sig`: `wasmctrl plugin verify SHA256SUMS --key release.pub`, or
//! `cosign verify-blob --bundle`). `release.json` lists every reference and digest.
//!
//! The version must be the workspace's: what the binaries report and what the chart says
//! are then the same. Pushing and signing are done by the release's own `wasmctrl` (the
//! linux/amd64 build), with the docker configuration's credentials; the chart is pushed by
//! the pinned helm, with helm's (`helm registry login`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail, ensure};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use wasmctrl_testenv::image;

/// A platform the release builds for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Platform {
    /// x86_64.
    #[value(name = "linux/amd64")]
    LinuxAmd64,
    /// aarch64, cross-compiled with cargo-zigbuild.
    #[value(name = "linux/arm64")]
    LinuxArm64,
}

impl Platform {
    /// The Rust target of its static binary.
    pub fn target(self) -> &'static str {
        match self {
            Self::LinuxAmd64 => "x86_64-unknown-linux-musl",
            Self::LinuxArm64 => "aarch64-unknown-linux-musl",
        }
    }

    /// Its architecture, as OCI names it.
    pub fn architecture(self) -> &'static str {
        match self {
            Self::LinuxAmd64 => "amd64",
            Self::LinuxArm64 => "arm64",
        }
    }
}

/// What `cargo xtask release` is asked.
#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    /// Where everything goes: `HOST[:PORT][/PATH]`, e.g. `ghcr.io/acme`.
    #[arg(long)]
    pub registry: String,
    /// The release's version: the workspace's (`Cargo.toml`), checked.
    #[arg(long)]
    pub version: String,
    /// The release key (cosign's encrypted format, its password in `COSIGN_PASSWORD`).
    #[arg(long, value_name = "FILE")]
    pub key: PathBuf,
    /// The platforms of the image and the CLI archives; linux/amd64 is always among them
    /// (its `wasmctrl` pushes and signs).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "linux/amd64,linux/arm64"
    )]
    pub platforms: Vec<Platform>,
    /// Talk plain HTTP to the registry (a local one).
    #[arg(long)]
    pub insecure: bool,
    /// Cargo profile of the binaries (the e2e suite sets `image-test`, which builds faster).
    #[arg(long, env = "WASMCTRL_IMAGE_PROFILE", default_value = "release")]
    pub profile: String,
    /// Where the archives, SHA256SUMS and release.json go; default `dist/release-VERSION`.
    #[arg(long, value_name = "DIR")]
    pub output_dir: Option<PathBuf>,
    /// Release the version again, replacing what its tags name.
    #[arg(long)]
    pub force: bool,
}

/// What a release pushed and wrote: `release.json`.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct Released {
    version: String,
    /// The image index, by tag and by digest.
    image: Pushed,
    /// Each platform's image in the index.
    platforms: Vec<Value>,
    chart: Pushed,
    plugin: Pushed,
    /// The files in the output directory, by name, with their SHA-256.
    files: Vec<Value>,
}

#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct Pushed {
    reference: String,
    digest: String,
}

impl Pushed {
    fn pinned(&self) -> String {
        let repository = self
            .reference
            .rsplit_once(':')
            .filter(|(_, tag)| !tag.contains('/'))
            .map_or(self.reference.as_str(), |(repository, _)| repository);
        format!("{repository}@{}", self.digest)
    }
}

pub fn release(args: &ReleaseArgs) -> anyhow::Result<()> {
    let version = env!("CARGO_PKG_VERSION");
    ensure!(
        args.version == version,
        "the workspace's version is {version}, not {}: set it in Cargo.toml first, so the binaries, the image and the chart all say the same",
        args.version
    );
    ensure!(
        args.platforms.contains(&Platform::LinuxAmd64),
        "a release includes linux/amd64: its wasmctrl pushes and signs the rest"
    );
    let registry = args.registry.trim_end_matches('/');
    let out = args.output_dir.clone().unwrap_or_else(|| {
        wasmctrl_testenv::repo_root()
            .join("dist")
            .join(format!("release-{version}"))
    });
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let key = std::fs::canonicalize(&args.key)
        .with_context(|| format!("the release key {}", args.key.display()))?;

    let built = build(args, version, &out)?;
    let wasmctrl = Wasmctrl {
        binary: built.wasmctrl.clone(),
        key,
        insecure: args.insecure,
    };
    crate::tasks::build_named_plugins(&["myapp-plugin".to_owned()])?;

    // Nothing is pushed until the key signs and the version is not out yet: a release that
    // fails here has published nothing.
    let check = out.join("key-check");
    std::fs::write(&check, version)?;
    let signed = wasmctrl.sign_file(&check);
    let _ = std::fs::remove_file(out.join("key-check.sig"));
    let _ = std::fs::remove_file(&check);
    signed.context("the release key does not sign (is COSIGN_PASSWORD its password?)")?;
    let runtime = tokio::runtime::Runtime::new()?;
    let image_ref = format!("{registry}/wasmctrl:{version}");
    let exists = runtime
        .block_on(image::manifest_exists(&image_ref, args.insecure))
        .context(
            "checking whether the version is out already (--force releases without the check)",
        )?;
    if !args.force && exists {
        bail!("{image_ref} exists: version {version} is released already (--force replaces it)");
    }

    let mut published = Vec::new();
    let released = publish(
        &runtime,
        &wasmctrl,
        &built,
        registry,
        version,
        &out,
        args,
        &mut published,
    )
    .with_context(|| match published.is_empty() {
        true => "nothing was published".to_owned(),
        false => format!(
            "published before the failure, unsigned or incomplete: {}",
            published.join(", ")
        ),
    })?;
    let manifest = out.join("release.json");
    std::fs::write(&manifest, serde_json::to_string_pretty(&released)? + "\n")?;
    println!(
        "release: {version} in {} (release.json, SHA256SUMS, SHA256SUMS.sig)\n\
         install: helm install wasmctrl oci://{registry}/charts/wasmctrl --version {version}",
        out.display()
    );
    Ok(())
}

/// What the release built before it pushes anything.
struct Built {
    /// Each platform's image.
    images: Vec<(Platform, image::Image)>,
    /// The CLI archives.
    archives: Vec<PathBuf>,
    /// The linux/amd64 binary, which pushes and signs.
    wasmctrl: PathBuf,
}

/// The binaries, images and archives, one per platform.
fn build(args: &ReleaseArgs, version: &str, out: &Path) -> anyhow::Result<Built> {
    let mut images = Vec::new();
    let mut archives = Vec::new();
    let mut wasmctrl = None;
    for platform in dedup(&args.platforms) {
        let binary = image::build_static_binary_for(platform.target(), &args.profile)?;
        if platform == Platform::LinuxAmd64 {
            let reported = crate::dist::version_of(&binary)?;
            ensure!(reported == version, "the binary reports {reported}");
            wasmctrl = Some(binary.clone());
        }
        let layout = out.join("image").join(platform.architecture());
        let built = image::assemble_for(&binary, &layout, platform.architecture())?;
        let executable = image::stripped(&binary, &binary.with_extension("release-stripped"))?;
        archives.push(crate::dist::write(out, version, platform.target(), &executable)?.archive);
        images.push((platform, built));
    }
    Ok(Built {
        images,
        archives,
        wasmctrl: wasmctrl.context("the linux/amd64 binary")?,
    })
}

/// Push and sign everything, recording in `published` what is out as it goes out.
#[allow(clippy::too_many_arguments)]
fn publish(
    runtime: &tokio::runtime::Runtime,
    wasmctrl: &Wasmctrl,
    built: &Built,
    registry: &str,
    version: &str,
    out: &Path,
    args: &ReleaseArgs,
    published: &mut Vec<String>,
) -> anyhow::Result<Released> {
    // The image index.
    let image_ref = format!("{registry}/wasmctrl:{version}");
    let index = runtime.block_on(image::push_index(
        &built
            .images
            .iter()
            .map(|(platform, image)| (platform.architecture(), image))
            .collect::<Vec<_>>(),
        &image_ref,
        args.insecure,
    ))?;
    published.push(image_ref.clone());
    let image = Pushed {
        reference: image_ref,
        digest: index,
    };
    wasmctrl.sign(&image.pinned())?;
    println!("release: image {} ({})", image.reference, image.digest);

    // The example plugin.
    let plugin_ref = format!("{registry}/plugins/myapp:{version}");
    let plugin = wasmctrl.push_plugin(
        &wasmctrl_testenv::plugins::guest_path("myapp_plugin"),
        &plugin_ref,
    )?;
    published.push(plugin_ref);
    wasmctrl.sign(&plugin.pinned())?;
    println!("release: plugin {} ({})", plugin.reference, plugin.digest);

    // The chart, its image pinned to the index.
    let package = package_chart(out, version, &format!("{registry}/wasmctrl"), &image.digest)?;
    let chart = push_chart(&package, registry, version, args.insecure)?;
    published.push(chart.reference.clone());
    wasmctrl.sign(&chart.pinned())?;
    println!("release: chart {} ({})", chart.reference, chart.digest);

    // Checksums of every file, signed.
    let mut files = built.archives.clone();
    files.push(package);
    let listed = write_checksums(out, &files)?;
    wasmctrl.sign_file(&out.join("SHA256SUMS"))?;

    Ok(Released {
        version: version.to_owned(),
        platforms: built
            .images
            .iter()
            .map(|(platform, image)| {
                json!({"platform": format!("linux/{}", platform.architecture()), "digest": image.digest()})
            })
            .collect(),
        image,
        chart,
        plugin,
        files: listed,
    })
}

/// `SHA256SUMS` in `out`: a `sha256sum` line for each of `files`; what it lists.
fn write_checksums(out: &Path, files: &[PathBuf]) -> anyhow::Result<Vec<Value>> {
    let mut listed = Vec::new();
    let mut text = String::new();
    for file in files {
        let name = file
            .file_name()
            .and_then(|n| n.to_str())
            .context("a file name")?;
        let hex = hex::encode(Sha256::digest(
            std::fs::read(file).with_context(|| format!("reading {}", file.display()))?,
        ));
        text.push_str(&format!("{hex}  {name}\n"));
        listed.push(json!({"name": name, "sha256": hex}));
    }
    let sums = out.join("SHA256SUMS");
    std::fs::write(&sums, text).with_context(|| format!("writing {}", sums.display()))?;
    Ok(listed)
}

/// `platforms` in order, each once.
fn dedup(platforms: &[Platform]) -> Vec<Platform> {
    let mut unique = Vec::new();
    for platform in platforms {
        if !unique.contains(platform) {
            unique.push(*platform);
        }
    }
    unique
}

/// The release's own `wasmctrl`, which pushes and signs.
struct Wasmctrl {
    binary: PathBuf,
    key: PathBuf,
    insecure: bool,
}

impl Wasmctrl {
    /// Run `wasmctrl args`, over plain HTTP when `registry` and the release is insecure.
    fn run(&self, args: &[&str], registry: bool) -> anyhow::Result<String> {
        let mut command = Command::new(&self.binary);
        command.args(args);
        if registry && self.insecure {
            command.arg("--plain-http");
        }
        let output = command
            .output()
            .with_context(|| format!("running {}", self.binary.display()))?;
        ensure!(
            output.status.success(),
            "wasmctrl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
        Ok(String::from_utf8(output.stdout)?)
    }

    /// Sign a registry reference (a signature in its repository).
    fn sign(&self, reference: &str) -> anyhow::Result<()> {
        let key = self.key.display().to_string();
        self.run(&["plugin", "sign", reference, "--key", &key], true)?;
        Ok(())
    }

    /// Sign a file: a bundle beside it, `.sig` added.
    fn sign_file(&self, file: &Path) -> anyhow::Result<()> {
        let key = self.key.display().to_string();
        let file = file.display().to_string();
        self.run(&["plugin", "sign", &file, "--key", &key], false)?;
        Ok(())
    }

    /// Push a plugin; the reference as pushed and its manifest's digest.
    fn push_plugin(&self, file: &Path, reference: &str) -> anyhow::Result<Pushed> {
        let file = file.display().to_string();
        let said: Value = serde_json::from_str(
            &self.run(&["plugin", "push", &file, reference, "-o", "json"], true)?,
        )
        .context("plugin push -o json")?;
        Ok(Pushed {
            reference: reference.to_owned(),
            digest: said["manifestDigest"]
                .as_str()
                .context("the manifest's digest")?
                .to_owned(),
        })
    }
}

/// Package the chart at `version`, its default image `repository` pinned to `digest`; the
/// package's path (in `out`).
fn package_chart(
    out: &Path,
    version: &str,
    repository: &str,
    digest: &str,
) -> anyhow::Result<PathBuf> {
    let source = wasmctrl_testenv::repo_root().join("deploy/chart/wasmctrl");
    let staged = out.join("chart").join("wasmctrl");
    let _ = std::fs::remove_dir_all(&staged);
    copy_dir(&source, &staged)?;
    let values = staged.join("values.yaml");
    let text = std::fs::read_to_string(&values)?;
    std::fs::write(&values, pin_image(&text, repository, digest)?)?;
    let helm = wasmctrl_testenv::tools::helm()?;
    let output = Command::new(&helm)
        .args([
            "package",
            "--version",
            version,
            "--app-version",
            version,
            "-d",
        ])
        .arg(out)
        .arg(&staged)
        .output()
        .with_context(|| format!("running {}", helm.display()))?;
    ensure!(
        output.status.success(),
        "helm package failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(out.join(format!("wasmctrl-{version}.tgz")))
}

/// Push the packaged chart to `REGISTRY/charts`; its reference and digest.
fn push_chart(
    package: &Path,
    registry: &str,
    version: &str,
    insecure: bool,
) -> anyhow::Result<Pushed> {
    let helm = wasmctrl_testenv::tools::helm()?;
    let mut command = Command::new(&helm);
    command
        .arg("push")
        .arg(package)
        .arg(format!("oci://{registry}/charts"));
    if insecure {
        command.arg("--plain-http");
    }
    let output = command
        .output()
        .with_context(|| format!("running {}", helm.display()))?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(output.status.success(), "helm push failed: {said}");
    let digest = said
        .lines()
        .find_map(|line| line.trim().strip_prefix("Digest: "))
        .with_context(|| format!("helm push printed no digest: {said}"))?;
    Ok(Pushed {
        reference: format!("{registry}/charts/wasmctrl:{version}"),
        digest: digest.trim().to_owned(),
    })
}

/// `values` (the chart's values.yaml) with `image.repository` and `image.digest` set: the
/// two lines under `image:`, each of which must be there exactly once.
fn pin_image(values: &str, repository: &str, digest: &str) -> anyhow::Result<String> {
    let mut out = String::with_capacity(values.len());
    let (mut in_image, mut repository_set, mut digest_set) = (false, false, false);
    for line in values.lines() {
        if !line.starts_with(' ') && !line.starts_with('#') && !line.is_empty() {
            in_image = line == "image:";
        }
        if in_image && line.starts_with("  repository: ") {
            ensure!(!repository_set, "image.repository twice");
            out.push_str(&format!("  repository: {repository}\n"));
            repository_set = true;
        } else if in_image && line.starts_with("  digest: ") {
            ensure!(!digest_set, "image.digest twice");
            out.push_str(&format!("  digest: {digest}\n"));
            digest_set = true;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !(repository_set && digest_set) {
        bail!("the chart's values.yaml has no image.repository or image.digest line to set");
    }
    Ok(out)
}

fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_packaged_chart_pulls_the_released_index_by_digest() -> anyhow::Result<()> {
        let values = std::fs::read_to_string(
            wasmctrl_testenv::repo_root().join("deploy/chart/wasmctrl/values.yaml"),
        )?;
        let pinned = pin_image(&values, "ghcr.io/acme/wasmctrl", "sha256:abc")?;
        let parsed: Value = serde_yaml_ng::from_str(&pinned)?;
        assert_eq!(parsed["image"]["repository"], "ghcr.io/acme/wasmctrl");
        assert_eq!(parsed["image"]["digest"], "sha256:abc");
        assert_eq!(
            pinned.lines().count(),
            values.lines().count(),
            "nothing else changed"
        );
        assert!(pin_image("image:\n  tag: x\n", "r", "d").is_err());
        Ok(())
    }

    #[test]
    fn a_pinned_reference_drops_the_tag_not_the_port() {
        let pushed = Pushed {
            reference: "127.0.0.1:5000/charts/wasmctrl:0.1.0".into(),
            digest: "sha256:abc".into(),
        };
        assert_eq!(pushed.pinned(), "127.0.0.1:5000/charts/wasmctrl@sha256:abc");
        let untagged = Pushed {
            reference: "127.0.0.1:5000/wasmctrl".into(),
            digest: "sha256:abc".into(),
        };
        assert_eq!(untagged.pinned(), "127.0.0.1:5000/wasmctrl@sha256:abc");
    }
}
