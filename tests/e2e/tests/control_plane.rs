//! The local control plane is the real thing: workloads progress, CRDs validate and serve
//! status, RBAC and TokenRequest work. These pin what wasmctrl's own end-to-end tests rely on.

use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use wasmctrl_e2e::{myapp, myapps};
use wasmctrl_testenv::TestEnv;
use wasmctrl_testenv::cluster::eventually;

fn from_json<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> T {
    serde_json::from_value(value).expect("test object is valid")
}

#[tokio::test]
async fn deployment_becomes_ready_and_is_garbage_collected() -> anyhow::Result<()> {
    let (client, ns) = TestEnv::get().namespace("deployment-ready").await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    deployments
        .create(
            &PostParams::default(),
            &from_json(json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "web"},
                "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
                         "template": {"metadata": {"labels": {"app": "web"}},
                                      "spec": {"containers": [{"name": "web", "image": "nginx:1.25"}]}}}
            })),
        )
        .await?;
    eventually("readyReplicas == 3", Duration::from_secs(60), || async {
        let d = deployments.get("web").await?;
        Ok(d.status.and_then(|s| s.ready_replicas) == Some(3))
    })
    .await?;

    deployments
        .delete("web", &DeleteParams::background())
        .await?;
    let replica_sets: Api<ReplicaSet> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    eventually(
        "ReplicaSet and Pods collected",
        Duration::from_secs(60),
        || async {
            let selector = ListParams::default().labels("app=web");
            Ok(replica_sets.list(&selector).await?.items.is_empty()
                && pods.list(&selector).await?.items.is_empty())
        },
    )
    .await
}

#[tokio::test]
async fn crd_serves_status_subresource_and_rejects_invalid_objects() -> anyhow::Result<()> {
    let env = TestEnv::get();
    let client = env.client().await?;
    let crd_yaml = std::fs::read_to_string(wasmctrl_testenv::repo_root().join("crds/myapp.yaml"))?;
    let crd: CustomResourceDefinition = serde_yaml_ng::from_str(&crd_yaml)?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.patch(
        "myapps.example.com",
        &PatchParams::apply("wasmctrl-e2e").force(),
        &Patch::Apply(&crd),
    )
    .await?;
    eventually("CRD established", Duration::from_secs(30), || async {
        let crd = crds.get("myapps.example.com").await?;
        Ok(crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True"))
    })
    .await?;

    let (client, ns) = env.namespace("crd-status").await?;
    let myapps = myapps(&client, &ns);
    let app: DynamicObject = from_json(myapp("web", 3, "nginx:1.25", None));
    // The discovery cache of a fresh CRD can lag a moment behind Established.
    eventually("MyApp created", Duration::from_secs(30), || async {
        Ok(myapps.create(&PostParams::default(), &app).await.is_ok())
    })
    .await?;

    myapps
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"replicas": 3, "readyReplicas": 2, "ready": "2/3"}})),
        )
        .await?;
    let read = myapps.get("web").await?;
    assert_eq!(read.data["status"]["readyReplicas"], 2);
    assert_eq!(read.data["status"]["ready"], "2/3");
    assert_eq!(
        read.data["spec"]["replicas"], 3,
        "status write left spec alone"
    );

    let invalid: DynamicObject = from_json(myapp("invalid", 0, "nginx", None));
    let err = myapps
        .create(
            &PostParams {
                dry_run: true,
                ..PostParams::default()
            },
            &invalid,
        )
        .await
        .expect_err("replicas 0 violates the schema");
    match err {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 422, "{status:?}");
            assert!(
                status.message.contains("spec.replicas"),
                "{}",
                status.message
            );
        }
        other => panic!("expected a 422 from the API server, got {other}"),
    }
    Ok(())
}

#[tokio::test]
async fn service_account_token_is_bound_by_rbac() -> anyhow::Result<()> {
    let env = TestEnv::get();
    let (admin, ns) = env.namespace("token-rbac").await?;
    let pp = PostParams::default();
    Api::<ServiceAccount>::namespaced(admin.clone(), &ns)
        .create(&pp, &from_json(json!({"metadata": {"name": "reader"}})))
        .await?;
    Api::<Role>::namespaced(admin.clone(), &ns)
        .create(&pp, &from_json(json!({
            "metadata": {"name": "configmap-reader"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}]
        })))
        .await?;
    Api::<RoleBinding>::namespaced(admin.clone(), &ns)
        .create(&pp, &from_json(json!({
            "metadata": {"name": "reader-reads-configmaps"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmap-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]
        })))
        .await?;

    let request: TokenRequest =
        from_json(json!({"spec": {"audiences": [], "expirationSeconds": 3600}}));
    let issued: TokenRequest = Api::<ServiceAccount>::namespaced(admin.clone(), &ns)
        .create_subresource("token", "reader", &pp, &request)
        .await?;
    let token = issued.status.context("TokenRequest has a status")?.token;

    // A kubeconfig for the same server, authenticating with the token instead.
    let mut kubeconfig: serde_json::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(env.kubeconfig())?)?;
    kubeconfig["users"][0]["user"] = json!({ "token": token });
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), serde_yaml_ng::to_string(&kubeconfig)?)?;
    let reader = wasmctrl_testenv::cluster::admin_client(file.path()).await?;

    Api::<ConfigMap>::namespaced(reader.clone(), &ns)
        .list(&ListParams::default())
        .await
        .context("the RoleBinding grants listing ConfigMaps")?;
    for (what, denied) in [
        (
            "secrets in its namespace",
            Api::<Secret>::namespaced(reader.clone(), &ns)
                .list(&ListParams::default())
                .await
                .err(),
        ),
        (
            "configmaps in another namespace",
            Api::<ConfigMap>::namespaced(reader.clone(), "default")
                .list(&ListParams::default())
                .await
                .err(),
        ),
    ] {
        match denied {
            Some(kube::Error::Api(status)) if status.code == 403 => {}
            other => panic!("listing {what} must be forbidden, got {other:?}"),
        }
    }
    Ok(())
}
