//! A burst of fast calls does not multiply threads. Alone in its test binary: it counts the
//! process's threads, which other tests running beside it would change.

mod support;

use serde_json::json;
use support::misbehave_plugin;

use wasmctrl_runtime::{Limits, ReconcileRequest};

fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .map(|name| name.trim().to_owned())
        .collect()
}

/// 16 tasks calling as fast as they can, 400 calls each (a restarted host checking every
/// parent at a policy's 16 at a time): every call runs on a `wasmctrl-call` thread and there
/// are never more of those than calls in flight, however many slots the engine has. With the
/// calls in `block_in_place` the same load started ~80 threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_callers_need_at_most_sixteen_call_threads() {
    // More slots than callers: the bound comes from the calls in flight, not the slots.
    let plugin = misbehave_plugin(64, Limits::default()).await;
    let before = thread_names().len();

    let callers: Vec<_> = (0..16)
        .map(|caller| {
            let plugin = plugin.clone();
            tokio::spawn(async move {
                for call in 0..400 {
                    let name = format!("parent-{caller}-{call}");
                    let response = plugin
                        .reconcile_as(
                            "policy",
                            ReconcileRequest {
                                parent: json!({"metadata": {"name": name}}).to_string(),
                                ..ReconcileRequest::default()
                            },
                        )
                        .await
                        .expect("call succeeds");
                    let status = response.status.expect("status");
                    assert_eq!(status["parent"], name, "answers crossed");
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.expect("caller");
    }

    let after = thread_names();
    let call_threads = after.iter().filter(|name| *name == "wasmctrl-call").count();
    assert!(
        call_threads >= 1,
        "the calls ran on call threads: {after:?}"
    );
    assert!(
        call_threads <= 16,
        "{call_threads} call threads for 16 callers"
    );
    // Nothing else grew: the async runtime kept its two workers.
    assert!(
        after.len() <= before + 16,
        "{} threads before the calls, {} after: {after:?}",
        before,
        after.len()
    );
}
