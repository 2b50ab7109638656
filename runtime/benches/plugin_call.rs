//! Per-call latency of a plugin through the runtime, against the same logic run natively.
//!
//! Run with `cargo xtask bench` (or `cargo bench -p wasmctrl --bench plugin_call`); prints a
//! Markdown table for BENCHMARKS.md. Percentiles come from timing every call individually,
//! which criterion does not report.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use wasmctrl_plugin_sdk::testing::{RawRequest, reconcile_raw};
use wasmctrl_runtime::{EngineOptions, Limits, ObservedObject, PluginEngine, ReconcileRequest};

/// The host's allocator, so both rows measure what the host does (with jemalloc's default
/// settings: the host's arena and decay settings matter for its peak memory, not for one
/// pinned call loop).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const WARMUP: usize = 2_000;
const CALLS: usize = 20_000;

fn fixture(name: &str) -> String {
    let path = support::workspace_root()
        .join("runtime/benches/fixtures")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

struct Stats {
    p50: Duration,
    p99: Duration,
    mean: Duration,
}

fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    let total: Duration = samples.iter().sum();
    Stats {
        p50: at(0.50),
        p99: at(0.99),
        mean: total / samples.len() as u32,
    }
}

/// Time `calls` calls of `f` one by one, after a warm-up. The calls are split into rounds and
/// the median round is reported: this machine is a VM whose speed drifts between phases of a
/// run, and one slow phase should not decide a figure.
fn measure(calls: usize, mut f: impl FnMut()) -> Stats {
    const ROUNDS: usize = 5;
    for _ in 0..WARMUP {
        f();
    }
    let mut rounds: Vec<Stats> = (0..ROUNDS)
        .map(|_| {
            let mut samples = Vec::with_capacity(calls / ROUNDS);
            for _ in 0..calls / ROUNDS {
                let started = Instant::now();
                f();
                samples.push(started.elapsed());
            }
            stats(samples)
        })
        .collect();
    rounds.sort_by_key(|r| r.p50);
    rounds.swap_remove(ROUNDS / 2)
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

/// The component the file in `$variable` holds, or the built plugin `default`.
fn plugin_bytes(variable: &str, default: &str) -> Vec<u8> {
    match std::env::var_os(variable) {
        Some(path) => std::fs::read(path).unwrap_or_else(|e| panic!("reading {variable}: {e}")),
        None => support::guest_bytes(default),
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

#[expect(clippy::too_many_lines, reason = "the bench's table, row by row")]
fn main() {
    // `cargo bench` passes `--bench`; ignore arguments.
    // WASMCTRL_BENCH_PLUGIN=path/to/other.wasm compares another build of the plugin.
    let component = plugin_bytes("WASMCTRL_BENCH_PLUGIN", "myapp_plugin");
    // The Deployment as the API server returns it, and as the contract says the host sends it:
    // without managedFields, which no reconcile decision needs.
    let full: serde_json::Value =
        serde_json::from_str(&fixture("deployment.json")).expect("fixture is JSON");
    let mut stripped = full.clone();
    if let Some(meta) = stripped["metadata"].as_object_mut() {
        meta.remove("managedFields");
    }
    let service: serde_json::Value =
        serde_json::from_str(&fixture("service.json")).expect("fixture is JSON");
    let request_for = |deployment: &serde_json::Value| ReconcileRequest {
        parent: fixture("myapp.json"),
        children: [deployment, &service]
            .into_iter()
            .map(ObservedObject::from_value)
            .collect(),
        ..ReconcileRequest::default()
    };
    let request = request_for(&stripped);
    let request_with_managed_fields = request_for(&full);
    let raw = RawRequest {
        parent: request.parent.clone(),
        children: request
            .children
            .iter()
            .map(|o| wasmctrl_plugin_sdk::ObservedObject {
                api_version: o.api_version.clone(),
                kind: o.kind.clone(),
                name: o.name.clone(),
                json: o.json.clone(),
            })
            .collect(),
        ..RawRequest::default()
    };

    let engine = PluginEngine::new(EngineOptions::default()).expect("engine");
    let plugin = engine
        .load(&component, None, Limits::default())
        .expect("load myapp");
    let check = plugin.reconcile_blocking(request.clone()).expect("call");
    assert_eq!(check.children.len(), 2);

    // The fixed cost of a call: a plugin that does almost nothing, on a tiny request
    // (WASMCTRL_BENCH_ECHO_PLUGIN=path/to/other.wasm puts another component in its place).
    let echo = engine
        .load(
            &plugin_bytes("WASMCTRL_BENCH_ECHO_PLUGIN", "misbehave_plugin"),
            None,
            Limits::default(),
        )
        .expect("load misbehave");
    let tiny = ReconcileRequest {
        parent: r#"{"metadata":{"name":"x"}}"#.to_owned(),
        ..ReconcileRequest::default()
    };

    // For profilers: `WASMCTRL_BENCH_ONLY_CALLS=myapp|echo perf record …` runs one call loop.
    if let Some(which) = std::env::var_os("WASMCTRL_BENCH_ONLY_CALLS") {
        let (plugin, request) = if which == "echo" {
            (echo, tiny)
        } else {
            (plugin, request)
        };
        let only = measure(CALLS * 5, || {
            std::hint::black_box(plugin.reconcile_blocking(request.clone()).expect("call"));
        });
        println!("calls only: p50 {} p99 {}", us(only.p50), us(only.p99));
        return;
    }

    let wasm = measure(CALLS, || {
        let response = plugin.reconcile_blocking(request.clone()).expect("call");
        std::hint::black_box(response);
    });

    let wasm_managed_fields = measure(CALLS, || {
        let response = plugin
            .reconcile_blocking(request_with_managed_fields.clone())
            .expect("call");
        std::hint::black_box(response);
    });

    let overhead = measure(CALLS, || {
        std::hint::black_box(echo.reconcile_blocking(tiny.clone()).expect("call"));
    });

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let wasm_async = measure(CALLS, || {
        let response = runtime
            .block_on(plugin.reconcile(request.clone()))
            .expect("call");
        std::hint::black_box(response);
    });

    let native = measure(CALLS, || {
        let response =
            reconcile_raw::<myapp_plugin::MyAppReconciler>(raw.clone()).expect("native call");
        std::hint::black_box(response);
    });

    // Compile vs. cached load, each on a fresh engine like a restarted host.
    let cache_dir = std::env::temp_dir().join(format!("wasmctrl-bench-{}", std::process::id()));
    let mut compile = Vec::new();
    for _ in 0..3 {
        let engine = PluginEngine::new(EngineOptions::default()).expect("engine");
        let started = Instant::now();
        engine
            .load(&component, None, Limits::default())
            .expect("compile");
        compile.push(started.elapsed());
    }
    let cached_engine = PluginEngine::new(EngineOptions {
        cache_dir: Some(cache_dir.clone()),
        ..EngineOptions::default()
    })
    .expect("engine");
    let first = cached_engine
        .load(&component, None, Limits::default())
        .expect("populate cache");
    assert!(!first.info().from_cache);
    let mut cached = Vec::new();
    let mut cached_with_bytes = Vec::new();
    let digest = *first.digest();
    for _ in 0..50 {
        let started = Instant::now();
        let plugin = cached_engine
            .load_cached(&digest, Limits::default())
            .expect("cached load")
            .expect("cache hit");
        cached.push(started.elapsed());
        std::hint::black_box(plugin);
        let started = Instant::now();
        let plugin = cached_engine
            .load(&component, Some(&digest), Limits::default())
            .expect("cached load");
        cached_with_bytes.push(started.elapsed());
        assert!(plugin.info().from_cache, "cache miss");
    }
    let _ = std::fs::remove_dir_all(&cache_dir);
    let compile = stats(compile);
    let cached = stats(cached);
    let cached_with_bytes = stats(cached_with_bytes);

    let ratio = wasm.p50.as_secs_f64() / native.p50.as_secs_f64();
    println!("| measurement | p50 | p99 | mean |");
    println!("|---|---|---|---|");
    println!(
        "| myapp via runtime, fresh sandbox per call (`reconcile_blocking`) | {} | {} | {} |",
        us(wasm.p50),
        us(wasm.p99),
        us(wasm.mean)
    );
    println!(
        "| myapp via runtime from async code (`reconcile`, call-thread hop) | {} | {} | {} |",
        us(wasm_async.p50),
        us(wasm_async.p99),
        us(wasm_async.mean)
    );
    println!(
        "| same, Deployment with its managedFields (+2 KB) | {} | {} | {} |",
        us(wasm_managed_fields.p50),
        us(wasm_managed_fields.p99),
        us(wasm_managed_fields.mean)
    );
    println!(
        "| fixed cost: near-empty plugin on a tiny request, fresh sandbox | {} | {} | {} |",
        us(overhead.p50),
        us(overhead.p99),
        us(overhead.mean)
    );
    println!(
        "| same logic natively in-process (`reconcile_raw`) | {} | {} | {} |",
        us(native.p50),
        us(native.p99),
        us(native.mean)
    );
    println!(
        "| compile (cache miss, fresh engine; 3 runs) | {} | {} | {} |",
        ms(compile.p50),
        ms(compile.p99),
        ms(compile.mean)
    );
    println!(
        "| load by digest from the precompiled-artifact cache (`load_cached`, 50 runs) | {} | {} | {} |",
        ms(cached.p50),
        ms(cached.p99),
        ms(cached.mean)
    );
    println!(
        "| load from bytes with a cache hit (SHA-256 of the bytes + the above, 50 runs) | {} | {} | {} |",
        ms(cached_with_bytes.p50),
        ms(cached_with_bytes.p99),
        ms(cached_with_bytes.mean)
    );
    println!();
    println!("- wasm / native (p50): {ratio:.2}×");
    println!(
        "- component size: {} bytes ({:.2} MB)",
        component.len(),
        component.len() as f64 / 1e6
    );
    println!(
        "- request: MyApp + observed Deployment and Service with status, {} bytes of JSON",
        request.parent.len() + request.children.iter().map(|o| o.json.len()).sum::<usize>()
    );
}
