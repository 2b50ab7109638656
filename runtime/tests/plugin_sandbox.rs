//! The sandbox holds against hostile plugins, and the runtime keeps serving afterwards.

mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::guest_bytes;
use wasmctrl_runtime::{
    CallError, Digest, EngineOptions, Limits, LoadError, Plugin, PluginEngine, ReconcileRequest,
    ReportedKind, Retry,
};

fn engine() -> PluginEngine {
    PluginEngine::new(EngineOptions::default()).expect("engine")
}

fn misbehave(engine: &PluginEngine, limits: Limits) -> Plugin {
    engine
        .load(&guest_bytes("misbehave_plugin"), None, limits)
        .expect("load misbehave plugin")
}

fn request(name: &str, behavior: &str) -> ReconcileRequest {
    ReconcileRequest {
        parent: json!({"apiVersion": "example.com/v1", "kind": "MyApp",
                       "metadata": {"name": name, "namespace": "default"}})
        .to_string(),
        config: Some(json!({ "behavior": behavior }).to_string()),
        ..ReconcileRequest::default()
    }
}

/// After any failure, the same plugin must still answer a good call correctly.
fn assert_still_serves(plugin: &Plugin) {
    let response = plugin
        .reconcile_blocking(request("after", ""))
        .expect("a good call after a bad one");
    let status = response.status.expect("status");
    assert_eq!(status["parent"], "after");
    assert_eq!(status["calls"], 1);
}

#[test]
fn infinite_loop_is_stopped_at_the_deadline() {
    let engine = engine();
    let timeout = Duration::from_millis(200);
    let plugin = misbehave(
        &engine,
        Limits {
            timeout,
            ..Limits::default()
        },
    );
    let started = Instant::now();
    let err = plugin
        .reconcile_blocking(request("spin", "loop"))
        .expect_err("must not finish");
    let elapsed = started.elapsed();
    assert!(
        matches!(err, CallError::DeadlineExceeded { timeout: t } if t == timeout),
        "{err}"
    );
    assert!(elapsed >= timeout, "stopped early: {elapsed:?}");
    assert!(
        elapsed <= timeout + Duration::from_millis(100),
        "stopped late: {elapsed:?}"
    );
    assert_still_serves(&plugin);
}

#[test]
fn unbounded_memory_growth_is_stopped_at_the_cap() {
    let engine = engine();
    let plugin = misbehave(
        &engine,
        Limits {
            memory_bytes: 32 << 20,
            ..Limits::default()
        },
    );
    let err = plugin
        .reconcile_blocking(request("hoarder", "grow-memory"))
        .expect_err("must hit the cap");
    match err {
        CallError::MemoryExceeded {
            limit_bytes,
            requested_bytes,
        } => {
            assert_eq!(limit_bytes, 32 << 20);
            assert!(requested_bytes > limit_bytes);
        }
        other => panic!("expected MemoryExceeded, got {other}"),
    }
    assert_still_serves(&plugin);
}

#[test]
fn panic_is_a_trap_carrying_the_panic_message() {
    let engine = engine();
    let plugin = misbehave(&engine, Limits::default());
    let err = plugin
        .reconcile_blocking(request("boom", "panic"))
        .expect_err("panics");
    match &err {
        CallError::Trap { plugin_said, .. } => {
            let said = plugin_said
                .as_deref()
                .expect("the panic message is reported");
            assert!(
                said.contains("deliberate panic while reconciling boom"),
                "{said}"
            );
        }
        other => panic!("expected Trap, got {other}"),
    }
    assert!(!err.to_string().contains('\n'), "one line: {err}");
    assert_still_serves(&plugin);
}

#[test]
fn panic_message_wins_over_earlier_stderr_output() {
    let engine = engine();
    let plugin = misbehave(&engine, Limits::default());
    let err = plugin
        .reconcile_blocking(request("noisy", "noisy-panic"))
        .expect_err("panics");
    match &err {
        CallError::Trap { plugin_said, .. } => {
            let said = plugin_said.as_deref().expect("a message is reported");
            assert!(
                said.contains("deliberate panic while reconciling noisy"),
                "{said}"
            );
        }
        other => panic!("expected Trap, got {other}"),
    }
}

#[test]
fn hundred_megabytes_of_output_are_rejected() {
    let engine = engine();
    // Enough memory and time to build 100 MB of output, so the output cap decides.
    let plugin = misbehave(
        &engine,
        Limits {
            memory_bytes: 512 << 20,
            timeout: Duration::from_secs(10),
            ..Limits::default()
        },
    );
    let err = plugin
        .reconcile_blocking(request("big", "big-output"))
        .expect_err("too large");
    // The 100 MiB answer is refused while it is being copied out, not after: the host never
    // holds more than about its output limit of it.
    match err {
        CallError::OutputCopyRefused { limit_bytes } => {
            let output = Limits::default().max_output_bytes;
            assert!(
                limit_bytes > output && limit_bytes < 2 * output,
                "{limit_bytes}"
            );
        }
        other => panic!("expected OutputCopyRefused, got {other}"),
    }
    assert_still_serves(&plugin);
}

#[test]
fn invalid_json_output_is_rejected() {
    let engine = engine();
    let plugin = misbehave(&engine, Limits::default());
    let err = plugin
        .reconcile_blocking(request("garbled", "invalid-json"))
        .expect_err("invalid");
    assert!(
        matches!(&err, CallError::InvalidOutput(m) if m.contains("child #0")),
        "{err}"
    );
    assert_still_serves(&plugin);
}

#[test]
#[allow(unsafe_code)] // see the SAFETY comment inside
fn files_environment_sockets_and_clocks_are_out_of_reach() {
    // A variable the host has must not be visible to the guest.
    // SAFETY: set before any other thread of this test reads the environment.
    unsafe { std::env::set_var("WASMCTRL_TEST_SECRET", "hunter2") };
    let engine = engine();
    let plugin = misbehave(&engine, Limits::default());
    let response = plugin
        .reconcile_blocking(request("escapee", "escape"))
        .expect("escape attempts fail inside the guest, the call itself succeeds");
    let status = response.status.expect("status");
    for field in ["file", "dir", "env", "socket"] {
        let outcome = status[field].as_str().expect("string");
        assert!(
            outcome.starts_with("denied"),
            "{field} reachable: {outcome}"
        );
    }
    assert_eq!(status["envCount"], 0, "environment leaked");
    assert_eq!(status["args"], 0, "arguments leaked");
    assert_eq!(status["stdin"], "ok: \"\"", "stdin must be empty");
    assert_eq!(status["wallClock"], 0, "the clock must be frozen");
    assert_still_serves(&plugin);
}

#[test]
fn sleeping_traps_instead_of_blocking_a_host_thread() {
    let engine = engine();
    let plugin = misbehave(&engine, Limits::default());
    let started = Instant::now();
    let err = plugin
        .reconcile_blocking(request("sleepy", "sleep"))
        .expect_err("must not sleep");
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(err.to_string().contains("may not sleep"), "{err}");
    assert_still_serves(&plugin);
}

#[test]
fn exit_is_a_trap() {
    let engine = engine();
    let plugin = misbehave(&engine, Limits::default());
    let err = plugin
        .reconcile_blocking(request("quitter", "exit"))
        .expect_err("exit");
    assert!(err.to_string().contains("exit("), "{err}");
    assert_still_serves(&plugin);
}

#[test]
fn log_flood_is_bounded_and_the_call_completes() {
    let engine = engine();
    let plugin = misbehave(&engine, Limits::default());
    plugin
        .reconcile_blocking(request("chatty", "log-flood"))
        .expect("a chatty plugin still answers");
    assert_still_serves(&plugin);
}

#[test]
fn plugin_reported_errors_keep_their_kind() {
    let engine = engine();
    let plugin = misbehave(&engine, Limits::default());
    let err = plugin
        .reconcile_blocking(request("flaky", "error"))
        .expect_err("reports an error");
    assert!(
        matches!(&err, CallError::Reported { kind: ReportedKind::Transient, message } if message.contains("flaky")),
        "{err}"
    );
    assert_eq!(err.retry(), Retry::WithBackoff);
}

#[test]
fn component_of_another_world_is_rejected_at_load() {
    let engine = engine();
    let err = engine
        .load(&guest_bytes("wrong-world"), None, Limits::default())
        .expect_err("not a reconciler");
    let message = err.to_string();
    assert!(matches!(err, LoadError::WrongWorld(_)), "{message}");
    assert!(
        message.contains("wasmctrl:plugin/reconciler@0.1.1"),
        "{message}"
    );
    assert!(
        message.contains("wasi:cli/run"),
        "names what it exports: {message}"
    );
    // The engine is unaffected.
    assert_still_serves(&misbehave(&engine, Limits::default()));
}

#[test]
fn a_plugin_of_another_contract_version_is_refused_naming_both_and_can_still_be_inspected() {
    let engine = engine();
    let bytes = guest_bytes("future_contract_plugin");
    let err = engine
        .load(&bytes, None, Limits::default())
        .expect_err("contract 0.2.0");
    assert!(
        matches!(&err, LoadError::ContractVersion { found, supported: "0.1.1" } if found == "0.2.0"),
        "{err}"
    );
    let inspection = engine.inspect(&bytes).expect("inspects");
    assert_eq!(inspection.contract_version.as_deref(), Some("0.2.0"));
    assert_eq!(inspection.refusal, Some(err.to_string()));
    let myapp = engine
        .inspect(&guest_bytes("myapp_plugin"))
        .expect("inspects");
    assert_eq!(myapp.contract_version.as_deref(), Some("0.1.1"));
    assert_eq!(myapp.refusal, None);
    assert_still_serves(&misbehave(&engine, Limits::default()));
}

#[test]
fn core_module_and_garbage_are_rejected_with_a_reason() {
    let engine = engine();
    let core = engine
        .load(b"\0asm\x01\0\0\0", None, Limits::default())
        .expect_err("core module");
    assert!(
        core.to_string().contains("core WebAssembly module"),
        "{core}"
    );
    let garbage = engine
        .load(b"#!/bin/sh\necho hi\n", None, Limits::default())
        .expect_err("garbage");
    assert!(
        matches!(garbage, LoadError::InvalidComponent(_)),
        "{garbage}"
    );
}

#[test]
fn digest_is_verified_before_anything_runs() {
    let engine = engine();
    let bytes = guest_bytes("misbehave_plugin");
    let wrong: Digest = "sha256:0000000000000000000000000000000000000000000000000000000000000000"
        .parse()
        .expect("digest");
    let err = engine
        .load(&bytes, Some(&wrong), Limits::default())
        .expect_err("mismatch");
    assert!(
        matches!(err, LoadError::DigestMismatch { expected, actual } if expected == wrong && actual == Digest::of(&bytes))
    );
    let right = Digest::of(&bytes);
    let plugin = engine
        .load(&bytes, Some(&right), Limits::default())
        .expect("matching digest loads");
    assert_eq!(plugin.digest(), &right);
}

#[test]
fn memory_cap_above_the_engine_maximum_is_refused() {
    let engine = PluginEngine::new(EngineOptions {
        max_memory_bytes: 64 << 20,
        ..EngineOptions::default()
    })
    .expect("engine");
    let err = engine
        .load(
            &guest_bytes("misbehave_plugin"),
            None,
            Limits {
                memory_bytes: 128 << 20,
                ..Limits::default()
            },
        )
        .expect_err("too much memory");
    assert!(matches!(err, LoadError::InvalidLimits(_)), "{err}");
}

#[test]
fn too_many_children_are_rejected() {
    let engine = engine();
    let plugin = engine
        .load(
            &guest_bytes("myapp_plugin"),
            None,
            Limits {
                max_children: 1,
                ..Limits::default()
            },
        )
        .expect("load");
    let parent: Value = json!({"apiVersion": "example.com/v1", "kind": "MyApp",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"replicas": 1, "image": "nginx"}});
    let err = plugin
        .reconcile_blocking(ReconcileRequest {
            parent: parent.to_string(),
            ..ReconcileRequest::default()
        })
        .expect_err("two children, limit one");
    assert!(
        matches!(err, CallError::TooManyChildren { count: 2, limit: 1 }),
        "{err}"
    );
}
