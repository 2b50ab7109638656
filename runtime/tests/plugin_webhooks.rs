//! The webhooks a plugin serves run on the reconcile call path (fresh sandbox, deadline,
//! memory cap, output bounds) and every answer is checked against the contract; plugins of
//! contract 0.1.0, and plugins that implement none, serve none and still reconcile.

mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{guest_bytes, workspace_root};
use wasmctrl_runtime::{
    AdmissionRequest, CallError, EngineOptions, JsonObject, Limits, MAX_WARNINGS, Operation,
    Plugin, PluginEngine, ReconcileRequest, Retry,
};

fn engine() -> PluginEngine {
    PluginEngine::new(EngineOptions::default()).expect("engine")
}

fn object(value: Value) -> JsonObject {
    match value {
        Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

fn myapp(replicas: i32, image: &str) -> JsonObject {
    object(json!({
        "apiVersion": "example.com/v1", "kind": "MyApp",
        "metadata": {"name": "web", "namespace": "default", "uid": "u-1"},
        "spec": {"replicas": replicas, "image": image},
    }))
}

fn create(object: JsonObject, behavior: &str) -> AdmissionRequest {
    AdmissionRequest {
        operation: Operation::Create,
        object: Some(object),
        old_object: None,
        user: None,
        config: Some(json!({ "behavior": behavior }).to_string()),
    }
}

fn reconcile_request() -> ReconcileRequest {
    ReconcileRequest {
        parent: Value::Object(myapp(2, "nginx:1.27")).to_string(),
        ..ReconcileRequest::default()
    }
}

fn misbehave(engine: &PluginEngine, limits: Limits) -> Plugin {
    engine
        .load(&guest_bytes("misbehave_plugin"), None, limits)
        .expect("load misbehave plugin")
}

/// The checked-in MyApp plugin built for contract 0.1.0, before webhooks existed.
fn contract_0_1_0_bytes() -> Vec<u8> {
    let path =
        workspace_root().join("plugins/testdata/myapp-contract-0.1.0/myapp-contract-0.1.0.wasm");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn a_plugin_of_the_first_contract_loads_reconciles_and_serves_no_webhooks() {
    let engine = engine();
    let bytes = contract_0_1_0_bytes();
    let inspection = engine.inspect(&bytes).expect("inspects");
    assert_eq!(inspection.contract_version.as_deref(), Some("0.1.0"));
    assert_eq!(inspection.refusal, None);
    let plugin = engine
        .load(&bytes, None, Limits::default())
        .expect("a 0.1.0 plugin loads");
    let response = plugin
        .reconcile_blocking(reconcile_request())
        .expect("a 0.1.0 plugin reconciles");
    assert_eq!(response.children.len(), 2, "a Deployment and a Service");
    assert!(!plugin.exports_webhooks());
    let served = plugin.served_webhooks();
    assert!(!served.any(), "{served:?}");
    let refused = plugin
        .validate_blocking(create(myapp(1, "nginx:1.27"), ""))
        .expect_err("serves no validate");
    assert!(
        matches!(refused, CallError::NotServed("validate")),
        "{refused}"
    );
    assert_eq!(refused.retry(), Retry::AfterChange);
}

#[test]
fn a_plugin_that_implements_no_webhook_exports_the_plain_world() {
    let engine = engine();
    let plugin = engine
        .load(&guest_bytes("myapp_v2_plugin"), None, Limits::default())
        .expect("loads");
    assert_eq!(plugin.info().contract_version.as_deref(), Some("0.1.1"));
    assert!(!plugin.exports_webhooks(), "{:?}", plugin.info().exports);
    assert!(!plugin.served_webhooks().any());
}

#[test]
fn myapp_validates_and_defaults_through_the_sandbox() {
    let engine = engine();
    let plugin = engine
        .load(&guest_bytes("myapp_plugin"), None, Limits::default())
        .expect("loads");
    assert_eq!(plugin.served_webhooks().names(), ["validate", "default"]);
    let without_object = plugin
        .apply_defaults_blocking(AdmissionRequest {
            object: None,
            ..create(myapp(1, "a:1"), "")
        })
        .expect_err("nothing to default");
    assert!(
        matches!(without_object, CallError::InvalidRequest(_)),
        "{without_object}"
    );

    let denied = plugin
        .validate_blocking(create(myapp(0, "nginx:1.27"), ""))
        .expect("decides");
    assert!(!denied.allowed());
    assert_eq!(denied.violations[0].field, "spec.replicas");
    let allowed = plugin
        .validate_blocking(create(myapp(3, "nginx"), ""))
        .expect("decides");
    assert!(allowed.allowed(), "{allowed:?}");
    assert_eq!(allowed.warnings.len(), 1, "unpinned image: {allowed:?}");

    let defaulted = plugin
        .apply_defaults_blocking(create(myapp(3, "nginx:1.27"), ""))
        .expect("defaults");
    assert_eq!(defaulted.object["spec"]["port"], 80);
    assert_eq!(defaulted.object["metadata"], myapp(3, "x")["metadata"]);

    let err = plugin
        .convert_blocking(myapp(1, "nginx:1.27"), "example.com/v2")
        .expect_err("MyApp has one version");
    assert!(matches!(err, CallError::NotServed("convert")), "{err}");
}

#[tokio::test]
async fn webhook_calls_share_the_reconcile_call_path_under_a_tenant() {
    let engine = engine();
    let plugin = engine
        .load_async(guest_bytes("myapp_plugin"), None, Limits::default())
        .await
        .expect("loads");
    let verdict = plugin
        .validate("policy/a", create(myapp(100, "nginx:1.27"), ""))
        .await
        .expect("decides");
    assert_eq!(verdict.violations[0].field, "spec.replicas");
    let defaulted = plugin
        .apply_defaults("policy/a", create(myapp(1, "nginx:1.27"), ""))
        .await
        .expect("defaults");
    assert_eq!(defaulted.object["spec"]["port"], 80);
}

#[test]
fn a_trap_in_validate_is_an_error_and_the_plugin_keeps_serving() {
    let engine = engine();
    let plugin = misbehave(&engine, Limits::default());
    let err = plugin
        .validate_blocking(create(myapp(1, "a:1"), "panic"))
        .expect_err("panics");
    assert!(
        matches!(&err, CallError::Trap { plugin_said: Some(said), .. } if said.contains("deliberate panic in a webhook")),
        "{err}"
    );
    let err = plugin
        .validate_blocking(create(myapp(1, "a:1"), "error"))
        .expect_err("cannot decide");
    assert!(
        err.to_string().contains("the webhook cannot decide"),
        "{err}"
    );
    let denied = plugin
        .validate_blocking(create(myapp(1, "a:1"), "deny"))
        .expect("decides");
    assert_eq!(denied.message(), "spec.x: x is never allowed");
    plugin
        .reconcile_blocking(ReconcileRequest {
            config: Some(json!({}).to_string()),
            ..reconcile_request()
        })
        .expect("still reconciles");
}

#[test]
fn a_webhook_runs_under_its_own_deadline_and_the_memory_cap() {
    let engine = engine();
    let limits = Limits {
        timeout: Duration::from_secs(30),
        webhook_timeout: Duration::from_millis(200),
        memory_bytes: 32 << 20,
        ..Limits::default()
    };
    let plugin = misbehave(&engine, limits);
    let started = Instant::now();
    let err = plugin
        .apply_defaults_blocking(create(myapp(1, "a:1"), "loop"))
        .expect_err("never ends");
    assert!(
        matches!(err, CallError::DeadlineExceeded { timeout } if timeout == Duration::from_millis(200)),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let err = plugin
        .validate_blocking(create(myapp(1, "a:1"), "grow-memory"))
        .expect_err("runs out of memory");
    assert!(matches!(err, CallError::MemoryExceeded { .. }), "{err}");
}

#[test]
fn answers_that_break_the_contract_are_refused_or_bounded() {
    let engine = engine();
    let plugin = misbehave(&engine, Limits::default());
    let err = plugin
        .apply_defaults_blocking(create(myapp(1, "a:1"), "rename"))
        .expect_err("a default may not rename");
    assert!(
        matches!(&err, CallError::InvalidOutput(m) if m.contains("metadata.name")),
        "{err}"
    );
    let defaulted = plugin
        .apply_defaults_blocking(create(myapp(1, "a:1"), ""))
        .expect("defaults");
    assert_eq!(defaulted.object["spec"]["defaulted"], true);
    let flooded = plugin
        .validate_blocking(create(myapp(1, "a:1"), "warn-flood"))
        .expect("allowed");
    assert_eq!(flooded.warnings.len(), MAX_WARNINGS + 1);
    let mut lossy = myapp(1, "a:1");
    lossy["spec"]["lost"] = json!("only v1 has it");
    let converted = plugin
        .convert_blocking(lossy, "example.com/v2")
        .expect("converts");
    assert_eq!(converted["apiVersion"], "example.com/v2");
    assert!(converted["spec"].get("lost").is_none());
}

#[tokio::test]
async fn a_webhook_call_keeps_to_one_budget_for_the_slot_the_pool_and_the_call() {
    let engine = PluginEngine::new(EngineOptions {
        max_concurrent_calls: 1,
        ..EngineOptions::default()
    })
    .expect("engine");
    let budget = Duration::from_millis(300);
    let plugin = engine
        .load_async(
            guest_bytes("misbehave_plugin"),
            None,
            Limits {
                webhook_timeout: budget,
                ..Limits::default()
            },
        )
        .await
        .expect("loads");
    let mut spinning = myapp(1, "a:1");
    spinning["spec"]["behavior"] = json!("loop");
    // One call holds the only slot until its deadline; the second waits for the slot, and
    // its budget runs out while it waits, not a budget later.
    let started = Instant::now();
    let (first, second) = tokio::join!(
        plugin.convert("policy/a", spinning.clone(), "example.com/v2"),
        async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            plugin.convert("policy/a", spinning, "example.com/v2").await
        }
    );
    for err in [
        first.expect_err("loops"),
        second.expect_err("waits, then loops"),
    ] {
        assert!(
            matches!(err, CallError::DeadlineExceeded { timeout } if timeout == budget),
            "{err}"
        );
    }
    assert!(
        started.elapsed() < budget * 3,
        "the second call ended {:?} after the first began",
        started.elapsed()
    );
}
