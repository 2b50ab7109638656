//! The kubelet's part, played for a chart's pods on a control plane that has no nodes: a
//! Deployment's pod run from its image in a registry (runc, the pod's arguments, environment,
//! volumes and ServiceAccount token), and `helm test`'s pod run to completion with its phase
//! reported back, which is what helm waits for.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, ServiceAccount};
use kube::Api;
use kube::api::ListParams;
use serde_json::Value;
use wasmctrl_testenv::container::{Container, ContainerSpec, service_account_files};
use wasmctrl_testenv::image;

use crate::http::https_get;

/// The node a chart's pods run on: the cluster they belong to and how images are pulled.
#[derive(Clone, Copy)]
pub struct Node<'a> {
    /// An admin client.
    pub client: &'a kube::Client,
    /// The release's namespace.
    pub namespace: &'a str,
    /// The cluster's kubeconfig: its server and CA are what a pod is given.
    pub kubeconfig: &'a Path,
    /// A CA the node trusts for the registry, besides the system's.
    pub registry_ca: Option<&'a str>,
    /// The registry speaks plain HTTP.
    pub insecure: bool,
    /// Where images are unpacked and volumes kept.
    pub work: &'a Path,
}

/// The login a pod's `imagePullSecrets` hold for `reference`'s registry; anonymous when the
/// pod names none.
async fn pull_auth(
    client: &kube::Client,
    namespace: &str,
    pod: &Value,
    reference: &str,
) -> anyhow::Result<oci_client::secrets::RegistryAuth> {
    let Some(pull_secret) = pod["imagePullSecrets"][0]["name"].as_str() else {
        return Ok(oci_client::secrets::RegistryAuth::Anonymous);
    };
    let registry = reference.split('/').next().unwrap_or_default();
    let secret = Api::<Secret>::namespaced(client.clone(), namespace)
        .get(pull_secret)
        .await?;
    let docker_config: Value = serde_json::from_slice(
        &secret
            .data
            .as_ref()
            .and_then(|data| data.get(".dockerconfigjson"))
            .context(".dockerconfigjson")?
            .0,
    )?;
    let login = base64::Engine::decode(
        &base64::engine::general_purpose::STANDARD,
        docker_config["auths"][registry]["auth"]
            .as_str()
            .context("a login for the image's registry")?,
    )?;
    let (user, password) = std::str::from_utf8(&login)?
        .split_once(':')
        .context("user:password")?;
    Ok(oci_client::secrets::RegistryAuth::Basic(
        user.into(),
        password.into(),
    ))
}

/// Run the chart's Deployment as a kubelet would run one of its pods: its image pulled with
/// its `imagePullSecrets`, its arguments and environment, its `emptyDir` and ConfigMap
/// volumes, its ServiceAccount's token. Only the listener moves to a free loopback port (the
/// container shares the test machine's network).
pub async fn run_chart_pod(node: &Node<'_>) -> anyhow::Result<(Container, SocketAddr)> {
    let Node {
        client,
        namespace,
        kubeconfig,
        registry_ca,
        insecure,
        work,
    } = *node;
    let deployments = Api::<Deployment>::namespaced(client.clone(), namespace)
        .list(&Default::default())
        .await?;
    let [deployment] = deployments.items.as_slice() else {
        bail!(
            "the chart installs one Deployment, not {}",
            deployments.items.len()
        );
    };
    let pod = serde_json::to_value(deployment)?["spec"]["template"]["spec"].clone();
    let container = &pod["containers"][0];

    // Pull with the pod's imagePullSecrets (anonymously without), trusting the registry's CA
    // as the node would.
    let reference = container["image"].as_str().context("an image")?;
    let auth = pull_auth(client, namespace, &pod, reference).await?;
    let rootfs = work.join("rootfs");
    image::pull_with(
        reference,
        &rootfs,
        &image::Access {
            insecure,
            ca_pem: registry_ca,
            auth,
        },
    )
    .await?;
    std::fs::set_permissions(&rootfs, std::fs::Permissions::from_mode(0o755))?;

    // Arguments, with the listener on a free port.
    let address = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let mut args = vec![image::ENTRYPOINT.to_owned()];
    for arg in container["args"].as_array().context("args")? {
        let arg = arg.as_str().context("a string argument")?;
        args.push(if arg.starts_with("--listen=") {
            format!("--listen={address}")
        } else {
            arg.to_owned()
        });
    }

    // Environment: values and the pod's own fields; the in-cluster API server address.
    let pod_name = format!("{namespace}-host-0");
    let kubeconfig: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(kubeconfig)
            .with_context(|| format!("reading {}", kubeconfig.display()))?,
    )?;
    let server = kubeconfig["clusters"][0]["cluster"]["server"]
        .as_str()
        .context("the cluster's server")?;
    let (host, port) = server
        .trim_start_matches("https://")
        .rsplit_once(':')
        .context("server host:port")?;
    let mut env = vec![
        ("KUBERNETES_SERVICE_HOST".to_owned(), host.to_owned()),
        ("KUBERNETES_SERVICE_PORT".to_owned(), port.to_owned()),
    ];
    for var in container["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().context("a name")?.to_owned();
        let value = match (
            &var["value"],
            var["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        ) {
            (Value::String(value), _) => value.clone(),
            (_, Some("metadata.name")) => pod_name.clone(),
            (_, Some("metadata.namespace")) => namespace.to_owned(),
            _ => bail!("an environment variable this test cannot fill: {var}"),
        };
        env.push((name, value));
    }

    // Volumes: emptyDirs as scratch space, ConfigMaps as read-only files.
    let volumes = pod["volumes"].as_array().cloned().unwrap_or_default();
    let mut scratch = Vec::new();
    let mut binds = Vec::new();
    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
        let name = mount["name"].as_str().context("a volume name")?;
        let at = mount["mountPath"]
            .as_str()
            .context("a mount path")?
            .to_owned();
        let volume = volumes
            .iter()
            .find(|v| v["name"] == name)
            .with_context(|| format!("volume {name}"))?;
        if volume.get("emptyDir").is_some() {
            scratch.push(at);
        } else if let Some(config_map) = volume["configMap"]["name"].as_str() {
            let data = Api::<ConfigMap>::namespaced(client.clone(), namespace)
                .get(config_map)
                .await?
                .data
                .unwrap_or_default();
            let dir = work.join("volumes").join(name);
            std::fs::create_dir_all(&dir)?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
            for (key, value) in data {
                std::fs::write(dir.join(&key), value)?;
                std::fs::set_permissions(dir.join(&key), std::fs::Permissions::from_mode(0o644))?;
            }
            binds.push((dir, at));
        } else {
            bail!("a volume this test cannot provide: {volume}");
        }
    }

    // The ServiceAccount's token.
    let account = pod["serviceAccountName"]
        .as_str()
        .context("a ServiceAccount")?;
    let token = Api::<ServiceAccount>::namespaced(client.clone(), namespace)
        .create_token_request(
            account,
            &Default::default(),
            &TokenRequest {
                spec: Some(TokenRequestSpec {
                    expiration_seconds: Some(3600),
                    ..TokenRequestSpec::default()
                }),
                ..TokenRequest::default()
            },
        )
        .await?
        .status
        .and_then(|status| status.token)
        .context("a token")?;
    let cluster_ca = std::fs::read(
        kubeconfig["clusters"][0]["cluster"]["certificate-authority"]
            .as_str()
            .context("the cluster's CA file")?,
    )?;
    let sa_dir = work.join("serviceaccount");
    service_account_files(&sa_dir, &token, &cluster_ca, namespace)?;
    std::fs::set_permissions(&sa_dir, std::fs::Permissions::from_mode(0o755))?;

    let user = pod["securityContext"]["runAsUser"]
        .as_u64()
        .and_then(|uid| u32::try_from(uid).ok())
        .unwrap_or(image::USER);
    let started = Container::start(
        &format!("pod-{}-{namespace}", std::process::id()),
        &ContainerSpec {
            rootfs,
            args,
            env,
            user,
            service_account: sa_dir,
            scratch,
            binds,
        },
    )?;
    wasmctrl_testenv::cluster::eventually(
        "the chart's pod ready",
        Duration::from_secs(60),
        || async { Ok(https_get(address, "/readyz", None).await.ok() == Some((200, "ok".into()))) },
    )
    .await
    .with_context(|| format!("the pod printed:\n{}", started.output()))?;
    Ok((started, address))
}

/// What `helm test` said, and what its pod printed.
pub struct HelmTest {
    /// Whether `helm test` passed.
    pub passed: bool,
    /// What helm printed.
    pub said: String,
    /// What the test pod printed.
    pub probe: String,
}

/// Run `helm test wasmctrl` and play the kubelet for its pod: run the pod's container from
/// the image `run_chart_pod` pulled (its arguments as given, the Service's address replaced
/// by the host's, which has no Service proxy here), and report the container's exit as the
/// pod's phase, which is what helm waits for.
pub async fn helm_test(
    node: &Node<'_>,
    release: &str,
    host: SocketAddr,
    env: &[(&str, String)],
) -> anyhow::Result<HelmTest> {
    let Node {
        client,
        namespace,
        work,
        ..
    } = *node;
    let helm = wasmctrl_testenv::tools::helm()?;
    let mut command = Command::new(&helm);
    command.args(["test", release, "-n", namespace, "--timeout", "90s"]);
    for (name, value) in env {
        command.env(name, value);
    }
    let helm_run = tokio::task::spawn_blocking(move || command.output());

    let pods = Api::<Pod>::namespaced(client.clone(), namespace);
    // The chart's test pod, as helm made it for this run (a pod an earlier run left behind
    // is replaced first: the hook's before-hook-creation). The control plane's simulated node
    // (kwok) reports every pod Running at once; what the container really does decides.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let pod = loop {
        let pending = pods
            .list(&ListParams::default().labels(&format!(
                "app.kubernetes.io/component=test,app.kubernetes.io/instance={release}"
            )))
            .await?
            .items
            .into_iter()
            // Once the simulated node took it (an IP given), so its status is not
            // overwritten after the phase is reported.
            .find(|p| {
                p.metadata.deletion_timestamp.is_none()
                    && p.status.as_ref().is_some_and(|s| s.pod_ip.is_some())
                    && !p
                        .status
                        .as_ref()
                        .and_then(|s| s.phase.as_deref())
                        .is_some_and(|phase| phase == "Succeeded" || phase == "Failed")
            });
        if let Some(pod) = pending {
            break pod;
        }
        if helm_run.is_finished() || std::time::Instant::now() > deadline {
            let said = match helm_run.is_finished() {
                true => helm_run
                    .await?
                    .map(|o| {
                        format!(
                            "{}{}",
                            String::from_utf8_lossy(&o.stdout),
                            String::from_utf8_lossy(&o.stderr)
                        )
                    })
                    .unwrap_or_else(|e| e.to_string()),
                false => "(helm still waits)".to_owned(),
            };
            bail!("helm made no test pod in {namespace}: {said}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let name = pod.metadata.name.clone().context("the test pod's name")?;
    let pod = serde_json::to_value(&pod)?;
    assert_eq!(pod["metadata"]["annotations"]["helm.sh/hook"], "test");
    let container = &pod["spec"]["containers"][0];
    let mut args = vec![image::ENTRYPOINT.to_owned()];
    for arg in container["args"].as_array().context("args")? {
        let arg = arg.as_str().context("a string argument")?;
        args.push(match arg.strip_prefix("https://") {
            Some(rest) => {
                let path = rest.find('/').map_or("", |at| &rest[at..]);
                format!("https://{host}{path}")
            }
            None => arg.to_owned(),
        });
    }
    let no_token = work.join("no-serviceaccount");
    std::fs::create_dir_all(&no_token)?;
    std::fs::set_permissions(&no_token, std::fs::Permissions::from_mode(0o755))?;
    let user = pod["spec"]["securityContext"]["runAsUser"]
        .as_u64()
        .and_then(|uid| u32::try_from(uid).ok())
        .unwrap_or(image::USER);
    let mut probe = Container::start(
        &format!(
            "readme-test-{}-{}",
            std::process::id(),
            pod["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .get(..8)
                .unwrap_or_default()
        ),
        &ContainerSpec {
            rootfs: work.join("rootfs"),
            args,
            env: Vec::new(),
            user,
            service_account: no_token,
            scratch: Vec::new(),
            binds: Vec::new(),
        },
    )?;
    let exit = tokio::task::block_in_place(|| probe.wait(Duration::from_secs(30)))?;
    let phase = if exit.success() {
        "Succeeded"
    } else {
        "Failed"
    };
    pods.patch_status(
        &name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(serde_json::json!({"status": {"phase": phase}})),
    )
    .await?;
    let output = helm_run.await??;
    Ok(HelmTest {
        passed: output.status.success(),
        said: format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
        probe: probe.output(),
    })
}
