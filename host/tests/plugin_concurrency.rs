//! Many calls at once: every call gets a fresh sandbox and its own correct answer.

mod support;

use serde_json::json;
use std::time::Duration;
use support::guest_bytes;

use wasmctrl::plugin::{
    EngineOptions, Limits, ObservedObject, PluginEngine, PluginError, ReconcileRequest,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_concurrent_calls_are_independent() {
    let engine = PluginEngine::new(EngineOptions {
        max_concurrent_calls: 16,
        ..EngineOptions::default()
    })
    .expect("engine");
    let plugin = engine
        .load_async(guest_bytes("misbehave_plugin"), None, Limits::default())
        .await
        .expect("load");

    let calls = (0..1000).map(|i| {
        let plugin = plugin.clone();
        tokio::spawn(async move {
            let name = format!("parent-{i}");
            let children: Vec<ObservedObject> = (0..i % 5)
                .map(|c| ObservedObject::from_value(&json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("{name}-{c}")}})))
                .collect();
            let response = plugin
                .reconcile(ReconcileRequest {
                    parent: json!({"metadata": {"name": name}}).to_string(),
                    children,
                    ..ReconcileRequest::default()
                })
                .await
                .expect("call succeeds");
            (i, response)
        })
    });
    let results = futures_lite_join(calls.collect()).await;
    assert_eq!(results.len(), 1000);
    for (i, response) in results {
        let status = response.status.expect("status");
        assert_eq!(status["parent"], format!("parent-{i}"), "answers crossed");
        assert_eq!(status["children"], i % 5, "inputs crossed");
        assert_eq!(
            status["calls"], 1,
            "a static survived between calls: sandboxes are not fresh"
        );
    }
}

async fn futures_lite_join<T: Send + 'static>(handles: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        out.push(handle.await.expect("task"));
    }
    out
}

fn named(name: &str, behavior: &str) -> ReconcileRequest {
    ReconcileRequest {
        parent: json!({"metadata": {"name": name}}).to_string(),
        config: Some(json!({ "behavior": behavior }).to_string()),
        ..ReconcileRequest::default()
    }
}

/// With one call slot, an async call waits for a running one instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_beyond_the_pool_wait_for_a_slot() {
    let engine = PluginEngine::new(EngineOptions {
        max_concurrent_calls: 1,
        ..EngineOptions::default()
    })
    .expect("engine");
    let plugin = engine
        .load_async(
            guest_bytes("misbehave_plugin"),
            None,
            Limits {
                timeout: Duration::from_millis(300),
                ..Limits::default()
            },
        )
        .await
        .expect("load");
    let slow = tokio::spawn({
        let plugin = plugin.clone();
        async move { plugin.reconcile(named("slow", "loop")).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let fast = plugin
        .reconcile(named("fast", ""))
        .await
        .expect("waits for the slot, then succeeds");
    assert_eq!(fast.status.expect("status")["parent"], "fast");
    assert!(matches!(
        slow.await.expect("task"),
        Err(PluginError::DeadlineExceeded { .. })
    ));
}

/// A caller that bypasses the slots gets a clear sandbox error, not a trap or a hang.
#[test]
fn blocking_calls_beyond_the_pool_fail_as_sandbox_errors() {
    let engine = PluginEngine::new(EngineOptions {
        max_concurrent_calls: 1,
        ..EngineOptions::default()
    })
    .expect("engine");
    let plugin = engine
        .load(
            &guest_bytes("misbehave_plugin"),
            None,
            Limits {
                timeout: Duration::from_millis(300),
                ..Limits::default()
            },
        )
        .expect("load");
    let busy = std::thread::spawn({
        let plugin = plugin.clone();
        move || plugin.reconcile_blocking(named("slow", "loop"))
    });
    std::thread::sleep(Duration::from_millis(50));
    let err = plugin
        .reconcile_blocking(named("second", ""))
        .expect_err("the pool has one slot");
    assert!(matches!(err, PluginError::PoolExhausted(_)), "{err}");
    assert!(busy.join().expect("thread").is_err());
    // The slot is free again.
    plugin
        .reconcile_blocking(named("third", ""))
        .expect("slot released");
}
