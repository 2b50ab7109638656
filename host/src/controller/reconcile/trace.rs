//! The record of one reconcile, built as it runs: each step's time, what happened to each
//! child, the status, the Events and the plugin call. At the end it becomes an
//! [`explain::Record`](crate::explain::Record) in the host's store, and a case file when the
//! recorder samples it. A host that keeps no records builds none of this.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::core::DynamicObject;
use kube::runtime::events::EventType;
use serde_json::Value;

use crate::case::{
    Case, Recorded, RecordedError, Redaction, RunOutput, recorded_text, with_recorded,
};
use crate::controller::reconcile::context::PolicyContext;
use crate::controller::reconcile::error::ReconcileError;
use crate::explain::{
    ChildAction, ChildRecord, ErrorRecord, EventRecord, ParentRef, Record, RecordResult,
    StatusRecord, StepTime, timestamp,
};
use crate::plugin::{CallError, Digest, ReconcileRequest, ReconcileResponse};

/// A reconcile's record, filled in step by step.
pub(crate) struct Trace {
    enabled: bool,
    at: jiff::Timestamp,
    started: Instant,
    lap: Instant,
    steps: Vec<StepTime>,
    children: Vec<ChildRecord>,
    status: Option<StatusRecord>,
    events: Vec<EventRecord>,
    asked: Option<Asked>,
    recorded: Option<RecordedAnswer>,
    plugin: Option<Digest>,
    shadow: Option<String>,
    /// What the record must not show.
    redaction: Arc<Redaction>,
}

impl Trace {
    /// A trace that records only if `enabled`, with what `redaction` names redacted.
    pub fn new(enabled: bool, redaction: Arc<Redaction>) -> Self {
        let now = Instant::now();
        Self {
            enabled,
            redaction,
            at: jiff::Timestamp::now(),
            started: now,
            lap: now,
            steps: Vec::new(),
            children: Vec::new(),
            status: None,
            events: Vec::new(),
            asked: None,
            recorded: None,
            plugin: None,
            shadow: None,
        }
    }

    /// `step` ended now: it took the time since the previous one ended.
    pub fn step(&mut self, step: &'static str) {
        let now = Instant::now();
        if self.enabled {
            self.steps.push(StepTime {
                step: step.to_owned(),
                ms: millis(now - self.lap),
            });
        }
        self.lap = now;
    }

    /// The plugin `plugin` is asked `request` about a parent of `parent_type` (apiVersion,
    /// kind).
    pub fn asked(&mut self, request: &ReconcileRequest, plugin: Digest, parent_type: (&str, &str)) {
        if !self.enabled {
            return;
        }
        let redaction = &self.redaction;
        let untouched = !redaction.changes(parent_type.0, parent_type.1)
            && request
                .children
                .iter()
                .chain(&request.related)
                .all(|o| !redaction.changes(&o.api_version, &o.kind));
        self.asked = Some(if untouched {
            Asked::Verbatim(request.clone())
        } else {
            Asked::Redacted(Box::new(Case::of(request, redaction)))
        });
        self.plugin = Some(plugin);
    }

    /// The plugin answered.
    pub fn answered(&mut self, answer: &Result<ReconcileResponse, CallError>, policy: &str) {
        let (Some(_), Some(plugin)) = (&self.asked, self.plugin) else {
            return;
        };
        let redaction = &self.redaction;
        let at = timestamp(self.at);
        let untouched = answer.as_ref().is_ok_and(|response| {
            (response.status.is_none() || !redaction.changes_status())
                && response.children.iter().all(|child| {
                    let field = |name: &str| child.get(name).and_then(Value::as_str);
                    !redaction.changes(
                        field("apiVersion").unwrap_or_default(),
                        field("kind").unwrap_or_default(),
                    )
                })
        });
        if untouched || answer.is_err() {
            self.recorded = match recorded_text(&at, policy, &plugin.to_string(), answer) {
                Ok(text) => Some(RecordedAnswer::Text(text)),
                Err(error) => {
                    tracing::warn!(%error, "could not keep the plugin's answer for the record");
                    None
                }
            };
            return;
        }
        let (response, error) = match answer {
            Ok(response) => {
                let mut output = RunOutput::from(response.clone());
                for child in &mut output.children {
                    let mut value = Value::Object(std::mem::take(child));
                    redaction.object(&mut value);
                    if let Value::Object(object) = value {
                        *child = object;
                    }
                }
                if let Some(status) = &mut output.status {
                    let mut value = Value::Object(std::mem::take(status));
                    redaction.status(&mut value);
                    if let Value::Object(object) = value {
                        *status = object;
                    }
                }
                (Some(output), None)
            }
            Err(error) => (None, Some(RecordedError::of(error))),
        };
        self.recorded = Some(RecordedAnswer::Redacted(Recorded {
            at,
            policy: policy.to_owned(),
            plugin: plugin.to_string(),
            response,
            error,
        }));
    }

    /// The candidate's shadow verdict, in words.
    /// The detail quotes the values that differ, which may be a Secret's or a field the
    /// policy marks; it is kept only when nothing is to be redacted.
    pub fn shadowed(&mut self, verdict: &crate::plugin::Verdict) {
        if self.enabled {
            self.shadow = Some(match verdict.detail() {
                "" => verdict.name().to_owned(),
                _ if self.redaction.hides_anything() => format!(
                    "{} (the difference may quote redacted values; the policy's status shows it)",
                    verdict.name()
                ),
                detail => format!("{}: {detail}", verdict.name()),
            });
        }
    }

    /// What happened to the child `kind` `name`.
    pub fn child(&mut self, kind: &str, name: &str, action: ChildAction, changed: Vec<String>) {
        if self.enabled {
            self.children.push(ChildRecord {
                kind: kind.to_owned(),
                name: name.to_owned(),
                action,
                changed,
                waiting_for: None,
            });
        }
    }

    /// A child held back: it waits for `waiting_for`.
    pub fn waiting(&mut self, kind: &str, name: &str, waiting_for: String) {
        if self.enabled {
            self.children.push(ChildRecord {
                kind: kind.to_owned(),
                name: name.to_owned(),
                action: ChildAction::Waiting,
                changed: Vec::new(),
                waiting_for: Some(waiting_for),
            });
        }
    }

    /// The status as desired, and whether it was written.
    pub fn status(&mut self, status: &Value, written: bool) {
        if self.enabled {
            let mut status = status.clone();
            self.redaction.status(&mut status);
            self.status = Some(StatusRecord { written, status });
        }
    }

    /// An Event the reconcile asked for.
    pub fn event(&mut self, type_: EventType, reason: &str, message: &str) {
        if self.enabled {
            self.events.push(EventRecord {
                type_: format!("{type_:?}"),
                reason: reason.to_owned(),
                message: message.to_owned(),
            });
        }
    }

    /// Keep the record of this reconcile of `parent`, which ended with `result`.
    pub fn finish(
        self,
        parent: &DynamicObject,
        ctx: &PolicyContext,
        result: RecordResult,
        error: Option<&ReconcileError>,
    ) {
        if !self.enabled {
            return;
        }
        let mut steps = self.steps;
        if error.is_some() {
            // The step that failed ran from the last one's end until now.
            steps.push(StepTime {
                step: "failed".to_owned(),
                ms: millis(self.lap.elapsed()),
            });
        }
        let explain = &ctx.explain;
        let parent = ParentRef {
            api_version: ctx.parent.api_version.clone(),
            kind: ctx.parent.kind.clone(),
            plural: ctx.parent.plural.clone(),
            namespace: parent.metadata.namespace.clone(),
            name: parent.metadata.name.clone().unwrap_or_default(),
            uid: parent.metadata.uid.clone().unwrap_or_default(),
            generation: parent.metadata.generation,
            resource_version: parent.metadata.resource_version.clone(),
        };
        if let (Some(recorder), Some(asked)) = (&explain.recorder, &self.asked)
            && recorder.sample()
        {
            let case = Case {
                recorded: self.recorded.as_ref().and_then(RecordedAnswer::parsed),
                ..asked.case(&self.redaction)
            };
            recorder.record(&ctx.policy, parent.namespace.as_deref(), &parent.name, case);
        }
        let record = Record {
            at: timestamp(self.at),
            policy: ctx.policy.clone(),
            plugin: self.plugin.map(|d| d.to_string()),
            result,
            duration_ms: millis(self.started.elapsed()),
            steps,
            children: self.children,
            status: self.status,
            events: self.events,
            error: error.map(|e| ErrorRecord {
                reason: e.reason().to_owned(),
                message: format!("{e:#}"),
            }),
            shadow: self.shadow,
            // Kept beside the record: the store drops it when a newer record comes.
            case: None,
            parent,
        };
        let recorded = self.recorded;
        let case = self.asked.map(|asked| asked.text(recorded)).transpose();
        match (serde_json::to_string(&record), case) {
            (Ok(json), Ok(case)) => {
                let eventful = record.result != RecordResult::Reconciled
                    || record
                        .children
                        .iter()
                        .any(|c| c.action != ChildAction::Unchanged);
                explain.store.push(&record.parent, json, case, eventful);
            }
            (Err(error), _) | (_, Err(error)) => {
                tracing::warn!(%error, "could not keep the reconcile's record");
            }
        }
    }
}

/// What the plugin was asked, as a case keeps it.
enum Asked {
    /// Nothing in the request is to be redacted: kept as the texts the plugin was sent, and
    /// written out as they are.
    Verbatim(ReconcileRequest),
    /// Parsed, with what is to be redacted redacted.
    Redacted(Box<Case>),
}

impl Asked {
    fn case(&self, redaction: &Redaction) -> Case {
        match self {
            Self::Verbatim(request) => Case::of(request, redaction),
            Self::Redacted(case) => Case::clone(case),
        }
    }

    fn text(self, recorded: Option<RecordedAnswer>) -> Result<String, serde_json::Error> {
        let recorded = recorded.map(RecordedAnswer::text).transpose()?;
        match self {
            Self::Verbatim(request) => Case::text_of(&request, recorded.as_deref()),
            Self::Redacted(case) => Ok(with_recorded(
                serde_json::to_string(&Case {
                    recorded: None,
                    ..*case
                })?,
                recorded.as_deref(),
            )),
        }
    }
}

/// The plugin's answer, as a case keeps it.
enum RecordedAnswer {
    /// Nothing in it is to be redacted: written out as it came (see [`recorded_text`]).
    Text(String),
    /// Parsed, with what is to be redacted redacted.
    Redacted(Recorded),
}

impl RecordedAnswer {
    /// As a case file holds it (read back from the text: only sampled reconciles are
    /// recorded to files).
    fn parsed(&self) -> Option<Recorded> {
        match self {
            Self::Text(text) => serde_json::from_str(text)
                .inspect_err(|error| {
                    tracing::warn!(%error, "the case file is written without the plugin's answer: it did not read back");
                })
                .ok(),
            Self::Redacted(recorded) => Some(recorded.clone()),
        }
    }

    fn text(self) -> Result<String, serde_json::Error> {
        match self {
            Self::Text(text) => Ok(text),
            Self::Redacted(recorded) => serde_json::to_string(&recorded),
        }
    }
}

fn millis(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 1e6).round() / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_always_carry_three_decimals_so_they_sort_as_text() {
        let whole = jiff::Timestamp::from_second(1_796_076_402).expect("in range");
        let later = whole
            .checked_add(jiff::SignedDuration::from_millis(661))
            .expect("in range");
        assert_eq!(timestamp(whole), "2026-11-30T22:06:42.000Z");
        assert_eq!(timestamp(later), "2026-11-30T22:06:42.661Z");
        assert!(timestamp(whole) < timestamp(later));
    }
}
