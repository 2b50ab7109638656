//! Installing CRDs the way the tests and benchmarks need them: applied, then waited for until
//! the API server serves their kind.

use std::time::Duration;

use anyhow::Context as _;
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::Value;

/// How long a freshly applied CRD may take to be served.
const SERVED: Duration = Duration::from_secs(30);

/// The CustomResourceDefinition API.
pub fn crds_api(client: &Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "apiextensions.k8s.io",
            "v1",
            "CustomResourceDefinition",
        )),
    )
}

/// Server-side apply a CRD and wait until its kind is served.
pub async fn install_crd(client: &Client, crd: &Value) -> anyhow::Result<()> {
    let name = crd["metadata"]["name"]
        .as_str()
        .context("CRD without a name")?;
    crds_api(client)
        .patch(
            name,
            &PatchParams::apply("wasmctrl-e2e").force(),
            &Patch::Apply(crd),
        )
        .await
        .with_context(|| format!("applying CRD {name}"))?;
    let group = crd["spec"]["group"].as_str().unwrap_or_default().to_owned();
    let kind = crd["spec"]["names"]["kind"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let version = crd["spec"]["versions"][0]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let gvk = GroupVersionKind::gvk(&group, &version, &kind);
    crate::cluster::eventually(&format!("{kind} to be served"), SERVED, || {
        let client = client.clone();
        let gvk = gvk.clone();
        async move { Ok(kube::discovery::pinned_kind(&client, &gvk).await.is_ok()) }
    })
    .await
}

/// Install the repository's CRDs (ReconcilePolicy, MyApp).
pub async fn install_repo_crds(client: &Client) -> anyhow::Result<()> {
    for file in [
        "crds/reconcilepolicy.yaml",
        "crds/namespacedreconcilepolicy.yaml",
        "crds/myapp.yaml",
    ] {
        let text = std::fs::read_to_string(crate::repo_root().join(file))?;
        install_crd(client, &serde_yaml_ng::from_str(&text)?).await?;
    }
    Ok(())
}
