use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use wasmctrl_plugin_sdk::Condition;

/// The port the app listens on when `spec.port` is not set.
pub const DEFAULT_PORT: i32 = 80;

/// A stateless application: `replicas` copies of `image`, reachable through a Service.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "example.com",
    version = "v1",
    kind = "MyApp",
    plural = "myapps",
    shortname = "ma",
    namespaced,
    status = "MyAppStatus",
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.ready"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MyAppSpec {
    /// How many Pods to run.
    #[schemars(range(min = 1))]
    pub replicas: i32,
    /// The container image to run.
    #[schemars(length(min = 1))]
    pub image: String,
    /// The port the container listens on and the Service exposes (default 80).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<i32>,
    /// A ConfigMap in the same namespace whose data becomes the container's environment.
    /// Editing it rolls the pods. The policy must list ConfigMaps as related objects: by
    /// name (`nameFrom: spec.configMap`, no label needed) or by selector (the example policy
    /// relates those labelled `example.com/myapp-config: "true"`). A ConfigMap the plugin is
    /// not given shows as `ConfigMapFound=False`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub config_map: Option<String>,
}

/// The policy's plugin config.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MyAppConfig {
    /// Whether each MyApp gets a Service (default true).
    #[serde(default = "yes")]
    pub service: bool,
}

impl Default for MyAppConfig {
    fn default() -> Self {
        Self { service: true }
    }
}

fn yes() -> bool {
    true
}

/// What the controller observed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MyAppStatus {
    /// Desired replicas, as last reconciled.
    #[serde(default)]
    pub replicas: i32,
    /// Replicas the Deployment reports ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// `readyReplicas/replicas`, for `kubectl get`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ready: String,
    /// The generation the host last reconciled (written by the host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` (from the plugin) and `Reconciled` (from the host).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}
