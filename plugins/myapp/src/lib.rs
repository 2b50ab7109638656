//! The MyApp example plugin: the operator pattern's "hello world".
//!
//! A `MyApp` (`example.com/v1`) declares `replicas`, `image`, an optional `port` and an
//! optional `configMap`; the plugin turns it into a Deployment and (unless the policy config
//! says `service: false`) a Service, and reports `replicas`, `readyReplicas` (from the
//! observed Deployment) and a `Ready` condition. The host adds `observedGeneration`.
//!
//! The plugin also serves two webhooks for its kind: a validator (`replicas` within bounds,
//! an image reference that parses, a warning for an image without a tag or digest) and a
//! defaulter (`port`, when left out).
//!
//! The ConfigMap arrives as a related object: its data becomes the container's environment,
//! and a hash of it goes into the pod template, so editing the ConfigMap rolls the pods.

mod admission;
mod reconcile;
mod types;

pub use admission::{MAX_REPLICAS, MyAppRules};
pub use reconcile::MyAppReconciler;
pub use types::{DEFAULT_PORT, MyApp, MyAppConfig, MyAppSpec, MyAppStatus};

wasmctrl_plugin_sdk::export_plugin!(
    reconciler: MyAppReconciler,
    validator: MyAppRules,
    defaulter: MyAppRules,
);
