//! The ReconcilePolicy CRD, as the real API server enforces it: valid policies are accepted,
//! and the mistakes its schema and CEL rules exist for are refused at apply time.

use kube::api::{Api, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};
use wasmctrl_testenv::TestEnv;

async fn policies() -> anyhow::Result<Api<DynamicObject>> {
    let client = TestEnv::get().client().await?;
    wasmctrl_testenv::crds::install_repo_crds(&client).await?;
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "wasmctrl.dev",
        "v1alpha1",
        "ReconcilePolicy",
    ));
    Ok(Api::all_with(client, &resource))
}

fn policy(name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
        "metadata": {"name": name}, "spec": spec
    }))
    .expect("valid object")
}

fn valid_spec() -> Value {
    json!({
        "parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
        "children": [{"apiVersion": "apps/v1", "kind": "Deployment"}, {"apiVersion": "v1", "kind": "Service"}],
        "plugin": {
            "source": {"file": {"path": "/plugins/myapp.wasm"}},
            "digest": format!("sha256:{}", "a".repeat(64)),
            "config": {"anything": ["goes", 1]}
        },
        "limits": {"timeoutMs": 200, "memoryMib": 32},
        "finalize": true
    })
}

/// Server-side dry-run create; `Err(message)` when the API server refuses it.
async fn dry_run(api: &Api<DynamicObject>, object: &DynamicObject) -> Result<(), String> {
    // A fresh CRD can take a moment to be served; retry "not found" briefly.
    for _ in 0..50 {
        match api
            .create(
                &PostParams {
                    dry_run: true,
                    ..PostParams::default()
                },
                object,
            )
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            Err(kube::Error::Api(status)) => return Err(status.message),
            Err(other) => return Err(other.to_string()),
        }
    }
    Err("the ReconcilePolicy API never became available".into())
}

#[tokio::test]
async fn valid_policy_is_accepted_and_mistakes_are_refused() -> anyhow::Result<()> {
    let api = policies().await?;
    dry_run(&api, &policy("valid", valid_spec()))
        .await
        .map_err(anyhow::Error::msg)?;

    let mut cases: Vec<(&str, Value, &str)> = Vec::new();
    let mut two_sources = valid_spec();
    two_sources["plugin"]["source"]["configMap"] =
        json!({"namespace": "wasmctrl", "name": "plugins", "key": "myapp.wasm"});
    cases.push(("two sources", two_sources, "exactly one plugin source"));
    let config_map =
        json!({"configMap": {"namespace": "wasmctrl", "name": "plugins", "key": "myapp.wasm"}});
    let mut unpinned = valid_spec();
    unpinned["plugin"] = json!({"source": config_map});
    cases.push((
        "unpinned ConfigMap plugin",
        unpinned,
        "from a ConfigMap needs a digest",
    ));
    let mut unpinned_candidate = valid_spec();
    unpinned_candidate["plugin"]["candidate"] = json!({"source": config_map});
    cases.push((
        "unpinned ConfigMap candidate",
        unpinned_candidate,
        "from a ConfigMap needs a digest",
    ));
    let stages = json!({"stages": [{"percent": 0}, {"percent": 100}]});
    let mut rollout_alone = valid_spec();
    rollout_alone["plugin"]["rollout"] = stages.clone();
    cases.push((
        "a rollout with no candidate",
        rollout_alone,
        "set candidate",
    ));
    let mut rollout_and_canary = valid_spec();
    rollout_and_canary["plugin"]["candidate"] = json!({"source": {"file": {"path": "/p.wasm"}},
        "canary": {"selector": {"matchLabels": {"a": "b"}}}});
    rollout_and_canary["plugin"]["rollout"] = stages;
    cases.push((
        "a rollout beside a canary selector",
        rollout_and_canary,
        "without candidate.canary",
    ));
    let mut no_stages = valid_spec();
    no_stages["plugin"]["candidate"] = json!({"source": {"file": {"path": "/p.wasm"}}});
    no_stages["plugin"]["rollout"] = json!({"stages": []});
    cases.push((
        "a rollout of no stage",
        no_stages,
        "spec.plugin.rollout.stages",
    ));
    let mut over = valid_spec();
    over["plugin"]["candidate"] = json!({"source": {"file": {"path": "/p.wasm"}}});
    over["plugin"]["rollout"] = json!({"stages": [{"percent": 101}]});
    cases.push((
        "a share above 100%",
        over,
        "spec.plugin.rollout.stages[0].percent",
    ));
    let mut safety = valid_spec();
    safety["safety"] = json!({"maxPruneFraction": 1.5});
    cases.push(("a share above 1", safety, "spec.safety.maxPruneFraction"));
    let mut no_source = valid_spec();
    no_source["plugin"]["source"] = json!({});
    cases.push(("no source", no_source, "exactly one plugin source"));
    let mut bad_digest = valid_spec();
    bad_digest["plugin"]["digest"] = json!("md5:abc");
    cases.push(("bad digest", bad_digest, "spec.plugin.digest"));
    let mut duplicate_child = valid_spec();
    duplicate_child["children"] = json!([
        {"apiVersion": "v1", "kind": "Service"},
        {"apiVersion": "v1", "kind": "Service"}
    ]);
    cases.push(("duplicate child kind", duplicate_child, "listed once"));
    let mut zero_timeout = valid_spec();
    zero_timeout["limits"]["timeoutMs"] = json!(0);
    cases.push(("zero timeout", zero_timeout, "spec.limits.timeoutMs"));
    let mut two_ways = valid_spec();
    two_ways["related"] = json!([{"apiVersion": "v1", "kind": "Secret",
        "selector": {"matchLabels": {"a": "b"}}, "nameFrom": "spec.secret"}]);
    cases.push(("selector and nameFrom", two_ways, "not both"));
    let mut bad_path = valid_spec();
    bad_path["related"] = json!([{"apiVersion": "v1", "kind": "Secret",
        "nameFrom": "spec.secrets[0]"}]);
    cases.push((
        "nameFrom not a field path",
        bad_path,
        "spec.related[0].nameFrom",
    ));

    let mut no_webhook = valid_spec();
    no_webhook["admission"] = json!({"failurePolicy": "Ignore"});
    cases.push(("admission serving nothing", no_webhook, "set at least one"));
    let mut impatient = valid_spec();
    impatient["admission"] =
        json!({"validate": true, "timeoutSeconds": 2, "pluginTimeoutMs": 2000});
    cases.push((
        "a plugin deadline the API server does not wait for",
        impatient,
        "pluginTimeoutMs must be below timeoutSeconds",
    ));
    let mut twice = valid_spec();
    twice["admission"] = json!({"default": true, "operations": ["CREATE", "CREATE"]});
    cases.push(("an operation listed twice", twice, "listed once"));
    let mut elsewhere = valid_spec();
    elsewhere["conversion"] = json!({"versions": ["v1alpha1", "v2"]});
    cases.push((
        "conversion without the parent's version",
        elsewhere,
        "lists the parent's own version",
    ));
    let mut one = valid_spec();
    one["conversion"] = json!({"versions": ["v1"]});
    cases.push(("conversion of one version", one, "spec.conversion.versions"));
    let mut converting = valid_spec();
    converting["conversion"] = json!({"versions": ["v1alpha1", "v1"]});
    dry_run(&api, &policy("valid", converting))
        .await
        .map_err(anyhow::Error::msg)?;
    let mut admission = valid_spec();
    admission["admission"] = json!({"validate": true, "default": true, "failurePolicy": "Ignore",
        "timeoutSeconds": 3, "operations": ["CREATE", "UPDATE", "DELETE"]});
    dry_run(&api, &policy("valid", admission))
        .await
        .map_err(anyhow::Error::msg)?;

    for (what, spec, expected) in cases {
        let message = dry_run(&api, &policy("invalid", spec))
            .await
            .expect_err(what);
        assert!(
            message.contains(expected),
            "{what}: expected a message about {expected:?}, got {message}"
        );
    }
    Ok(())
}
