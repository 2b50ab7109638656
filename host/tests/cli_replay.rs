//! `wasmctrl plugin run --case` and `wasmctrl plugin replay`: a case file runs exactly as the
//! request it holds, and replay says per case whether a plugin's answer is unchanged, would
//! change or would fail, with `diff`'s exit codes (0 same, 1 different, 2 trouble).

mod support;

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{Value, json};

fn wasmctrl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .env("WASMCTRL_LOG", "off")
        .arg("--cache-dir")
        .arg(support::workspace_root().join("target/test-artifact-cache"))
        .args(args)
        .output()
        .expect("run wasmctrl")
}

/// `wasmctrl plugin replay PLUGIN CASES --expect`: the exit code and stdout.
fn replay_expecting(plugin_name: &str, cases: &Path) -> (Option<i32>, String) {
    let out = wasmctrl(&[
        "plugin",
        "replay",
        &plugin(plugin_name),
        path(cases),
        "--expect",
    ]);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn plugin(name: &str) -> String {
    support::guest(name).to_string_lossy().into_owned()
}

fn parent() -> Value {
    let text = std::fs::read_to_string(
        support::workspace_root().join("plugins/myapp/examples/myapp-web.yaml"),
    )
    .expect("example parent");
    let mut parent: Value = serde_yaml_ng::from_str(&text).expect("yaml");
    parent["metadata"]["uid"] = json!("uid-web");
    parent
}

/// `plugin run` of the example parent with `--config`, as JSON.
fn run_with_files(dir: &Path) -> Value {
    let parent_file = dir.join("parent.json");
    let config_file = dir.join("config.json");
    std::fs::write(&parent_file, parent().to_string()).expect("write");
    std::fs::write(&config_file, json!({"service": true}).to_string()).expect("write");
    run_json(&[
        "--parent",
        path(&parent_file),
        "--config",
        path(&config_file),
    ])
}

/// `wasmctrl plugin run` of MyApp with `args`: its JSON output.
fn run_json(args: &[&str]) -> Value {
    let plugin = plugin("myapp_plugin");
    let mut all = vec!["plugin", "run", &plugin, "-o", "json"];
    all.extend_from_slice(args);
    let out = wasmctrl(&all);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

#[test]
fn a_case_runs_as_the_request_it_holds_and_replays_against_what_was_recorded() {
    let dir = tempfile::tempdir().expect("temp dir");
    let expected = run_with_files(dir.path());

    // A case without an answer runs exactly as the same request given file by file.
    let mut case = json!({"parent": parent(), "config": {"service": true}});
    let bare = dir.path().join("bare.yaml");
    std::fs::write(&bare, serde_yaml_ng::to_string(&case).expect("yaml")).expect("write");
    assert_eq!(run_json(&["--case", path(&bare)]), expected);

    // `--expect` needs a recorded answer: trouble, exit 2.
    let out = wasmctrl(&[
        "plugin",
        "replay",
        &plugin("myapp_plugin"),
        path(&bare),
        "--expect",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no recorded answer"));

    // Recorded with this plugin's answer: the same plugin replays unchanged...
    case["recorded"] = json!({"at": "2026-11-30T00:00:00Z", "policy": "myapp",
                              "plugin": "sha256:x", "response": expected});
    let cases = dir.path().join("cases");
    std::fs::create_dir(&cases).expect("mkdir");
    std::fs::write(
        cases.join("web.yaml"),
        serde_yaml_ng::to_string(&case).expect("yaml"),
    )
    .expect("write");
    let (code, stdout) = replay_expecting("myapp_plugin", &cases);
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.starts_with("unchanged"), "{stdout}");
    assert!(
        stdout.contains("1 cases: 1 unchanged, 0 would change, 0 would fail"),
        "{stdout}"
    );

    // ...and v2, which labels every child, would change them: exit 1, with the diff.
    let (code, stdout) = replay_expecting("myapp_v2_plugin", &cases);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.starts_with("would-change"), "{stdout}");
    assert!(
        stdout.contains("~ Deployment web: .metadata.labels.example.com/plugin-version"),
        "{stdout}"
    );

    // `--against` compares two plugins on the same cases, as YAML for tools.
    let out = wasmctrl(&[
        "plugin",
        "replay",
        &plugin("myapp_v2_plugin"),
        path(&bare),
        "--against",
        &plugin("myapp_plugin"),
        "-o",
        "yaml",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let report: Value = serde_yaml_ng::from_slice(&out.stdout).expect("yaml");
    assert_eq!(report["wouldChange"], 1);
    assert_eq!(report["cases"][0]["verdict"], "WouldChange");

    // Another plugin answers something else than what was recorded.
    assert_eq!(replay_expecting("misbehave_plugin", &cases).0, Some(1));
}
