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

pub mod child;
mod conditions;
mod error;
#[doc(hidden)]
pub mod glue;
pub mod labels;
pub mod log;
mod request;
mod response;
pub mod testing;
pub mod webhooks;

pub use child::Child;
pub use conditions::{Condition, ConditionStatus, set_condition};
pub use error::{Error, ResultExt};
pub use request::{Observed, ObservedObject, Request};
pub use response::{Event, EventType, Response};

/// The version of the host contract (`wasmctrl:plugin`) plugins built with this SDK export.
/// A host refuses a plugin whose contract it does not serve, naming both versions;
/// `wasmctrl plugin inspect` shows a plugin's and `wasmctrl version` the host's.
pub const CONTRACT_VERSION: &str = "0.1.1";

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

/// The WIT bindings, generated from the contract bundled in this crate's `wit/`, for the
/// `plugin` world, or for `plugin-with-webhooks` with the `webhooks` feature. Used by the
/// export macros; plugin code does not need to touch them.
///
/// One world per build, chosen by a feature rather than by the macro a plugin calls: the
/// bindings embed their world's type in the component, so a crate that generated both would
/// always claim the webhooks export. A plugin without webhooks thus exports exactly the
/// `plugin` world, as plugins always have.
#[doc(hidden)]
pub mod bindings {
    #[cfg(not(feature = "webhooks"))]
    wit_bindgen::generate!({
        path: "wit",
        world: "plugin",
        pub_export_macro: true,
        export_macro_name: "__export_plugin",
        default_bindings_module: "wasmctrl_plugin_sdk::bindings",
    });
    #[cfg(feature = "webhooks")]
    wit_bindgen::generate!({
        path: "wit",
        world: "plugin-with-webhooks",
        pub_export_macro: true,
        export_macro_name: "__export_plugin",
        default_bindings_module: "wasmctrl_plugin_sdk::bindings",
    });
}

/// Exports a [`Reconciler`] as the component's `reconcile` function, serving no webhooks.
///
/// On non-Wasm targets nothing is exported (the same crate builds natively for tests); the
/// reconciler is still referenced, so it type-checks and counts as used.
#[cfg(not(feature = "webhooks"))]
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
            use $crate::bindings::exports::wasmctrl::plugin::reconciler as __reconciler;
            struct __WasmctrlExport;
            impl __reconciler::Guest for __WasmctrlExport {
                fn reconcile(
                    request: __reconciler::ReconcileRequest,
                ) -> ::core::result::Result<
                    __reconciler::ReconcileResponse,
                    __reconciler::ReconcileError,
                > {
                    $crate::glue::wasm_reconcile::<$reconciler>(request)
                }
            }
    $crate::bindings::__export_plugin!(__WasmctrlExport with_types_in $crate::bindings);
        };
    };
}

/// Exports a [`Reconciler`] as the component's `reconcile` function, serving no webhooks
/// (with the `webhooks` feature the component still exports the webhooks interface, whose
/// `served` names none).
#[cfg(feature = "webhooks")]
#[macro_export]
macro_rules! export_reconciler {
    ($reconciler:ty) => {
        $crate::export_plugin!(reconciler: $reconciler, webhooks: []);
    };
}

/// Without the `webhooks` feature only a reconciler can be exported.
#[cfg(not(feature = "webhooks"))]
#[macro_export]
macro_rules! export_plugin {
    (reconciler: $reconciler:ty $(,)?) => {
        $crate::export_reconciler!($reconciler);
    };
    ($($anything:tt)*) => {
        ::core::compile_error!(
            "serving webhooks needs the SDK's `webhooks` feature: wasmctrl-plugin-sdk = { version = \"0.1\", features = [\"webhooks\"] }"
        );
    };
}

/// Exports a [`Reconciler`] and the webhooks the plugin serves for its kind
/// ([`webhooks::Validator`], [`webhooks::Defaulter`], [`webhooks::Converter`]), each named
/// once, in this order (needs the `webhooks` feature):
///
/// ```ignore
/// wasmctrl_plugin_sdk::export_plugin!(
///     reconciler: MyApp,
///     validator: MyAppRules,
///     defaulter: MyAppRules,
///     converter: MyAppVersions,
/// );
/// ```
///
/// Any of the last three may be left out; the plugin's `served` export names exactly those
/// given, and the host calls no other.
///
/// On non-Wasm targets nothing is exported (the same crate builds natively for tests); the
/// types are still referenced, so they type-check and count as used.
#[cfg(feature = "webhooks")]
#[macro_export]
macro_rules! export_plugin {
    (reconciler: $reconciler:ty, webhooks: []) => {
        $crate::export_plugin!(@export $reconciler; [] [] []);
    };
    (reconciler: $reconciler:ty
     $(, validator: $validator:ty)?
     $(, defaulter: $defaulter:ty)?
     $(, converter: $converter:ty)? $(,)?) => {
        $crate::export_plugin!(@export $reconciler; [$($validator)?] [$($defaulter)?] [$($converter)?]);
    };
    (@export $reconciler:ty; [$($validator:ty)?] [$($defaulter:ty)?] [$($converter:ty)?]) => {
        #[cfg(not(target_arch = "wasm32"))]
        const _: () = {
            let _: fn(
                $crate::testing::RawRequest,
            ) -> ::core::result::Result<$crate::Response, $crate::Error> =
                $crate::testing::reconcile_raw::<$reconciler>;
            $(let _: fn(&$crate::webhooks::RawAdmission) -> ::core::result::Result<$crate::webhooks::Verdict, $crate::Error> =
                $crate::webhooks::validate_raw::<$validator>;)?
            $(let _: fn(&$crate::webhooks::RawAdmission) -> ::core::result::Result<$crate::webhooks::DefaultedRaw, $crate::Error> =
                $crate::webhooks::default_raw::<$defaulter>;)?
            $(let _: fn(&str, &str) -> ::core::result::Result<::std::string::String, $crate::Error> =
                $crate::webhooks::convert_raw::<$converter>;)?
        };

        #[cfg(target_arch = "wasm32")]
        const _: () = {
            use $crate::bindings::exports::wasmctrl::plugin::reconciler as __reconciler;
            use $crate::bindings::exports::wasmctrl::plugin::webhooks as __webhooks;
            struct __WasmctrlExport;
            impl __reconciler::Guest for __WasmctrlExport {
                fn reconcile(
                    request: __reconciler::ReconcileRequest,
                ) -> ::core::result::Result<__reconciler::ReconcileResponse, __reconciler::ReconcileError> {
                    $crate::glue::wasm_reconcile::<$reconciler>(request)
                }
            }
            impl __webhooks::Guest for __WasmctrlExport {
                fn served() -> __webhooks::ServedWebhooks {
                    #[allow(unused_mut)]
                    let mut served = __webhooks::ServedWebhooks::empty();
                    $({ let _ = ::core::marker::PhantomData::<$validator>; served = served | __webhooks::ServedWebhooks::VALIDATE; })?
                    $({ let _ = ::core::marker::PhantomData::<$defaulter>; served = served | __webhooks::ServedWebhooks::DEFAULT; })?
                    $({ let _ = ::core::marker::PhantomData::<$converter>; served = served | __webhooks::ServedWebhooks::CONVERT; })?
                    served
                }
                #[allow(unreachable_code, unused_variables)]
                fn validate(
                    request: __webhooks::AdmissionRequest,
                ) -> ::core::result::Result<__webhooks::Verdict, ::std::string::String> {
                    $(return $crate::glue::webhooks::validate::<$validator>(request);)?
                    ::core::result::Result::Err($crate::glue::webhooks::NOT_SERVED.into())
                }
                #[allow(unreachable_code, unused_variables)]
                fn default(
                    request: __webhooks::AdmissionRequest,
                ) -> ::core::result::Result<__webhooks::Defaulted, ::std::string::String> {
                    $(return $crate::glue::webhooks::default::<$defaulter>(request);)?
                    ::core::result::Result::Err($crate::glue::webhooks::NOT_SERVED.into())
                }
                #[allow(unreachable_code, unused_variables)]
                fn convert(
                    object: ::std::string::String,
                    desired_api_version: ::std::string::String,
                ) -> ::core::result::Result<::std::string::String, ::std::string::String> {
                    $(return $crate::glue::webhooks::convert::<$converter>(object, desired_api_version);)?
                    ::core::result::Result::Err($crate::glue::webhooks::NOT_SERVED.into())
                }
            }
            $crate::bindings::__export_plugin!(__WasmctrlExport with_types_in $crate::bindings);
        };
    };
}

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
