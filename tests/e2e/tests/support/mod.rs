//! What the host's end-to-end tests share: CRDs installed once, a wasmctrl host running
//! in-process for one test (scoped to its namespace and its own policies, so tests running
//! side by side never act on each other's objects), and small object helpers.
#![allow(dead_code)] // each test binary uses a different part

use std::time::Duration;

use anyhow::Context as _;
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use wasmctrl::controller::{Host, HostOptions};
use wasmctrl::plugin::{EngineOptions, PluginEngine};
#[allow(unused_imports)] // each test binary uses a different part
pub use wasmctrl_testenv::crds::{crds_api, install_crd, install_repo_crds};
use wasmctrl_testenv::{TestEnv, cluster::eventually};

/// Label that ties a test's policies to the host the test runs.
pub const TEST_LABEL: &str = "e2e.wasmctrl.dev/test";

/// How long anything that needs the host to act may take.
pub const ACT: Duration = Duration::from_secs(30);

pub fn resource(group: &str, version: &str, kind: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind))
}

/// A CRD for a test-only namespaced kind with a status subresource and a free-form spec.
pub fn test_crd(group: &str, kind: &str) -> Value {
    let plural = format!("{}s", kind.to_lowercase());
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.{group}")},
        "spec": {
            "group": group,
            "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(), "listKind": format!("{kind}List")},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                    },
                }},
            }],
        },
    })
}

/// A wasmctrl host running in this test process, watching only `namespace` and only the
/// policies labelled for this test.
pub struct HostUnderTest {
    /// The host's metrics, read by tests that count reconciles.
    pub metrics: std::sync::Arc<wasmctrl::metrics::Metrics>,
    /// The host's readiness, for tests of `/readyz`.
    pub readiness: std::sync::Arc<wasmctrl::health::Readiness>,
    /// The records of its reconciles, for tests of `explain`.
    pub explain: std::sync::Arc<wasmctrl::explain::Explain>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl HostUnderTest {
    pub async fn start(test: &str, namespace: &str) -> anyhow::Result<Self> {
        let cache = std::env::temp_dir().join("wasmctrl-e2e-artifacts");
        Self::start_with(TestEnv::get().client().await?, test, namespace, Some(cache)).await
    }

    /// A host that keeps the records of its reconciles in `explain`.
    pub async fn start_explained(
        test: &str,
        namespace: &str,
        explain: std::sync::Arc<wasmctrl::explain::Explain>,
    ) -> anyhow::Result<Self> {
        let cache = std::env::temp_dir().join("wasmctrl-e2e-artifacts");
        let client = TestEnv::get().client().await?;
        Self::start_with_explain(client, test, namespace, Some(cache), explain).await
    }

    /// A host with no precompiled artifacts on disk, so a pinned digest it has not loaded
    /// itself is always fetched from its source (for tests of the sources).
    pub async fn start_without_disk_cache(test: &str, namespace: &str) -> anyhow::Result<Self> {
        Self::start_with(TestEnv::get().client().await?, test, namespace, None).await
    }

    /// A host whose every request is made as `user` (e.g. a ServiceAccount), so it has
    /// exactly the permissions RBAC grants that user.
    pub async fn start_as(test: &str, namespace: &str, user: &str) -> anyhow::Result<Self> {
        let cache = std::env::temp_dir().join("wasmctrl-e2e-artifacts");
        Self::start_with(
            impersonating_client(user).await?,
            test,
            namespace,
            Some(cache),
        )
        .await
    }

    async fn start_with(
        client: Client,
        test: &str,
        namespace: &str,
        cache_dir: Option<std::path::PathBuf>,
    ) -> anyhow::Result<Self> {
        let explain = HostOptions::default().explain;
        Self::start_with_explain(client, test, namespace, cache_dir, explain).await
    }

    async fn start_with_explain(
        client: Client,
        test: &str,
        namespace: &str,
        cache_dir: Option<std::path::PathBuf>,
        explain: std::sync::Arc<wasmctrl::explain::Explain>,
    ) -> anyhow::Result<Self> {
        let engine = PluginEngine::new(EngineOptions {
            cache_dir,
            max_concurrent_calls: 8,
            max_memory_bytes: 128 << 20,
            ..EngineOptions::default()
        })?;
        let options = HostOptions {
            namespace: Some(namespace.to_owned()),
            policy_selector: Some(format!("{TEST_LABEL}={test}")),
            backoff_base: Duration::from_millis(500),
            backoff_max: Duration::from_secs(8),
            event_interval: Duration::from_secs(30),
            credentials_namespace: Some(namespace.to_owned()),
            explain,
            ..HostOptions::default()
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let host = Host::new(client, engine, options);
        let metrics = host.metrics();
        let readiness = host.readiness();
        let explain = host.explain();
        let task = tokio::spawn(host.run(async {
            let _ = stopped.await;
        }));
        Ok(Self {
            metrics,
            readiness,
            explain,
            stop: Some(stop),
            task,
        })
    }

    /// Stop gracefully and wait for every controller to finish.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task).await.context("host task panicked")?
    }
}

impl Drop for HostUnderTest {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A client that acts as `user` through impersonation by the admin credentials.
pub async fn impersonating_client(user: &str) -> anyhow::Result<Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(TestEnv::get().kubeconfig())?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.auth_info.impersonate = Some(user.to_owned());
    Ok(Client::try_from(config)?)
}

/// The ReconcilePolicy API.
pub fn policies(client: &Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &resource("wasmctrl.dev", "v1alpha1", "ReconcilePolicy"),
    )
}

/// The namespace each test made with [`test_namespace`], by test name.
static TEST_NAMESPACES: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// A fresh namespace for `test` and an admin client. Policies the test applies reconcile
/// parents in this namespace only (`spec.parent.namespace`), so tests that share a parent
/// kind run side by side without claiming it from each other.
pub async fn test_namespace(test: &str) -> anyhow::Result<(Client, String)> {
    let (client, namespace) = TestEnv::get().namespace(test).await?;
    TEST_NAMESPACES
        .lock()
        .expect("not poisoned")
        .push((test.to_owned(), namespace.clone()));
    Ok((client, namespace))
}

/// Create or update policy `name` for `test` with `spec`. Unless the spec names a parent
/// namespace, the policy is confined to the test's namespace.
pub async fn apply_policy(
    client: &Client,
    test: &str,
    name: &str,
    mut spec: Value,
) -> anyhow::Result<()> {
    let namespace = TEST_NAMESPACES
        .lock()
        .expect("not poisoned")
        .iter()
        .rev()
        .find(|(t, _)| t == test)
        .map(|(_, ns)| ns.clone());
    if let (Some(namespace), Some(parent)) = (namespace, spec["parent"].as_object_mut()) {
        parent
            .entry("namespace")
            .or_insert_with(|| json!(namespace));
    }
    let policy = json!({
        "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
        "metadata": {"name": name, "labels": {TEST_LABEL: test}},
        "spec": spec,
    });
    policies(client)
        .patch(
            name,
            &PatchParams::apply("wasmctrl-e2e").force(),
            &Patch::Apply(&policy),
        )
        .await
        .with_context(|| format!("applying policy {name}"))?;
    Ok(())
}

/// The path of a built plugin, as a file source.
pub fn file_source(plugin: &str) -> Value {
    let path = wasmctrl_testenv::plugins::guest(plugin);
    json!({"file": {"path": path.to_string_lossy()}})
}

/// An API for `resource` in `namespace`.
pub fn api(client: &Client, resource: &ApiResource, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), namespace, resource)
}

/// Server-side apply `object` (a JSON manifest) as the test's own field manager.
pub async fn apply(api: &Api<DynamicObject>, object: Value) -> anyhow::Result<DynamicObject> {
    let name = object["metadata"]["name"]
        .as_str()
        .context("object without a name")?
        .to_owned();
    api.patch(
        &name,
        &PatchParams::apply("wasmctrl-e2e").force(),
        &Patch::Apply(&object),
    )
    .await
    .with_context(|| format!("applying {name}"))
}

/// The object as JSON, or `None` if it does not exist.
pub async fn get(api: &Api<DynamicObject>, name: &str) -> anyhow::Result<Option<Value>> {
    Ok(api
        .get_opt(name)
        .await?
        .map(|o| serde_json::to_value(o).unwrap_or_default()))
}

/// The condition `type_` of `object`'s status.
pub fn condition<'a>(object: &'a Value, type_: &str) -> Option<&'a Value> {
    object["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// Wait until `check` accepts the object (which must exist).
pub async fn wait_for_object(
    api: &Api<DynamicObject>,
    name: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    let found = std::sync::Mutex::new(Value::Null);
    eventually(what, ACT, || {
        let fetched = get(api, name);
        let check = &check;
        let found = &found;
        async move {
            Ok(match fetched.await? {
                Some(object) if check(&object) => {
                    *found.lock().expect("not poisoned") = object;
                    true
                }
                _ => false,
            })
        }
    })
    .await?;
    Ok(found.into_inner().expect("not poisoned"))
}

/// Wait until the object is gone.
pub async fn wait_gone(api: &Api<DynamicObject>, name: &str, what: &str) -> anyhow::Result<()> {
    eventually(
        what,
        ACT,
        || async move { Ok(get(api, name).await?.is_none()) },
    )
    .await
}

/// How long garbage collection may take. It is kube-controller-manager's work, not the
/// host's, and for a kind whose CRD was installed moments ago its collector first has to
/// notice the kind (its discovery resyncs every 30 s).
pub const COLLECT: Duration = Duration::from_secs(90);

/// Wait until garbage collection has removed the object.
pub async fn wait_collected(
    api: &Api<DynamicObject>,
    name: &str,
    what: &str,
) -> anyhow::Result<()> {
    eventually(what, COLLECT, || async move {
        Ok(get(api, name).await?.is_none())
    })
    .await
}

/// Event reasons recorded on objects named `name` in `namespace`.
pub async fn event_reasons(
    client: &Client,
    namespace: &str,
    name: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), namespace);
    Ok(events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.type_.unwrap_or_default(), e.reason.unwrap_or_default()))
        .collect())
}

/// Delete a test's namespace once it passed (a failed test leaves it for inspection).
pub async fn delete_namespace(client: &Client, namespace: &str) -> anyhow::Result<()> {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .delete(namespace, &Default::default())
        .await
        .with_context(|| format!("deleting namespace {namespace}"))?;
    Ok(())
}

/// A plain HTTP GET on loopback: the status code and the body.
pub async fn http_get(address: std::net::SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut stream = std::net::TcpStream::connect(address)?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let status = response
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or(0);
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .unwrap_or_default();
        anyhow::Ok((status, body))
    })
    .await?
}

/// The Helm chart, relative to the repository root.
pub const CHART: &str = "deploy/chart/wasmctrl";

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

pub async fn apply_object(client: &kube::Client, object: &Value) -> anyhow::Result<()> {
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
    api.patch(
        name,
        &PatchParams::apply("wasmctrl-e2e").force(),
        &Patch::Apply(object),
    )
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
    let rendered = render(&[release, CHART, "--namespace", ns])?;
    for object in documents(&rendered)? {
        if RBAC_KINDS.contains(&object["kind"].as_str().unwrap_or_default()) {
            apply_object(client, &object).await?;
        }
    }
    Ok(format!("{release}-wasmctrl"))
}

/// What `wasmctrl rbac FILES… --service-account SA --name NAME` prints.
pub async fn rbac_for(
    files: &[std::path::PathBuf],
    service_account: &str,
    name: &str,
) -> anyhow::Result<String> {
    use clap::Parser as _;
    let mut args = vec![
        "wasmctrl".to_owned(),
        "rbac".into(),
        "--service-account".into(),
        service_account.into(),
        "--name".into(),
        name.into(),
    ];
    args.extend(files.iter().map(|f| f.to_string_lossy().into_owned()));
    match wasmctrl::cli::Cli::try_parse_from(args)?.command {
        wasmctrl::cli::Command::Rbac(command) => command.render().await,
        _ => anyhow::bail!("not the rbac command"),
    }
}

/// The MyApp policy's spec: Deployments and Services as children, the labelled ConfigMaps as
/// related objects, its plugin at `source` called with `config`.
pub fn myapp_policy_spec(source: Value, config: Value) -> Value {
    json!({
        "parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
        "children": [
            {"apiVersion": "apps/v1", "kind": "Deployment"},
            {"apiVersion": "v1", "kind": "Service"},
        ],
        "related": [{
            "apiVersion": "v1", "kind": "ConfigMap",
            "selector": {"matchLabels": {"example.com/myapp-config": "true"}},
        }],
        "plugin": {"source": source, "config": config},
    })
}

/// The MyApp policy's spec as the deployment tests use it: confined to `ns`, its plugin at
/// `source`.
pub fn myapp_policy_in(ns: &str, source: Value) -> Value {
    let mut spec = myapp_policy_spec(source, json!({"service": true}));
    spec["parent"]["namespace"] = json!(ns);
    spec
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
    let generated = documents(&rbac_for(&[crd, policy_file], service_account, rbac_name).await?)?;
    for object in &generated {
        apply_object(client, object).await?;
    }
    Ok(generated)
}
