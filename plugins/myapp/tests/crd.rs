//! `crds/myapp.yaml` is generated from the Rust types; this keeps the two in sync.
//! Regenerate with `WASMCTRL_BLESS=1 cargo test -p myapp-plugin --test crd` (or `cargo xtask crds`).

use kube::CustomResourceExt as _;
use myapp_plugin::MyApp;

#[test]
fn crd_yaml_matches_the_rust_types() {
    let generated = format!(
        "# Generated from plugins/myapp/src/types.rs by `cargo xtask crds`; do not edit.\n{}",
        serde_yaml_ng::to_string(&MyApp::crd()).expect("CRD serializes")
    );
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../crds/myapp.yaml");
    if std::env::var_os("WASMCTRL_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write crds/myapp.yaml");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "crds/myapp.yaml is out of date with the MyApp types; run `cargo xtask crds`"
    );
}

#[test]
fn crd_validates_replicas_image_and_port_and_has_status_and_columns() {
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
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .expect("columns")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(columns, ["Replicas", "Ready", "Age"]);
    assert_eq!(crd["spec"]["scope"], "Namespaced");
}
