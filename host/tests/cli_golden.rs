//! Golden tests of `wasmctrl plugin run` with the MyApp plugin: each directory under
//! `tests/golden/myapp/` holds a parent, optional observed children (`children.yaml` or
//! `children.json`), optional extra `args`, and the expected stdout (`expected.yaml`/`.json`)
//! or, for failures, the expected one-line error (`expected-error.txt`).
//!
//! After an intended change, regenerate with `WASMCTRL_BLESS=1 cargo test -p wasmctrl --test cli_golden`
//! and review the diff.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

fn golden_cases() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/myapp");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("golden directory")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.is_dir())
        .collect();
    cases.sort();
    cases
}

fn run_case(case: &Path, plugin: &Path) -> (bool, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_wasmctrl"));
    // Run inside the case directory with relative paths, so messages naming a file are the
    // same wherever the repository is checked out.
    command
        .current_dir(case)
        .env("WASMCTRL_LOG", "off")
        .arg("--cache-dir")
        .arg(support::workspace_root().join("target/test-artifact-cache"))
        .args(["plugin", "run"])
        .arg(plugin)
        .args(["--parent", "parent.yaml"]);
    for children in ["children.yaml", "children.json"] {
        if case.join(children).exists() {
            command.args(["--children", children]);
        }
    }
    if let Ok(args) = std::fs::read_to_string(case.join("args")) {
        command.args(args.split_whitespace());
    }
    let output = command.output().expect("run wasmctrl");
    (
        output.status.success(),
        String::from_utf8(output.stdout).expect("utf-8 stdout"),
        String::from_utf8(output.stderr).expect("utf-8 stderr"),
    )
}

#[test]
fn myapp_plugin_run_matches_golden_output() {
    check_golden_output("myapp_plugin", std::env::var_os("WASMCTRL_BLESS").is_some());
}

/// The Python MyApp (`plugins/python/myapp`) decides exactly as the Rust one: the same golden
/// outputs, byte for byte, never blessed from Python.
#[test]
fn python_myapp_plugin_run_matches_the_same_golden_output() {
    check_golden_output("myapp_py", false);
}

fn check_golden_output(plugin: &str, bless: bool) {
    let plugin = support::guest(plugin);
    let mut failures = Vec::new();
    let cases = golden_cases();
    assert!(cases.len() >= 8, "golden cases missing");
    for case in &cases {
        let name = case
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let (ok, stdout, stderr) = run_case(case, &plugin);
        let is_json = case.join("expected.json").exists()
            || std::fs::read_to_string(case.join("args")).is_ok_and(|a| a.contains("json"));
        let (expected_path, actual) = if case.join("expected-error.txt").exists() {
            if ok {
                failures.push(format!("{name}: expected failure, got success:\n{stdout}"));
                continue;
            }
            let lines: Vec<&str> = stderr.lines().collect();
            if lines.len() != 1 {
                failures.push(format!("{name}: error must be one line, got:\n{stderr}"));
            }
            (case.join("expected-error.txt"), stderr)
        } else {
            if !ok {
                failures.push(format!("{name}: failed: {stderr}"));
                continue;
            }
            let file = if is_json {
                "expected.json"
            } else {
                "expected.yaml"
            };
            (case.join(file), stdout)
        };
        if bless {
            std::fs::write(&expected_path, &actual).expect("bless");
        }
        let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
        if expected != actual {
            failures.push(format!(
                "{name}: output differs from {}\n--- expected\n{expected}\n--- actual\n{actual}",
                expected_path.display()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Run `wasmctrl plugin run PLUGIN` on the golden `defaults` parent with extra arguments.
fn run_plugin(plugin: &Path, extra: &[&str]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/myapp/defaults"))
        .env("WASMCTRL_LOG", "off")
        .arg("--cache-dir")
        .arg(support::workspace_root().join("target/test-artifact-cache"))
        .args(["plugin", "run"])
        .arg(plugin)
        .args(["--parent", "parent.yaml"])
        .args(extra)
        .output()
        .expect("run wasmctrl");
    (
        output.status.success(),
        String::from_utf8(output.stderr).expect("utf-8 stderr"),
    )
}

#[test]
fn every_failure_is_one_line_that_names_the_cause() {
    let config = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(config.path(), r#"{"behavior": "loop"}"#).expect("write config");
    let hoard = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(hoard.path(), r#"{"behavior": "grow-memory"}"#).expect("write config");
    let misbehave = support::guest("misbehave_plugin");
    let config_arg = config.path().to_str().expect("utf-8 path");
    let hoard_arg = hoard.path().to_str().expect("utf-8 path");
    let cases: Vec<(&str, PathBuf, Vec<&str>, &str)> = vec![
        (
            "missing plugin",
            PathBuf::from("no-such-plugin.wasm"),
            vec![],
            "cannot read plugin no-such-plugin.wasm",
        ),
        (
            "not a component",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/myapp/defaults/parent.yaml"),
            vec![],
            "not a WebAssembly file",
        ),
        (
            "wrong world",
            support::guest("wrong-world"),
            vec![],
            "does not export `wasmctrl:plugin/reconciler@0.1.1`",
        ),
        (
            "future contract",
            support::guest("future_contract_plugin"),
            vec![],
            "implements contract wasmctrl:plugin@0.2.0, but this host serves only @0.1.0 to @0.1.1: rebuild the plugin with wasmctrl-plugin-sdk for contract 0.1.1",
        ),
        (
            "wrong digest",
            support::guest("myapp_plugin"),
            vec![
                "--digest",
                "sha256:0000000000000000000000000000000000000000000000000000000000000000",
            ],
            "digest mismatch",
        ),
        (
            "deadline",
            misbehave.clone(),
            vec!["--config", config_arg, "--timeout-ms", "100"],
            "exceeded its 100ms deadline",
        ),
        (
            "memory",
            misbehave,
            vec!["--config", hoard_arg, "--memory-mib", "16"],
            "exceeded its memory limit of 16777216 bytes",
        ),
        (
            "missing parent",
            support::guest("myapp_plugin"),
            vec!["--children", "nope.yaml"],
            "cannot read nope.yaml",
        ),
    ];
    for (what, plugin, extra, expected) in cases {
        let (ok, stderr) = run_plugin(&plugin, &extra);
        assert!(!ok, "{what}: must fail");
        assert_eq!(
            stderr.lines().count(),
            1,
            "{what}: one line, got:\n{stderr}"
        );
        assert!(stderr.starts_with("error: "), "{what}: {stderr}");
        assert!(
            stderr.contains(expected),
            "{what}: expected {expected:?} in {stderr}"
        );
    }
}

/// `wasmctrl plugin diff ACTIVE CANDIDATE ...`, as YAML; it must exit with `code`.
fn diff(active: &str, candidate: &str, extra: &[&str], code: i32) -> serde_yaml_ng::Value {
    let output = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .args(["plugin", "diff"])
        .arg(support::guest(active))
        .arg(support::guest(candidate))
        .arg("--parent")
        .arg(support::workspace_root().join("plugins/myapp/examples/myapp-web.yaml"))
        .args(extra)
        .output()
        .expect("running wasmctrl");
    assert_eq!(
        output.status.code(),
        Some(code),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_yaml_ng::from_slice(&output.stdout).expect("YAML output")
}

#[test]
fn plugin_diff_shows_what_a_candidate_would_change() {
    let same = diff("myapp_plugin", "myapp_plugin", &[], 0);
    assert_eq!(same["verdict"], "Unchanged");

    let v2 = diff("myapp_plugin", "myapp_v2_plugin", &[], 1);
    assert_eq!(v2["verdict"], "WouldChange");
    assert_eq!(
        v2["detail"].as_str().unwrap_or_default(),
        "~ Deployment web: .metadata.labels.example.com/plugin-version (absent) -> \"v2\"\n\
         ~ Service web: .metadata.labels.example.com/plugin-version (absent) -> \"v2\""
    );
    assert_ne!(v2["activeDigest"], v2["candidateDigest"]);

    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("panic.yaml");
    std::fs::write(&config, "behavior: panic\n").expect("write");
    let failing = diff(
        "myapp_plugin",
        "misbehave_plugin",
        &["--candidate-config", config.to_str().expect("utf-8")],
        1,
    );
    assert_eq!(failing["verdict"], "WouldFail");
    assert!(
        failing["detail"]
            .as_str()
            .is_some_and(|d| d.contains("deliberate panic")),
        "{failing:?}"
    );
}

/// `plugin inspect` shows any component's contract, whether or not this host serves it, and
/// says why it would refuse one; `wasmctrl version` says which contracts it serves.
#[test]
fn inspect_and_version_name_the_contracts() {
    let inspect = |plugin: &str| -> serde_json::Value {
        let output = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
            .env("WASMCTRL_LOG", "off")
            .args(["plugin", "inspect", "-o", "json"])
            .arg(support::guest(plugin))
            .output()
            .expect("run wasmctrl");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_slice(&output.stdout).expect("json")
    };
    let future = inspect("future_contract_plugin");
    assert_eq!(future["contractVersion"], "0.2.0");
    assert_eq!(
        future["hostContractVersions"],
        serde_json::json!(["0.1.0", "0.1.1"])
    );
    assert_eq!(future["compatible"], false);
    assert!(
        future["refused"]
            .as_str()
            .is_some_and(|r| r.contains("serves only @0.1.0 to @0.1.1")),
        "{future}"
    );
    assert!(future["webhooksUnknown"].is_string(), "{future}");
    let myapp = inspect("myapp_plugin");
    assert_eq!(myapp["contractVersion"], "0.1.1");
    assert_eq!(myapp["compatible"], true);
    assert!(myapp.get("refused").is_none(), "{myapp}");
    assert_eq!(
        myapp["webhooks"],
        serde_json::json!(["validate", "default"])
    );
    let without_webhooks = inspect("myapp_v2_plugin");
    assert_eq!(without_webhooks["webhooks"], serde_json::json!([]));
    assert!(without_webhooks.get("webhooksUnknown").is_none());
    let wrong_world = inspect("wrong-world");
    assert_eq!(wrong_world["compatible"], false);
    assert!(wrong_world["contractVersion"].is_null());

    let version = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .arg("version")
        .output()
        .expect("run wasmctrl");
    let version: serde_json::Value =
        serde_yaml_ng::from_slice(&version.stdout).expect("version is YAML");
    assert_eq!(
        version["pluginContracts"],
        serde_json::json!(["wasmctrl:plugin@0.1.0", "wasmctrl:plugin@0.1.1"])
    );
    assert_eq!(
        version["pluginWebhooks"],
        serde_json::json!(["validate", "default", "convert"])
    );
}

/// Beyond the golden cases: where MyApp reads a related ConfigMap and its config, `plugin diff`
/// finds nothing between the Rust and the Python plugin.
#[test]
fn python_myapp_decides_as_the_rust_one_with_config_maps_and_config() {
    let dir = tempfile::tempdir().expect("temp dir");
    let write = |name: &str, value: serde_json::Value| {
        let path = dir.path().join(name);
        std::fs::write(&path, value.to_string()).expect("write");
        path.to_string_lossy().into_owned()
    };
    let parent = |config_map: &str| {
        serde_json::json!({"apiVersion": "example.com/v1", "kind": "MyApp",
            "metadata": {"name": "web", "namespace": "default", "uid": "u"},
            "spec": {"replicas": 2, "image": "nginx", "port": 8080, "configMap": config_map},
            "status": {"conditions": [{"type": "ConfigMapFound", "status": "True", "reason": "Found",
                        "lastTransitionTime": "2026-11-29T10:00:01Z"}]}})
    };
    let related = write(
        "related.json",
        serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "env", "namespace": "default"},
         "data": {"B": "2", "A": "1", "é": "ü"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "empty", "namespace": "default"},
         "data": {}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "nodata", "namespace": "default"}}]}),
    );
    let no_service = write("config.json", serde_json::json!({"service": false}));
    let rust = support::guest("myapp_plugin");
    let python = support::guest("myapp_py");
    for (config_map, extra) in [
        ("env", vec![]),
        ("empty", vec![]),
        ("nodata", vec![]),
        ("missing", vec![]),
        ("env", vec!["--config", no_service.as_str()]),
    ] {
        let parent_file = write("parent.json", parent(config_map));
        let output = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
            .env("WASMCTRL_LOG", "off")
            .arg("--cache-dir")
            .arg(support::workspace_root().join("target/test-artifact-cache"))
            .args(["plugin", "diff", "-o", "json"])
            .arg(&rust)
            .arg(&python)
            .args(["--parent", &parent_file, "--related", &related])
            .args(&extra)
            .output()
            .expect("run wasmctrl");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let diff: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
        assert_eq!(
            diff["verdict"], "Unchanged",
            "configMap {config_map} {extra:?}: {diff}"
        );
    }
}

/// A plugin that cannot decode its input names the value where the user wrote it: file, line,
/// column and path, not a column of the JSON the CLI made from the YAML.
#[test]
fn a_decoding_error_points_into_the_users_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        name.to_owned()
    };
    let parent = write(
        "parent.yaml",
        "apiVersion: example.com/v1\nkind: MyApp\nmetadata:\n  name: web\n  namespace: default\nspec:\n  image: nginx\n  replicas: three\n",
    );
    let good_parent = write(
        "good.yaml",
        "apiVersion: example.com/v1\nkind: MyApp\nmetadata:\n  name: web\nspec:\n  image: nginx\n  replicas: 1\n",
    );
    let config = write("config.yaml", "# the policy's config\nservice: \"yes\"\n");
    let case = write(
        "case.yaml",
        "# a saved case\nparent:\n  apiVersion: example.com/v1\n  kind: MyApp\n  metadata: {name: web}\n  spec:\n    image: nginx\n    replicas: [1]\n",
    );
    let run = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
            .current_dir(dir.path())
            .env("WASMCTRL_LOG", "off")
            .arg("--cache-dir")
            .arg(support::workspace_root().join("target/test-artifact-cache"))
            .args(["plugin", "run"])
            .arg(support::guest("myapp_plugin"))
            .args(args)
            .output()
            .expect("run wasmctrl");
        assert_eq!(output.status.code(), Some(2));
        String::from_utf8(output.stderr).expect("utf-8")
    };
    let stderr = run(&["--parent", &parent]);
    assert!(
        stderr.contains(
            "invalid type: string \"three\", expected i32 at parent.yaml:8:3 (spec.replicas)"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("line 1 column"), "{stderr}");
    let stderr = run(&["--parent", &good_parent, "--config", &config]);
    assert!(
        stderr.contains("plugin config is invalid: invalid type: string \"yes\", expected a boolean at config.yaml:2:1 (service)"),
        "{stderr}"
    );
    let stderr = run(&["--case", &case]);
    assert!(
        stderr.contains("expected i32 at case.yaml:8:5 (spec.replicas)"),
        "{stderr}"
    );
}

/// The binary runs on jemalloc with the host's settings compiled in (the peak-memory figures
/// in BENCHMARKS.md depend on them), and the environment can still override them.
#[test]
fn the_binary_allocates_with_the_host_settings() {
    let output = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .arg("version")
        // jemalloc reports where each setting came from.
        .env("_RJEM_MALLOC_CONF", "confirm_conf:true")
        .output()
        .expect("run wasmctrl");
    assert!(output.status.success());
    let report = String::from_utf8_lossy(&output.stderr);
    let settings = wasmctrl::ALLOCATOR_SETTINGS
        .to_str()
        .expect("settings are text");
    assert!(
        report.contains(&format!(
            "string pointed to by the global variable malloc_conf): \"{settings}\""
        )),
        "{report}"
    );
    for setting in settings.split(',') {
        assert!(
            report.contains(&format!("Set conf value: {setting}")),
            "{setting} not applied: {report}"
        );
    }
    assert!(
        report.contains("Set conf value: confirm_conf:true"),
        "{report}"
    );
}

/// The binary is its own plugin compiler: started with the compiler's argument (as
/// `wasmctrl run` starts it for every plugin the cache does not hold) it turns a component
/// on stdin into a wasmtime artifact on stdout, and refuses what is not one with exit code 3.
#[test]
fn the_binary_compiles_plugins_when_started_as_the_compiler() {
    use std::io::Write as _;
    let compile = |input: Vec<u8>| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
            .args([wasmctrl::plugin::COMPILE_CHILD_ARG, "1073741824"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run wasmctrl");
        let mut stdin = child.stdin.take().expect("stdin");
        let writer = std::thread::spawn(move || stdin.write_all(&input));
        let output = child.wait_with_output().expect("wait");
        writer.join().expect("writer").expect("write the component");
        output
    };

    let compiled = compile(wasmctrl_testenv::plugins::guest_bytes("myapp_plugin"));
    assert!(
        compiled.status.success(),
        "{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    assert!(
        compiled.stdout.starts_with(b"\x7fELF"),
        "wasmtime's artifacts are ELF files"
    );

    let mut not_a_component = b"\0asm\x0d\0\x01\0".to_vec();
    not_a_component.extend_from_slice(&[0xff; 64]);
    let refused = compile(not_a_component);
    assert_eq!(refused.status.code(), Some(3));
    assert!(refused.stdout.is_empty());
    assert!(!refused.stderr.is_empty(), "says why");
}

/// `wasmctrl plugin run` with debug logs in `format`, returning its stderr.
fn logs(format: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .env("WASMCTRL_LOG", "debug")
        .env_remove("WASMCTRL_LOG_FORMAT")
        .args(format)
        .args(["plugin", "run"])
        .arg(support::guest("myapp_plugin"))
        .arg("--parent")
        .arg(support::workspace_root().join("plugins/myapp/examples/myapp-web.yaml"))
        .output()
        .expect("running wasmctrl");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stderr).expect("UTF-8 logs")
}

#[test]
fn logs_are_json_lines_when_asked_and_never_coloured_off_a_terminal() {
    let json = logs(&["--log-format", "json"]);
    assert!(json.lines().count() > 0, "debug logs expected");
    for line in json.lines() {
        let event: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        assert!(event["level"].is_string(), "{line}");
    }
    let text = logs(&[]);
    assert!(text.contains("DEBUG"), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "escape sequences in logs written to a pipe: {text:?}"
    );
}

#[test]
fn completion_scripts_name_the_commands_for_each_shell() {
    for (shell, marker) in [
        ("bash", "_wasmctrl()"),
        ("zsh", "#compdef wasmctrl"),
        ("fish", "complete -c wasmctrl"),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
            .args(["completion", shell])
            .output()
            .expect("running wasmctrl");
        assert!(output.status.success(), "{shell}");
        let script = String::from_utf8_lossy(&output.stdout);
        assert!(script.contains(marker), "{shell}: {script}");
        for command in ["plugin", "explain", "rbac", "replay"] {
            assert!(script.contains(command), "{shell}: {command} missing");
        }
    }
}

/// A reader that goes away, as `wasmctrl … | head -1` has it, ends the command with the
/// status SIGPIPE gives and nothing on stderr.
#[test]
fn a_closed_stdout_ends_a_command_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .arg("version")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run wasmctrl");
    // Closed before the command (still starting) writes.
    drop(child.stdout.take());
    let output = child.wait_with_output().expect("wait for wasmctrl");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(141), "{stderr}");
    assert!(stderr.is_empty(), "nothing to report: {stderr}");
}
