//! The host's memory of recent reconciles, bounded in total size and per parent.
//!
//! Records are kept as their JSON text: the size the bound counts is the size they take.
//! Only a parent's newest record keeps its case (the request and answer, most of a record's
//! size): that is the one `explain --save` writes, and older ones are history.
//!
//! When a new record does not fit, the cases kept as text are deflated first, oldest first
//! (so a reconcile pays for compression only under memory pressure, and only for a case that
//! outlived its parent's next reconcile); then history goes, oldest first; a parent's newest
//! record goes only when no history is left. So every parent keeps its last reconcile for as long
//! as the bound allows, however often other parents are reconciled.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use super::record::ParentRef;
use crate::lock;

/// What a parent is known by in the store: its kind, namespace and name (not its uid, so a
/// re-created parent continues its predecessor's history).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParentKey {
    /// `apiVersion`.
    pub api_version: String,
    /// `kind`.
    pub kind: String,
    /// The resource's plural.
    pub plural: String,
    /// `metadata.namespace`.
    pub namespace: Option<String>,
    /// `metadata.name`.
    pub name: String,
}

impl ParentKey {
    /// Whether `kind` names this parent's kind the way `kubectl` accepts it: the kind or its
    /// plural, any case, optionally qualified by the API group (`myapps.example.com`).
    pub fn is_kind(&self, kind: &str) -> bool {
        let kind = kind.to_ascii_lowercase();
        let group = self.api_version.rsplit_once('/').map_or("", |(g, _)| g);
        [&self.kind, &self.plural].iter().any(|name| {
            let name = name.to_ascii_lowercase();
            kind == name || (!group.is_empty() && kind == format!("{name}.{group}"))
        })
    }
}

impl From<&ParentRef> for ParentKey {
    fn from(parent: &ParentRef) -> Self {
        Self {
            api_version: parent.api_version.clone(),
            kind: parent.kind.clone(),
            plural: parent.plural.clone(),
            namespace: parent.namespace.clone(),
            name: parent.name.clone(),
        }
    }
}

/// How much the store may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Total size of the records, in bytes; 0 keeps none.
    pub max_bytes: usize,
    /// Records kept per parent.
    pub per_parent: usize,
}

/// Bookkeeping per record beyond its text: the entries in two queues and the map.
const OVERHEAD_BYTES: usize = 96;

/// Recent reconcile records by parent.
pub struct ExplainStore {
    bounds: Bounds,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Each parent's records, oldest first.
    parents: HashMap<Arc<ParentKey>, VecDeque<Entry>>,
    /// Records that are no longer their parent's newest, in the order they became history:
    /// the first to evict. An entry whose record is gone already is skipped.
    history: VecDeque<(Arc<ParentKey>, u64)>,
    /// Records in the order they came (each came as its parent's newest): evicted only when
    /// no history is left. An entry whose record is no longer the newest is skipped.
    newest: VecDeque<(Arc<ParentKey>, u64)>,
    /// Records holding their case as text, oldest first: deflated before anything is
    /// evicted. An entry whose case is gone or deflated is skipped.
    raw_cases: VecDeque<(Arc<ParentKey>, u64)>,
    bytes: usize,
    /// Records held, over all parents.
    records: usize,
    next: u64,
}

struct Entry {
    seq: u64,
    /// The record without its case.
    json: Arc<str>,
    /// The case, while this is the parent's newest record.
    case: Option<CaseText>,
    /// The reconcile changed something (or failed): kept over quiet ones.
    eventful: bool,
}

impl Entry {
    fn cost(&self) -> usize {
        self.json.len() + self.case.as_ref().map_or(0, CaseText::len) + OVERHEAD_BYTES
    }

    /// The whole record: the case goes back in as its last field.
    fn record(&self) -> String {
        match (
            self.case.as_ref().and_then(CaseText::text),
            self.json.strip_suffix('}'),
        ) {
            (Some(case), Some(open)) => {
                let comma = if open.ends_with('{') { "" } else { "," };
                format!("{open}{comma}\"case\":{case}}}")
            }
            _ => self.json.to_string(),
        }
    }
}

/// A case as JSON text, or deflated once memory ran short.
enum CaseText {
    Raw(Box<str>),
    Deflated(Box<[u8]>),
}

impl CaseText {
    fn len(&self) -> usize {
        match self {
            Self::Raw(text) => text.len(),
            Self::Deflated(bytes) => bytes.len(),
        }
    }

    fn text(&self) -> Option<String> {
        match self {
            Self::Raw(text) => Some(text.to_string()),
            Self::Deflated(bytes) => inflate(bytes),
        }
    }
}

/// `text` deflated (fast level: cases are objects' JSON, which shrinks several times).
fn deflate(text: &str) -> Box<[u8]> {
    use std::io::Write as _;
    let mut encoder = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
    // Writing to a Vec cannot fail.
    let _ = encoder.write_all(text.as_bytes());
    encoder.finish().unwrap_or_default().into_boxed_slice()
}

fn inflate(bytes: &[u8]) -> Option<String> {
    use std::io::Read as _;
    let mut text = String::new();
    flate2::read::DeflateDecoder::new(bytes)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

/// What a look-up found.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The parent's records as JSON, newest first.
    Found(Vec<String>),
    /// No record of such a parent.
    NotFound,
    /// The kind names more than one kind of parent with that name; these.
    Ambiguous(Vec<String>),
}

impl std::fmt::Debug for ExplainStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExplainStore")
            .field("bounds", &self.bounds)
            .field("bytes", &self.bytes())
            .finish_non_exhaustive()
    }
}

impl ExplainStore {
    /// An empty store with `bounds`.
    pub fn new(bounds: Bounds) -> Self {
        Self {
            bounds,
            inner: Mutex::default(),
        }
    }

    /// The bounds the store keeps to.
    pub fn bounds(&self) -> Bounds {
        self.bounds
    }

    /// Keep `json`, the record of a reconcile of `parent` (a JSON object without its
    /// `case`), and `case`, dropping the oldest records as the bounds require. The parent's
    /// previous record loses its case. A record larger than the whole store is not kept.
    ///
    /// Past the per-parent bound, the oldest *quiet* record goes first (one that changed no
    /// child and did not fail: a resync, an echo of the reconcile's own writes), so the
    /// reconciles that did something stay to be explained.
    pub fn push(&self, parent: &ParentRef, json: String, case: Option<String>, eventful: bool) {
        let case = case.map(|text| CaseText::Raw(text.into()));
        let entry_cost = json.len() + case.as_ref().map_or(0, CaseText::len) + OVERHEAD_BYTES;
        if self.bounds.per_parent == 0 || entry_cost > self.bounds.max_bytes {
            return;
        }
        let key = ParentKey::from(parent);
        let mut inner = lock(&self.inner);
        let inner = &mut *inner;
        let seq = inner.next;
        inner.next += 1;
        // One shared key per parent, however many records and queue entries name it.
        let key = match inner.parents.get_key_value(&key) {
            Some((shared, _)) => shared.clone(),
            None => Arc::new(key),
        };
        let records = inner.parents.entry(key.clone()).or_default();
        if let Some(previous) = records.back_mut() {
            if let Some(case) = previous.case.take() {
                inner.bytes -= case.len();
            }
            inner.history.push_back((key.clone(), previous.seq));
        }
        if case.is_some() {
            inner.raw_cases.push_back((key.clone(), seq));
        }
        records.push_back(Entry {
            seq,
            json: json.into(),
            case,
            eventful,
        });
        inner.bytes += entry_cost;
        inner.records += 1;
        while records.len() > self.bounds.per_parent {
            let quiet = records
                .iter()
                .take(records.len() - 1)
                .position(|e| !e.eventful)
                .unwrap_or(0);
            if let Some(dropped) = records.remove(quiet) {
                inner.bytes -= dropped.cost();
                inner.records -= 1;
            }
        }
        inner.newest.push_back((key, seq));
        while inner.bytes > self.bounds.max_bytes {
            if let Some((key, seq)) = inner.raw_cases.pop_front() {
                inner.deflate_case(&key, seq);
            } else if let Some((key, seq)) = inner.history.pop_front() {
                inner.evict(&key, seq);
            } else if let Some((key, seq)) = inner.newest.pop_front() {
                inner.evict(&key, seq);
            } else {
                break;
            }
        }
        inner.compact();
    }

    /// The records of the parent `name` in `namespace` whose kind `kind` names (kind or
    /// plural, any case, optionally `.group`), newest first, at most `history`.
    pub fn lookup(
        &self,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        history: usize,
    ) -> Lookup {
        let inner = lock(&self.inner);
        let matches: Vec<_> = inner
            .parents
            .iter()
            .filter(|(key, _)| {
                key.name == name && key.namespace.as_deref() == namespace && key.is_kind(kind)
            })
            .collect();
        match matches.as_slice() {
            [] => Lookup::NotFound,
            [(_, records)] => Lookup::Found(
                records
                    .iter()
                    .rev()
                    .take(history.max(1))
                    .map(Entry::record)
                    .collect(),
            ),
            several => Lookup::Ambiguous(
                several
                    .iter()
                    .map(|(key, _)| format!("{}.{}", key.plural, key.api_version))
                    .collect(),
            ),
        }
    }

    /// The total size of the records held, in bytes (what the bound counts).
    pub fn bytes(&self) -> usize {
        lock(&self.inner).bytes
    }

    /// How many records are held.
    pub fn len(&self) -> usize {
        lock(&self.inner).records
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Inner {
    /// Drop record `seq` of `key` if the parent still holds it.
    fn evict(&mut self, key: &Arc<ParentKey>, seq: u64) {
        let Some(records) = self.parents.get_mut(key) else {
            return;
        };
        if let Some(position) = records.iter().position(|e| e.seq == seq)
            && let Some(dropped) = records.remove(position)
        {
            self.bytes -= dropped.cost();
            self.records -= 1;
        }
        if records.is_empty() {
            self.parents.remove(key);
        }
    }

    /// Deflate the case of record `seq` of `key`, if it still holds one as text.
    fn deflate_case(&mut self, key: &Arc<ParentKey>, seq: u64) {
        let Some(entry) = self
            .parents
            .get_mut(key)
            .and_then(|records| records.iter_mut().find(|e| e.seq == seq))
        else {
            return;
        };
        if let Some(CaseText::Raw(text)) = &entry.case {
            let deflated = deflate(text);
            self.bytes = self.bytes - text.len() + deflated.len();
            entry.case = Some(CaseText::Deflated(deflated));
        }
    }

    /// Queue entries of records already gone (history a parent's own bound dropped) or no
    /// longer newest pile up for parents reconciled over and over; drop them once they
    /// outnumber the records.
    fn compact(&mut self) {
        let parents = &self.parents;
        if self.history.len() > 2 * self.records + 1024 {
            self.history.retain(|(key, seq)| {
                parents
                    .get(key)
                    .is_some_and(|records| records.iter().any(|e| e.seq == *seq))
            });
        }
        if self.raw_cases.len() > 2 * parents.len() + 1024 {
            self.raw_cases.retain(|(key, seq)| {
                parents
                    .get(key)
                    .and_then(VecDeque::back)
                    .is_some_and(|e| e.seq == *seq && matches!(e.case, Some(CaseText::Raw(_))))
            });
        }
        if self.newest.len() > 2 * parents.len() + 1024 {
            self.newest.retain(|(key, seq)| {
                parents
                    .get(key)
                    .and_then(VecDeque::back)
                    .is_some_and(|e| e.seq == *seq)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parent(name: &str) -> ParentRef {
        ParentRef {
            api_version: "example.com/v1".into(),
            kind: "MyApp".into(),
            plural: "myapps".into(),
            namespace: Some("ns".into()),
            name: name.into(),
            uid: format!("uid-{name}"),
            generation: Some(1),
            resource_version: None,
        }
    }

    fn found(lookup: Lookup) -> Vec<String> {
        match lookup {
            Lookup::Found(records) => records.iter().map(ToString::to_string).collect(),
            other => panic!("expected records, got {other:?}"),
        }
    }

    #[test]
    fn keeps_the_newest_records_per_parent_newest_first() {
        let store = ExplainStore::new(Bounds {
            max_bytes: 1 << 20,
            per_parent: 2,
        });
        for n in 1..=3 {
            store.push(
                &parent("a"),
                format!(r#"{{"n":"a{n}"}}"#),
                Some(r#"{"c":1}"#.into()),
                false,
            );
        }
        store.push(&parent("b"), "{}".into(), Some("{}".into()), false);
        assert_eq!(
            found(store.lookup("MyApp", Some("ns"), "a", 10)),
            [r#"{"n":"a3","case":{"c":1}}"#, r#"{"n":"a2"}"#],
            "only the newest record keeps its case"
        );
        assert_eq!(
            found(store.lookup("myapp", Some("ns"), "a", 1)),
            [r#"{"n":"a3","case":{"c":1}}"#]
        );
        assert_eq!(
            found(store.lookup("myapps.example.com", Some("ns"), "b", 5)),
            [r#"{"case":{}}"#]
        );
        assert_eq!(
            store.lookup("myapps", Some("other"), "a", 1),
            Lookup::NotFound
        );
        assert_eq!(store.lookup("widget", Some("ns"), "a", 1), Lookup::NotFound);
        assert_eq!(store.len(), 3);
        assert_eq!(store.bytes(), 10 + (10 + 7) + (2 + 2) + 3 * OVERHEAD_BYTES);
    }

    #[test]
    fn quiet_records_make_room_before_eventful_ones() {
        let store = ExplainStore::new(Bounds {
            max_bytes: 1 << 20,
            per_parent: 3,
        });
        store.push(&parent("a"), "1".into(), None, true);
        for n in 2..=6 {
            store.push(&parent("a"), format!("{n}"), None, false);
        }
        assert_eq!(
            found(store.lookup("MyApp", Some("ns"), "a", 5)),
            ["6", "5", "1"]
        );
        for n in 7..=9 {
            store.push(&parent("a"), format!("{n}"), None, true);
        }
        assert_eq!(
            found(store.lookup("MyApp", Some("ns"), "a", 5)),
            ["9", "8", "7"]
        );
    }

    #[test]
    fn a_quiet_parent_keeps_its_last_record_while_a_busy_one_loses_history() {
        let record = "x".repeat(904);
        let store = ExplainStore::new(Bounds {
            max_bytes: 4 * (904 + OVERHEAD_BYTES),
            per_parent: 5,
        });
        store.push(&parent("quiet"), record.clone(), None, false);
        for _ in 0..10 {
            store.push(&parent("busy"), record.clone(), None, false);
        }
        assert!(
            matches!(store.lookup("MyApp", Some("ns"), "quiet", 5), Lookup::Found(r) if r.len() == 1)
        );
        assert!(
            matches!(store.lookup("MyApp", Some("ns"), "busy", 5), Lookup::Found(r) if r.len() == 3)
        );
        assert!(store.bytes() <= store.bounds().max_bytes);
    }

    #[test]
    fn cases_are_deflated_before_anything_is_evicted_and_served_whole() {
        let case = format!(
            r#"{{"parent":{{"metadata":{{"name":"{}"}}}}}}"#,
            "n".repeat(4000)
        );
        let store = ExplainStore::new(Bounds {
            max_bytes: 4200,
            per_parent: 5,
        });
        store.push(&parent("a"), r#"{"n":1}"#.into(), Some(case.clone()), false);
        assert!(store.bytes() > 4000, "kept as text while memory lasts");
        store.push(&parent("b"), r#"{"n":2}"#.into(), Some("{}".into()), false);
        assert!(store.bytes() < 1000, "a's case deflated: {}", store.bytes());
        assert_eq!(store.len(), 2, "nothing evicted");
        assert_eq!(
            found(store.lookup("MyApp", Some("ns"), "a", 1)),
            [format!(r#"{{"n":1,"case":{case}}}"#)]
        );
    }

    #[test]
    fn the_total_never_exceeds_the_bound_and_the_oldest_records_go_first() {
        let record = "x".repeat(999);
        let bounds = Bounds {
            max_bytes: 50 * (1000 + OVERHEAD_BYTES),
            per_parent: 3,
        };
        let store = ExplainStore::new(bounds);
        for round in 0..3 {
            for n in 0..5000 {
                store.push(
                    &parent(&format!("p{n}")),
                    format!("{round}{record}"),
                    None,
                    false,
                );
                assert!(store.bytes() <= bounds.max_bytes);
            }
        }
        assert_eq!(store.len(), 50);
        // The last 50 parents of the last round are what is left.
        assert!(
            matches!(store.lookup("MyApp", Some("ns"), "p4999", 3), Lookup::Found(r) if r.len() == 1)
        );
        assert_eq!(store.lookup("MyApp", Some("ns"), "p0", 3), Lookup::NotFound);
    }

    #[test]
    fn one_busy_parent_does_not_grow_the_eviction_queue_without_bound() {
        let store = ExplainStore::new(Bounds {
            max_bytes: 1 << 20,
            per_parent: 2,
        });
        for n in 0..100_000 {
            store.push(&parent("busy"), format!("{n}"), None, false);
        }
        let (history, newest) = {
            let inner = lock(&store.inner);
            (inner.history.len(), inner.newest.len())
        };
        assert!(
            history <= 2 * 2 + 1024 + 1,
            "{history} history entries for 2 records"
        );
        assert!(
            newest <= 2 + 1024 + 1,
            "{newest} newest entries for 1 parent"
        );
        assert_eq!(
            found(store.lookup("MyApp", Some("ns"), "busy", 5)),
            ["99999", "99998"]
        );
    }

    #[test]
    fn a_zero_bound_keeps_nothing_and_the_same_name_of_two_kinds_is_ambiguous() {
        let none = ExplainStore::new(Bounds {
            max_bytes: 0,
            per_parent: 10,
        });
        none.push(&parent("a"), "a".into(), None, false);
        assert!(none.is_empty());

        let store = ExplainStore::new(Bounds {
            max_bytes: 1 << 20,
            per_parent: 10,
        });
        store.push(&parent("a"), "a".into(), None, false);
        let mut other = parent("a");
        other.api_version = "other.com/v1".into();
        store.push(&other, "b".into(), None, false);
        assert!(
            matches!(store.lookup("myapp", Some("ns"), "a", 1), Lookup::Ambiguous(k) if k.len() == 2)
        );
        assert_eq!(
            found(store.lookup("myapp.other.com", Some("ns"), "a", 1)),
            ["b"]
        );
    }
}
