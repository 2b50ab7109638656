//! wasmctrl's plugin runtime: sandboxed reconcile plugins — loading, limits, and calls.
//!
//! This crate knows nothing of Kubernetes (it has no kube dependency), so the host's
//! controller can only reach a plugin through the plain data below. The host re-exports it
//! as `wasmctrl::plugin`.
//!
//! The nouns, in the order a plugin meets them:
//! - [`PluginEngine`]: one per process; compiles, caches and pre-instantiates components and
//!   owns the instance pool and the deadline clock.
//! - [`Plugin`]: one loaded, verified, pre-instantiated component with its [`Limits`]. Cheap
//!   to clone and share; every call runs in a fresh sandbox, so calls are independent.
//! - [`ReconcileRequest`] → [`ReconcileResponse`]: plain data. The controller never sees a
//!   wasmtime type, and this crate never sees a Kubernetes client.
//! - [`LoadError`] and [`CallError`]: what can go wrong obtaining a plugin, and what can go
//!   wrong in one call. A failed call has one [`Retry`] class: whether the same call may
//!   succeed later, or only after the parent or the plugin changes.
//!
//! This file is only these docs and the re-exports; each item lives in the module that is
//! about it, and the modules import one another directly, never through here, so they form
//! no circle:
//! - `plugin`: [`Plugin`] and its call path (call slot, call thread, fresh sandbox,
//!   deadline), turning what went wrong into a [`CallError`];
//! - `engine`: [`PluginEngine`], loading and inspecting components; `compiler` and
//!   `artifact_cache` compile them and keep the precompiled artifacts;
//! - `call`: the request and response, and the validation of every answer;
//! - `webhook`: the same for the webhooks a plugin may serve (validate, default, convert);
//! - `error`: [`LoadError`], [`CallError`] with its [`Retry`] class, [`ReportedKind`];
//! - `contract` (the WIT bindings), `sandbox` (one call's store), `call_slots`,
//!   `call_threads` and `idle_lane` (where calls run), `limits`, `digest`, `diff`.

mod artifact_cache;
mod call;
mod call_slots;
mod call_threads;
mod compiler;
mod contract;
mod diff;
mod digest;
mod engine;
mod error;
mod idle_lane;
mod limits;
mod plugin;
mod sandbox;
mod webhook;

pub use call::{
    EventType, JsonObject, ObservedObject, PluginEvent, ReconcileRequest, ReconcileResponse,
};
pub use compiler::{COMPILE_CHILD_ARG, ChildCompiler, Compiler, compile_child_if_asked};
pub use contract::{CONTRACT_VERSION, CONTRACT_VERSIONS};
pub use diff::{Hide, Verdict, compare, compare_hiding};
pub use digest::{Digest, InvalidDigest};
pub use engine::{CallMemory, EngineOptions, Inspection, PluginEngine, PoolUsage};
pub use error::{CallError, LoadError, ReportedKind, Retry};
pub use limits::Limits;
pub use plugin::{Plugin, PluginInfo, WeakPlugin};
pub use webhook::{
    AdmissionRequest, AdmissionVerdict, Defaulted, MAX_WARNING_BYTES, MAX_WARNINGS, Operation,
    ServedWebhooks, UserInfo, Violation, bounded_warnings, one_line,
};
