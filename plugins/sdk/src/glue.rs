//! Decoding a request into the plugin's types and running its [`Reconciler`].
//!
//! Both the Wasm export and the native test harness go through [`reconcile_raw`], so a test
//! that passes natively exercises the same decoding the host will see; only the ABI differs.
//! Plugins reach these through [`crate::testing`]; the crate root keeps to what a reconciler
//! is written with.

use crate::{Error, Observed, ObservedObject, Reconciler, Request, Response};

/// A reconcile request as it crosses the boundary: JSON text, like the WIT record. Build one
/// with [`TestRequest`](crate::testing::TestRequest) (or by hand, from JSON a tool already
/// holds) and run it with [`reconcile_raw`].
#[derive(Debug, Clone, Default)]
pub struct RawRequest {
    /// The parent object as JSON.
    pub parent: String,
    /// Observed children.
    pub children: Vec<ObservedObject>,
    /// Related objects.
    pub related: Vec<ObservedObject>,
    /// The plugin config as JSON, if any.
    pub config: Option<String>,
    /// The parent is being deleted.
    pub finalizing: bool,
}

/// Decode `raw` exactly as the Wasm export does and run `R::reconcile` on it: the native
/// path for tests, benchmarks and tools that compare a plugin's logic without a Wasm engine.
pub fn reconcile_raw<R: Reconciler>(raw: RawRequest) -> Result<Response, Error> {
    let parent = serde_json::from_str(&raw.parent).map_err(|e| {
        Error::invalid_parent(format!("parent does not match the plugin's type: {e}"))
    })?;
    // Read once here, so `Request::name` is a field access and no plugin re-checks it.
    let (name, namespace) = crate::request::parent_identity(&raw.parent)?;
    let config = match raw.config.as_deref() {
        None => R::Config::default(),
        Some(json) => serde_json::from_str(json)
            .map_err(|e| Error::permanent(format!("plugin config is invalid: {e}")))?,
    };
    let request = Request {
        parent,
        children: Observed::new(raw.children),
        related: Observed::new(raw.related),
        config,
        finalizing: raw.finalizing,
        name,
        namespace,
    };
    R::reconcile(&request)
}

/// The body of the exported `reconcile` function.
#[cfg(target_arch = "wasm32")]
mod reconciler {
    use super::{RawRequest, install_panic_hook, reconcile_raw};
    use crate::bindings::exports::wasmctrl::plugin::reconciler as wit;
    use crate::{Error, EventType, ObservedObject, Reconciler};

    /// The body of the exported `reconcile` function.
    pub fn wasm_reconcile<R: Reconciler>(
        request: wit::ReconcileRequest,
    ) -> Result<wit::ReconcileResponse, wit::ReconcileError> {
        install_panic_hook();
        let observed = |list: Vec<wit::Observed>| {
            list.into_iter()
                .map(|o| ObservedObject {
                    api_version: o.api_version,
                    kind: o.kind,
                    name: o.name,
                    json: o.object,
                })
                .collect()
        };
        let raw = RawRequest {
            parent: request.parent,
            children: observed(request.children),
            related: observed(request.related),
            config: request.config,
            finalizing: request.finalizing,
        };
        match reconcile_raw::<R>(raw) {
            Ok(response) => Ok(wit::ReconcileResponse {
                children: response.children,
                status: response.status,
                requeue_after_ms: response
                    .requeue_after
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                events: response
                    .events
                    .into_iter()
                    .map(|e| wit::Event {
                        kind: match e.kind {
                            EventType::Normal => wit::EventType::Normal,
                            EventType::Warning => wit::EventType::Warning,
                        },
                        reason: e.reason,
                        message: e.message,
                    })
                    .collect(),
                finalized: response.finalized,
            }),
            Err(Error::InvalidParent(m)) => Err(wit::ReconcileError::InvalidParent(m)),
            Err(Error::Transient(m)) => Err(wit::ReconcileError::Transient(m)),
            Err(Error::Permanent(m)) => Err(wit::ReconcileError::Permanent(m)),
        }
    }
}

/// Route panics to the host's log before the abort, so the host can report the message
/// alongside the trap instead of a bare `unreachable`.
#[cfg(target_arch = "wasm32")]
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        crate::log::write(
            crate::log::Level::Error,
            &format!("plugin panicked: {info}"),
        );
    }));
}

#[cfg(target_arch = "wasm32")]
pub use reconciler::wasm_reconcile;

/// The bodies of the exported webhook functions.
#[cfg(all(target_arch = "wasm32", feature = "webhooks"))]
pub mod webhooks {
    use super::install_panic_hook;
    use crate::bindings::exports::wasmctrl::plugin::webhooks as wit;
    use crate::webhooks::{
        Converter, Defaulter, Operation, RawAdmission, UserInfo, Validator, convert_raw,
        default_raw, validate_raw,
    };

    fn raw(request: wit::AdmissionRequest) -> RawAdmission {
        RawAdmission {
            operation: match request.operation {
                wit::Operation::Create => Operation::Create,
                wit::Operation::Update => Operation::Update,
                wit::Operation::Delete => Operation::Delete,
            },
            object: request.object,
            old_object: request.old_object,
            user: request.user.map(|u| UserInfo {
                username: u.username,
                groups: u.groups,
            }),
            config: request.config,
        }
    }

    /// The body of the exported `validate` function.
    pub fn validate<V: Validator>(request: wit::AdmissionRequest) -> Result<wit::Verdict, String> {
        install_panic_hook();
        let verdict = validate_raw::<V>(&raw(request)).map_err(|e| e.to_string())?;
        Ok(wit::Verdict {
            violations: verdict
                .violations
                .into_iter()
                .map(|v| wit::Violation {
                    field: v.field,
                    message: v.message,
                })
                .collect(),
            warnings: verdict.warnings,
        })
    }

    /// The body of the exported `default` function.
    pub fn default<D: Defaulter>(request: wit::AdmissionRequest) -> Result<wit::Defaulted, String> {
        install_panic_hook();
        let defaulted = default_raw::<D>(&raw(request)).map_err(|e| e.to_string())?;
        Ok(wit::Defaulted {
            object: defaulted.object.to_string(),
            warnings: defaulted.warnings,
        })
    }

    /// The body of the exported `convert` function.
    pub fn convert<C: Converter>(
        object: String,
        desired_api_version: String,
    ) -> Result<String, String> {
        install_panic_hook();
        convert_raw::<C>(&object, &desired_api_version).map_err(|e| e.to_string())
    }

    /// What a webhook the plugin does not serve answers, should a host call it anyway.
    pub const NOT_SERVED: &str =
        "this plugin does not serve this webhook (its `served` export leaves it out)";
}
