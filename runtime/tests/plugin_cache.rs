//! Precompiled artifacts: compiled once per digest, reused by later engines, and a damaged
//! entry costs a recompile, never a failure.

mod support;

use wasmctrl_runtime::{EngineOptions, Limits, PluginEngine, ReconcileRequest};

fn engine(cache_dir: &std::path::Path) -> PluginEngine {
    PluginEngine::new(EngineOptions {
        cache_dir: Some(cache_dir.to_path_buf()),
        ..EngineOptions::default()
    })
    .expect("engine")
}

fn answers(plugin: &wasmctrl_runtime::Plugin) {
    let response = plugin
        .reconcile_blocking(ReconcileRequest {
            parent: r#"{"metadata":{"name":"cached"}}"#.into(),
            ..ReconcileRequest::default()
        })
        .expect("call");
    assert_eq!(response.status.expect("status")["parent"], "cached");
}

#[test]
fn second_engine_loads_the_precompiled_artifact() {
    let dir = tempfile::tempdir().expect("temp dir");
    let bytes = support::guest_bytes("misbehave_plugin");

    let first = engine(dir.path())
        .load(&bytes, None, Limits::default())
        .expect("compile");
    assert!(!first.info().from_cache);
    let artifacts: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
    assert_eq!(artifacts.len(), 1, "one artifact per digest");

    let second = engine(dir.path())
        .load(&bytes, None, Limits::default())
        .expect("cached load");
    assert!(second.info().from_cache);
    assert!(second.info().load_time < first.info().load_time);
    answers(&second);
}

#[test]
fn damaged_artifact_is_replaced_by_a_recompile() {
    let dir = tempfile::tempdir().expect("temp dir");
    let bytes = support::guest_bytes("misbehave_plugin");
    engine(dir.path())
        .load(&bytes, None, Limits::default())
        .expect("compile");
    let artifact = std::fs::read_dir(dir.path())
        .expect("dir")
        .next()
        .expect("an artifact")
        .expect("entry")
        .path();
    std::fs::write(&artifact, b"not an artifact").expect("damage it");

    let plugin = engine(dir.path())
        .load(&bytes, None, Limits::default())
        .expect("recompiles");
    assert!(!plugin.info().from_cache);
    answers(&plugin);
    // And the cache is healthy again.
    let again = engine(dir.path())
        .load(&bytes, None, Limits::default())
        .expect("cached");
    assert!(again.info().from_cache);
}

#[test]
fn cached_plugin_loads_by_digest_without_its_bytes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let bytes = support::guest_bytes("misbehave_plugin");
    let digest = wasmctrl_runtime::Digest::of(&bytes);
    let fresh = engine(dir.path());
    assert!(
        fresh
            .load_cached(&digest, Limits::default())
            .expect("a miss is not an error")
            .is_none(),
        "nothing cached yet"
    );
    fresh
        .load(&bytes, Some(&digest), Limits::default())
        .expect("compile");
    let plugin = engine(dir.path())
        .load_cached(&digest, Limits::default())
        .expect("load")
        .expect("cache hit");
    assert_eq!(plugin.digest(), &digest);
    answers(&plugin);
}
