//! `wasmctrl plugin new`: the crate it writes builds, passes its own tests and golden cases,
//! and runs, outside any workspace (with the SDK this binary carries); inside a workspace it
//! becomes a member.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn wasmctrl(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .current_dir(dir)
        .env("WASMCTRL_LOG", "off")
        .arg("--cache-dir")
        .arg(support::workspace_root().join("target/test-artifact-cache"))
        .args(args)
        .output()
        .expect("run wasmctrl")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The scaffolded crate builds in its own target directory: `cargo test` holds the lock on
/// this one while tests run. It lives under cargo's target tree, so CI's cache keeps its
/// dependencies between runs.
fn scaffold_target_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("plugin-new-target")
}

/// Run `command` in the scaffolded crate with this `wasmctrl` first on PATH.
fn in_crate(dir: &Path, program: &str, args: &[&str]) -> Output {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .parent()
        .expect("bin dir")
        .to_path_buf();
    let path = std::env::join_paths(std::iter::once(bin_dir).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .expect("PATH");
    Command::new(program)
        .current_dir(dir)
        .args(args)
        .env("PATH", path)
        .env("CARGO_TARGET_DIR", scaffold_target_dir())
        .env("WASMCTRL_LOG", "off")
        .env(
            "WASMCTRL_CACHE_DIR",
            support::workspace_root().join("target/test-artifact-cache"),
        )
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"))
}

fn read_yaml(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `wasmctrl plugin new backup-plugin` in `parent`, outside any workspace: the new crate.
fn scaffold_outside_a_workspace(parent: &Path) -> PathBuf {
    let out = wasmctrl(
        parent,
        &[
            "plugin",
            "new",
            "backup-plugin",
            "--group",
            "backup.example.com",
            "--version",
            "v1alpha1",
            "--kind",
            "BackupSchedule",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let dir = parent.join("backup-plugin");
    let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).expect("Cargo.toml");
    assert!(manifest.contains("\n[workspace]\n"), "{manifest}");
    assert!(manifest.contains("[profile.plugin]"), "{manifest}");
    assert!(
        dir.join("vendor/wasmctrl-plugin-sdk/wit/plugin.wit")
            .is_file()
    );
    // The lock file of this repository: the same dependency versions, so their builds are
    // shared between runs (cargo drops what the crate does not use).
    std::fs::copy(
        support::workspace_root().join("Cargo.lock"),
        dir.join("Cargo.lock"),
    )
    .expect("copy Cargo.lock");
    dir
}

/// The scaffold's deploy path: the policy acts as an account of its own, as the chart's hosts
/// require, `wasmctrl rbac` (the README's step before the policy) prints that account and the
/// host's grant, and the README's steps come in that order with a local host's address.
fn deploys_as_its_readme_says(dir: &Path, policy: &serde_json::Value) {
    assert_eq!(
        policy["spec"]["serviceAccount"],
        serde_json::json!({"namespace": "default", "name": "backupschedule-operator"})
    );
    let rbac = wasmctrl(dir, &["rbac", "deploy/crd.yaml", "deploy/policy.yaml"]);
    assert!(rbac.status.success(), "{}", text(&rbac.stderr));
    let printed = text(&rbac.stdout);
    assert!(
        printed.contains("kind: ServiceAccount")
            && printed.contains("name: backupschedule-operator")
            && printed.contains("impersonate")
            && printed.contains("backupschedules"),
        "{printed}"
    );
    // The README's steps, in order: RBAC before the policy, and explain told where the host
    // is when it runs locally.
    let readme = std::fs::read_to_string(dir.join("README.md")).expect("README.md");
    let rbac_at = readme
        .find("wasmctrl rbac deploy/crd.yaml")
        .expect("the rbac step");
    let policy_at = readme
        .find("kubectl apply -f deploy/policy.yaml")
        .expect("the policy step");
    assert!(rbac_at < policy_at, "{readme}");
    assert!(
        readme.contains("wasmctrl explain BackupSchedule/example --host http://127.0.0.1:8080"),
        "{readme}"
    );
    assert!(
        readme.contains("wasmctrl run --plugin-dir target/wasm32-wasip2/plugin "),
        "{readme}"
    );
}

#[test]
fn a_new_plugin_builds_passes_its_tests_and_golden_cases_and_runs_outside_a_workspace() {
    let parent = tempfile::tempdir().expect("temp dir");
    let dir = scaffold_outside_a_workspace(parent.path());

    // What the crate's CI runs: native tests (logic, the CRD), the component, golden cases.
    let ci = in_crate(&dir, "./ci.sh", &[]);
    let (stdout, stderr) = (text(&ci.stdout), text(&ci.stderr));
    assert!(ci.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("test tests::deploy_crd_yaml_matches_the_types ... ok"),
        "{stdout}"
    );
    assert!(stdout.contains("2 cases: 2 passed, 0 failed"), "{stdout}");

    // The component runs offline on the example, and the CRD names the kind.
    let wasm = scaffold_target_dir().join("wasm32-wasip2/plugin/backup_plugin.wasm");
    let run = wasmctrl(
        &dir,
        &[
            "plugin",
            "run",
            wasm.to_str().expect("utf-8"),
            "--parent",
            "examples/backupschedule.yaml",
            "-o",
            "json",
        ],
    );
    assert!(run.status.success(), "{}", text(&run.stderr));
    let answer: serde_json::Value = serde_json::from_slice(&run.stdout).expect("json");
    assert_eq!(answer["children"][0]["kind"], "Deployment");
    assert_eq!(
        answer["status"]["conditions"][0]["reason"],
        "ReplicasNotReady"
    );
    let crd = read_yaml(&dir.join("deploy/crd.yaml"));
    assert_eq!(
        crd["metadata"]["name"],
        "backupschedules.backup.example.com"
    );
    assert_eq!(crd["spec"]["versions"][0]["name"], "v1alpha1");
    let policy = read_yaml(&dir.join("deploy/policy.yaml"));
    assert_eq!(policy["spec"]["parent"]["kind"], "BackupSchedule");
    assert_eq!(
        policy["spec"]["plugin"]["source"]["file"]["path"],
        "target/wasm32-wasip2/plugin/backup_plugin.wasm"
    );
    deploys_as_its_readme_says(&dir, &policy);

    // The CRD check catches a type change that the YAML does not follow.
    let lib = dir.join("src/lib.rs");
    let source = std::fs::read_to_string(&lib).expect("lib.rs");
    std::fs::write(
        &lib,
        source.replace("/// How many pods to run.", "/// Pods to run."),
    )
    .expect("write lib.rs");
    let test = in_crate(&dir, "cargo", &["test", "deploy_crd"]);
    assert!(!test.status.success());
    assert!(
        text(&test.stdout).contains("deploy/crd.yaml is out of date"),
        "{}",
        text(&test.stdout)
    );

    // A directory that is not empty is refused.
    let again = wasmctrl(
        parent.path(),
        &[
            "plugin",
            "new",
            "backup-plugin",
            "--group",
            "example.com",
            "--version",
            "v1",
            "--kind",
            "Backup",
        ],
    );
    assert_eq!(again.status.code(), Some(2));
    assert!(
        text(&again.stderr).contains("is not empty"),
        "{}",
        text(&again.stderr)
    );
}

#[test]
fn inside_a_workspace_the_plugin_becomes_a_member_and_the_root_gets_the_profile() {
    let root = tempfile::tempdir().expect("temp dir");
    std::fs::write(
        root.path().join("Cargo.toml"),
        "# my operators\n[workspace]\nresolver = \"3\"\nmembers = []\n",
    )
    .expect("write");
    let sdk = support::workspace_root().join("plugins/sdk");
    let out = wasmctrl(
        root.path(),
        &[
            "plugin",
            "new",
            "widget",
            "--dir",
            "plugins/widget",
            "--group",
            "example.com",
            "--version",
            "v1",
            "--kind",
            "Widget",
            "--sdk-path",
            sdk.to_str().expect("utf-8"),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("added \"plugins/widget\" to workspace.members"));
    let dir = root.path().join("plugins/widget");
    assert!(
        !dir.join("vendor").exists(),
        "--sdk-path is used, not a copy"
    );
    let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).expect("Cargo.toml");
    assert!(
        !manifest.contains("[workspace]") && !manifest.contains("[profile"),
        "{manifest}"
    );
    let root_manifest = std::fs::read_to_string(root.path().join("Cargo.toml")).expect("root");
    assert!(
        root_manifest.starts_with("# my operators\n"),
        "{root_manifest}"
    );
    assert!(
        root_manifest.contains("members = [\"plugins/widget\"]"),
        "{root_manifest}"
    );
    assert!(
        root_manifest.contains("[profile.plugin]"),
        "{root_manifest}"
    );
    let policy = std::fs::read_to_string(dir.join("deploy/policy.yaml")).expect("policy");
    assert!(
        policy.contains("path: ../../target/wasm32-wasip2/plugin/widget.wasm"),
        "{policy}"
    );

    // Cargo sees the member (no dependency resolution, so nothing is fetched or built).
    let metadata = in_crate(
        &dir,
        "cargo",
        &["metadata", "--no-deps", "--format-version", "1"],
    );
    assert!(metadata.status.success(), "{}", text(&metadata.stderr));
    let metadata: serde_json::Value = serde_json::from_slice(&metadata.stdout).expect("json");
    let members: Vec<&str> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert_eq!(members, ["widget"]);
}

/// Without `wasmctrl` on PATH, the crate's CI stops before building anything and says how to
/// install it, naming the version that made the crate.
#[test]
fn ci_without_wasmctrl_on_path_says_how_to_install_it() {
    let parent = tempfile::tempdir().expect("temp dir");
    let dir = scaffold_outside_a_workspace(parent.path());
    // A PATH holding only what the script itself needs: no wasmctrl, no cargo.
    let bin = parent.path().join("bin");
    std::fs::create_dir(&bin).expect("bin dir");
    for tool in ["bash", "dirname", "cat"] {
        let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|dir| dir.join(tool))
            .find(|path| path.is_file())
            .unwrap_or_else(|| panic!("{tool} on PATH"));
        std::os::unix::fs::symlink(found, bin.join(tool)).expect("symlink");
    }
    let ci = Command::new("./ci.sh")
        .current_dir(&dir)
        .env("PATH", &bin)
        .env_remove("WASMCTRL")
        .output()
        .expect("run ci.sh");
    let stderr = text(&ci.stderr);
    assert_eq!(ci.status.code(), Some(127), "{stderr}");
    assert!(
        stderr.contains("the wasmctrl CLI was not found"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("made by wasmctrl {}", env!("CARGO_PKG_VERSION"))),
        "{stderr}"
    );
    assert!(stderr.contains("cargo install --locked"), "{stderr}");
    assert!(
        !dir.join("target").exists(),
        "nothing was built before the check"
    );

    // WASMCTRL names one off PATH: the check passes, and the script goes on to `cargo test`
    // (which this PATH lacks).
    let named = Command::new("./ci.sh")
        .current_dir(&dir)
        .env("PATH", &bin)
        .env("WASMCTRL", env!("CARGO_BIN_EXE_wasmctrl"))
        .output()
        .expect("run ci.sh");
    let stderr = text(&named.stderr);
    assert!(!named.status.success());
    assert!(!stderr.contains("wasmctrl CLI was not found"), "{stderr}");
    assert!(stderr.contains("cargo"), "{stderr}");
}

#[test]
fn a_new_plugin_with_webhooks_validates_defaults_and_converts_and_its_cases_pass() {
    let parent = tempfile::tempdir().expect("temp dir");
    let out = wasmctrl(
        parent.path(),
        &[
            "plugin",
            "new",
            "widget-plugin",
            "--group",
            "widgets.example.com",
            "--version",
            "v1",
            "--kind",
            "Widget",
            "--with-webhooks",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let dir = parent.path().join("widget-plugin");
    std::fs::copy(
        support::workspace_root().join("Cargo.lock"),
        dir.join("Cargo.lock"),
    )
    .expect("copy Cargo.lock");
    assert!(dir.join("cases/convert-to-v1beta1.yaml").is_file());

    // Its CI: the native tests of all three webhooks, the component, and five cases (two
    // reconciles, a denial, a default, and a conversion there and back).
    let ci = in_crate(&dir, "./ci.sh", &[]);
    let (stdout, stderr) = (text(&ci.stdout), text(&ci.stderr));
    assert!(ci.status.success(), "{stdout}\n{stderr}");
    for test in [
        "webhooks::tests::too_many_replicas_are_denied_on_the_field ... ok",
        "webhooks::tests::replicas_default_to_one_and_nothing_else_changes ... ok",
        "webhooks::tests::a_conversion_comes_back_to_where_it_started ... ok",
    ] {
        assert!(stdout.contains(test), "{test}: {stdout}");
    }
    assert!(stdout.contains("5 cases: 5 passed, 0 failed"), "{stdout}");

    // The component says it serves all three.
    let wasm = scaffold_target_dir().join("wasm32-wasip2/plugin/widget_plugin.wasm");
    let inspect = wasmctrl(
        &dir,
        &[
            "plugin",
            "inspect",
            wasm.to_str().expect("utf-8"),
            "-o",
            "json",
        ],
    );
    assert!(inspect.status.success(), "{}", text(&inspect.stderr));
    let inspected: serde_json::Value = serde_json::from_slice(&inspect.stdout).expect("json");
    assert_eq!(
        inspected["webhooks"],
        serde_json::json!(["validate", "default", "convert"])
    );
}
