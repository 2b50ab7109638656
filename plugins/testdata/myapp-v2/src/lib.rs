//! Version 2 of the MyApp plugin, for hot-swap tests: MyApp's reconciler, unchanged, plus the
//! label `example.com/plugin-version: v2` on every child.
//!
//! It compiles MyApp's own source files rather than depending on the `myapp-plugin` crate: a
//! dependency's component would be built too, exporting a second reconciler.

#[path = "../../../myapp/src/reconcile.rs"]
mod reconcile;
#[path = "../../../myapp/src/types.rs"]
mod types;

use reconcile::MyAppReconciler;
use serde_json::Value;
use types::{MyApp, MyAppConfig};
use wasmctrl_plugin_sdk::{Error, Reconciler, Request, Response};

/// The label v2 adds.
pub const VERSION_LABEL: &str = "example.com/plugin-version";

struct MyAppV2;

impl Reconciler for MyAppV2 {
    type Parent = MyApp;
    type Config = MyAppConfig;

    fn reconcile(request: &Request<MyApp, MyAppConfig>) -> Result<Response, Error> {
        let v1 = MyAppReconciler::reconcile(request)?;
        let mut v2 = Response::new();
        for child in v1.children_json() {
            let mut child: Value = serde_json::from_str(child)
                .map_err(|e| Error::permanent(format!("MyApp produced invalid JSON: {e}")))?;
            if let Some(metadata) = child.get_mut("metadata").and_then(Value::as_object_mut) {
                let labels = metadata
                    .entry("labels")
                    .or_insert_with(|| Value::Object(Default::default()));
                if let Some(labels) = labels.as_object_mut() {
                    labels.insert(VERSION_LABEL.into(), "v2".into());
                }
            }
            v2.add_child(&child)?;
        }
        if let Some(status) = v1.status_json() {
            let status: Value = serde_json::from_str(status)
                .map_err(|e| Error::permanent(format!("MyApp produced an invalid status: {e}")))?;
            v2.set_status(&status)?;
        }
        for event in v1.events() {
            v2.add_event(event.kind, event.reason.clone(), event.message.clone());
        }
        if let Some(delay) = v1.requeue_after() {
            v2.set_requeue_after(delay);
        }
        if v1.is_finalized() {
            v2.set_finalized();
        }
        Ok(v2)
    }
}

wasmctrl_plugin_sdk::export_reconciler!(MyAppV2);
