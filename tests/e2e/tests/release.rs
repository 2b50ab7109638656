//! A release installs from its registry alone: `cargo xtask release` pushes the host's image
//! index, the chart and the MyApp plugin to a local registry and signs them with a release
//! key; the chart is then installed by its OCI reference (`helm install oci://…`), its pod
//! run from the index (the kubelet's part played as `readme_deploy` does), and a policy whose
//! plugin comes from the same registry, signature required, converges a MyApp. Every
//! signature verifies with cosign and with `wasmctrl plugin verify`, the CLI archives match
//! `SHA256SUMS`, and the index lists each platform asked for.
//!
//! The suite releases linux/amd64 only (`image-test` profile); an arm64 build adds a full
//! cross-compile, so it runs when asked: `WASMCTRL_RELEASE_PLATFORMS=linux/amd64,linux/arm64`.

use std::path::Path;
use std::process::Command;

use anyhow::Context as _;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use wasmctrl_e2e::*;
use wasmctrl_testenv::TestEnv;

const TEST: &str = "release";

/// `cargo xtask release` as a release pipeline runs it, the key's password `password`:
/// whether it succeeded, and what it printed.
fn xtask_release(
    registry: &str,
    key: &Path,
    password: &str,
    out: &Path,
    platforms: &str,
) -> anyhow::Result<(bool, String)> {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    wasmctrl_testenv::runner::without_cargos_package_variables(&mut command);
    let output = command
        .current_dir(wasmctrl_testenv::repo_root())
        .args(["xtask", "release", "--registry", registry, "--insecure"])
        .args([
            "--version",
            env!("CARGO_PKG_VERSION"),
            "--platforms",
            platforms,
        ])
        .arg("--key")
        .arg(key)
        .arg("--output-dir")
        .arg(out)
        .env("COSIGN_PASSWORD", password)
        .env(
            "WASMCTRL_IMAGE_PROFILE",
            std::env::var("WASMCTRL_IMAGE_PROFILE").unwrap_or_else(|_| "image-test".into()),
        )
        .output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok((output.status.success(), said))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_installs_from_its_registry_with_every_signature_verified() -> anyhow::Result<()>
{
    let version = env!("CARGO_PKG_VERSION");
    let platforms =
        std::env::var("WASMCTRL_RELEASE_PLATFORMS").unwrap_or_else(|_| "linux/amd64".into());
    let registry =
        tokio::task::spawn_blocking(wasmctrl_testenv::registry::Registry::start).await??;
    let address = registry.address.clone();
    let work = tempfile::tempdir()?;
    let keys = work.path().join("release");
    wasmctrl_cli(&[
        "plugin",
        "keygen",
        "--output-prefix",
        &keys.display().to_string(),
    ])
    .await?;
    let (key, public) = (keys.with_extension("key"), keys.with_extension("pub"));
    let out = work.path().join("dist");
    let release = |password: &'static str| {
        let (address, key, out, platforms) =
            (address.clone(), key.clone(), out.clone(), platforms.clone());
        tokio::task::spawn_blocking(move || {
            xtask_release(&address, &key, password, &out, &platforms)
        })
    };
    // A key that does not sign stops the release before anything is pushed.
    let (passed, said) = release("not-its-password").await??;
    assert!(!passed && said.contains("does not sign"), "{said}");
    let tag = format!("http://{address}/v2/wasmctrl/manifests/{version}");
    let before = reqwest::get(&tag).await?.status();
    assert_eq!(
        before, 404,
        "nothing pushed by a release that could not sign"
    );
    let (passed, said) = release("").await??;
    assert!(passed, "cargo xtask release:\n{said}");
    // The same version again is refused: its tags stay as released.
    let (passed, said) = release("").await??;
    assert!(!passed && said.contains("released already"), "{said}");
    let released: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("release.json"))?)?;

    // The image index lists every platform asked for, each its own image.
    let index: Value = serde_json::from_str(
        &reqwest::Client::new()
            .get(format!("http://{address}/v2/wasmctrl/manifests/{version}"))
            .header("accept", "application/vnd.oci.image.index.v1+json")
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?,
    )?;
    assert_eq!(
        index["mediaType"], "application/vnd.oci.image.index.v1+json",
        "{index}"
    );
    let listed: Vec<String> = index["manifests"]
        .as_array()
        .context("manifests")?
        .iter()
        .map(|m| {
            format!(
                "{}/{}",
                m["platform"]["os"].as_str().unwrap_or_default(),
                m["platform"]["architecture"].as_str().unwrap_or_default()
            )
        })
        .collect();
    let asked: Vec<String> = platforms.split(',').map(str::to_owned).collect();
    assert_eq!(listed, asked, "{index}");
    let digests: Vec<&str> = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["digest"].as_str())
        .collect();
    assert_eq!(digests.len(), asked.len());

    // Each artifact's signature, by the release key and no other.
    let image = released["image"]["digest"]
        .as_str()
        .context("the index's digest")?;
    let chart = released["chart"]["digest"]
        .as_str()
        .context("the chart's digest")?;
    let plugin = released["plugin"]["digest"]
        .as_str()
        .context("the plugin's digest")?;
    cosign(
        work.path(),
        &["generate-key-pair", "--output-key-prefix", "other"],
    )?;
    for pinned in [
        format!("{address}/wasmctrl@{image}"),
        format!("{address}/charts/wasmctrl@{chart}"),
        format!("{address}/plugins/myapp@{plugin}"),
    ] {
        let public = public.display().to_string();
        let verify = |key: &str| {
            cosign(
                work.path(),
                &[
                    "verify",
                    "--key",
                    key,
                    "--insecure-ignore-tlog",
                    "--allow-http-registry",
                    &pinned,
                ],
            )
        };
        verify(&public).with_context(|| format!("{pinned} signed by the release key"))?;
        assert!(
            verify("other.pub").is_err(),
            "{pinned} is not signed by another key"
        );
    }
    let public_file = public.display().to_string();
    wasmctrl_cli(&[
        "plugin",
        "verify",
        &format!("{address}/plugins/myapp:{version}"),
        "--key",
        &public_file,
        "--plain-http",
    ])
    .await?;

    // SHA256SUMS lists each archive and the chart's package with its hash, and is signed.
    let sums = std::fs::read_to_string(out.join("SHA256SUMS"))?;
    let mut named = Vec::new();
    for line in sums.lines() {
        let (hex, name) = line.split_once("  ").context("`HEX  NAME`")?;
        let bytes =
            std::fs::read(out.join(name)).with_context(|| format!("{name} beside SHA256SUMS"))?;
        assert_eq!(hex, hex::encode(Sha256::digest(&bytes)), "{name}");
        named.push(name.to_owned());
    }
    for platform in &asked {
        let target = match platform.as_str() {
            "linux/amd64" => "x86_64-unknown-linux-musl",
            "linux/arm64" => "aarch64-unknown-linux-musl",
            other => anyhow::bail!("a platform this test does not know: {other}"),
        };
        assert!(
            named.contains(&format!("wasmctrl-{version}-{target}.tar.gz")),
            "{named:?}"
        );
    }
    assert!(
        named.contains(&format!("wasmctrl-{version}.tgz")),
        "{named:?}"
    );
    wasmctrl_cli(&[
        "plugin",
        "verify",
        &out.join("SHA256SUMS").display().to_string(),
        "--key",
        &public_file,
    ])
    .await?;
    cosign(
        work.path(),
        &[
            "verify-blob",
            "--key",
            &public_file,
            "--insecure-ignore-tlog",
            "--bundle",
            &out.join("SHA256SUMS.sig").display().to_string(),
            &out.join("SHA256SUMS").display().to_string(),
        ],
    )?;

    // Installed by its OCI reference, watching this test's namespace and policies only.
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    // A release of this run's own: its cluster-wide objects are named after it, and a run
    // that failed leaves its own behind.
    let release = format!("rel-{}", &ns[ns.len().saturating_sub(8)..]);
    let kubeconfig = TestEnv::get().kubeconfig().to_owned();
    let helm_home = work.path().join("helm");
    let helm_env: Vec<(&str, String)> = vec![
        ("KUBECONFIG", kubeconfig.display().to_string()),
        (
            "HELM_CACHE_HOME",
            helm_home.join("cache").display().to_string(),
        ),
        (
            "HELM_CONFIG_HOME",
            helm_home.join("config").display().to_string(),
        ),
        (
            "HELM_DATA_HOME",
            helm_home.join("data").display().to_string(),
        ),
    ];
    let mut install = Command::new(wasmctrl_testenv::tools::helm()?);
    install
        .args([
            "install",
            &release,
            &format!("oci://{address}/charts/wasmctrl"),
        ])
        .args(["--version", version, "--plain-http", "-n", &ns])
        .args(["--set", &format!("watchNamespace={ns}")])
        .args(["--set", &format!("policySelector={TEST_LABEL}={TEST}")])
        .args(["--set", "replicaCount=1,podDisruptionBudget.enabled=false"])
        .args(["--set", "networkPolicy.apiServerCidrs={127.0.0.1/32}"]);
    for (name, value) in &helm_env {
        install.env(name, value);
    }
    let installed = install.output()?;
    anyhow::ensure!(
        installed.status.success(),
        "helm install oci://: {}",
        String::from_utf8_lossy(&installed.stderr)
    );
    let deployment = api(&client, &resource("apps", "v1", "Deployment"), &ns)
        .get(&format!("{release}-wasmctrl"))
        .await?;
    let deployment = serde_json::to_value(deployment)?;
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"],
        format!("{address}/wasmctrl@{image}"),
        "the chart runs the released index, pinned"
    );

    // The policy acts as its own account; its plugin comes from the registry, pinned by the
    // digest release.json gives, and must carry the release key's signature.
    let mut spec = myapp_policy_in(
        &ns,
        json!({"oci": {"reference": format!("{address}/plugins/myapp@{plugin}"), "insecure": true}}),
    );
    spec["plugin"]["verify"] = json!({"keys": [std::fs::read_to_string(&public)?]});
    spec["serviceAccount"] = json!({"namespace": ns, "name": "myapp-operator"});
    apply_policy_rbac(
        &client,
        TEST,
        &spec,
        &format!("{ns}/{release}-wasmctrl"),
        &format!("{release}-policies"),
    )
    .await?;
    apply_policy(&client, TEST, TEST, spec).await?;
    let node = Node {
        client: &client,
        namespace: &ns,
        kubeconfig: &kubeconfig,
        registry_ca: None,
        insecure: true,
        work: work.path(),
    };
    let (host, _address) = run_chart_pod(&node).await?;
    let apps = myapps(&client, &ns);
    apply(&apps, myapp("web", 2, "nginx:1.27", None)).await?;
    wait_for_object(
        &apps,
        "web",
        "reconciled by the released host and plugin",
        |app| condition(app, "Reconciled").is_some_and(|c| c["status"] == "True"),
    )
    .await
    .with_context(|| format!("the host printed:\n{}", host.output()))?;
    let policy = serde_json::to_value(policies(&client).get(TEST).await?)?;
    assert_eq!(
        policy["status"]["activeSigners"][0]["key"]
            .as_str()
            .map(|k| k.starts_with("sha256:")),
        Some(true),
        "the host verified the release key's signature: {}",
        policy["status"]
    );
    drop(host);

    let mut uninstall = Command::new(wasmctrl_testenv::tools::helm()?);
    uninstall.args(["uninstall", &release, "-n", &ns]);
    for (name, value) in &helm_env {
        uninstall.env(name, value);
    }
    uninstall.output()?;
    policies(&client).delete(TEST, &Default::default()).await?;
    delete_namespace(&client, &ns).await
}
