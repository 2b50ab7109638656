//! The guest plugins the tests run, built on first use.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Every plugin crate in the repository, built for wasm32-wasip2 one cargo invocation each
/// (by the tests on first use, and by `cargo xtask build-plugins`).
pub const GUESTS: [&str; 8] = [
    "myapp-plugin",
    "widget-plugin",
    "stack-plugin",
    "myapp-v2-plugin",
    "myapp-before-plugin",
    "misbehave-plugin",
    "wrong-world-plugin",
    "future-contract-plugin",
];

/// Python plugins (`plugins/python/<dir>/app.py`, with the Python SDK beside them), built
/// with componentize-py into `<stem>.wasm`: (directory, file stem).
pub const PYTHON_GUESTS: [(&str, &str); 1] = [("myapp", "myapp_py")];

/// Build every Python guest whose component is older than its sources (app, SDK, contract)
/// or the pinned componentize-py. About 5 s each when it has to.
pub fn build_python_guests() -> anyhow::Result<()> {
    use anyhow::Context as _;
    let root = crate::repo_root();
    let componentize = crate::tools::build("componentize-py")?;
    let python = root.join("plugins/python");
    for (dir, stem) in PYTHON_GUESTS {
        let app = python.join(dir);
        let out = guest_path(stem);
        let inputs = [
            app.join("app.py"),
            python.join("wasmctrl_plugin.py"),
            root.join("wit/plugin.wit"),
            componentize.clone(),
        ];
        if is_newer_than_all(&out, &inputs) {
            continue;
        }
        std::fs::create_dir_all(plugin_dir())?;
        let output = Command::new(&componentize)
            .arg("-d")
            .arg(root.join("wit"))
            .args(["-w", "plugin", "componentize", "app", "-p"])
            .arg(&app)
            .arg("-p")
            .arg(&python)
            .arg("-o")
            .arg(&out)
            .output()
            .with_context(|| format!("running {}", componentize.display()))?;
        anyhow::ensure!(
            output.status.success(),
            "componentize-py could not build {}: {}",
            app.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

fn is_newer_than_all(out: &std::path::Path, inputs: &[PathBuf]) -> bool {
    let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let Some(built) = modified(out) else {
        return false;
    };
    inputs
        .iter()
        .all(|input| modified(input).is_some_and(|t| t <= built))
}

/// Cargo's target directory (honours `CARGO_TARGET_DIR`, as CI sets it).
pub fn target_dir() -> PathBuf {
    let root = crate::repo_root();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    if target.is_absolute() {
        target
    } else {
        root.join(target)
    }
}

/// Names the directory built plugin components are read from when it is not the target
/// directory's (a bench built into a target directory of its own reads them from the usual
/// one).
pub const PLUGIN_DIR_ENV: &str = "WASMCTRL_PLUGIN_DIR";

/// Where cargo puts plugin components.
pub fn plugin_dir() -> PathBuf {
    match std::env::var_os(PLUGIN_DIR_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => target_dir().join("wasm32-wasip2").join("plugin"),
    }
}

/// Where the component `file_stem` is once built (without building it).
pub fn guest_path(file_stem: &str) -> PathBuf {
    plugin_dir().join(format!("{file_stem}.wasm"))
}

/// The path of a built guest component, e.g. `guest("myapp_plugin")`. The first call in a
/// process builds every guest (a no-op when they are up to date), so tests never run a stale
/// plugin; unless the runner says they were built for this run
/// ([`PLUGINS_BUILT_ENV`](crate::runner::PLUGINS_BUILT_ENV)).
pub fn guest(file_stem: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        if std::env::var_os(crate::runner::PLUGINS_BUILT_ENV).is_some() {
            return;
        }
        // One cargo invocation per plugin: building them together would unify features,
        // and myapp-v2 needs MyApp's logic without MyApp's component export.
        for guest in GUESTS {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = Command::new(cargo)
                .current_dir(crate::repo_root())
                .args(["build", "--quiet", "--target", "wasm32-wasip2", "--profile", "plugin", "-p", guest])
                .status()
                .expect("running cargo to build the guest plugins");
            assert!(
                status.success(),
                "building {guest} failed; is the wasm32-wasip2 target installed? (`cargo xtask setup`)"
            );
        }
        if let Err(e) = build_python_guests() {
            panic!("building the Python guest plugins failed: {e:#}");
        }
    });
    let path = guest_path(file_stem);
    assert!(path.exists(), "{} was not built", path.display());
    path
}

/// The bytes of a built guest component.
pub fn guest_bytes(file_stem: &str) -> Vec<u8> {
    std::fs::read(guest(file_stem)).expect("reading a built guest")
}
