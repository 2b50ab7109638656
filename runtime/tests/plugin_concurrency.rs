//! Many calls at once: every call gets a fresh sandbox and its own correct answer.

mod support;

use serde_json::json;
use std::time::Duration;
use support::{guest_bytes, misbehave_plugin};

use wasmctrl_runtime::{
    CallError, EngineOptions, Limits, ObservedObject, PluginEngine, ReconcileRequest,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_concurrent_calls_are_independent() {
    let plugin = misbehave_plugin(16, Limits::default()).await;

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
    let plugin = misbehave_plugin(
        1,
        Limits {
            timeout: Duration::from_millis(300),
            ..Limits::default()
        },
    )
    .await;
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
        Err(CallError::DeadlineExceeded { .. })
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
    assert!(matches!(err, CallError::PoolExhausted(_)), "{err}");
    assert!(busy.join().expect("thread").is_err());
    // The slot is free again.
    plugin
        .reconcile_blocking(named("third", ""))
        .expect("slot released");
}

/// A tenant whose plugin ran into its deadline runs one call at a time, at idle priority,
/// while another tenant's calls go on at full speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_that_hit_its_deadline_runs_one_call_at_a_time_and_others_are_not_slowed() {
    let plugin = misbehave_plugin(
        8,
        Limits {
            timeout: Duration::from_millis(200),
            ..Limits::default()
        },
    )
    .await;
    let first = plugin.reconcile_as("looping", named("l0", "loop")).await;
    assert!(matches!(first, Err(CallError::DeadlineExceeded { .. })));

    // Three more looping calls at once: penalized, they run one after another.
    let started = std::time::Instant::now();
    let loops: Vec<_> = (1..=3)
        .map(|i| {
            let plugin = plugin.clone();
            tokio::spawn(async move {
                plugin
                    .reconcile_as("looping", named(&format!("l{i}"), "loop"))
                    .await
            })
        })
        .collect();
    // Meanwhile another tenant's calls take their usual few milliseconds.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for i in 0..5 {
        let call = std::time::Instant::now();
        let answer = plugin
            .reconcile_as("well-behaved", named(&format!("w{i}"), ""))
            .await
            .expect("a well-behaved call succeeds");
        assert_eq!(answer.status.expect("status")["parent"], format!("w{i}"));
        // Generous: other tests of this binary may be busy on the same two cores.
        assert!(
            call.elapsed() < Duration::from_millis(500),
            "a well-behaved call took {:?} beside a looping tenant",
            call.elapsed()
        );
    }
    for handle in loops {
        assert!(matches!(
            handle.await.expect("task"),
            Err(CallError::DeadlineExceeded { .. })
        ));
    }
    assert!(
        started.elapsed() >= Duration::from_millis(580),
        "three 200 ms calls of a penalized tenant ran side by side ({:?})",
        started.elapsed()
    );
}

/// When the instance pool is full (here: a caller bypassing the call slots holds it), an
/// async call waits for room, up to its own deadline, instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_finds_the_instance_pool_full_waits_for_room() {
    let engine = PluginEngine::new(EngineOptions {
        max_concurrent_calls: 1,
        ..EngineOptions::default()
    })
    .expect("engine");
    let bytes = guest_bytes("misbehave_plugin");
    let hog = engine
        .load(
            &bytes,
            None,
            Limits {
                timeout: Duration::from_millis(300),
                ..Limits::default()
            },
        )
        .expect("load");
    let patient = engine
        .load_async(
            bytes,
            None,
            Limits {
                timeout: Duration::from_secs(3),
                ..Limits::default()
            },
        )
        .await
        .expect("load");
    let busy = std::thread::spawn(move || hog.reconcile_blocking(named("hog", "loop")));
    std::thread::sleep(Duration::from_millis(50));
    let started = std::time::Instant::now();
    let answer = patient
        .reconcile_as("patient", named("patient", ""))
        .await
        .expect("waits for the pool, then succeeds");
    assert_eq!(answer.status.expect("status")["parent"], "patient");
    assert!(
        started.elapsed() >= Duration::from_millis(150),
        "it could only have run once the hog's instance was gone ({:?})",
        started.elapsed()
    );
    assert!(busy.join().expect("thread").is_err());
}
