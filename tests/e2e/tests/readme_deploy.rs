//! README's "Deploy to a cluster" section, run as written: every `sh` block of it, in order,
//! by bash, against a control plane of its own (the example policy claims MyApp in every
//! namespace, which the shared test cluster's tests must keep) and a private registry (TLS
//! from a CA of its own, a login required). The only changes are the placeholders a reader
//! replaces too: the registry's name, the login, the CA file, and where cargo puts the
//! plugins. The workstation's state is what the section asks for: a `docker login` (a docker
//! config), and the CA trusted system-wide (`SSL_CERT_FILE`).
//!
//! A kubelet is the one thing this control plane lacks (its simulated node reports pods
//! running without running them), so between the blocks the test does what one would with
//! the chart's Deployment: pull its image with its `imagePullSecrets`, and run it (with runc,
//! as `deploy_image` does) with the pod's arguments, environment, volumes and ServiceAccount
//! token. `helm test` then passes with that host running and fails once it is gone, its pod
//! run the same way (`wasmctrl_e2e::helm_test`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};
use wasmctrl_e2e::*;
use wasmctrl_testenv::cluster::{Binaries, ControlPlane, Lifetime};
use wasmctrl_testenv::image;
use wasmctrl_testenv::registry::{Login, Registry};
use wasmctrl_testenv::repo_root;

/// The namespace and release the section installs into.
const NAMESPACE: &str = "wasmctrl";
/// The label `myapp-v2` puts on every child it makes.
const VERSION_LABEL: &str = "example.com/plugin-version";
const LOGIN: Login<'static> = Login {
    username: "platform-bot",
    password: "readme-test-password",
};

/// The `sh` blocks of the README's "Deploy to a cluster" section, in order.
fn deploy_blocks() -> anyhow::Result<Vec<String>> {
    let readme = std::fs::read_to_string(repo_root().join("README.md"))?;
    sh_blocks(&readme, "## Deploy to a cluster")
}

/// A reader's own values for the section's placeholders.
struct Placeholders {
    registry: String,
    ca_file: PathBuf,
    plugin_dir: PathBuf,
}

impl Placeholders {
    fn fill(&self, block: &str) -> String {
        block
            .replace("registry.example.com", &self.registry)
            .replace(
                "--docker-username=BOT",
                &format!("--docker-username={}", LOGIN.username),
            )
            .replace(
                "--docker-password=TOKEN",
                &format!("--docker-password={}", LOGIN.password),
            )
            .replace("=registry-ca.pem", &format!("={}", self.ca_file.display()))
            .replace(
                "target/wasm32-wasip2/plugin/",
                &format!("{}/", self.plugin_dir.display()),
            )
    }
}

/// Run `block` with bash in the repository root, as a reader would paste it.
fn run_block(block: &str, env: &[(&str, String)]) -> anyhow::Result<()> {
    run_block_in(&repo_root(), block, env)
}

/// Run `block` with bash in `dir`.
fn run_block_in(dir: &Path, block: &str, env: &[(&str, String)]) -> anyhow::Result<()> {
    eprintln!("--- README block:\n{block}\n---");
    let output = Command::new("bash")
        .args(["-euo", "pipefail", "-c", block])
        .current_dir(dir)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .context("running bash")?;
    if !output.status.success() {
        bail!(
            "the README block failed ({}):\n{block}\nstdout:\n{}\nstderr:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_deploy_section_works_as_written() -> anyhow::Result<()> {
    let blocks = deploy_blocks()?;
    assert_eq!(
        blocks.len(),
        4,
        "publish, install, policy, swap: the test plays a kubelet after the second"
    );
    let binaries = tokio::task::spawn_blocking(|| Binaries::build(&repo_root())).await??;
    let state = tempfile::Builder::new()
        .prefix("readme-cluster-")
        .tempdir_in(repo_root().join("target"))?;
    let cluster = ControlPlane::start(state.path(), &binaries, Lifetime::TiedToStarter).await?;
    let client = cluster.client().await?;
    let registry = tokio::task::spawn_blocking(|| Registry::start_secured(LOGIN)).await??;

    // The workstation: logged in to the registry, trusting its CA, with kubectl, helm and
    // wasmctrl on its PATH (the binary the image holds, which `cargo xtask image` builds).
    let work = tempfile::tempdir()?;
    let ca_file = work.path().join("registry-ca.pem");
    let ca_pem = registry.ca_pem.clone().context("a CA")?;
    std::fs::write(&ca_file, &ca_pem)?;
    let docker_dir = work.path().join("docker");
    std::fs::create_dir_all(&docker_dir)?;
    let auth = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        format!("{}:{}", LOGIN.username, LOGIN.password),
    );
    std::fs::write(
        docker_dir.join("config.json"),
        serde_json::json!({"auths": {registry.address.clone(): {"auth": auth}}}).to_string(),
    )?;
    let profile = std::env::var("WASMCTRL_IMAGE_PROFILE").unwrap_or_else(|_| "image-test".into());
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let cli_dir = target_dir.join(image::TARGET).join(&profile);
    let helm = wasmctrl_testenv::tools::helm()?;
    let path = [
        cli_dir.clone(),
        binaries.dir().to_owned(),
        helm.parent().context("helm's directory")?.to_owned(),
    ]
    .into_iter()
    .chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ))
    .collect::<Vec<_>>();
    let env = [
        (
            "PATH",
            std::env::join_paths(path)?.to_string_lossy().into_owned(),
        ),
        ("KUBECONFIG", cluster.kubeconfig.display().to_string()),
        ("DOCKER_CONFIG", docker_dir.display().to_string()),
        ("SSL_CERT_FILE", ca_file.display().to_string()),
        ("WASMCTRL_IMAGE_PROFILE", profile.clone()),
        (
            "HELM_CACHE_HOME",
            work.path().join("helm-cache").display().to_string(),
        ),
        (
            "HELM_CONFIG_HOME",
            work.path().join("helm-config").display().to_string(),
        ),
        (
            "HELM_DATA_HOME",
            work.path().join("helm-data").display().to_string(),
        ),
    ];
    let placeholders = Placeholders {
        registry: registry.address.clone(),
        ca_file: ca_file.clone(),
        plugin_dir: wasmctrl_testenv::plugins::plugin_dir(),
    };
    let mut blocks = blocks.iter().map(|block| placeholders.fill(block));
    let mut next_block = || blocks.next().context("another README block");

    // Publish the image and build the plugins; install the chart.
    run_block(&next_block()?, &env)?;
    run_block(&next_block()?, &env)?;

    // The kubelet's part: the Deployment's pod, run from the registry.
    let node = Node {
        client: &client,
        namespace: NAMESPACE,
        kubeconfig: &cluster.kubeconfig,
        registry_ca: Some(&ca_pem),
        insecure: false,
        work: work.path(),
    };
    let (host, address) = run_chart_pod(&node).await?;

    // `helm test`: the chart's test pod asks the host's Service for /readyz and passes.
    let tested = helm_test(&node, "wasmctrl", address, &env)
        .await
        .with_context(|| format!("the host printed:\n{}", host.output()))?;
    assert!(tested.passed, "helm test:\n{}", tested.said);
    assert!(tested.said.contains("Succeeded"), "{}", tested.said);
    assert!(
        tested.probe.contains("/readyz answered 200"),
        "{}",
        tested.probe
    );

    // Publish the plugin and apply the policy and the MyApps; they are reconciled from the
    // plugin in the registry.
    run_block(&next_block()?, &env)?;
    let apps = api(&client, &resource("example.com", "v1", "MyApp"), "default");
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), "default");
    for name in ["web", "api"] {
        wait_for_object(&apps, name, &format!("{name} reconciled"), |app| {
            condition(app, "Reconciled").is_some_and(|c| c["status"] == "True")
        })
        .await
        .with_context(|| format!("the host printed:\n{}", host.output()))?;
        wait_for_object(&deployments, name, &format!("{name} built by v1"), |d| {
            d["metadata"]["labels"][VERSION_LABEL].is_null()
        })
        .await?;
    }

    // The swap: every child follows the new build.
    run_block(&next_block()?, &env)?;
    for name in ["web", "api"] {
        wait_for_object(&deployments, name, &format!("{name} built by v2"), |d| {
            d["metadata"]["labels"][VERSION_LABEL] == "v2"
        })
        .await
        .with_context(|| format!("the host printed:\n{}", host.output()))?;
    }

    // A plugin of one's own, from `wasmctrl plugin new` (as docs/plugins.md starts it) to
    // the chart, by its README's "In a cluster" steps.
    scaffold_deploys_to_the_chart(&client, work.path(), &registry.address, &env)
        .await
        .with_context(|| format!("the host printed:\n{}", host.output()))?;
    // With the host gone, the same test fails.
    drop(host);
    let tested = helm_test(&node, "wasmctrl", address, &env).await?;
    assert!(
        !tested.passed,
        "helm test passed with no host:\n{}",
        tested.said
    );
    assert!(tested.probe.contains("asking https://"), "{}", tested.probe);
    cluster.stop();
    Ok(())
}

/// The scaffold's own README, run against the chart the README's section installed: make
/// the crate (docs/plugins.md's command), build it, and run its "In a cluster" block with a
/// reader's values: the registry, where cargo puts the component, and the registry's login
/// (the README's `--secret-ref` for a registry that needs one). The block's last line asks
/// through the chart's Service, which needs a kubelet and a proxy this control plane lacks:
/// it is left out, and the test checks what it would show instead.
async fn scaffold_deploys_to_the_chart(
    client: &kube::Client,
    work: &Path,
    registry: &str,
    env: &[(&str, String)],
) -> anyhow::Result<()> {
    let plugins = work.join("my-plugins");
    std::fs::create_dir_all(&plugins)?;
    let new = "wasmctrl plugin new backup-plugin --group example.com --version v1 --kind Backup";
    let guide = std::fs::read_to_string(repo_root().join("docs/plugins.md"))?;
    assert!(
        guide.contains(new),
        "docs/plugins.md starts a plugin with `{new}`"
    );
    run_block_in(&plugins, new, env)?;
    let dir = plugins.join("backup-plugin");
    // The repository's lock file: the same dependency versions as the other scaffold tests,
    // whose builds the shared target directory keeps.
    std::fs::copy(repo_root().join("Cargo.lock"), dir.join("Cargo.lock"))?;
    let target = scaffold_target_dir();
    let mut env = env.to_vec();
    env.push(("CARGO_TARGET_DIR", target.display().to_string()));
    let readme = std::fs::read_to_string(dir.join("README.md"))?;
    let build = sh_blocks(&readme, "## Build and test")?
        .first()
        .cloned()
        .context("the build block")?;
    let build_line = build
        .lines()
        .find(|line| line.starts_with("cargo build "))
        .context("the build line")?;
    run_block_in(&dir, build_line, &env)?;

    let cluster_block = sh_blocks(&readme, "### In a cluster")?
        .first()
        .cloned()
        .context("the \"In a cluster\" block")?;
    let explain = "kubectl wasmctrl explain";
    let block = cluster_block
        .lines()
        .filter(|line| !line.starts_with(explain))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("REGISTRY/", &format!("{registry}/"))
        .replace(
            " -o merge-patch)",
            " --secret-ref wasmctrl/registry-login -o merge-patch)",
        )
        .replace(
            "target/wasm32-wasip2/plugin/",
            &format!("{}/", target.join("wasm32-wasip2/plugin").display()),
        );
    assert!(cluster_block.contains(explain), "{cluster_block}");
    assert!(
        readme.contains("--secret-ref"),
        "the README says how to pull with a login:\n{readme}"
    );
    run_block_in(&dir, &block, &env)?;

    let backups = api(client, &resource("example.com", "v1", "Backup"), "default");
    wait_for_object(&backups, "example", "the Backup reconciled", |backup| {
        condition(backup, "Reconciled").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    let deployments = api(client, &resource("apps", "v1", "Deployment"), "default");
    wait_for_object(&deployments, "example", "the Backup's Deployment", |d| {
        d["metadata"]["ownerReferences"][0]["kind"] == "Backup"
    })
    .await?;
    Ok(())
}

/// Where the scaffold tests build a new crate (the host's `cli_plugin_new` too): shared, so
/// its dependencies build once.
fn scaffold_target_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("plugin-new-target")
}

/// The `sh` blocks of the section of `markdown` that starts with the line `heading`.
fn sh_blocks(markdown: &str, heading: &str) -> anyhow::Result<Vec<String>> {
    let level = heading.split(' ').next().unwrap_or("#");
    let section = markdown
        .split_once(&format!("\n{heading}\n"))
        .with_context(|| format!("a section {heading:?}"))?
        .1;
    let section = section
        .split(&format!("\n{level} "))
        .next()
        .unwrap_or(section);
    let mut blocks = Vec::new();
    let mut rest = section;
    while let Some((_, after)) = rest.split_once("```sh\n") {
        let (block, after) = after.split_once("\n```").context("an unclosed block")?;
        blocks.push(block.to_owned());
        rest = after;
    }
    Ok(blocks)
}
