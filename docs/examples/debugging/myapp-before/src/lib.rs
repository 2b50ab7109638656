//! The MyApp plugin as it was before the fix that docs/debugging.md walks through: a MyApp
//! that names a ConfigMap the plugin is not given runs without it, and says so only in a
//! Warning Event, while its status looks healthy. It is MyApp's reconciler with the
//! `ConfigMapFound` condition taken out of the status it answers, so the walk-through's
//! "before" and "after" differ in exactly that.
//!
//! It compiles MyApp's own source files rather than depending on the `myapp-plugin` crate: a
//! dependency's component would be built too, exporting a second reconciler.

#[path = "../../../../../plugins/myapp/src/reconcile.rs"]
mod reconcile;
#[path = "../../../../../plugins/myapp/src/types.rs"]
mod types;

use reconcile::MyAppReconciler;
use serde_json::Value;
use types::{MyApp, MyAppConfig};
use wasmctrl_plugin_sdk::{Error, Reconciler, Request, Response};

/// The condition the fix added.
const ADDED_BY_THE_FIX: &str = "ConfigMapFound";

struct MyAppBefore;

impl Reconciler for MyAppBefore {
    type Parent = MyApp;
    type Config = MyAppConfig;

    fn reconcile(request: &Request<MyApp, MyAppConfig>) -> Result<Response, Error> {
        let after = MyAppReconciler::reconcile(request)?;
        let mut before = Response::new();
        for child in after.children_json() {
            let child: Value = serde_json::from_str(child)
                .map_err(|e| Error::permanent(format!("MyApp produced invalid JSON: {e}")))?;
            before.add_child(&child)?;
        }
        if let Some(status) = after.status_json() {
            let mut status: Value = serde_json::from_str(status)
                .map_err(|e| Error::permanent(format!("MyApp produced an invalid status: {e}")))?;
            if let Some(conditions) = status.get_mut("conditions").and_then(Value::as_array_mut) {
                conditions.retain(|c| c["type"] != ADDED_BY_THE_FIX);
            }
            before.set_status(&status)?;
        }
        for event in after.events() {
            before.add_event(event.kind, event.reason.clone(), event.message.clone());
        }
        if let Some(delay) = after.requeue_after() {
            before.set_requeue_after(delay);
        }
        if after.is_finalized() {
            before.set_finalized();
        }
        Ok(before)
    }
}

wasmctrl_plugin_sdk::export_reconciler!(MyAppBefore);
