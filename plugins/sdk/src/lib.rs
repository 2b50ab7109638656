//! # wasmctrl plugin SDK
//!
//! A wasmctrl plugin decides, for one parent object, which child objects should exist and what
//! the parent's status should say. The host does everything else: watching, caching, applying,
//! pruning, writing status and recording events. This crate lets you write that decision as a
//! plain Rust function over typed objects and export it as a WebAssembly component with one line.
//!
//! ```
//! use k8s_openapi::api::core::v1::ConfigMap;
//! use serde::Deserialize;
//! use wasmctrl_plugin_sdk::{Error, Reconciler, Request, Response, k8s_openapi, serde_json};
//!
//! /// The parent: any `serde::Deserialize` type, usually the CRD's Rust type.
//! #[derive(Deserialize)]
//! struct Greeting {
//!     metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
//!     spec: GreetingSpec,
//! }
//!
//! #[derive(Deserialize)]
//! struct GreetingSpec {
//!     message: String,
//! }
//!
//! struct Greeter;
//!
//! impl Reconciler for Greeter {
//!     type Parent = Greeting;
//!     type Config = serde_json::Value; // the policy's `plugin.config`
//!
//!     fn reconcile(request: &Request<Greeting, serde_json::Value>) -> Result<Response, Error> {
//!         let name = request.name(); // the host guarantees the parent has one
//!         let child = ConfigMap {
//!             metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
//!                 name: Some(format!("{name}-greeting")),
//!                 ..Default::default()
//!             },
//!             data: Some([("message".to_owned(), request.parent.spec.message.clone())].into()),
//!             ..Default::default()
//!         };
//!         let mut response = Response::new();
//!         response.add_child(&child)?;
//!         response.set_status(&serde_json::json!({"greeted": true}))?;
//!         Ok(response)
//!     }
//! }
//!
//! wasmctrl_plugin_sdk::export_reconciler!(Greeter);
//!
//! // The same function, natively, as `cargo test` runs it (see [`testing`]):
//! let parent = serde_json::json!({
//!     "apiVersion": "example.com/v1", "kind": "Greeting",
//!     "metadata": {"name": "hello", "namespace": "default"},
//!     "spec": {"message": "hi"},
//! });
//! let response = wasmctrl_plugin_sdk::testing::TestRequest::new(&parent).reconcile::<Greeter>()?;
//! let child: ConfigMap = response.child("hello-greeting")?;
//! assert_eq!(child.data.unwrap_or_default()["message"], "hi");
//! # Ok::<(), Error>(())
//! ```
//!
//! The same function runs natively under `cargo test` through [`testing`], with the exact
//! decoding and encoding the Wasm export uses, so plugin logic is tested without Wasm or a cluster.

mod conditions;
mod error;
mod glue;
pub mod labels;
pub mod log;
mod request;
mod response;
pub mod testing;

pub use conditions::{Condition, ConditionStatus, set_condition};
pub use error::{Error, ResultExt};
pub use request::{Observed, ObservedObject, Request};
pub use response::{Event, EventType, Response};

/// The version of the host contract (`wasmctrl:plugin`) plugins built with this SDK export.
/// A host refuses a plugin whose contract it does not serve, naming both versions;
/// `wasmctrl plugin inspect` shows a plugin's and `wasmctrl version` the host's.
pub const CONTRACT_VERSION: &str = "0.1.0";

/// Re-exported so plugins use the same Kubernetes types the SDK was built against.
pub use k8s_openapi;
/// Re-exported for building and reading untyped objects.
pub use serde_json;

/// The one trait a plugin implements.
///
/// `reconcile` must be a pure function of its request: the host may call it any number of
/// times, on any replica, in a fresh sandbox each time (statics do not survive between calls).
/// Returning the same response for the same request is what makes reconciliation idempotent.
pub trait Reconciler {
    /// The parent object's type. Usually a struct with `metadata`, `spec` and `status`.
    type Parent: serde::de::DeserializeOwned;
    /// The policy's plugin configuration. `Default` is used when the policy sets none.
    type Config: serde::de::DeserializeOwned + Default;

    /// Decide the desired children and status of `request.parent`.
    fn reconcile(request: &Request<Self::Parent, Self::Config>) -> Result<Response, Error>;
}

/// The WIT bindings, generated from the contract bundled in this crate's `wit/`. Used by [`export_reconciler!`];
/// plugin code does not need to touch them.
#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "wit",
        world: "plugin",
        pub_export_macro: true,
        export_macro_name: "__export_plugin",
        default_bindings_module: "wasmctrl_plugin_sdk::bindings",
    });
}

/// Exports a [`Reconciler`] as the component's `reconcile` function.
///
/// On non-Wasm targets nothing is exported (the same crate builds natively for tests); the
/// reconciler is still referenced, so it type-checks and counts as used.
#[macro_export]
macro_rules! export_reconciler {
    ($reconciler:ty) => {
        #[cfg(not(target_arch = "wasm32"))]
        const _: fn(
            $crate::testing::RawRequest,
        ) -> ::core::result::Result<$crate::Response, $crate::Error> =
            $crate::testing::reconcile_raw::<$reconciler>;

        #[cfg(target_arch = "wasm32")]
        const _: () = {
            struct __WasmctrlExport;
            impl $crate::bindings::exports::wasmctrl::plugin::reconciler::Guest for __WasmctrlExport {
                fn reconcile(
                    request: $crate::bindings::exports::wasmctrl::plugin::reconciler::ReconcileRequest,
                ) -> ::core::result::Result<
                    $crate::bindings::exports::wasmctrl::plugin::reconciler::ReconcileResponse,
                    $crate::bindings::exports::wasmctrl::plugin::reconciler::ReconcileError,
                > {
                    $crate::__wasm_reconcile::<$reconciler>(request)
                }
            }
            $crate::bindings::__export_plugin!(__WasmctrlExport with_types_in $crate::bindings);
        };
    };
}

#[doc(hidden)]
#[cfg(target_arch = "wasm32")]
pub use glue::wasm_reconcile as __wasm_reconcile;

#[cfg(test)]
mod tests {
    #[test]
    fn contract_version_is_the_bundled_wit_package_version() {
        let wit = include_str!("../wit/plugin.wit");
        let package = format!("package wasmctrl:plugin@{};", super::CONTRACT_VERSION);
        assert!(
            wit.lines().any(|l| l.trim() == package),
            "{package} not in wit/plugin.wit"
        );
    }
}
