//! Native tests: the same decoding the Wasm export uses, no Wasm or cluster needed.

use k8s_openapi::api::apps::v1::{Deployment, DeploymentStatus};
use kube::CustomResourceExt;
use wasmctrl_plugin_sdk::testing::TestRequest;

use super::*;

fn parent(replicas: i32) -> {{kind}} {
    let mut parent = {{kind}}::new(
        "example",
        {{kind}}Spec {
            image: "nginx:1.27".to_owned(),
            replicas,
        },
    );
    parent.metadata.namespace = Some("default".to_owned());
    parent
}

fn ready_condition(status: &{{kind}}Status) -> &Condition {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("a Ready condition")
}

#[test]
fn a_new_parent_gets_its_deployment_and_is_not_ready() {
    let response = TestRequest::new(&parent(2))
        .reconcile::<{{kind}}Reconciler>()
        .expect("reconciles");
    let deployment: Deployment = response.child("example").expect("the Deployment");
    let spec = deployment.spec;
    assert_eq!(spec.replicas, Some(2));
    assert_eq!(
        spec.template.spec.expect("pod spec").containers[0]
            .image
            .as_deref(),
        Some("nginx:1.27")
    );
    let status: {{kind}}Status = response.status().expect("a status");
    assert_eq!(status.ready_replicas, 0);
    assert_eq!(ready_condition(&status).status, ConditionStatus::False);
}

#[test]
fn ready_when_the_deployment_reports_every_replica_ready() {
    let observed = Deployment {
        metadata: ObjectMeta {
            name: Some("example".to_owned()),
            ..ObjectMeta::default()
        },
        status: Some(DeploymentStatus {
            ready_replicas: Some(2),
            ..DeploymentStatus::default()
        }),
        ..Deployment::default()
    };
    let response = TestRequest::new(&parent(2))
        .child(&observed)
        .reconcile::<{{kind}}Reconciler>()
        .expect("reconciles");
    let status: {{kind}}Status = response.status().expect("a status");
    assert_eq!(status.ready_replicas, 2);
    assert_eq!(ready_condition(&status).status, ConditionStatus::True);
}

#[test]
fn a_parent_being_deleted_is_finalized_at_once() {
    let response = TestRequest::new(&parent(1))
        .finalizing()
        .reconcile::<{{kind}}Reconciler>()
        .expect("reconciles");
    assert!(response.is_finalized());
    assert!(response.children_json().is_empty());
}

/// `deploy/crd.yaml` is generated from the types above; `UPDATE_CRD=1 cargo test` rewrites it
/// after you change them.
#[test]
fn deploy_crd_yaml_matches_the_types() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/crd.yaml");
    let generated = serde_json::to_value({{kind}}::crd()).expect("the CRD serializes");
    if std::env::var_os("UPDATE_CRD").is_some() {
        let yaml = serde_saphyr::to_string(&generated).expect("the CRD as YAML");
        let header = "# Generated from src/lib.rs by `UPDATE_CRD=1 cargo test`; do not edit.\n";
        std::fs::write(&path, format!("{header}{yaml}")).expect("write deploy/crd.yaml");
    }
    let text = std::fs::read_to_string(&path).expect("read deploy/crd.yaml");
    let committed: serde_json::Value =
        serde_saphyr::from_str(&text).expect("deploy/crd.yaml is YAML");
    assert!(
        committed == generated,
        "deploy/crd.yaml is out of date with the types: run `UPDATE_CRD=1 cargo test`"
    );
}
