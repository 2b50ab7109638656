//! A plugin written in Python (componentize-py, `plugins/python/myapp`) runs in the host
//! under the same sandbox limits as the Rust one: it converges MyApps against the real control
//! plane, reads related ConfigMaps, and in shadow against the Rust MyApp it would change
//! nothing — the two decide the same — so it can be promoted with no write.

use serde_json::{Value, json};
use wasmctrl_e2e::*;

/// How long compiling the Python component may take.
const COMPILE: std::time::Duration = std::time::Duration::from_secs(180);

fn ready(app: &Value) -> bool {
    app["status"]["readyReplicas"] == app["spec"]["replicas"]
        && app["status"]["observedGeneration"] == app["metadata"]["generation"]
        && condition(app, "Ready").is_some_and(|c| c["status"] == "True")
        && condition(app, "ConfigMapFound").is_some_and(|c| c["status"] == "True")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_plugin_converges_myapps_and_decides_as_the_rust_one() -> anyhow::Result<()> {
    const TEST: &str = "python-plugin";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    apply_policy(
        &client,
        TEST,
        TEST,
        myapp_policy_spec(file_source("myapp_py"), json!({})),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    // The Python component is 19 MB (the interpreter is in it): compiling it takes 15 s on an
    // idle 2-core machine and more beside other work, and a new build has a new digest, so
    // the suite's cache rarely holds it. That wait is the compiler's, not the host's reaction.
    let policy_api = policies(&client);
    wait_for_object_within(
        &policy_api,
        TEST,
        "the Python plugin compiled and loaded",
        COMPILE,
        |p| condition(p, "PluginLoaded").is_some_and(|c| c["status"] == "True"),
    )
    .await?;
    let myapps = myapps(&client, &ns);
    let deployments = api(&client, &resource("apps", "v1", "Deployment"), &ns);
    let services = api(&client, &resource("", "v1", "Service"), &ns);
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    apply(
        &config_maps,
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "env", "labels": {"example.com/myapp-config": "true"}},
            "data": {"GREETING": "hello"},
        }),
    )
    .await?;

    // Python decides: Deployments with the ConfigMap's environment, Services, Ready status.
    for (name, replicas) in [("a", 1), ("b", 2)] {
        apply(&myapps, myapp(name, replicas, "nginx:1.27", Some("env"))).await?;
    }
    for name in ["a", "b"] {
        wait_for_object(&myapps, name, "MyApp ready under the Python plugin", ready).await?;
        let deployment = get(&deployments, name).await?.expect("the Deployment");
        assert_eq!(
            deployment["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"],
            "hello"
        );
        assert!(get(&services, name).await?.is_some(), "the Service");
    }
    apply(&myapps, myapp("b", 3, "nginx:1.27", Some("env"))).await?;
    wait_for_object(&myapps, "b", "MyApp b scaled under Python", |a| {
        ready(a) && a["status"]["readyReplicas"] == 3
    })
    .await?;

    // The Rust MyApp as the candidate, in shadow: nothing would change for any parent.
    let mut with_rust = myapp_policy_spec(file_source("myapp_py"), json!({}));
    with_rust["plugin"]["candidate"] = json!({"source": file_source("myapp_plugin")});
    apply_policy(&client, TEST, TEST, with_rust).await?;
    wait_for_object(
        &policy_api,
        TEST,
        "the Rust candidate evaluated, unchanged",
        |p| candidate_decides_the_same(p, 2),
    )
    .await?;

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policy_api.delete(TEST, &Default::default()).await?;
    Ok(())
}
