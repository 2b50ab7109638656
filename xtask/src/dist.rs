//! `cargo xtask dist`: the release archive of the `wasmctrl` CLI, the same static binary the
//! image runs, as `dist/wasmctrl-<version>-x86_64-unknown-linux-musl.tar.gz` beside a
//! `.sha256` in `sha256sum` format. The archive's layout is the one `cargo binstall` is told
//! to expect (`[package.metadata.binstall]` in `host/Cargo.toml`): one directory named like
//! the archive, holding the binary.
//!
//! The archive is reproducible: entries owned by root with times at zero, and gzip's header
//! without a time, so the same binary always gives the same checksum.

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail, ensure};
use sha2::{Digest as _, Sha256};
use wasmctrl_testenv::image;

/// The binary's name, in the archive and on the user's `PATH`.
const BIN: &str = "wasmctrl";

/// What `dist` wrote.
#[derive(Debug)]
pub struct Release {
    /// The `.tar.gz`.
    pub archive: PathBuf,
    /// Its checksum file: `<hex>  <archive file name>`.
    pub checksum: PathBuf,
}

pub fn dist() -> anyhow::Result<()> {
    let binary = image::build_static_binary("release")?;
    let version = version_of(&binary)?;
    let executable = image::stripped(&binary, &binary.with_extension("dist-stripped"))?;
    let out = wasmctrl_testenv::repo_root().join("dist");
    let release = write(&out, &version, image::TARGET, &executable)?;
    verify(&release, &executable)?;
    println!(
        "dist: {} ({:.1} MiB) and {}",
        release.archive.display(),
        std::fs::metadata(&release.archive)?.len() as f64 / f64::from(1 << 20),
        release.checksum.display()
    );
    Ok(())
}

/// The version the built binary reports (`wasmctrl 0.1.0` → `0.1.0`): the archive is named
/// for what it holds, whatever the manifests say.
pub fn version_of(binary: &Path) -> anyhow::Result<String> {
    let output = Command::new(binary)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", binary.display()))?;
    ensure!(
        output.status.success(),
        "{} --version failed ({})",
        binary.display(),
        output.status
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    match stdout.trim().split_once(' ') {
        Some((name, version)) if name == BIN && !version.is_empty() => Ok(version.to_owned()),
        _ => bail!(
            "{} --version printed {stdout:?}, not `{BIN} <version>`",
            binary.display()
        ),
    }
}

/// The archive's base name, also the directory inside it: `wasmctrl-<version>-<target>`.
fn base_name(version: &str, target: &str) -> String {
    format!("{BIN}-{version}-{target}")
}

/// Write `executable` as the release archive for `version` and `target` into `out`, and its
/// checksum file beside it.
pub fn write(
    out: &Path,
    version: &str,
    target: &str,
    executable: &[u8],
) -> anyhow::Result<Release> {
    let base = base_name(version, target);
    let mut tar = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Directory);
    header.set_mode(0o755);
    header.set_mtime(0);
    header.set_size(0);
    tar.append_data(&mut header, &base, std::io::empty())?;
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_mode(0o755);
    header.set_mtime(0);
    header.set_size(executable.len() as u64);
    tar.append_data(&mut header, format!("{base}/{BIN}"), executable)?;
    let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gzip.write_all(&tar.into_inner()?)?;
    let archive_bytes = gzip.finish()?;

    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let archive = out.join(format!("{base}.tar.gz"));
    std::fs::write(&archive, &archive_bytes)
        .with_context(|| format!("writing {}", archive.display()))?;
    let checksum = out.join(format!("{base}.tar.gz.sha256"));
    std::fs::write(
        &checksum,
        format!(
            "{}  {base}.tar.gz\n",
            hex::encode(Sha256::digest(&archive_bytes))
        ),
    )
    .with_context(|| format!("writing {}", checksum.display()))?;
    Ok(Release { archive, checksum })
}

/// Read the release back as a user would: the checksum file names the archive and matches
/// it, and the archive holds exactly `<base>/wasmctrl`, executable, with `executable`'s bytes.
pub fn verify(release: &Release, executable: &[u8]) -> anyhow::Result<()> {
    let archive_name = release
        .archive
        .file_name()
        .and_then(|name| name.to_str())
        .context("the archive has no file name")?;
    let base = archive_name
        .strip_suffix(".tar.gz")
        .context("the archive is not a .tar.gz")?;
    let archive_bytes = std::fs::read(&release.archive)
        .with_context(|| format!("reading {}", release.archive.display()))?;
    let checksum = std::fs::read_to_string(&release.checksum)
        .with_context(|| format!("reading {}", release.checksum.display()))?;
    let expected = format!(
        "{}  {archive_name}\n",
        hex::encode(Sha256::digest(&archive_bytes))
    );
    ensure!(
        checksum == expected,
        "{} says {checksum:?}, but the archive's sha256sum line is {expected:?}",
        release.checksum.display()
    );

    let mut entries = Vec::new();
    let mut found = None;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(&archive_bytes[..]));
    for entry in tar.entries()? {
        let mut entry = entry?;
        let path = entry
            .path()?
            .to_string_lossy()
            .trim_end_matches('/')
            .to_owned();
        if path == format!("{base}/{BIN}") {
            let mode = entry.header().mode()?;
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes)?;
            found = Some((mode, bytes));
        }
        entries.push(path);
    }
    ensure!(
        entries == [base.to_owned(), format!("{base}/{BIN}")],
        "{} holds {entries:?}, not just {base}/{BIN}",
        release.archive.display()
    );
    let (mode, bytes) = found.context("the archive holds no binary")?;
    ensure!(
        mode & 0o111 == 0o111,
        "{base}/{BIN} is not executable (mode {mode:o})"
    );
    ensure!(
        bytes == executable,
        "{base}/{BIN} in the archive is not the binary that was built"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TARGET: &str = "x86_64-unknown-linux-musl";

    #[test]
    fn the_archive_holds_the_binary_and_its_checksum_file_matches() {
        let out = tempfile::tempdir().expect("temp dir");
        let binary = b"\x7fELF a static wasmctrl";
        let release = write(out.path(), "1.2.3", TARGET, binary).expect("write");
        assert_eq!(
            release.archive,
            out.path()
                .join("wasmctrl-1.2.3-x86_64-unknown-linux-musl.tar.gz")
        );
        verify(&release, binary).expect("a release as written verifies");

        // What `sha256sum -c` reads: one line, two spaces, the archive's file name.
        let line = std::fs::read_to_string(&release.checksum).expect("checksum");
        let (hex, name) = line.trim_end().split_once("  ").expect("two spaces");
        assert_eq!(name, "wasmctrl-1.2.3-x86_64-unknown-linux-musl.tar.gz");
        assert_eq!(hex.len(), 64);
        if Command::new("sha256sum").arg("--version").output().is_ok() {
            let check = Command::new("sha256sum")
                .arg("-c")
                .arg(&release.checksum)
                .current_dir(out.path())
                .output()
                .expect("sha256sum");
            assert!(
                check.status.success(),
                "{}",
                String::from_utf8_lossy(&check.stderr)
            );
        }
    }

    /// `cargo binstall` looks for what `dist` writes: host/Cargo.toml's templates, filled in
    /// as binstall fills them, name the archive and the binary's path inside it.
    #[test]
    fn binstall_metadata_names_the_archive_dist_writes() {
        let manifest =
            std::fs::read_to_string(wasmctrl_testenv::repo_root().join("host/Cargo.toml"))
                .expect("host/Cargo.toml");
        let manifest: toml_edit::DocumentMut = manifest.parse().expect("toml");
        let package = &manifest["package"];
        let binstall = &package["metadata"]["binstall"];
        let fill = |template: &str| {
            template
                .replace(
                    "{ repo }",
                    package["repository"].as_str().expect("repository"),
                )
                .replace("{ version }", "1.2.3")
                .replace("{ name }", package["name"].as_str().expect("name"))
                .replace("{ target }", TARGET)
                .replace("{ bin }", BIN)
                .replace("{ binary-ext }", "")
        };
        let out = tempfile::tempdir().expect("temp dir");
        let release = write(out.path(), "1.2.3", TARGET, b"binary").expect("write");
        let archive_name = release.archive.file_name().expect("name").to_string_lossy();
        let url = fill(binstall["pkg-url"].as_str().expect("pkg-url"));
        assert!(
            url.ends_with(&format!("/releases/download/v1.2.3/{archive_name}")),
            "{url}"
        );
        assert_eq!(
            fill(binstall["bin-dir"].as_str().expect("bin-dir")),
            format!("{}/{BIN}", base_name("1.2.3", TARGET))
        );
        assert_eq!(binstall["pkg-fmt"].as_str(), Some("tgz"));
    }

    #[test]
    fn the_same_binary_gives_the_same_archive() {
        let (one, two) = (
            tempfile::tempdir().expect("dir"),
            tempfile::tempdir().expect("dir"),
        );
        let first = write(one.path(), "1.2.3", TARGET, b"binary").expect("write");
        let second = write(two.path(), "1.2.3", TARGET, b"binary").expect("write");
        assert_eq!(
            std::fs::read(first.archive).expect("read"),
            std::fs::read(second.archive).expect("read")
        );
    }

    #[test]
    fn a_tampered_archive_or_another_binary_fails_verification() {
        let out = tempfile::tempdir().expect("temp dir");
        let release = write(out.path(), "1.2.3", TARGET, b"binary").expect("write");
        let error = verify(&release, b"another binary").expect_err("another binary");
        assert!(error.to_string().contains("not the binary"), "{error:#}");

        let mut bytes = std::fs::read(&release.archive).expect("read");
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&release.archive, bytes).expect("write");
        let error = verify(&release, b"binary").expect_err("tampered");
        assert!(error.to_string().contains("sha256sum line"), "{error:#}");
    }
}
