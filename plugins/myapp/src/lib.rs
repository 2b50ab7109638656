//! The MyApp example plugin: the operator pattern's "hello world".
//!
//! A `MyApp` (`example.com/v1`) declares `replicas`, `image`, an optional `port` and an
//! optional `configMap`; the plugin turns it into a Deployment and (unless the policy config
//! says `service: false`) a Service, and reports `replicas`, `readyReplicas` (from the
//! observed Deployment) and a `Ready` condition. The host adds `observedGeneration`.
//!
//! The ConfigMap arrives as a related object: its data becomes the container's environment,
//! and a hash of it goes into the pod template, so editing the ConfigMap rolls the pods.

mod reconcile;
mod types;

pub use reconcile::MyAppReconciler;
pub use types::{DEFAULT_PORT, MyApp, MyAppConfig, MyAppSpec, MyAppStatus};

wasmctrl_plugin_sdk::export_reconciler!(MyAppReconciler);
