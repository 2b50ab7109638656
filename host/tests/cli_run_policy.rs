//! `wasmctrl plugin run --policy`: offline, the plugin sees what the host would show it and
//! its answer becomes what the host would apply and write.

mod support;

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{Value, json};

fn write_yaml(dir: &Path, name: &str, documents: &[Value]) -> String {
    let text: Vec<String> = documents
        .iter()
        .map(|d| serde_yaml_ng::to_string(d).expect("yaml"))
        .collect();
    let path = dir.join(name);
    std::fs::write(&path, text.join("---\n")).expect("write");
    path.to_string_lossy().into_owned()
}

fn policy(config: Value, children: &[(&str, &str)]) -> Value {
    json!({
        "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
        "metadata": {"name": "myapp"},
        "spec": {
            "parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
            "children": children.iter().map(|(a, k)| json!({"apiVersion": a, "kind": k})).collect::<Vec<_>>(),
            "related": [{"apiVersion": "v1", "kind": "ConfigMap",
                         "selector": {"matchLabels": {"example.com/myapp-config": "true"}}}],
            "plugin": {"source": {"file": {"path": "unused.wasm"}}, "config": config},
        }
    })
}

fn config_map(name: &str, namespace: &str, labelled: bool) -> Value {
    let mut object = json!({"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": name, "namespace": namespace}, "data": {"A": "1"}});
    if labelled {
        object["metadata"]["labels"] = json!({"example.com/myapp-config": "true"});
    }
    object
}

/// `plugin run myapp --policy …` in `dir` with the files given: exit code, stdout as JSON
/// (when it succeeded), stderr.
fn run(dir: &Path, args: &[&str]) -> (Option<i32>, Value, String) {
    let out: Output = Command::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .current_dir(dir)
        .env("WASMCTRL_LOG", "off")
        .arg("--cache-dir")
        .arg(support::workspace_root().join("target/test-artifact-cache"))
        .args(["plugin", "run", "-o", "json"])
        .arg(support::guest("myapp_plugin"))
        .args(args)
        .output()
        .expect("run wasmctrl");
    let stdout = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (
        out.status.code(),
        stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The files every test starts from: a MyApp with a ConfigMap named, its Deployment and a
/// stranger Deployment, ConfigMaps the policy does and does not select, and a policy that
/// allows Deployments and Services.
struct Files {
    dir: tempfile::TempDir,
    parent: String,
    children: String,
    policy: String,
}

impl Files {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path();
        let parent = write_yaml(
            d,
            "parent.yaml",
            &[json!({
                "apiVersion": "example.com/v1", "kind": "MyApp",
                "metadata": {"name": "web", "namespace": "shop", "uid": "uid-web", "generation": 3},
                "spec": {"replicas": 2, "image": "nginx:1.27", "configMap": "web-env"},
            })],
        );
        let children = write_yaml(
            d,
            "children.yaml",
            &[
                json!({"apiVersion": "apps/v1", "kind": "Deployment",
                   "metadata": {"name": "web", "namespace": "shop", "ownerReferences": [
                       {"apiVersion": "example.com/v1", "kind": "MyApp", "name": "web", "uid": "uid-web", "controller": true}]},
                   "status": {"readyReplicas": 2}}),
                json!({"apiVersion": "apps/v1", "kind": "Deployment",
                   "metadata": {"name": "stranger", "namespace": "shop"}, "status": {"readyReplicas": 9}}),
            ],
        );
        let policy = write_yaml(
            d,
            "policy.yaml",
            &[policy(
                json!({"service": true}),
                &[("apps/v1", "Deployment"), ("v1", "Service")],
            )],
        );
        Self {
            dir,
            parent,
            children,
            policy,
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `plugin run --policy` with the policy, parent and children, plus `args`.
    fn run(&self, args: &[&str]) -> (Option<i32>, Value, String) {
        let base = [
            "--policy",
            &self.policy,
            "--parent",
            &self.parent,
            "--children",
            &self.children,
        ];
        run(self.path(), &[&base[..], args].concat())
    }
}

fn condition<'a>(answer: &'a Value, kind: &str) -> &'a Value {
    answer["status"]["conditions"]
        .as_array()
        .expect("conditions")
        .iter()
        .find(|c| c["type"] == kind)
        .unwrap_or_else(|| panic!("no {kind} condition in {answer}"))
}

#[test]
fn the_plugin_sees_only_what_the_host_would_show_it() {
    let files = Files::new();
    let d = files.path();
    let unlabelled = write_yaml(
        d,
        "unlabelled.yaml",
        &[config_map("web-env", "shop", false)],
    );
    let elsewhere = write_yaml(d, "elsewhere.yaml", &[config_map("web-env", "other", true)]);
    // A ConfigMap the selector does not match, or in another namespace, never reaches the
    // plugin, nor does a Deployment the parent does not control; the notes say why.
    for (related, why) in [
        (&unlabelled, "do not match the policy's selector"),
        (&elsewhere, "not the parent's"),
    ] {
        let (code, answer, stderr) = files.run(&["--related", related]);
        assert_eq!(code, Some(0), "{stderr}");
        assert!(stderr.contains(why), "{stderr}");
        assert!(
            stderr.contains("child Deployment stranger: not controlled by this parent"),
            "{stderr}"
        );
        assert_eq!(condition(&answer, "ConfigMapFound")["status"], "False");
        assert_eq!(condition(&answer, "Ready")["message"], "2/2 replicas ready");
    }
    let labelled = write_yaml(d, "labelled.yaml", &[config_map("web-env", "shop", true)]);
    let (code, answer, stderr) = files.run(&["--related", &labelled]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(condition(&answer, "ConfigMapFound")["status"], "True");
}

#[test]
fn the_answer_comes_back_stamped_with_the_status_the_host_would_write() {
    let files = Files::new();
    let (code, answer, stderr) = files.run(&[]);
    assert_eq!(code, Some(0), "{stderr}");
    let reconciled = condition(&answer, "Reconciled");
    assert_eq!(reconciled["message"], "2 children desired");
    assert!(reconciled["lastTransitionTime"].is_string());
    assert_eq!(answer["status"]["observedGeneration"], 3);
    let deployment = &answer["children"][0];
    assert_eq!(deployment["metadata"]["namespace"], "shop");
    assert_eq!(
        deployment["metadata"]["ownerReferences"][0]["uid"],
        "uid-web"
    );
    assert_eq!(
        deployment["metadata"]["labels"]["wasmctrl.dev/policy"],
        "myapp"
    );
    assert!(deployment["metadata"]["annotations"]["wasmctrl.dev/desired-hash"].is_string());
}

#[test]
fn the_policys_config_applies_and_what_it_does_not_allow_is_refused() {
    let files = Files::new();
    let d = files.path();
    let parent = files.parent.as_str();
    // The policy's config is the plugin's: no Service.
    let no_service = write_yaml(
        d,
        "no-service.yaml",
        &[policy(
            json!({"service": false}),
            &[("apps/v1", "Deployment"), ("v1", "Service")],
        )],
    );
    let (code, answer, stderr) = run(d, &["--policy", &no_service, "--parent", parent]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(answer["children"].as_array().map(Vec::len), Some(1));

    // A child kind the policy does not allow is refused as the host refuses it.
    let deployments_only = write_yaml(
        d,
        "deployments-only.yaml",
        &[policy(
            json!({"service": true}),
            &[("apps/v1", "Deployment")],
        )],
    );
    let (code, _, stderr) = run(d, &["--policy", &deployments_only, "--parent", parent]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("child 1 is a v1 Service, which the policy does not allow"),
        "{stderr}"
    );

    // A parent the policy does not reconcile, and a custom child kind whose scope is unknown.
    let other = write_yaml(
        d,
        "other.yaml",
        &[json!({"apiVersion": "example.com/v2", "kind": "MyApp",
        "metadata": {"name": "web", "namespace": "shop"}, "spec": {}})],
    );
    let (code, _, stderr) = run(d, &["--policy", &files.policy, "--parent", &other]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("the policy reconciles example.com/v1 MyApp"),
        "{stderr}"
    );
    let custom = write_yaml(
        d,
        "custom.yaml",
        &[policy(json!({}), &[("example.com/v1", "Widget")])],
    );
    let (code, _, stderr) = run(d, &["--policy", &custom, "--parent", parent]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("give its CustomResourceDefinition with --crd"),
        "{stderr}"
    );
}

#[test]
fn a_related_kind_chosen_by_name_shows_the_plugin_only_the_object_the_parent_names() {
    let files = Files::new();
    let d = files.path();
    let mut by_name = policy(
        json!({"service": true}),
        &[("apps/v1", "Deployment"), ("v1", "Service")],
    );
    by_name["spec"]["related"] =
        json!([{"apiVersion": "v1", "kind": "ConfigMap", "nameFrom": "spec.configMap"}]);
    let by_name = write_yaml(d, "by-name.yaml", &[by_name]);
    // Unlabelled and named: shown. Labelled but not named, or named in another namespace:
    // left out, with why.
    let related = write_yaml(
        d,
        "related.yaml",
        &[
            config_map("web-env", "shop", false),
            config_map("shared", "shop", true),
            config_map("web-env", "other", false),
        ],
    );
    let args = [
        "--policy",
        &by_name,
        "--parent",
        &files.parent,
        "--related",
        &related,
    ];
    let (code, answer, stderr) = run(d, &args);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(condition(&answer, "ConfigMapFound")["status"], "True");
    assert!(
        stderr.contains(
            "related ConfigMap shared: the parent's spec.configMap does not name it (it names web-env)"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("not the parent's"), "{stderr}");
    assert!(
        !stderr.contains("related ConfigMap web-env: the parent's"),
        "{stderr}"
    );

    // The parent names nothing: nothing is shown.
    let unnamed = write_yaml(
        d,
        "unnamed.yaml",
        &[json!({
            "apiVersion": "example.com/v1", "kind": "MyApp",
            "metadata": {"name": "web", "namespace": "shop", "uid": "uid-web"},
            "spec": {"replicas": 1, "image": "nginx:1.27"},
        })],
    );
    let (code, _, stderr) = run(
        d,
        &[
            "--policy",
            &by_name,
            "--parent",
            &unnamed,
            "--related",
            &related,
        ],
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("related ConfigMap web-env: the parent's spec.configMap does not name it (it names nothing)"),
        "{stderr}"
    );
}
