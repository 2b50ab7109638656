//! Shared by the runtime's integration tests: the guest plugins they run.
#![allow(dead_code, unused_imports)] // each test binary uses a different part

pub use wasmctrl_testenv::plugins::{guest, guest_bytes};

/// The repository root.
pub fn workspace_root() -> std::path::PathBuf {
    wasmctrl_testenv::repo_root()
}
