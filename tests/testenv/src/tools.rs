//! Go-built tools the tests use (`tools/<name>/build.sh`), built once into the cache and
//! reused across runs, as the control plane is.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

/// The path of tool `name`, built by `tools/<name>/build.sh` if the cache lacks it.
pub fn build(name: &str) -> anyhow::Result<PathBuf> {
    let script = crate::repo_root().join(format!("tools/{name}/build.sh"));
    let output = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        bail!("{} failed ({})", script.display(), output.status);
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
