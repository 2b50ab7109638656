//! Many calls at once: every call gets a fresh sandbox and its own correct answer.

mod support;

use serde_json::json;
use support::guest_bytes;
use wasmctrl::plugin::{EngineOptions, Limits, ObservedObject, PluginEngine, ReconcileRequest};

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
