//! Run a plugin natively, in `cargo test`, through the same decoding the Wasm export uses.
//!
//! The parent must have a `metadata.name`, as every parent the host sends has: a request
//! without one fails to decode, as an invalid parent.
//!
//! ```
//! use wasmctrl_plugin_sdk::testing::TestRequest;
//! use wasmctrl_plugin_sdk::{Error, Reconciler, Request, Response, serde_json};
//!
//! /// Mirrors the parent's spec into its status.
//! struct Echo;
//! impl Reconciler for Echo {
//!     type Parent = serde_json::Value;
//!     type Config = serde_json::Value;
//!     fn reconcile(request: &Request<serde_json::Value, serde_json::Value>) -> Result<Response, Error> {
//!         let mut response = Response::new();
//!         response.set_status(&request.parent["spec"])?;
//!         Ok(response)
//!     }
//! }
//!
//! let parent = serde_json::json!({"metadata": {"name": "echo"}, "spec": {"size": 3}});
//! let response = TestRequest::new(&parent).reconcile::<Echo>()?;
//! assert_eq!(response.status::<serde_json::Value>()?, serde_json::json!({"size": 3}));
//! # Ok::<(), Error>(())
//! ```

use serde::Serialize;

use crate::{Error, ObservedObject, Reconciler, Response};

pub use crate::glue::{RawRequest, reconcile_raw};

/// A reconcile request built from typed objects.
#[derive(Debug, Clone, Default)]
pub struct TestRequest {
    raw: RawRequest,
}

fn to_json<T: Serialize + ?Sized>(what: &str, value: &T) -> String {
    serde_json::to_string(value)
        .unwrap_or_else(|e| panic!("test {what} does not serialize to JSON: {e}"))
}

fn observed<T: Serialize + ?Sized>(what: &str, value: &T) -> ObservedObject {
    ObservedObject::from_json(to_json(what, value))
        .unwrap_or_else(|e| panic!("test {what} is not an object: {e}"))
}

impl TestRequest {
    /// A request for `parent`.
    pub fn new<P: Serialize + ?Sized>(parent: &P) -> Self {
        Self {
            raw: RawRequest {
                parent: to_json("parent", parent),
                ..RawRequest::default()
            },
        }
    }

    /// Add an observed child.
    pub fn child<T: Serialize + ?Sized>(mut self, child: &T) -> Self {
        self.raw.children.push(observed("child", child));
        self
    }

    /// Add a related object.
    pub fn related<T: Serialize + ?Sized>(mut self, object: &T) -> Self {
        self.raw.related.push(observed("related object", object));
        self
    }

    /// Set the plugin config.
    pub fn config<T: Serialize + ?Sized>(mut self, config: &T) -> Self {
        self.raw.config = Some(to_json("config", config));
        self
    }

    /// Mark the parent as being deleted.
    pub fn finalizing(mut self) -> Self {
        self.raw.finalizing = true;
        self
    }

    /// The request as it would cross the Wasm boundary, to run many times with
    /// [`reconcile_raw`] without serializing the test objects again (benchmarks do this).
    pub fn into_raw(self) -> RawRequest {
        self.raw
    }

    /// Run `R` on this request.
    pub fn reconcile<R: Reconciler>(self) -> Result<Response, Error> {
        reconcile_raw::<R>(self.raw)
    }
}

pub use crate::webhooks::{DefaultedRaw, RawAdmission, convert_raw, default_raw, validate_raw};

use crate::webhooks::{Defaulter, Operation, UserInfo, Validator, Verdict};

/// A write to validate or default, built from typed objects.
///
/// ```
/// use wasmctrl_plugin_sdk::testing::TestAdmission;
/// use wasmctrl_plugin_sdk::webhooks::{Admission, Validator, Verdict};
/// use wasmctrl_plugin_sdk::{Error, serde_json};
///
/// /// Refuses to shrink `spec.size`.
/// struct NoShrink;
/// impl Validator for NoShrink {
///     type Parent = serde_json::Value;
///     type Config = serde_json::Value;
///     fn validate(request: &Admission<serde_json::Value, serde_json::Value>) -> Result<Verdict, Error> {
///         let mut verdict = Verdict::allow();
///         if let (Some(new), Some(old)) = (&request.object, &request.old_object) {
///             if new["spec"]["size"].as_u64() < old["spec"]["size"].as_u64() {
///                 verdict.deny("spec.size", "may not shrink");
///             }
///         }
///         Ok(verdict)
///     }
/// }
///
/// let old = serde_json::json!({"spec": {"size": 3}});
/// let new = serde_json::json!({"spec": {"size": 2}});
/// assert!(!TestAdmission::update(&new, &old).validate::<NoShrink>()?.is_allowed());
/// assert!(TestAdmission::update(&old, &new).validate::<NoShrink>()?.is_allowed());
/// # Ok::<(), Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct TestAdmission {
    raw: RawAdmission,
}

impl TestAdmission {
    fn of(operation: Operation, object: Option<String>, old_object: Option<String>) -> Self {
        Self {
            raw: RawAdmission {
                operation,
                object,
                old_object,
                user: None,
                config: None,
            },
        }
    }

    /// A create of `object`.
    pub fn create<P: Serialize + ?Sized>(object: &P) -> Self {
        Self::of(Operation::Create, Some(to_json("object", object)), None)
    }

    /// An update from `old_object` to `object`.
    pub fn update<P: Serialize + ?Sized>(object: &P, old_object: &P) -> Self {
        Self::of(
            Operation::Update,
            Some(to_json("object", object)),
            Some(to_json("old object", old_object)),
        )
    }

    /// A delete of `old_object`.
    pub fn delete<P: Serialize + ?Sized>(old_object: &P) -> Self {
        Self::of(
            Operation::Delete,
            None,
            Some(to_json("old object", old_object)),
        )
    }

    /// Set the plugin config.
    pub fn config<T: Serialize + ?Sized>(mut self, config: &T) -> Self {
        self.raw.config = Some(to_json("config", config));
        self
    }

    /// Say who is writing.
    pub fn user(mut self, username: &str, groups: &[&str]) -> Self {
        self.raw.user = Some(UserInfo {
            username: username.to_owned(),
            groups: groups.iter().map(|g| (*g).to_owned()).collect(),
        });
        self
    }

    /// The write as it would cross the Wasm boundary.
    pub fn into_raw(self) -> RawAdmission {
        self.raw
    }

    /// Run `V` on this write.
    pub fn validate<V: Validator>(self) -> Result<Verdict, Error> {
        validate_raw::<V>(&self.raw)
    }

    /// Run `D` on this write: the object with its defaults set, and the warnings.
    pub fn apply_defaults<D: Defaulter>(self) -> Result<DefaultedRaw, Error> {
        default_raw::<D>(&self.raw)
    }
}
