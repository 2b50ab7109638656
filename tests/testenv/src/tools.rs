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
