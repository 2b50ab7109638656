//! The CRD YAML in `crds/` is generated from the Rust types; these keep the two in sync and
//! pin the schema rules users rely on. Regenerate with `cargo xtask crds`.

use kube::CustomResourceExt;
use myapp_plugin::MyApp;
use wasmctrl::policy::ReconcilePolicy;

/// Compare (or, with `WASMCTRL_BLESS=1`, rewrite) `crds/<file>` with `K::crd()`.
fn assert_in_sync<K: CustomResourceExt>(file: &str, source: &str) {
    assert_crd_in_sync(&K::crd(), file, source);
}

/// Compare (or, with `WASMCTRL_BLESS=1`, rewrite) `crds/<file>` with `crd`.
fn assert_crd_in_sync(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    file: &str,
    source: &str,
) {
    let generated = format!(
        "# Generated from {source} by `cargo xtask crds`; do not edit.\n{}",
        serde_yaml_ng::to_string(crd).expect("CRD serializes")
    );
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../crds")
        .join(file);
    if std::env::var_os("WASMCTRL_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write the CRD");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "crds/{file} is out of date with {source}; run `cargo xtask crds`"
    );
}

/// The names of a CRD version's printer columns.
fn printer_columns(version: &serde_json::Value) -> Vec<&str> {
    version["additionalPrinterColumns"]
        .as_array()
        .expect("columns")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect()
}

#[test]
fn myapp_crd_matches_the_rust_types() {
    assert_in_sync::<MyApp>("myapp.yaml", "plugins/myapp/src/types.rs");
}

#[test]
fn reconcile_policy_crd_matches_the_rust_types() {
    assert_in_sync::<ReconcilePolicy>("reconcilepolicy.yaml", "host/src/policy/mod.rs");
}

#[test]
fn namespaced_reconcile_policy_crd_matches_the_rust_types() {
    assert_crd_in_sync(
        &wasmctrl::policy::namespaced::crd(),
        "namespacedreconcilepolicy.yaml",
        "host/src/policy/namespaced.rs",
    );
}

#[test]
fn myapp_crd_validates_replicas_image_and_port_and_has_status_and_columns() {
    let crd = serde_json::to_value(MyApp::crd()).expect("CRD serializes");
    let version = &crd["spec"]["versions"][0];
    let spec = &version["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(
        spec["properties"]["replicas"]["minimum"].as_f64(),
        Some(1.0)
    );
    assert_eq!(spec["properties"]["image"]["minLength"].as_u64(), Some(1));
    assert_eq!(
        spec["properties"]["port"]["maximum"].as_f64(),
        Some(65535.0)
    );
    let required: Vec<&str> = spec["required"]
        .as_array()
        .expect("required")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert_eq!(required, ["image", "replicas"]);
    assert!(version["subresources"]["status"].is_object());
    let columns = printer_columns(version);
    assert_eq!(columns, ["Replicas", "Ready", "Age"]);
    assert_eq!(crd["spec"]["scope"], "Namespaced");
}

#[test]
fn reconcile_policy_is_cluster_scoped_with_status_and_columns() {
    let crd = serde_json::to_value(ReconcilePolicy::crd()).expect("CRD serializes");
    assert_eq!(crd["spec"]["scope"], "Cluster");
    let version = &crd["spec"]["versions"][0];
    assert!(version["subresources"]["status"].is_object());
    let columns = printer_columns(version);
    assert_eq!(columns, ["Parent", "Plugin", "Ready", "Age"]);
}
