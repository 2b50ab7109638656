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
