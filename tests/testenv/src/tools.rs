//! Go-built tools the tests use (`tools/<name>/build.sh`), built once into the cache and
//! reused across runs, as the control plane is.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

/// The path of tool `name`, built by `tools/<name>/build.sh` if the cache lacks it.
pub fn build(name: &str) -> anyhow::Result<PathBuf> {
    build_in(&crate::repo_root(), name)
}

/// [`build`] with the scripts of the checkout at `repo_root`. A script prints the path of
/// what it built (a binary, or a directory of them) on its last line of stdout.
pub fn build_in(repo_root: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let script = repo_root.join(format!("tools/{name}/build.sh"));
    let output = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{} failed ({}); see the messages above",
            script.display(),
            output.status
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    Ok(PathBuf::from(
        stdout
            .lines()
            .last()
            .context("build.sh printed no path")?
            .trim(),
    ))
}

/// The pinned Helm CLI (`tools/helm`).
pub fn helm() -> anyhow::Result<PathBuf> {
    build("helm")
}

/// Install Debian package `package` (for what `why` needs), refreshing the package lists
/// once if the install fails: a machine image's lists can be older than the mirror.
pub fn debian_package(package: &str, why: &str) -> anyhow::Result<()> {
    eprintln!("installing {package} ({why}) from Debian's packages");
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "-q", package])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .context("running apt-get")
    };
    if install()?.success() {
        return Ok(());
    }
    let update = Command::new("apt-get")
        .args(["update", "-q"])
        .status()
        .context("running apt-get update")?;
    let status = install()?;
    if !status.success() {
        if !update.success() {
            eprintln!("apt-get update failed too ({update})");
        }
        bail!(
            "installing {package} failed ({status}); run as root, or install it: apt-get install {package}"
        );
    }
    Ok(())
}
