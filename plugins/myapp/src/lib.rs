//! The MyApp example plugin: the operator pattern's "hello world".
//!
//! A `MyApp` (`example.com/v1`) declares `replicas`, `image` and an optional `port`; the plugin
//! turns it into a Deployment and a Service, and reports `replicas`, `readyReplicas` (from the
//! observed Deployment) and a `Ready` condition. The host adds `observedGeneration`.

mod reconcile;
mod types;

pub use reconcile::MyAppReconciler;
pub use types::{DEFAULT_PORT, MyApp, MyAppSpec, MyAppStatus};

wasmctrl_plugin_sdk::export_reconciler!(MyAppReconciler);
