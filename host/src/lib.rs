//! wasmctrl: a Kubernetes operator host whose reconcile logic runs in sandboxed,
//! hot-swappable WebAssembly plugins.
//!
//! Data flows one way: policy → plugin registry → controller → cluster. This crate currently
//! holds the policy API ([`policy`]), the plugin runtime ([`plugin`]) and the command line
//! ([`cli`]).

pub mod cli;
pub mod plugin;
pub mod policy;
