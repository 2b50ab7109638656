//! Signed plugins, end to end: a real registry, the real API server, signatures made by
//! `wasmctrl plugin sign` in cosign's layout. A policy's `verify` decides whose plugins it
//! serves: the listed key's, or a keyless signer's whose certificate chains to the host's
//! roots; anything else is refused before it is compiled, and the last good keeps serving.
//! A policy tightened after a load stops serving what no longer verifies and waits.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use wasmctrl::plugin::Digest;
use wasmctrl::signing::sign::SigningKey;
use wasmctrl::signing::{HostTrust, KeylessRoots};
use wasmctrl_e2e::*;
use wasmctrl_testenv::plugins::guest;
use wasmctrl_testenv::signing::SigningCa;

const TEST: &str = "signed";
const VERSION_LABEL: &str = "example.com/plugin-version";
const ISSUER: &str = "https://issuer.example.test";

fn digest_of(plugin: &str) -> String {
    Digest::of(&std::fs::read(guest(plugin)).expect("built")).to_string()
}

/// Push `plugin` to `registry/repository` and return its reference.
async fn push(registry: &str, repository: &str, plugin: &str) -> anyhow::Result<String> {
    let reference = format!("{registry}/{repository}:{}", plugin.replace('_', "-"));
    let file = guest(plugin).display().to_string();
    wasmctrl_cli(&["plugin", "push", &file, &reference, "--plain-http"]).await?;
    Ok(reference)
}

/// Sign `reference` with the key file `key` (and its certificate).
async fn sign(reference: &str, key: &Path, certificate: Option<&Path>) -> anyhow::Result<()> {
    let key = key.display().to_string();
    let mut args = vec!["plugin", "sign", reference, "--key", &key, "--plain-http"];
    let certificate = certificate.map(|c| c.display().to_string());
    if let Some(certificate) = &certificate {
        args.extend(["--certificate", certificate]);
    }
    wasmctrl_cli(&args).await
}

fn policy(reference: &str, digest: &str, verify: Value) -> Value {
    json!({
        "parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
        "children": [{"apiVersion": "apps/v1", "kind": "Deployment"}, {"apiVersion": "v1", "kind": "Service"}],
        "plugin": {
            "source": {"oci": {"reference": reference, "insecure": true}},
            "digest": digest,
            "verify": verify,
        },
    })
}

fn plugin_loaded(policy: &Value) -> Option<(String, String, String)> {
    let c = condition(policy, "PluginLoaded")?;
    Some((
        c["status"].as_str()?.to_owned(),
        c["reason"].as_str()?.to_owned(),
        c["message"].as_str()?.to_owned(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_plugins_signed_by_whom_the_policy_names_are_served() -> anyhow::Result<()> {
    let registry =
        tokio::task::spawn_blocking(wasmctrl_testenv::registry::Registry::start).await??;
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let keys = tempfile::tempdir()?;
    let (ours, theirs) = (keys.path().join("ours"), keys.path().join("theirs"));
    for prefix in [&ours, &theirs] {
        wasmctrl_cli(&[
            "plugin",
            "keygen",
            "--output-prefix",
            &prefix.display().to_string(),
        ])
        .await?;
    }
    let read_key = |prefix: &Path| -> anyhow::Result<(SigningKey, String)> {
        let key = SigningKey::from_pem(&std::fs::read(prefix.with_extension("key"))?, Some(b""))?;
        let public = std::fs::read_to_string(prefix.with_extension("pub"))?;
        Ok((key, public))
    };
    let ((our_key, our_pub), (their_key, their_pub)) = (read_key(&ours)?, read_key(&theirs)?);
    let (our_fingerprint, their_fingerprint) = (our_key.fingerprint()?, their_key.fingerprint()?);

    let (v1, v2) = (digest_of("myapp_plugin"), digest_of("myapp_v2_plugin"));
    let address = &registry.address;
    let v1_ref = push(address, "plugins/signed", "myapp_plugin").await?;
    let v2_ref = push(address, "plugins/signed", "myapp_v2_plugin").await?;
    let v2_theirs = push(address, "plugins/theirs", "myapp_v2_plugin").await?;
    let v2_unsigned = push(address, "plugins/unsigned", "myapp_v2_plugin").await?;
    sign(&v1_ref, &ours.with_extension("key"), None).await?;
    sign(&v2_ref, &ours.with_extension("key"), None).await?;
    sign(&v2_theirs, &theirs.with_extension("key"), None).await?;
    // What `plugin sign` pushed verifies with `plugin verify`, by that key and no other.
    let our_pub_file = ours.with_extension("pub").display().to_string();
    wasmctrl_cli(&[
        "plugin",
        "verify",
        &v1_ref,
        "--key",
        &our_pub_file,
        "--plain-http",
    ])
    .await?;
    let refused = wasmctrl_cli(&[
        "plugin",
        "verify",
        &v2_theirs,
        "--key",
        &our_pub_file,
        "--plain-http",
    ])
    .await;
    assert!(
        refused.is_err_and(|e| e.to_string().contains("not made by any listed key")),
        "another key's signature is refused by plugin verify"
    );

    let ca = SigningCa::new("test keyless root")?;
    let alice = ca.issue("alice@example.com", ISSUER)?;
    let alice_key = keys.path().join("alice.key");
    let alice_cert = keys.path().join("alice.pem");
    std::fs::write(&alice_key, &alice.key_pem)?;
    std::fs::write(&alice_cert, &alice.certificate_pem)?;
    let v1_keyless = push(address, "plugins/keyless", "myapp_plugin").await?;
    sign(&v1_keyless, &alice_key, Some(&alice_cert)).await?;

    let by_us = json!({"keys": [our_pub]});
    apply_policy(&client, TEST, TEST, policy(&v1_ref, &v1, by_us.clone())).await?;
    let host = HostUnderTest::builder(TEST, &ns)
        .without_disk_cache()
        .signing(HostTrust {
            keyless_roots: KeylessRoots::from_pem(ca.root_pem().as_bytes())?,
            rekor_keys: None,
        })
        .start()
        .await?;
    let policies = policies(&client);
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    apply(&myapps, myapp("web", 1, "nginx:1.27", None)).await?;
    let built_by =
        |v2: bool| move |d: &Value| (d["metadata"]["labels"][VERSION_LABEL] == "v2") == v2;
    wait_for_object(&deployments, "web", "built by v1", built_by(false)).await?;
    let signed = wait_for_object(&policies, TEST, "v1 loaded, signed by our key", |p| {
        plugin_loaded(p).is_some_and(|(status, _, _)| status == "True")
    })
    .await?;
    assert_eq!(
        signed["status"]["activeSigners"],
        json!([{"key": our_fingerprint}])
    );
    let (_, _, message) = plugin_loaded(&signed).expect("the condition");
    assert!(
        message.contains(&format!("signed by key {our_fingerprint}")),
        "{message}"
    );

    // The same v2 artifact, signed by another key: refused before it is compiled; v1 serves.
    apply_policy(&client, TEST, TEST, policy(&v2_theirs, &v2, by_us.clone())).await?;
    let refused = wait_for_object(&policies, TEST, "v2 by another key refused", |p| {
        plugin_loaded(p).is_some_and(|(_, reason, _)| reason == "SignatureInvalid")
    })
    .await?;
    let (_, _, message) = plugin_loaded(&refused).expect("the condition");
    assert!(
        message.contains(&our_fingerprint) && message.contains("still serving"),
        "names the key expected and the plugin still serving: {message}"
    );
    assert!(!message.contains(&their_fingerprint) || message.contains("no signature by"));
    // An unsigned one: missing, named as such.
    apply_policy(
        &client,
        TEST,
        TEST,
        policy(&v2_unsigned, &v2, by_us.clone()),
    )
    .await?;
    wait_for_object(&policies, TEST, "unsigned v2 refused", |p| {
        plugin_loaded(p).is_some_and(|(_, reason, message)| {
            reason == "SignatureMissing" && message.contains("sha256-")
        })
    })
    .await?;
    apply(&myapps, myapp("web", 2, "nginx:1.27", None)).await?;
    wait_for_object(&deployments, "web", "v1 still serving an edit", |d| {
        d["spec"]["replicas"] == 2 && built_by(false)(d)
    })
    .await?;

    // v2 signed by our key goes live.
    apply_policy(&client, TEST, TEST, policy(&v2_ref, &v2, by_us.clone())).await?;
    wait_for_object(&deployments, "web", "built by v2", built_by(true)).await?;

    // Keyless: the right identity under the host's root is accepted.
    let alice_only = json!({"identities": [{"subject": "alice@example.com", "issuer": ISSUER}]});
    apply_policy(&client, TEST, TEST, policy(&v1_keyless, &v1, alice_only)).await?;
    wait_for_object(&deployments, "web", "keyless v1 serves", built_by(false)).await?;
    let keyless = wait_for_object(&policies, TEST, "alice named as the signer", |p| {
        p["status"]["activeSigners"] == json!([{"subject": "alice@example.com", "issuer": ISSUER}])
    })
    .await?;
    assert_eq!(plugin_loaded(&keyless).map(|c| c.0), Some("True".into()));

    // Tightened to another identity after the load: v1 no longer verifies, so the policy
    // stops serving it and waits; nothing is deleted, and an edit is not acted on.
    let bob_only = json!({"identities": [{"subject": "bob@example.com", "issuer": ISSUER}]});
    apply_policy(&client, TEST, TEST, policy(&v1_keyless, &v1, bob_only)).await?;
    let waiting = wait_for_object(&policies, TEST, "tightened policy waits", |p| {
        plugin_loaded(p).is_some_and(|(_, reason, _)| reason == "SignatureInvalid")
            && condition(p, "Ready").is_some_and(|c| c["status"] == "False")
    })
    .await?;
    let (_, _, message) = plugin_loaded(&waiting).expect("the condition");
    assert!(
        message.contains("alice@example.com (issuer https://issuer.example.test), which matches no listed identity"),
        "says whose certificate it is: {message}"
    );
    apply(&myapps, myapp("web", 3, "nginx:1.27", None)).await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let deployment = deployments.get("web").await?;
    assert_eq!(
        deployment.data["spec"]["replicas"], 2,
        "a policy whose plugin no longer verifies decides nothing"
    );
    assert!(
        api(&client, &resource("", "v1", "Service"), &ns)
            .get_opt("web")
            .await?
            .is_some(),
        "and deletes nothing"
    );

    // Loosened again, with the keys kept in a ConfigMap, it serves.
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    apply(
        &config_maps,
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "signing-keys"},
            "data": {"ours.pub": our_pub, "theirs.pub": their_pub, "README": "release keys"},
        }),
    )
    .await?;
    let from_config_map =
        json!({"keysFrom": [{"configMap": {"namespace": ns, "name": "signing-keys"}}]});
    apply_policy(&client, TEST, TEST, policy(&v1_ref, &v1, from_config_map)).await?;
    wait_for_object(&deployments, "web", "serving again", |d| {
        d["spec"]["replicas"] == 3
    })
    .await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies.delete(TEST, &Default::default()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cosign_and_wasmctrl_accept_each_others_signatures() -> anyhow::Result<()> {
    let registry =
        tokio::task::spawn_blocking(wasmctrl_testenv::registry::Registry::start).await??;
    let dir = tempfile::tempdir()?;
    let at = |name: &str| dir.path().join(name).display().to_string();
    wasmctrl_cli(&["plugin", "keygen", "--output-prefix", &at("ours")]).await?;
    cosign(
        dir.path(),
        &["generate-key-pair", "--output-key-prefix", "theirs"],
    )?;
    let reference = push(&registry.address, "plugins/interop", "myapp_plugin").await?;

    // wasmctrl signs, cosign verifies, annotation included.
    let (ours_key, ours_pub) = (at("ours.key"), at("ours.pub"));
    wasmctrl_cli(&[
        "plugin",
        "sign",
        &reference,
        "--key",
        &ours_key,
        "-a",
        "team=shop",
        "--plain-http",
    ])
    .await?;
    let verified = cosign(
        dir.path(),
        &[
            "verify",
            "--key",
            "ours.pub",
            "--insecure-ignore-tlog",
            "--allow-http-registry",
            "-a",
            "team=shop",
            &reference,
        ],
    )?;
    assert!(verified.contains("docker-manifest-digest"), "{verified}");
    let other = cosign(
        dir.path(),
        &[
            "verify",
            "--key",
            "theirs.pub",
            "--insecure-ignore-tlog",
            "--allow-http-registry",
            &reference,
        ],
    );
    assert!(other.is_err(), "cosign refuses it with another key");

    // cosign signs, wasmctrl verifies (both signatures now sit under the one tag).
    cosign(
        dir.path(),
        &[
            "sign",
            "--key",
            "theirs.key",
            "--tlog-upload=false",
            "--allow-http-registry",
            "--yes",
            "-a",
            "team=payments",
            &reference,
        ],
    )?;
    let theirs_pub = at("theirs.pub");
    wasmctrl_cli(&[
        "plugin",
        "verify",
        &reference,
        "--key",
        &theirs_pub,
        "-a",
        "team=payments",
        "--plain-http",
    ])
    .await?;
    wasmctrl_cli(&[
        "plugin",
        "verify",
        &reference,
        "--key",
        &ours_pub,
        "-a",
        "team=shop",
        "--plain-http",
    ])
    .await?;
    let mixed = wasmctrl_cli(&[
        "plugin",
        "verify",
        &reference,
        "--key",
        &ours_pub,
        "-a",
        "team=payments",
        "--plain-http",
    ])
    .await;
    assert!(
        mixed.is_err(),
        "our key did not sign the payments annotation"
    );

    // Detached: cosign's sign-blob bundle verifies with wasmctrl, and the other way round.
    let file = dir.path().join("plugin.wasm");
    std::fs::copy(guest("myapp_plugin"), &file)?;
    cosign(
        dir.path(),
        &[
            "sign-blob",
            "--key",
            "theirs.key",
            "--tlog-upload=false",
            "--yes",
            "--bundle",
            "plugin.wasm.sig",
            "plugin.wasm",
        ],
    )?;
    let file_text = file.display().to_string();
    wasmctrl_cli(&["plugin", "verify", &file_text, "--key", &theirs_pub]).await?;
    std::fs::remove_file(dir.path().join("plugin.wasm.sig"))?;
    wasmctrl_cli(&["plugin", "sign", &file_text, "--key", &ours_key]).await?;
    let blob = cosign(
        dir.path(),
        &[
            "verify-blob",
            "--key",
            "ours.pub",
            "--insecure-ignore-tlog",
            "--bundle",
            "plugin.wasm.sig",
            "plugin.wasm",
        ],
    )?;
    assert!(blob.contains("Verified OK"), "{blob}");
    Ok(())
}
