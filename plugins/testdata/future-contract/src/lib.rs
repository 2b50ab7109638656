//! A plugin for a future contract: the repository's WIT with its version raised to 0.2.0,
//! as a plugin built with a newer SDK would export it. A host that serves only 0.1.0 must
//! refuse it before running anything, saying which contract it has and which the host serves.

// The generated export glue declares `extern "C"` entry points, which the workspace's
// `unsafe_code = "deny"` would refuse; the SDK keeps the same glue out of plugin crates.
#[allow(unsafe_code, missing_docs)]
mod future {
    wit_bindgen::generate!({ path: "wit", world: "plugin" });

    use exports::wasmctrl::plugin::reconciler::{
        Guest, ReconcileError, ReconcileRequest, ReconcileResponse,
    };

    struct Future;

    impl Guest for Future {
        fn reconcile(_: ReconcileRequest) -> Result<ReconcileResponse, ReconcileError> {
            Err(ReconcileError::Permanent(
                "a host that serves contract 0.1.0 must never call this".into(),
            ))
        }
    }

    export!(Future);
}
