//! Plugins compiled in a child process: bounded in memory and time, and a failure there fails
//! one load, not the process. Its own `main` (no libtest harness): the child is this test
//! executable, started again with the compiler's argument. It answers the arguments the test
//! runners use as libtest does (`--list`, a name filter, `--exact`, `--ignored`).

mod support;

use std::process::ExitCode;
use std::time::Duration;

use serde_json::json;
use support::guest_bytes;
use wasmctrl_runtime::{
    ChildCompiler, Compiler, EngineOptions, Limits, LoadError, PluginEngine, ReconcileRequest,
    compile_child_if_asked,
};

fn main() -> ExitCode {
    if let Some(code) = compile_child_if_asked() {
        return code;
    }
    let tests: [(&str, fn()); 4] = [
        (
            "a_plugin_compiled_in_a_child_answers_and_is_cached",
            a_plugin_compiled_in_a_child_answers_and_is_cached,
        ),
        (
            "a_compile_past_its_memory_bound_fails_that_load_only",
            a_compile_past_its_memory_bound_fails_that_load_only,
        ),
        (
            "a_compile_past_its_deadline_is_stopped",
            a_compile_past_its_deadline_is_stopped,
        ),
        (
            "bytes_wasmtime_cannot_compile_are_an_invalid_component",
            bytes_wasmtime_cannot_compile_are_an_invalid_component,
        ),
    ];
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().any(|arg| arg == name);
    // The first argument that is neither a flag nor a flag's value (`--format terse`).
    let filter = args
        .iter()
        .enumerate()
        .find(|(i, arg)| !arg.starts_with('-') && (*i == 0 || args[i - 1] != "--format"))
        .map(|(_, arg)| arg);
    let selected = |name: &str| {
        filter.is_none_or(|filter| {
            if flag("--exact") {
                name == filter
            } else {
                name.contains(filter.as_str())
            }
        })
    };
    // None of these is ignored: asked for the ignored ones, there are none.
    let ignored_only = flag("--ignored");
    if flag("--list") {
        for (name, _) in tests {
            if !ignored_only && selected(name) {
                println!("{name}: test");
            }
        }
        return ExitCode::SUCCESS;
    }
    let mut passed = 0;
    for (name, test) in tests {
        if ignored_only || !selected(name) {
            continue;
        }
        println!("test {name} ...");
        test();
        println!("test {name} ... ok");
        passed += 1;
    }
    // A failing test panics (exit code 101); the summary, worded as libtest words it, is
    // what the suite's runner counts.
    println!(
        "\ntest result: ok. {passed} passed; 0 failed; 0 ignored; 0 measured; {} filtered out\n",
        tests.len() - passed
    );
    ExitCode::SUCCESS
}

fn child_engine(
    max_memory_bytes: u64,
    timeout: Duration,
    cache: Option<&std::path::Path>,
) -> PluginEngine {
    PluginEngine::new(EngineOptions {
        cache_dir: cache.map(std::path::Path::to_path_buf),
        compiler: Compiler::Child(ChildCompiler {
            max_memory_bytes,
            timeout,
        }),
        ..EngineOptions::default()
    })
    .expect("engine")
}

fn myapp_request() -> ReconcileRequest {
    ReconcileRequest {
        parent: json!({
            "apiVersion": "demo.wasmctrl.dev/v1",
            "kind": "MyApp",
            "metadata": {"name": "web", "namespace": "default", "uid": "u1", "generation": 1},
            "spec": {"image": "nginx:1.27", "replicas": 2, "port": 80}
        })
        .to_string(),
        ..ReconcileRequest::default()
    }
}

fn a_plugin_compiled_in_a_child_answers_and_is_cached() {
    let cache = tempfile::tempdir().expect("tempdir");
    let engine = child_engine(1 << 30, Duration::from_secs(120), Some(cache.path()));
    let plugin = engine
        .load(&guest_bytes("myapp_plugin"), None, Limits::default())
        .expect("compiled in a child");
    assert!(!plugin.info().from_cache);
    let answer = plugin
        .reconcile_blocking(myapp_request())
        .expect("the plugin answers");
    assert_eq!(answer.children.len(), 2, "{answer:?}");

    // The artifact the child wrote through the host is in the cache, for the next start.
    let restarted = child_engine(1 << 30, Duration::from_secs(120), Some(cache.path()));
    let cached = restarted
        .load_cached(plugin.digest(), Limits::default())
        .expect("load")
        .expect("the artifact is cached");
    assert_eq!(
        cached.reconcile_blocking(myapp_request()).expect("answers"),
        answer
    );
}

fn a_compile_past_its_memory_bound_fails_that_load_only() {
    // Compiling MyApp takes ~35 MiB; 16 MiB is enough for the child to start and read it.
    let engine = child_engine(16 << 20, Duration::from_secs(120), None);
    match engine.load(&guest_bytes("myapp_plugin"), None, Limits::default()) {
        Err(LoadError::CompileLimitExceeded(reason)) => {
            assert!(reason.contains("16 MiB of memory"), "{reason}");
        }
        other => panic!("expected the compile's memory bound to stop it, got {other:?}"),
    }
    // This process, which holds the engine, is untouched and compiles with room to do so.
    let roomy = engine_with_room();
    roomy
        .load(&guest_bytes("myapp_plugin"), None, Limits::default())
        .expect("compiles with room");
}

fn engine_with_room() -> PluginEngine {
    child_engine(1 << 30, Duration::from_secs(120), None)
}

fn a_compile_past_its_deadline_is_stopped() {
    let engine = child_engine(1 << 30, Duration::from_millis(50), None);
    let started = std::time::Instant::now();
    match engine.load(&guest_bytes("myapp_plugin"), None, Limits::default()) {
        Err(LoadError::CompileLimitExceeded(reason)) => {
            assert!(reason.contains("longer than 0.05 s"), "{reason}");
        }
        other => panic!("expected the compile's deadline to stop it, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stopped at its deadline, not at its end: {:?}",
        started.elapsed()
    );
}

fn bytes_wasmtime_cannot_compile_are_an_invalid_component() {
    let mut bytes = b"\0asm\x0d\0\x01\0".to_vec();
    bytes.extend_from_slice(&[0xff; 64]);
    match engine_with_room().load(&bytes, None, Limits::default()) {
        Err(LoadError::InvalidComponent(reason)) => {
            assert!(!reason.is_empty(), "the child says why");
        }
        other => panic!("expected an invalid component, got {other:?}"),
    }
}
