//! The Widget example plugin: a kind that changed shape between API versions.
//!
//! `example.com/v1alpha1` spelled a Widget's backend as one string and its size as
//! `replicaCount`:
//!
//! ```yaml
//! spec: {address: "db.example.com:5432", replicaCount: 2}
//! ```
//!
//! `example.com/v1` splits the address in two and renames the count:
//!
//! ```yaml
//! spec: {endpoint: {host: db.example.com, port: 5432}, replicas: 2}
//! ```
//!
//! The plugin converts between the two (a `Converter` with one Rust type per version), and
//! reconciles at v1: each Widget gets a ConfigMap holding its endpoint.

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};
use wasmctrl_plugin_sdk::webhooks::Converter;
use wasmctrl_plugin_sdk::{Error, Reconciler, Request, Response, serde_json};

/// A Widget at `example.com/v1alpha1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WidgetV1Alpha1 {
    /// The object's metadata (kept by every conversion).
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// What the user asks for.
    pub spec: SpecV1Alpha1,
}

/// The v1alpha1 spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecV1Alpha1 {
    /// `host:port` of the backend.
    pub address: String,
    /// How many copies.
    pub replica_count: i32,
}

/// A Widget at `example.com/v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Widget {
    /// The object's metadata (kept by every conversion).
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// What the user asks for.
    pub spec: WidgetSpec,
}

/// The v1 spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WidgetSpec {
    /// The backend.
    pub endpoint: Endpoint,
    /// How many copies.
    pub replicas: i32,
}

/// Where the backend is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Endpoint {
    /// Host name or address.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

/// Converts Widgets between v1alpha1 and v1.
pub struct WidgetVersions;

impl Converter for WidgetVersions {
    type Older = WidgetV1Alpha1;
    type Newer = Widget;
    const OLDER: &'static str = "example.com/v1alpha1";
    const NEWER: &'static str = "example.com/v1";

    fn upgrade(older: WidgetV1Alpha1) -> Result<Widget, Error> {
        let address = &older.spec.address;
        let (host, port) = address.rsplit_once(':').ok_or_else(|| {
            Error::invalid_parent(format!("spec.address {address:?} is not host:port"))
        })?;
        let port = port
            .parse()
            .map_err(|e| Error::invalid_parent(format!("spec.address {address:?}: port: {e}")))?;
        Ok(Widget {
            metadata: older.metadata,
            spec: WidgetSpec {
                endpoint: Endpoint {
                    host: host.to_owned(),
                    port,
                },
                replicas: older.spec.replica_count,
            },
        })
    }

    fn downgrade(newer: Widget) -> Result<WidgetV1Alpha1, Error> {
        let Endpoint { host, port } = newer.spec.endpoint;
        Ok(WidgetV1Alpha1 {
            metadata: newer.metadata,
            spec: SpecV1Alpha1 {
                address: format!("{host}:{port}"),
                replica_count: newer.spec.replicas,
            },
        })
    }
}

/// Reconciles Widgets at v1: one ConfigMap per Widget with its endpoint.
pub struct WidgetReconciler;

impl Reconciler for WidgetReconciler {
    type Parent = Widget;
    type Config = serde_json::Value;

    fn reconcile(request: &Request<Widget, serde_json::Value>) -> Result<Response, Error> {
        let spec = &request.parent.spec;
        let mut response = Response::new();
        response.add_child(&ConfigMap {
            metadata: ObjectMeta {
                name: Some(format!("{}-endpoint", request.name())),
                ..ObjectMeta::default()
            },
            data: Some(
                [
                    ("host".to_owned(), spec.endpoint.host.clone()),
                    ("port".to_owned(), spec.endpoint.port.to_string()),
                    ("replicas".to_owned(), spec.replicas.to_string()),
                ]
                .into(),
            ),
            ..ConfigMap::default()
        })?;
        response.set_status(&serde_json::json!({
            "endpoint": format!("{}:{}", spec.endpoint.host, spec.endpoint.port),
        }))?;
        Ok(response)
    }
}

wasmctrl_plugin_sdk::export_plugin!(reconciler: WidgetReconciler, converter: WidgetVersions);

#[cfg(test)]
mod tests {
    use serde_json::json;
    use wasmctrl_plugin_sdk::testing::convert_raw;

    use super::*;

    fn v1alpha1() -> serde_json::Value {
        json!({
            "apiVersion": "example.com/v1alpha1", "kind": "Widget",
            "metadata": {"name": "w", "namespace": "default", "labels": {"team": "a"}},
            "spec": {"address": "db.example.com:5432", "replicaCount": 2},
        })
    }

    #[test]
    fn v1alpha1_converts_to_v1_and_back_unchanged() {
        let v1: serde_json::Value = serde_json::from_str(
            &convert_raw::<WidgetVersions>(&v1alpha1().to_string(), "example.com/v1")
                .expect("upgrade"),
        )
        .expect("json");
        assert_eq!(
            v1["spec"],
            json!({"endpoint": {"host": "db.example.com", "port": 5432}, "replicas": 2})
        );
        assert_eq!(v1["metadata"], v1alpha1()["metadata"]);
        let back: serde_json::Value = serde_json::from_str(
            &convert_raw::<WidgetVersions>(&v1.to_string(), "example.com/v1alpha1")
                .expect("downgrade"),
        )
        .expect("json");
        assert_eq!(back, v1alpha1());
    }

    #[test]
    fn an_address_without_a_port_cannot_be_upgraded() {
        let mut bad = v1alpha1();
        bad["spec"]["address"] = json!("db.example.com");
        let err =
            convert_raw::<WidgetVersions>(&bad.to_string(), "example.com/v1").expect_err("no port");
        assert!(err.to_string().contains("host:port"), "{err}");
    }
}
