//! `cargo xtask check-macos`: type-check the host and the runtime for macOS from Linux, so
//! that code behind `#[cfg(target_os = "linux")]` keeps a fallback that compiles.
//!
//! Only the Rust side can be checked here. The C in the dependency tree (ring, zstd, psm,
//! wasmtime's helpers, jemalloc) needs Apple's SDK headers, which no Linux package ships. So
//! their build scripts run as they would on a Mac — the `cfg`s they set for the Rust code are
//! the real ones — but the C compiler and archiver they call are stand-ins that write empty
//! objects and archives, and jemalloc's build is pointed at an empty library
//! (`JEMALLOC_OVERRIDE`). `cargo check` links nothing, so nothing reads those files. What this
//! proves: every Rust line of `wasmctrl` and `wasmctrl-runtime` compiles for macOS. What it
//! does not: that the C compiles there, or that the binary links and runs.

use std::path::Path;
use std::process::Command;

use anyhow::Context as _;
use wasmctrl_testenv::plugins::target_dir;

use crate::tasks;

/// The macOS target checked: Apple silicon, what a developer's Mac is today.
const TARGET: &str = "aarch64-apple-darwin";

/// Writes an empty file at the `-o` path it is given: a C compiler that compiles nothing.
const STUB_CC: &str = r#"#!/bin/sh
# Stand-in C compiler for `cargo xtask check-macos`: writes an empty object, compiles nothing.
out=
while [ $# -gt 0 ]; do
  case $1 in
    -o) out=$2; shift ;;
    -o*) out=${1#-o} ;;
  esac
  shift
done
if [ -n "$out" ]; then : > "$out"; fi
"#;

/// Writes an empty archive for `ar cq LIB …`: an archiver that archives nothing.
const STUB_AR: &str = r#"#!/bin/sh
# Stand-in archiver for `cargo xtask check-macos`: writes an empty archive.
for arg in "$@"; do
  case $arg in
    *.a) [ -s "$arg" ] || printf '!<arch>\n' > "$arg"; exit 0 ;;
  esac
done
"#;

pub fn check_macos() -> anyhow::Result<()> {
    add_target()?;
    let stubs = target_dir().join("check-macos");
    std::fs::create_dir_all(&stubs).with_context(|| format!("creating {}", stubs.display()))?;
    let cc = write_script(&stubs.join("cc"), STUB_CC)?;
    let ar = write_script(&stubs.join("ar"), STUB_AR)?;
    let jemalloc = stubs.join("libjemalloc.a");
    std::fs::write(&jemalloc, "!<arch>\n")
        .with_context(|| format!("writing {}", jemalloc.display()))?;
    let env_target = TARGET.replace('-', "_");
    tasks::run(
        &format!("type-checking wasmctrl and wasmctrl-runtime for {TARGET} (Rust only)"),
        tasks::cargo()
            .args(["check", "--target", TARGET, "-p", "wasmctrl", "-p"])
            .arg("wasmctrl-runtime")
            .env(format!("CC_{env_target}"), &cc)
            .env(format!("CXX_{env_target}"), &cc)
            .env(format!("AR_{env_target}"), &ar)
            .env("JEMALLOC_OVERRIDE", &jemalloc),
    )
}

/// The target's standard library, from rustup.
fn add_target() -> anyhow::Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("running rustup (the macOS check needs rustup)")?;
    if String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|line| line.trim() == TARGET)
    {
        return Ok(());
    }
    tasks::run(
        &format!("installing the {TARGET} standard library"),
        Command::new("rustup").args(["target", "add", TARGET]),
    )
}

fn write_script(path: &Path, text: &str) -> anyhow::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", path.display()))?;
    Ok(path.to_path_buf())
}
