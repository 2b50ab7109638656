//! The Helm chart and the RBAC a deployment needs: rendering with the pinned helm, applying
//! rendered objects, and what `wasmctrl rbac` prints for a policy.

use anyhow::Context as _;
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};

use crate::objects::resource;

/// The Helm chart, relative to the repository root.
pub const CHART: &str = "deploy/chart/wasmctrl";

/// Run the pinned helm with `args` in the repository root; what it printed and how it ended.
pub fn helm(args: &[&str]) -> anyhow::Result<std::process::Output> {
    let helm = wasmctrl_testenv::tools::helm()?;
    std::process::Command::new(&helm)
        .args(args)
        .current_dir(wasmctrl_testenv::repo_root())
        .output()
        .with_context(|| format!("running {}", helm.display()))
}

/// `helm template` with `args`; its output, or its error text as the error.
pub fn render(args: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["template"];
    all.extend_from_slice(args);
    let output = helm(&all)?;
    if !output.status.success() {
        anyhow::bail!("{}", String::from_utf8_lossy(&output.stderr));
    }
    Ok(String::from_utf8(output.stdout)?)
}

/// The documents of a multi-document YAML stream, as JSON, empty ones left out.
pub fn documents(yaml: &str) -> anyhow::Result<Vec<Value>> {
    let mut documents = Vec::new();
    for document in serde_yaml_ng::Deserializer::from_str(yaml) {
        let value = <Value as serde::Deserialize>::deserialize(document)?;
        if !value.is_null() {
            documents.push(value);
        }
    }
    Ok(documents)
}

/// Server-side apply `object` (a JSON manifest of any kind, namespaced or not) as the test's
/// own field manager.
async fn apply_object(client: &kube::Client, object: &Value) -> anyhow::Result<()> {
    apply_with(client, object, PatchParams::apply("wasmctrl-e2e").force()).await
}

/// Ask the API server to apply each of `objects` without storing anything (`dryRun=All`,
/// unknown fields refused): every admission and validation step runs, so an object the API
/// server would refuse fails here, naming it and why.
pub async fn dry_run_apply(client: &Client, objects: &[Value]) -> anyhow::Result<()> {
    let mut params = PatchParams::apply("wasmctrl-e2e").force();
    params.dry_run = true;
    params.field_validation = Some(kube::api::ValidationDirective::Strict);
    for object in objects {
        apply_with(client, object, params.clone()).await?;
    }
    Ok(())
}

async fn apply_with(
    client: &kube::Client,
    object: &Value,
    params: PatchParams,
) -> anyhow::Result<()> {
    let (group, version) = match object["apiVersion"]
        .as_str()
        .context("apiVersion")?
        .split_once('/')
    {
        Some((group, version)) => (group.to_owned(), version.to_owned()),
        None => (
            String::new(),
            object["apiVersion"].as_str().unwrap_or_default().to_owned(),
        ),
    };
    let kind = object["kind"].as_str().context("kind")?;
    let resource = resource(&group, &version, kind);
    let name = object["metadata"]["name"].as_str().context("name")?;
    let api: Api<DynamicObject> = match object["metadata"]["namespace"].as_str() {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    api.patch(name, &params, &Patch::Apply(object))
        .await
        .with_context(|| format!("applying {kind} {name}"))?;
    Ok(())
}

/// What of the chart is RBAC.
const RBAC_KINDS: [&str; 5] = [
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
];

/// Install the chart's ServiceAccount and RBAC (release `release`, namespace `ns`), as
/// `helm install` would; the ServiceAccount's name.
pub async fn install_chart_rbac(
    client: &Client,
    release: &str,
    ns: &str,
) -> anyhow::Result<String> {
    install_chart_rbac_with(client, release, ns, &[]).await
}

/// [`install_chart_rbac`] with `values` (`KEY=VALUE`, as `--set` takes them); the
/// ServiceAccount the Deployment runs as.
pub async fn install_chart_rbac_with(
    client: &Client,
    release: &str,
    ns: &str,
    values: &[&str],
) -> anyhow::Result<String> {
    let mut args = vec![release, CHART, "--namespace", ns];
    for value in values {
        args.extend(["--set", value]);
    }
    let objects = documents(&render(&args)?)?;
    for object in &objects {
        if RBAC_KINDS.contains(&object["kind"].as_str().unwrap_or_default()) {
            apply_object(client, object).await?;
        }
    }
    objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .and_then(|d| d["spec"]["template"]["spec"]["serviceAccountName"].as_str())
        .map(str::to_owned)
        .context("the chart's Deployment names no ServiceAccount")
}

/// Install the chart's explain-reader Role (release `release`, namespace `ns`) bound to
/// `subject`, as `helm install --set explain.readers=…` would.
pub async fn install_explain_reader(
    client: &Client,
    release: &str,
    ns: &str,
    subject: &Value,
) -> anyhow::Result<()> {
    let field = |name: &str| subject[name].as_str().unwrap_or_default().to_owned();
    let readers = format!(
        "explain.readers[0].kind={},explain.readers[0].name={},explain.readers[0].namespace={}",
        field("kind"),
        field("name"),
        field("namespace")
    );
    let rendered = render(&[release, CHART, "--namespace", ns, "--set", &readers])?;
    let mut installed = 0;
    for object in documents(&rendered)? {
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        if name.ends_with("-explain-reader")
            && RBAC_KINDS.contains(&object["kind"].as_str().unwrap_or_default())
        {
            // One binding per reader: the chart names them all alike.
            let mut object = object.clone();
            if object["kind"] == "RoleBinding" {
                object["metadata"]["name"] = json!(format!("{name}-{}", field("name")));
            }
            apply_object(client, &object).await?;
            installed += 1;
        }
    }
    anyhow::ensure!(
        installed == 2,
        "the chart rendered {installed} explain-reader objects, not a Role and its binding"
    );
    Ok(())
}

/// What `wasmctrl rbac FILES… --service-account SA --name NAME` prints.
async fn rbac_for(
    files: &[std::path::PathBuf],
    service_account: &str,
    name: Option<&str>,
) -> anyhow::Result<String> {
    use clap::Parser as _;
    let mut args = vec![
        "wasmctrl".to_owned(),
        "rbac".into(),
        "--service-account".into(),
        service_account.into(),
    ];
    if let Some(name) = name {
        args.extend(["--name".to_owned(), name.to_owned()]);
    }
    args.extend(files.iter().map(|f| f.to_string_lossy().into_owned()));
    match wasmctrl::cli::Cli::try_parse_from(args)?.command {
        wasmctrl::cli::Command::Rbac(command) => command.render().await,
        _ => anyhow::bail!("not the rbac command"),
    }
}

/// Apply what `wasmctrl rbac` prints for the policy `name` with `spec` (and the MyApp CRD),
/// granted to `service_account` (`NAMESPACE/NAME`) under the name `rbac_name`; the objects
/// applied.
pub async fn apply_policy_rbac(
    client: &Client,
    name: &str,
    spec: &Value,
    service_account: &str,
    rbac_name: &str,
) -> anyhow::Result<Vec<Value>> {
    let dir = tempfile::tempdir()?;
    let policy_file = dir.path().join("policy.yaml");
    std::fs::write(
        &policy_file,
        serde_yaml_ng::to_string(&json!({
            "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
            "metadata": {"name": name}, "spec": spec,
        }))?,
    )?;
    let crd = wasmctrl_testenv::repo_root().join("crds/myapp.yaml");
    let generated =
        documents(&rbac_for(&[crd, policy_file], service_account, Some(rbac_name)).await?)?;
    for object in &generated {
        apply_object(client, object).await?;
    }
    Ok(generated)
}

/// Apply what `wasmctrl rbac FILES --service-account HOST` prints, as the docs tell one to
/// (`| kubectl apply -f -`), named as it names its objects; the objects applied.
pub async fn apply_rbac_output(
    client: &Client,
    files: &[std::path::PathBuf],
    host_account: &str,
) -> anyhow::Result<Vec<Value>> {
    let generated = documents(&rbac_for(files, host_account, None).await?)?;
    for object in &generated {
        apply_object(client, object).await?;
    }
    Ok(generated)
}
