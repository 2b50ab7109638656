//! The built image, deployed: pushed to a registry, pulled and run by runc as two replicas
//! of a Pod's container (read-only root, non-root user, no capabilities, the ServiceAccount
//! token from the TokenRequest API, in-cluster configuration), with only the chart's RBAC
//! plus `wasmctrl rbac` for the MyApp policy, which acts as its own ServiceAccount (the
//! chart's `--require-policy-identity`). One replica leads and converges MyApps; SIGKILL
//! hands over once the lease expires, SIGTERM within about a second, and the terminated
//! replica exits 0. A replica whose cache directory is not writable still runs.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::Api;
use serde_json::{Value, json};
use wasmctrl_e2e::*;
use wasmctrl_testenv::TestEnv;
use wasmctrl_testenv::cluster::eventually;
use wasmctrl_testenv::container::{Container, ContainerSpec, service_account_files};
use wasmctrl_testenv::image;

const TEST: &str = "deploy-image";
const RELEASE: &str = "image-e2e";
const LEASE: &str = "wasmctrl-leader";
const PLUGIN_IN_IMAGE: &str = "/plugins/myapp_plugin.wasm";
/// The label `myapp-v2` puts on every child it makes.
const VERSION_LABEL: &str = "example.com/plugin-version";

/// The API server as a Pod sees it: `KUBERNETES_SERVICE_HOST`/`PORT` and the cluster CA.
fn api_server() -> anyhow::Result<(String, String, Vec<u8>)> {
    let kubeconfig: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(TestEnv::get().kubeconfig())?)?;
    let cluster = &kubeconfig["clusters"][0]["cluster"];
    let server = cluster["server"].as_str().context("server")?;
    let (host, port) = server
        .trim_start_matches("https://")
        .rsplit_once(':')
        .context("server host:port")?;
    let ca = std::fs::read(
        cluster["certificate-authority"]
            .as_str()
            .context("CA path")?,
    )?;
    Ok((host.to_owned(), port.to_owned(), ca))
}

struct Replica {
    name: String,
    container: Container,
    address: std::net::SocketAddr,
}

fn start_replica(
    name: &str,
    rootfs: &Path,
    service_account: &Path,
    with_cache: bool,
) -> anyhow::Result<Replica> {
    start_replica_with(name, rootfs, service_account, with_cache, &[], Vec::new())
}

/// A replica with `extra_args` after the chart's and `extra_binds` mounted read-only (the
/// chart's `extraArgs` and `extraVolumes`).
fn start_replica_with(
    name: &str,
    rootfs: &Path,
    service_account: &Path,
    with_cache: bool,
    extra_args: &[String],
    extra_binds: Vec<(std::path::PathBuf, String)>,
) -> anyhow::Result<Replica> {
    let (host, port, _) = api_server()?;
    let address = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    // The chart's container arguments, plus this test's policy selector and the directory
    // its plugin is mounted in (the chart's `pluginSources.fileDirs`).
    let args = [
        image::ENTRYPOINT,
        "run",
        &format!("--listen={address}"),
        "--shutdown-timeout-seconds=30",
        "--leader-elect",
        &format!("--leader-elect-lease-name={LEASE}"),
        "--require-policy-identity",
        &format!("--policy-selector={TEST_LABEL}={TEST}"),
        "--plugin-dir=/plugins",
    ]
    .map(str::to_owned)
    .into_iter()
    .chain(extra_args.iter().cloned())
    .collect();
    let spec = ContainerSpec {
        rootfs: rootfs.to_owned(),
        args,
        env: vec![
            ("KUBERNETES_SERVICE_HOST".into(), host),
            ("KUBERNETES_SERVICE_PORT".into(), port),
            ("POD_NAME".into(), name.to_owned()),
            ("WASMCTRL_CACHE_DIR".into(), image::CACHE_DIR.into()),
        ],
        user: image::USER,
        service_account: service_account.to_owned(),
        scratch: if with_cache {
            vec![image::CACHE_DIR.to_owned()]
        } else {
            Vec::new()
        },
        binds: [(
            wasmctrl_testenv::plugins::guest("myapp_plugin"),
            PLUGIN_IN_IMAGE.to_owned(),
        )]
        .into_iter()
        .chain(extra_binds)
        .collect(),
    };
    let container = Container::start(&format!("{name}-{}", std::process::id()), &spec)?;
    Ok(Replica {
        name: name.to_owned(),
        container,
        address,
    })
}

async fn wait_ready(replica: &Replica) -> anyhow::Result<()> {
    eventually(&format!("{} ready", replica.name), ACT, || async {
        Ok(https_get(replica.address, "/readyz", None).await.ok() == Some((200, "ok".into())))
    })
    .await
    .with_context(|| format!("{} printed:\n{}", replica.name, replica.container.output()))
}

async fn holder(leases: &Api<Lease>) -> Option<String> {
    leases
        .get_opt(LEASE)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
}

async fn wait_for_holder(
    leases: &Api<Lease>,
    among: &[&str],
    within: Duration,
) -> anyhow::Result<String> {
    let started = Instant::now();
    loop {
        if let Some(holder) = holder(leases).await
            && among.contains(&holder.as_str())
        {
            return Ok(holder);
        }
        anyhow::ensure!(
            started.elapsed() < within,
            "none of {among:?} took the lease in {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_runs_as_a_pod_with_the_charts_rbac_and_fails_over() -> anyhow::Result<()> {
    // Build (cached by cargo), push, pull and unpack: what a node does with an image.
    let profile = std::env::var("WASMCTRL_IMAGE_PROFILE").unwrap_or_else(|_| "image-test".into());
    let work = tempfile::tempdir()?;
    let built = tokio::task::spawn_blocking({
        let out = wasmctrl_testenv::repo_root().join("target/image/wasmctrl-e2e");
        move || image::build(&profile, &out)
    })
    .await??;
    eprintln!(
        "image {} is {:.1} MiB compressed",
        built.digest(),
        built.compressed_size() as f64 / f64::from(1 << 20)
    );
    let registry =
        tokio::task::spawn_blocking(wasmctrl_testenv::registry::Registry::start).await??;
    let reference = format!("{}/wasmctrl:e2e", registry.address);
    image::push(&built, &reference, true).await?;
    let rootfs = work.path().join("rootfs");
    image::pull_into(&reference, &rootfs).await?;
    std::fs::set_permissions(&rootfs, std::fs::Permissions::from_mode(0o755))?;

    // The chart's RBAC, the policy's generated RBAC (its own ServiceAccount, whose rules it
    // acts with, and the host's grant to impersonate it), and a token for the host's
    // ServiceAccount.
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let service_account = install_chart_rbac(&client, RELEASE, &ns).await?;
    let mut spec = myapp_policy_in(&ns, json!({"file": {"path": PLUGIN_IN_IMAGE}}));
    spec["serviceAccount"] = json!({"namespace": ns, "name": "myapp-operator"});
    apply_policy_rbac(
        &client,
        TEST,
        &spec,
        &format!("{ns}/{service_account}"),
        &format!("{RELEASE}-policies"),
    )
    .await?;
    let token = Api::<ServiceAccount>::namespaced(client.clone(), &ns)
        .create_token_request(
            &service_account,
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
    let sa_dir = work.path().join("serviceaccount");
    service_account_files(&sa_dir, &token, &api_server()?.2, &ns)?;
    std::fs::set_permissions(&sa_dir, std::fs::Permissions::from_mode(0o755))?;
    apply_policy(&client, TEST, TEST, spec).await?;
    // A scraper holding the chart's metrics-reader ClusterRole, as Prometheus would.
    wasmctrl_e2e::service_account(&client, &ns, "scraper").await?;
    let bindings = Api::<kube::api::DynamicObject>::all_with(
        client.clone(),
        &resource("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding"),
    );
    apply(
        &bindings,
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": format!("{ns}-scraper")},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": format!("{service_account}-metrics-reader")},
               "subjects": [account_subject(&ns, "scraper")]}),
    )
    .await?;
    let scraper = service_account_token(&ns, "scraper").await?;

    // Two replicas: one leads, both are ready, the leader converges a MyApp.
    let mut replicas = vec![
        start_replica(&format!("{RELEASE}-0"), &rootfs, &sa_dir, true)?,
        start_replica(&format!("{RELEASE}-1"), &rootfs, &sa_dir, true)?,
    ];
    for replica in &replicas {
        wait_ready(replica).await?;
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", replicas[0].container.pid()?))?;
    let uid_line = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .unwrap_or_default();
    assert!(
        uid_line.contains(&image::USER.to_string()),
        "runs as non-root: {uid_line}"
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let names: Vec<String> = replicas.iter().map(|r| r.name.clone()).collect();
    let leader = wait_for_holder(&leases, &[&names[0], &names[1]], ACT).await?;
    let apps = myapps(&client, &ns);
    let converged = |replicas: i64| {
        let apps = apps.clone();
        async move {
            wait_for_object(
                &apps,
                "web",
                &format!("web reconciled at {replicas} replicas"),
                |app| {
                    condition(app, "Reconciled").is_some_and(|c| c["status"] == "True")
                        && app["status"]["observedGeneration"] == app["metadata"]["generation"]
                },
            )
            .await
        }
    };
    apply(&apps, myapp("web", 1, "nginx:1.27", None)).await?;
    converged(1).await?;
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    assert!(get(&deployments, "web").await?.is_some());
    let leader_at = replicas
        .iter()
        .position(|r| r.name == leader)
        .context("leader")?;
    let (status, _) = https_get(replicas[leader_at].address, "/metrics", None).await?;
    assert_eq!(status, 401, "the image's listener checks who asks");
    let (_, metrics) = https_get(replicas[leader_at].address, "/metrics", Some(&scraper)).await?;
    assert!(
        metrics.contains(&format!(
            r#"leader_election_master_status{{name="{LEASE}"}} 1"#
        )),
        "{metrics}"
    );
    let (_, standby_metrics) =
        https_get(replicas[1 - leader_at].address, "/metrics", Some(&scraper)).await?;
    assert!(
        standby_metrics.contains(&format!(
            r#"leader_election_master_status{{name="{LEASE}"}} 0"#
        )) && !standby_metrics.contains(&format!(
            r#"controller_runtime_reconcile_total{{controller="{TEST}""#
        )),
        "the standby reconciles nothing:\n{standby_metrics}"
    );

    // SIGKILL the leader's container; a change made meanwhile is reconciled by the other.
    let standby = replicas[1 - leader_at].name.clone();
    let killed_at = Instant::now();
    let killed = replicas.remove(leader_at);
    killed.container.signal("KILL")?;
    drop(killed);
    apply(&apps, myapp("web", 2, "nginx:1.27", None)).await?;
    wait_for_holder(&leases, &[&standby], Duration::from_secs(30)).await?;
    let kill_failover = killed_at.elapsed();
    converged(2).await?;

    // SIGTERM with a ready standby: the lease moves within about a second; exit 0.
    replicas.push(start_replica(
        &format!("{RELEASE}-2"),
        &rootfs,
        &sa_dir,
        true,
    )?);
    wait_ready(&replicas[1]).await?;
    let termed_at = Instant::now();
    replicas[0].container.signal("TERM")?;
    wait_for_holder(&leases, &[&replicas[1].name], Duration::from_secs(15)).await?;
    let term_failover = termed_at.elapsed();
    let mut termed = replicas.remove(0);
    let exit = tokio::task::spawn_blocking(move || termed.container.wait(ACT)).await??;
    assert!(exit.success(), "a terminated replica exits 0, not {exit}");
    apply(&apps, myapp("web", 3, "nginx:1.27", None)).await?;
    converged(3).await?;

    // A replica whose cache directory is not writable (no emptyDir on a read-only root)
    // says so and runs anyway.
    let uncached = start_replica(&format!("{RELEASE}-nocache"), &rootfs, &sa_dir, false)?;
    wait_ready(&uncached).await?;
    let printed = uncached.container.output();
    assert!(printed.contains("not writable"), "{printed}");

    eprintln!(
        "image failover: SIGKILL → new holder {:.1} s; SIGTERM → new holder {:.1} s",
        kill_failover.as_secs_f64(),
        term_failover.as_secs_f64()
    );
    drop(uncached);
    // The leader steps down, so the next replica leads at once.
    let mut last = replicas.remove(0);
    last.container.signal("TERM")?;
    tokio::task::spawn_blocking(move || last.container.wait(ACT)).await??;

    from_a_private_registry(
        &client,
        &ns,
        &rootfs,
        &sa_dir,
        work.path(),
        &service_account,
    )
    .await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    delete_namespace(&client, &ns).await
}

/// The path a team takes: the plugin published with the image's own `wasmctrl plugin push`
/// (credentials from a docker config, as `docker login` leaves them) to a private registry
/// (TLS from a CA of its own, a login required), the CA given to the host the chart's way
/// (`extraCA`: mounted, `--extra-ca-file`), the login in a `kubernetes.io/dockerconfigjson`
/// Secret the chart lets the host read; a MyApp reconciled from there, then a swap to
/// `myapp-v2`, published the same way, that its children follow.
async fn from_a_private_registry(
    client: &kube::Client,
    ns: &str,
    rootfs: &Path,
    sa_dir: &Path,
    work: &Path,
    service_account: &str,
) -> anyhow::Result<()> {
    use wasmctrl_testenv::registry::{Login, Registry};
    const SECRET: &str = "registry-login";
    const CA_IN_POD: &str = "/etc/wasmctrl/extra-ca/ca.crt";
    let login = Login {
        username: "publisher",
        password: "s3cret-for-the-test",
    };
    let auth = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        format!("{}:{}", login.username, login.password),
    );
    let registry = tokio::task::spawn_blocking(move || Registry::start_secured(login)).await??;
    let ca_file = work.join("registry-ca.crt");
    std::fs::write(&ca_file, registry.ca_pem.as_deref().context("a CA")?)?;
    std::fs::set_permissions(&ca_file, std::fs::Permissions::from_mode(0o644))?;
    let docker_config = json!({"auths": {registry.address.clone(): {"auth": auth}}});
    let docker_dir = work.join("docker");
    std::fs::create_dir_all(&docker_dir)?;
    std::fs::write(docker_dir.join("config.json"), docker_config.to_string())?;

    // `wasmctrl plugin push`, the binary in the image, run as a publisher would.
    let cli = rootfs.join(image::ENTRYPOINT.trim_start_matches('/'));
    let publish = |plugin: &str, tag: &str| -> anyhow::Result<Value> {
        let reference = format!("{}/plugins/myapp:{tag}", registry.address);
        let output = std::process::Command::new(&cli)
            .args(["plugin", "push"])
            .arg(wasmctrl_testenv::plugins::guest(plugin))
            .arg(&reference)
            .arg("--ca-file")
            .arg(&ca_file)
            .args(["--output", "json"])
            .env("DOCKER_CONFIG", &docker_dir)
            .output()?;
        anyhow::ensure!(
            output.status.success(),
            "plugin push failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(serde_json::from_slice(&output.stdout)?)
    };
    // Without the login the registry refuses the push.
    let anonymous = std::process::Command::new(&cli)
        .args(["plugin", "push"])
        .arg(wasmctrl_testenv::plugins::guest("myapp_plugin"))
        .arg(format!("{}/plugins/myapp:anonymous", registry.address))
        .arg("--ca-file")
        .arg(&ca_file)
        .env("DOCKER_CONFIG", work.join("no-docker-config"))
        .output()?;
    assert!(!anonymous.status.success(), "an anonymous push is refused");
    let v1 = publish("myapp_plugin", "v1")?;
    assert_eq!(
        v1["componentDigest"].as_str(),
        Some(
            wasmctrl::plugin::Digest::of(&std::fs::read(wasmctrl_testenv::plugins::guest(
                "myapp_plugin"
            ))?)
            .to_string()
            .as_str()
        )
    );

    // The login as `kubectl create secret docker-registry` makes it, and the chart told
    // which Secret the host may read.
    let secrets = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), ns);
    secrets
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": SECRET},
                "type": "kubernetes.io/dockerconfigjson",
                "stringData": {".dockerconfigjson": docker_config.to_string()},
            }))?,
        )
        .await?;
    let chart_account = install_chart_rbac_with(
        client,
        RELEASE,
        ns,
        &[&format!("pluginSources.secretNames={{{SECRET}}}")],
    )
    .await?;
    assert_eq!(chart_account, service_account);

    let replica = start_replica_with(
        &format!("{RELEASE}-oci"),
        rootfs,
        sa_dir,
        true,
        &[format!("--extra-ca-file={CA_IN_POD}")],
        vec![(ca_file.clone(), CA_IN_POD.to_owned())],
    )?;
    wait_ready(&replica).await?;
    let from_registry = |pushed: &Value, digest: bool| {
        // A merge patch keeps keys it does not name: clear the other sources.
        let mut plugin = json!({"source": {
            "file": null, "configMap": null, "http": null,
            "oci": {
                "reference": pushed["pinnedReference"],
                "secretRef": {"namespace": ns, "name": SECRET},
            },
        }});
        plugin["digest"] = if digest {
            pushed["componentDigest"].clone()
        } else {
            Value::Null
        };
        plugin
    };
    let policy_api = policies(client);
    let patch = |plugin: Value| {
        let policy_api = policy_api.clone();
        async move {
            policy_api
                .patch(
                    TEST,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(json!({"spec": {"plugin": plugin}})),
                )
                .await
        }
    };
    patch(from_registry(&v1, true)).await?;
    wait_for_object(&policy_api, TEST, "v1 from the private registry", |p| {
        p["status"]["activeDigest"] == v1["componentDigest"]
            && condition(p, "PluginLoaded").is_some_and(|c| c["status"] == "True")
    })
    .await
    .with_context(|| format!("the replica printed:\n{}", replica.container.output()))?;
    let apps = myapps(client, ns);
    let deployments = api(client, &resource("apps", "v1", "Deployment"), ns);
    apply(&apps, myapp("api", 1, "nginx:1.27", None)).await?;
    wait_for_object(&deployments, "api", "api built by v1", |d| {
        d["metadata"]["labels"][VERSION_LABEL].is_null()
    })
    .await?;

    // Swap: v2 published the same way, pinned by its manifest alone; every child follows.
    let v2 = publish("myapp_v2_plugin", "v2")?;
    patch(from_registry(&v2, false)).await?;
    for name in ["web", "api"] {
        wait_for_object(&deployments, name, &format!("{name} built by v2"), |d| {
            d["metadata"]["labels"][VERSION_LABEL] == "v2"
        })
        .await
        .with_context(|| format!("the replica printed:\n{}", replica.container.output()))?;
    }
    drop(replica);
    drop(registry);
    Ok(())
}
