//! The host's memory of recent reconciles, bounded in total size and per parent.
//!
//! Records are kept as their JSON text: the size the bound counts is the size they take.
//! Only a parent's newest record keeps its case (the request and answer, most of a record's
//! size): that is the one `explain --save` writes, and older ones are history.
//!
//! When a new record does not fit, the records still held as text are packed first, oldest
//! first (so a reconcile pays for compression only under memory pressure); then history goes,
//! oldest first; a parent's newest record goes only when no history is left. So every parent
//! keeps its last reconcile for as long as the bound allows, however often other parents are
//! reconciled.
//!
//! Packing deflates a record against a dictionary: the first record of its parent kind to be
//! packed. Records of one kind share most of their text (field names, the policy, the plugin
//! digest, the children's specs), so a MyApp reconcile's record and case pack to a few hundred
//! bytes where deflating each alone left ~1.5 KB: the same bound keeps several times the
//! records. The dictionaries (one per parent kind, a record's size each) are not counted in
//! the bound.

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

/// Deflate uses the last 32 KiB of a dictionary; the rest would be held for nothing.
const MAX_DICTIONARY_BYTES: usize = 32 << 10;

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
    /// Records held as text, oldest first: packed before anything is evicted. An entry whose
    /// record is gone or packed is skipped.
    unpacked: VecDeque<(Arc<ParentKey>, u64)>,
    /// What records are packed against, by parent `apiVersion` and kind.
    dictionaries: HashMap<(String, String), Arc<[u8]>>,
    bytes: usize,
    /// Records held, over all parents.
    records: usize,
    next: u64,
}

struct Entry {
    seq: u64,
    /// The record without its case.
    json: Text,
    /// The case, while this is the parent's newest record.
    case: Option<Text>,
    /// The reconcile changed something (or failed): kept over quiet ones.
    eventful: bool,
}

impl Entry {
    fn cost(&self) -> usize {
        self.json.len() + self.case.as_ref().map_or(0, Text::len) + OVERHEAD_BYTES
    }

    fn is_packed(&self) -> bool {
        matches!(self.json, Text::Packed(_))
    }

    /// The whole record: the case goes back in as its last field.
    fn record(&self) -> String {
        let json = self.json.text().unwrap_or_else(|| "{}".to_owned());
        match (
            self.case.as_ref().and_then(Text::text),
            json.strip_suffix('}'),
        ) {
            (Some(case), Some(open)) => {
                let comma = if open.ends_with('{') { "" } else { "," };
                format!("{open}{comma}\"case\":{case}}}")
            }
            _ => json,
        }
    }
}

/// A record's JSON or its case: as text, or packed once memory ran short.
enum Text {
    Raw(Box<str>),
    Packed(Packed),
}

impl Text {
    fn len(&self) -> usize {
        match self {
            Self::Raw(text) => text.len(),
            Self::Packed(packed) => packed.bytes.len(),
        }
    }

    fn text(&self) -> Option<String> {
        match self {
            Self::Raw(text) => Some(text.to_string()),
            Self::Packed(packed) => packed.unpack(),
        }
    }
}

/// Text deflated against a dictionary, which it shares with the other records of its kind.
struct Packed {
    bytes: Box<[u8]>,
    dictionary: Arc<[u8]>,
    /// The text's length, to unpack without guessing.
    len: usize,
}

impl Packed {
    /// `text` deflated (fast level) against `dictionary`.
    fn new(text: &str, dictionary: Arc<[u8]>) -> Self {
        use flate2::{Compress, Compression, FlushCompress, Status};
        let mut compress = Compress::new(Compression::fast(), false);
        // Setting a dictionary on a fresh raw stream cannot fail; if it did, the text would
        // still deflate, only less well, and unpacking would report the record unreadable.
        let _ = compress.set_dictionary(&dictionary);
        let mut bytes = Vec::with_capacity(text.len() / 4 + 64);
        loop {
            let read = usize::try_from(compress.total_in()).unwrap_or(text.len());
            match compress.compress_vec(&text.as_bytes()[read..], &mut bytes, FlushCompress::Finish)
            {
                Ok(Status::StreamEnd) | Err(_) => break,
                Ok(_) => bytes.reserve(bytes.capacity().max(64)),
            }
        }
        Self {
            bytes: bytes.into_boxed_slice(),
            dictionary,
            len: text.len(),
        }
    }

    fn unpack(&self) -> Option<String> {
        use flate2::{Decompress, FlushDecompress, Status};
        let mut decompress = Decompress::new(false);
        decompress.set_dictionary(&self.dictionary).ok()?;
        let mut text = Vec::with_capacity(self.len);
        match decompress.decompress_vec(&self.bytes, &mut text, FlushDecompress::Finish) {
            Ok(Status::StreamEnd) => String::from_utf8(text).ok(),
            _ => None,
        }
    }
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
        let case = case.map(|text| Text::Raw(text.into()));
        let entry_cost = json.len() + case.as_ref().map_or(0, Text::len) + OVERHEAD_BYTES;
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
        inner.unpacked.push_back((key.clone(), seq));
        records.push_back(Entry {
            seq,
            json: Text::Raw(json.into()),
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
            if let Some((key, seq)) = inner.unpacked.pop_front() {
                inner.pack(&key, seq);
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

    /// Pack record `seq` of `key`, if it is still held as text.
    fn pack(&mut self, key: &Arc<ParentKey>, seq: u64) {
        let Some(records) = self.parents.get_mut(key) else {
            return;
        };
        let Some(position) = records.iter().position(|e| e.seq == seq && !e.is_packed()) else {
            return;
        };
        // The kind's first record to be packed becomes its dictionary, with its parent's
        // newest case (a record that is history has none), as later records of the kind are
        // packed: their JSON and their case.
        let dictionary = self
            .dictionaries
            .entry((key.api_version.clone(), key.kind.clone()))
            .or_insert_with(|| {
                let mut text = records[position].json.text().unwrap_or_default();
                let case = records.iter().rev().find_map(|e| e.case.as_ref()?.text());
                text.push_str(&case.unwrap_or_default());
                let start = text.len().saturating_sub(MAX_DICTIONARY_BYTES);
                text.as_bytes()[start..].into()
            })
            .clone();
        let entry = &mut records[position];
        let before = entry.cost();
        for text in std::iter::once(&mut entry.json).chain(entry.case.as_mut()) {
            if let Text::Raw(raw) = text {
                *text = Text::Packed(Packed::new(raw, dictionary.clone()));
            }
        }
        self.bytes = self.bytes - before + entry.cost();
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
        if self.unpacked.len() > 2 * self.records + 1024 {
            self.unpacked.retain(|(key, seq)| {
                parents
                    .get(key)
                    .is_some_and(|records| records.iter().any(|e| e.seq == *seq && !e.is_packed()))
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

    /// Text that deflate cannot shrink much and no dictionary helps with: each record of the
    /// eviction tests costs about the same whether packed or not.
    fn noise(seed: u64, len: usize) -> String {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                char::from(ALPHABET[(state % 64) as usize])
            })
            .collect()
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
        let store = ExplainStore::new(Bounds {
            max_bytes: 4 * (904 + OVERHEAD_BYTES),
            per_parent: 5,
        });
        store.push(&parent("quiet"), noise(0, 904), None, false);
        for n in 1..=10 {
            store.push(&parent("busy"), noise(n, 904), None, false);
            assert!(store.bytes() <= store.bounds().max_bytes);
        }
        assert!(
            matches!(store.lookup("MyApp", Some("ns"), "quiet", 5), Lookup::Found(r) if r.len() == 1)
        );
        let busy = found(store.lookup("MyApp", Some("ns"), "busy", 5));
        assert!(
            busy.len() < 5,
            "{} records: the busy parent lost none",
            busy.len()
        );
        assert_eq!(busy[0], noise(10, 904), "the newest stays");
    }

    #[test]
    fn records_are_packed_before_anything_is_evicted_and_served_whole() {
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
        assert!(store.bytes() < 1000, "a packed: {}", store.bytes());
        assert_eq!(store.len(), 2, "nothing evicted");
        assert_eq!(
            found(store.lookup("MyApp", Some("ns"), "a", 1)),
            [format!(r#"{{"n":1,"case":{case}}}"#)]
        );
    }

    /// A reconcile's record and case as the host writes them for MyApp `name`: records of
    /// one kind differ in names, uids, versions and times.
    fn myapp_record(name: &str, n: u64) -> (String, String) {
        let json = format!(
            r#"{{"at":"2026-12-01T10:{:02}:{:02}Z","policy":"myapp","parent":{{"apiVersion":"example.com/v1","kind":"MyApp","plural":"myapps","namespace":"ns","name":"{name}","uid":"{:08x}-5e1f-4c2a-9d3b-{:012x}","generation":1,"resourceVersion":"{}"}},"plugin":"sha256:0cac4dbc48263a0f88152a4f6af0effbdc55b9155700beaca5221701fdd8d19b","result":"Reconciled","durationMs":{}.{},"steps":[{{"step":"plugin","ms":0.041}},{{"step":"apply","ms":3.2}}],"children":[{{"kind":"Deployment","name":"{name}","action":"Created"}},{{"kind":"Service","name":"{name}","action":"Created"}}],"status":{{"written":true,"status":{{"observedGeneration":1,"readyReplicas":0,"conditions":[{{"type":"Ready","status":"False","reason":"Progressing","message":"0 of 1 replicas ready","lastTransitionTime":"2026-12-01T10:00:{:02}Z"}}]}}}},"events":[]}}"#,
            n % 60,
            (n * 7) % 60,
            n * 2_654_435_761 % (1 << 32),
            n * 40_503,
            100_000 + n * 3,
            n % 9,
            n % 97,
            (n * 13) % 60,
        );
        let case = format!(
            r#"{{"request":{{"parent":{{"apiVersion":"example.com/v1","kind":"MyApp","metadata":{{"name":"{name}","namespace":"ns","uid":"{:08x}","generation":1,"labels":{{"bench.wasmctrl.dev/run":"n10000"}}}},"spec":{{"image":"nginx:1.27","replicas":1,"port":80}}}},"children":[{{"apiVersion":"apps/v1","kind":"Deployment","metadata":{{"name":"{name}","namespace":"ns","labels":{{"app.kubernetes.io/managed-by":"wasmctrl","wasmctrl.dev/policy":"myapp","app":"{name}"}}}},"spec":{{"replicas":1,"selector":{{"matchLabels":{{"app":"{name}"}}}},"template":{{"metadata":{{"labels":{{"app":"{name}"}}}},"spec":{{"containers":[{{"name":"app","image":"nginx:1.27","ports":[{{"containerPort":80}}]}}]}}}}}},"status":{{"replicas":1,"readyReplicas":{},"observedGeneration":1}}}}]}},"answer":{{"children":[{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}"}},"spec":{{"selector":{{"app":"{name}"}},"ports":[{{"port":80,"targetPort":80}}]}}}}],"status":{{"observedGeneration":1,"readyReplicas":{}}}}}}}"#,
            n * 97_531,
            n % 2,
            n % 2,
        );
        (json, case)
    }

    #[test]
    fn records_of_one_kind_pack_against_a_shared_dictionary_and_read_back_exactly() {
        let records: Vec<_> = (0..200)
            .map(|n| myapp_record(&format!("app-{n:05}"), n))
            .collect();
        let text: usize = records
            .iter()
            .map(|(json, case)| json.len() + case.len())
            .sum();
        // A third of the records' text: every one is packed as the next comes.
        let store = ExplainStore::new(Bounds {
            max_bytes: text / 3,
            per_parent: 5,
        });
        for (n, (json, case)) in records.iter().enumerate() {
            store.push(
                &parent(&format!("app-{n:05}")),
                json.clone(),
                Some(case.clone()),
                true,
            );
        }
        // Deflating each record alone would not fit them: ~1.5 KB of every ~4.5 KB case was
        // left (BENCHMARKS.md, "Explain records").
        assert_eq!(store.len(), 200, "every parent keeps its record");
        for (n, (json, case)) in records.iter().enumerate() {
            let whole = format!("{},\"case\":{case}}}", &json[..json.len() - 1]);
            assert_eq!(
                found(store.lookup("MyApp", Some("ns"), &format!("app-{n:05}"), 1)),
                [whole]
            );
        }
    }

    #[test]
    fn the_total_never_exceeds_the_bound_and_the_oldest_records_go_first() {
        let bounds = Bounds {
            max_bytes: 50 * (1000 + OVERHEAD_BYTES),
            per_parent: 3,
        };
        let store = ExplainStore::new(bounds);
        for round in 0..3 {
            for n in 0..500 {
                store.push(
                    &parent(&format!("p{n}")),
                    noise(round * 1000 + n, 1000),
                    None,
                    false,
                );
                assert!(store.bytes() <= bounds.max_bytes);
            }
        }
        assert!((45..=55).contains(&store.len()), "{} records", store.len());
        // The last parents of the last round are what is left.
        assert_eq!(
            found(store.lookup("MyApp", Some("ns"), "p499", 3)),
            [noise(2499, 1000)]
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
        let (history, newest, unpacked) = {
            let inner = lock(&store.inner);
            (
                inner.history.len(),
                inner.newest.len(),
                inner.unpacked.len(),
            )
        };
        assert!(
            unpacked <= 2 * 2 + 1024 + 1,
            "{unpacked} unpacked entries for 2 records"
        );
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
