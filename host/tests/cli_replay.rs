//! `wasmctrl plugin run --case`, `plugin replay` and `plugin test`: a case file runs exactly as the
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
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no recorded or expected answer"));

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

#[test]
fn replay_round_trips_each_parent_through_the_converter_and_fails_what_does_not_come_back() {
    let dir = tempfile::tempdir().expect("temp dir");
    let case = |name: &str, spec: Value| {
        let file = dir.path().join(format!("{name}.yaml"));
        let case = json!({"parent": {"apiVersion": "example.com/v1", "kind": "Misfit",
                                     "metadata": {"name": name, "namespace": "default"},
                                     "spec": spec},
                          "config": {}});
        std::fs::write(&file, serde_yaml_ng::to_string(&case).expect("yaml")).expect("write");
        file
    };
    let replay = |file: &Path, convert: bool| {
        let plugin = plugin("misbehave_plugin");
        let mut args = vec![
            "plugin",
            "replay",
            &plugin,
            path(file),
            "--against",
            &plugin,
        ];
        if convert {
            args.extend(["--convert-to", "example.com/v2"]);
        }
        let out = wasmctrl(&args);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    // The misbehaving converter drops `spec.lost` on the way to v2.
    let keeps = case("keeps", json!({"kept": 1}));
    let loses = case("loses", json!({"lost": 1}));
    assert_eq!(replay(&keeps, true).0, Some(0));
    assert_eq!(
        replay(&loses, false).0,
        Some(0),
        "the reconcile alone is unchanged"
    );
    let (code, stdout) = replay(&loses, true);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.starts_with("would-fail"), "{stdout}");
    assert!(
        stdout.contains("converting to example.com/v2 and back to example.com/v1 does not give the original (spec differs)"),
        "{stdout}"
    );
}

/// `wasmctrl plugin test PLUGIN CASES [--update]`: exit code, stdout and stderr.
fn test_cases(plugin_name: &str, cases: &Path, update: bool) -> (Option<i32>, String, String) {
    let plugin = plugin(plugin_name);
    let mut args = vec!["plugin", "test", &plugin, path(cases)];
    if update {
        args.push("--update");
    }
    let out = wasmctrl(&args);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn golden_cases_pass_fail_with_the_difference_and_update_to_the_plugins_answers() {
    let dir = tempfile::tempdir().expect("temp dir");
    let answer = run_with_files(dir.path());
    let cases = dir.path().join("cases");
    std::fs::create_dir(&cases).expect("mkdir");
    // A case expecting MyApp's answer (YAML), and one expecting a failure (JSON): a parent
    // without a spec is invalid.
    let web = cases.join("web.yaml");
    std::fs::write(
        &web,
        serde_yaml_ng::to_string(
            &json!({"parent": parent(), "config": {"service": true}, "expect": answer}),
        )
        .expect("yaml"),
    )
    .expect("write");
    let mut broken_parent = parent();
    broken_parent
        .as_object_mut()
        .expect("object")
        .remove("spec");
    // Its expectation is written by `--update`: the plugin's error, as the host reports it.
    let broken = write_json(&cases, "broken.json", &json!({"parent": broken_parent}));
    let (code, stdout, _) = test_cases("myapp_plugin", &broken, true);
    assert_eq!(code, Some(0), "{stdout}");
    assert!(
        stdout.contains("1 cases: 0 passed, 0 failed, 1 updated"),
        "{stdout}"
    );
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(&broken).expect("read")).expect("json");
    assert_eq!(written["expect"]["error"]["outcome"], "reported_error");
    assert!(
        written["expect"]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("missing field `spec`")),
        "{written}"
    );

    let (code, stdout, stderr) = test_cases("myapp_plugin", &cases, false);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("2 cases: 2 passed, 0 failed"), "{stdout}");

    // v2 labels every child: the YAML case fails with the difference, exit 1.
    let (code, stdout, stderr) = test_cases("myapp_v2_plugin", &cases, false);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.contains("FAILED"), "{stdout}");
    assert!(
        stdout.contains("~ Deployment web: .metadata.labels.example.com/plugin-version"),
        "{stdout}"
    );
    assert!(stdout.contains("2 cases: 1 passed, 1 failed"), "{stdout}");
    // The report ends with its summary; a terminal, which shows stderr too, shows it once.
    assert!(!stderr.contains("1 failed"), "{stderr}");

    // --update writes v2's answer into the failing case only; then v2 passes and MyApp fails.
    let broken_before = std::fs::read_to_string(&broken).expect("read");
    let (code, stdout, _) = test_cases("myapp_v2_plugin", &cases, true);
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.contains("1 updated"), "{stdout}");
    assert_eq!(
        std::fs::read_to_string(&broken).expect("read"),
        broken_before,
        "a passing case is left as it was"
    );
    let updated: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&web).expect("read")).expect("yaml");
    assert_eq!(
        updated["expect"]["children"][0]["metadata"]["labels"]["example.com/plugin-version"],
        "v2"
    );
    assert_eq!(test_cases("myapp_v2_plugin", &cases, false).0, Some(0));
    assert_eq!(test_cases("myapp_plugin", &cases, false).0, Some(1));

    // A case without an expectation is trouble (exit 2) that names the way out; a typo in
    // `expect` is named.
    let bare = cases.join("bare.yaml");
    std::fs::write(
        &bare,
        serde_yaml_ng::to_string(&json!({"parent": parent()})).expect("yaml"),
    )
    .expect("write");
    let (code, _, stderr) = test_cases("myapp_plugin", &bare, false);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("--update"), "{stderr}");
    std::fs::write(
        &bare,
        serde_yaml_ng::to_string(&json!({"parent": parent(), "expect": {"chidren": []}}))
            .expect("yaml"),
    )
    .expect("write");
    let (code, _, stderr) = test_cases("myapp_plugin", &bare, false);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("unknown field `chidren`"), "{stderr}");
}

fn write_json(dir: &Path, name: &str, value: &Value) -> std::path::PathBuf {
    let file = dir.join(name);
    std::fs::write(&file, serde_json::to_string_pretty(value).expect("json")).expect("write");
    file
}

/// The repository's example cases of a plugin (`plugins/<name>/cases`).
fn example_cases(plugin: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../plugins")
        .join(plugin)
        .join("cases")
}

#[test]
fn webhook_cases_pass_fail_with_the_difference_and_update() {
    // MyApp's validator and defaulter, Widget's converter (each case converts there and back).
    let (code, stdout, stderr) = test_cases("myapp_plugin", &example_cases("myapp"), false);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("6 cases: 6 passed, 0 failed"), "{stdout}");
    let (code, stdout, stderr) = test_cases("widget_plugin", &example_cases("widget"), false);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("3 cases: 3 passed, 0 failed"), "{stdout}");

    // A case that expects MyApp to allow too many replicas fails, naming what differs; with
    // `--update` it expects the denial.
    let dir = tempfile::tempdir().expect("temp dir");
    let case = dir.path().join("too-many.yaml");
    std::fs::write(
        &case,
        serde_yaml_ng::to_string(&json!({
            "validate": {"object": {"apiVersion": "example.com/v1", "kind": "MyApp",
                                    "metadata": {"name": "web"},
                                    "spec": {"replicas": 99, "image": "nginx:1.27"}}},
            "expect": {"allowed": true, "violations": [], "warnings": []},
        }))
        .expect("yaml"),
    )
    .expect("write");
    let (code, stdout, _) = test_cases("myapp_plugin", &case, false);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(
        stdout.contains("allowed: expected true, got false"),
        "{stdout}"
    );
    let (code, stdout, _) = test_cases("myapp_plugin", &case, true);
    assert_eq!(code, Some(0), "{stdout}");
    let updated: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&case).expect("read")).expect("yaml");
    assert_eq!(updated["expect"]["violations"][0]["field"], "spec.replicas");
    assert_eq!(test_cases("myapp_plugin", &case, false).0, Some(0));

    // A plugin that serves no validate fails the case with that error, not a crash, and
    // `--update` does not make that the expectation.
    let before = std::fs::read_to_string(&case).expect("read");
    for update in [false, true] {
        let (code, stdout, _) = test_cases("myapp_v2_plugin", &case, update);
        assert_eq!(code, Some(1), "{stdout}");
        assert!(
            stdout.contains("does not serve the `validate` webhook"),
            "{stdout}"
        );
    }
    assert_eq!(std::fs::read_to_string(&case).expect("read"), before);

    // A conversion that loses a field on the way fails, whatever the case expects.
    let lossy = dir.path().join("lossy.yaml");
    std::fs::write(
        &lossy,
        serde_yaml_ng::to_string(&json!({
            "convert": {"object": {"apiVersion": "example.com/v1", "kind": "Thing",
                                   "metadata": {"name": "t"},
                                   "spec": {"kept": 1, "lost": "v2 has no field for it"}},
                        "to": "example.com/v2"},
        }))
        .expect("yaml"),
    )
    .expect("write");
    for update in [true, false] {
        let (code, stdout, _) = test_cases("misbehave_plugin", &lossy, update);
        assert_eq!(code, Some(1), "{stdout}");
        assert!(
            stdout.contains("converting back to example.com/v1 does not give the original")
                && stdout.contains("spec.lost"),
            "{stdout}"
        );
    }
}

#[test]
fn plugin_run_calls_one_webhook_on_a_given_object() {
    let dir = tempfile::tempdir().expect("temp dir");
    let app = write_json(
        dir.path(),
        "app.json",
        &json!({"apiVersion": "example.com/v1", "kind": "MyApp", "metadata": {"name": "web"},
                "spec": {"replicas": 0, "image": "nginx:1.27"}}),
    );
    let run = |plugin_name: &str, object: &Path, flags: &[&str]| -> Value {
        let plugin = plugin(plugin_name);
        let mut args = vec![
            "plugin",
            "run",
            &plugin,
            "--parent",
            path(object),
            "-o",
            "json",
        ];
        args.extend_from_slice(flags);
        let out = wasmctrl(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("json")
    };
    let verdict = run("myapp_plugin", &app, &["--validate"]);
    assert_eq!(verdict["allowed"], false);
    assert_eq!(verdict["violations"][0]["field"], "spec.replicas");
    let defaulted = run("myapp_plugin", &app, &["--default"]);
    assert_eq!(defaulted["object"]["spec"]["port"], 80);

    let widget = write_json(
        dir.path(),
        "widget.json",
        &json!({"apiVersion": "example.com/v1alpha1", "kind": "Widget", "metadata": {"name": "w"},
                "spec": {"address": "db:5432", "replicaCount": 1}}),
    );
    let converted = run(
        "widget_plugin",
        &widget,
        &["--convert-to", "example.com/v1"],
    );
    assert_eq!(converted["object"]["apiVersion"], "example.com/v1");
    assert_eq!(
        converted["object"]["spec"]["endpoint"],
        json!({"host": "db", "port": 5432})
    );

    // A call that fails is a failed command, with the plugin's reason.
    let v2 = plugin("myapp_v2_plugin");
    let out = wasmctrl(&["plugin", "run", &v2, "--parent", path(&app), "--validate"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("does not serve the `validate` webhook"),
        "{stderr}"
    );
    let out = wasmctrl(&[
        "plugin",
        "run",
        &plugin("widget_plugin"),
        "--parent",
        path(&app),
        "--convert-to",
        "example.com/v1alpha1",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("converting"), "{stderr}");
}
