//! Why does my object look like this? The host's answer, exactly: every reconcile leaves a
//! [`Record`] of what the plugin was asked, what it decided, what was written and how long
//! each step took, and every webhook answer a [`WebhookRecord`] of what the plugin said. The records live in memory ([`ExplainStore`], bounded), are served at
//! `/explain` on the host's listener for `wasmctrl explain`, and can be written to a
//! directory as case files ([`Recorder`]) for `wasmctrl plugin replay`.
//!
//! Keeping records costs no API request. Secret values among the objects a plugin saw are
//! redacted before a record is kept, unless the host is told otherwise.

mod record;
mod recorder;
mod store;

pub use record::{
    ChildAction, ChildRecord, ErrorRecord, EventRecord, Explained, ParentRef, Record, RecordResult,
    StatusRecord, StepTime, WebhookRecord, timestamp,
};
pub use recorder::{RecordOptions, Recorder};
pub use store::{Bounds, ExplainStore, Lookup, ParentResource};

/// What the host keeps of its reconciles.
#[derive(Debug, Clone)]
pub struct ExplainOptions {
    /// How much the in-memory store holds.
    pub bounds: Bounds,
    /// Where to record cases, if anywhere.
    pub record: Option<RecordOptions>,
    /// Keep Secret values in records and cases (off: they are redacted).
    pub secret_data: bool,
}

impl Default for ExplainOptions {
    fn default() -> Self {
        Self {
            bounds: Bounds {
                max_bytes: 16 << 20,
                per_parent: 10,
            },
            record: None,
            secret_data: false,
        }
    }
}

/// The host's records of its reconciles: the store, the optional recorder, and whether
/// Secret values are kept.
#[derive(Debug)]
pub struct Explain {
    /// Recent records by parent.
    pub store: ExplainStore,
    /// Where sampled cases are written.
    pub recorder: Option<Recorder>,
    /// Keep Secret values.
    pub secret_data: bool,
}

impl Explain {
    /// Keep records as `options` say; fails only when the record directory cannot be made.
    pub fn new(options: &ExplainOptions) -> anyhow::Result<Self> {
        Ok(Self {
            store: ExplainStore::new(options.bounds),
            recorder: options.record.as_ref().map(Recorder::start).transpose()?,
            secret_data: options.secret_data,
        })
    }

    /// Records kept in memory only, within `bounds`, Secret values redacted.
    pub fn in_memory(bounds: Bounds) -> Self {
        Self {
            store: ExplainStore::new(bounds),
            recorder: None,
            secret_data: false,
        }
    }

    /// Whether a reconcile should build a record at all.
    pub fn wanted(&self) -> bool {
        self.store.bounds().max_bytes > 0 || self.recorder.is_some()
    }
}
