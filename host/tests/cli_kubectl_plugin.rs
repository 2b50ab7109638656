//! `wasmctrl` as a kubectl plugin: a link named `kubectl-wasmctrl` runs the same commands,
//! and its help names the command as the user types it, `kubectl wasmctrl`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A link `kubectl-wasmctrl` to the built binary, in a directory of its own, as a user makes
/// one on their `PATH`.
fn kubectl_plugin_link(dir: &Path) -> PathBuf {
    let link = dir.join("kubectl-wasmctrl");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_wasmctrl"), &link).expect("symlink");
    link
}

fn run(program: &Path, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .env("WASMCTRL_LOG", "off")
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()))
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn run_as_kubectl_wasmctrl_the_help_names_kubectl_wasmctrl() {
    let dir = tempfile::tempdir().expect("temp dir");
    let link = kubectl_plugin_link(dir.path());

    let help = stdout(&run(&link, &["--help"]));
    assert!(
        help.contains("Usage: kubectl wasmctrl [OPTIONS] <COMMAND>"),
        "{help}"
    );
    let explain = stdout(&run(&link, &["explain", "--help"]));
    assert!(
        explain.contains("Usage: kubectl wasmctrl explain "),
        "{explain}"
    );

    // Under its own name, the binary is `wasmctrl` as before.
    let own = stdout(&run(Path::new(env!("CARGO_BIN_EXE_wasmctrl")), &["--help"]));
    assert!(own.contains("Usage: wasmctrl [OPTIONS] <COMMAND>"), "{own}");
}

#[test]
fn run_as_kubectl_wasmctrl_the_commands_are_wasmctrl_s() {
    let dir = tempfile::tempdir().expect("temp dir");
    let link = kubectl_plugin_link(dir.path());

    let version: serde_json::Value =
        serde_yaml_ng::from_str(&stdout(&run(&link, &["version"]))).expect("YAML");
    assert_eq!(version["wasmctrl"], env!("CARGO_PKG_VERSION"));
    assert!(
        version["pluginContracts"][0]
            .as_str()
            .is_some_and(|contract| contract.starts_with("wasmctrl:plugin@")),
        "{version}"
    );

    // A mistake is reported against the command as typed.
    let wrong = run(&link, &["no-such-command"]);
    assert!(!wrong.status.success());
    let stderr = String::from_utf8_lossy(&wrong.stderr);
    assert!(stderr.contains("Usage: kubectl wasmctrl"), "{stderr}");
}
