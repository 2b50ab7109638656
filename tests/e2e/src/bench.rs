//! What the benches (`benches/`, run by `cargo xtask bench`) share: the entry point every
//! bench binary has, a count read from the environment, and a fresh control plane to
//! measure on.

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use wasmctrl_testenv::cluster::{Binaries, ControlPlane, Lifetime};

/// A bench binary's `main`: the plugin-compiling child when this executable was started as
/// one (plugins compile in a child process, as `wasmctrl run` does), otherwise `bench`,
/// with its error printed.
pub fn main(bench: impl FnOnce() -> anyhow::Result<()>) -> ExitCode {
    if let Some(code) = wasmctrl::plugin::compile_child_if_asked() {
        return code;
    }
    match bench() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("Error: {error:?}");
            ExitCode::FAILURE
        }
    }
}

/// The count the environment variable `name` gives, or `default`.
pub fn count_from_env(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name) {
        Ok(text) => text.parse().with_context(|| format!("{name}={text}")),
        Err(_) => Ok(default),
    }
}

/// Run `measure` on a control plane of its own (given the directory `target/cluster-bench-<name>`,
/// its kubeconfig there), stopped and removed after, and print the table it returns.
pub fn on_fresh_control_plane<F, Fut>(name: &str, measure: F) -> anyhow::Result<()>
where
    F: FnOnce(PathBuf) -> Fut,
    Fut: Future<Output = anyhow::Result<String>>,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let binaries = Binaries::build(&wasmctrl_testenv::repo_root())?;
    let dir = wasmctrl_testenv::plugins::target_dir().join(format!("cluster-bench-{name}"));
    let plane = runtime.block_on(ControlPlane::start(
        &dir,
        &binaries,
        Lifetime::TiedToStarter,
    ))?;
    let result = runtime.block_on(measure(dir.clone()));
    plane.stop();
    let _ = std::fs::remove_dir_all(&dir);
    print!("{}", result?);
    Ok(())
}
