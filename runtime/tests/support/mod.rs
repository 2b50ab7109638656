//! Shared by the runtime's integration tests: the guest plugins they run.
#![allow(dead_code, unused_imports)] // each test binary uses a different part

pub use wasmctrl_testenv::plugins::{guest, guest_bytes};

/// The repository root.
pub fn workspace_root() -> std::path::PathBuf {
    wasmctrl_testenv::repo_root()
}

/// The misbehave plugin (its config picks a behaviour), loaded on an engine of its own with
/// `slots` call slots, under `limits`.
pub async fn misbehave_plugin(
    slots: u32,
    limits: wasmctrl_runtime::Limits,
) -> wasmctrl_runtime::Plugin {
    let engine = wasmctrl_runtime::PluginEngine::new(wasmctrl_runtime::EngineOptions {
        max_concurrent_calls: slots,
        ..wasmctrl_runtime::EngineOptions::default()
    })
    .expect("engine");
    engine
        .load_async(guest_bytes("misbehave_plugin"), None, limits)
        .await
        .expect("load")
}
