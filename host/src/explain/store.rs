//! The host's memory of recent reconciles, bounded in total size and per parent.
//!
//! Only a parent's newest record keeps its case (the request and answer, most of a record's
//! size): that is the one `explain --save` writes, and older ones are history.
//!
//! Records are packed as they arrive: deflated against a dictionary, a record of their
//! parent kind. Records of one kind share most of their text (field names, the policy, the
//! plugin digest, the children's specs), so a MyApp reconcile's record and case pack to under
//! 1 KB where deflating each alone left ~2.4 KB. A kind's first record is its first
//! dictionary; a later record that packs to more than a fifth of its text shows the
//! dictionary does not know the kind's records well (a parent's first reconcile has no
//! children yet, its later ones carry them all) and becomes the next, up to
//! [`MAX_DICTIONARIES`]. Packing costs a reconcile ~10 µs; holding records as text until
//! memory ran short (as the store once did) only put that off, since a bound that keeps every
//! parent's last reconcile is full at scale, and the text freed at packing fragmented the
//! heap.
//!
//! The bound counts what the store takes from the allocator: each packed text as the
//! allocator rounds it, and the bookkeeping around it (each parent's key and record slots,
//! the map, the eviction queues, the dictionaries, the compressor). When it counted only the
//! text, the records cost the process about twice the bound (31 MiB of RSS for 16 MiB at
//! 10,000 parents, BENCHMARKS.md); an operator sizing a pod by the flag gets what it says.
//!
//! When a new record does not fit, history goes, oldest first; a parent's newest record goes
//! only when no history is left. So every parent keeps its last reconcile for as long as the
//! bound allows, however often other parents are reconciled.

use std::collections::{HashMap, VecDeque};
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use super::record::ParentRef;
use crate::lock;

/// How much the store may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// What the records and their bookkeeping take from the allocator, in bytes; 0 keeps none.
    pub max_bytes: usize,
    /// Records kept per parent.
    pub per_parent: usize,
}

/// Deflate uses the last 32 KiB of a dictionary; the rest would be held for nothing.
const MAX_DICTIONARY_BYTES: usize = 32 << 10;

/// Dictionaries a kind may have. Each is kept while the kind is (its records may need it):
/// at most 128 KiB a kind, for records no dictionary helps with.
const MAX_DICTIONARIES: usize = 4;

/// A record of at least this much text that packs to more than a fifth of it becomes its
/// kind's next dictionary (smaller ones pack poorly against anything).
const DICTIONARY_MIN_TEXT: usize = 1024;

/// What the store's compressor takes: zlib-rs's deflate state, at the fast level with a
/// 32 KiB window (measured: 381,168 bytes). One is kept for the store's life; making one per
/// record took as much memory (the freed state stays with the allocator a while) and twice
/// the time.
const COMPRESSOR_BYTES: usize = 372 << 10;

/// What the allocator hands out for a request of `bytes`: the host's allocator (jemalloc)
/// rounds to its size classes, 16-byte steps up to 128 bytes and four classes per doubling
/// above (an 800-byte text takes 896). Without an allocation (`0`), nothing.
fn allocation(bytes: usize) -> usize {
    match bytes {
        0 => 0,
        1..=8 => 8,
        9..=128 => bytes.next_multiple_of(16),
        _ => {
            let group = usize::BITS - 1 - (bytes - 1).leading_zeros();
            bytes.next_multiple_of(1 << (group - 2))
        }
    }
}

/// A kind of parent, shared by the keys of all its parents.
#[derive(Debug, PartialEq, Eq, Hash)]
struct ParentKind {
    api_version: Box<str>,
    kind: Box<str>,
    plural: Box<str>,
}

impl ParentKind {
    /// The API group; empty for the core group.
    fn group(&self) -> &str {
        self.api_version
            .rsplit_once('/')
            .map_or("", |(group, _)| group)
    }

    /// Whether `kind` names this kind the way `kubectl` accepts it: the kind or its plural,
    /// any case, optionally qualified by the API group (`myapps.example.com`).
    fn is_named(&self, kind: &str) -> bool {
        let kind = kind.to_ascii_lowercase();
        let group = self.group();
        [&self.kind, &self.plural].iter().any(|name| {
            let name = name.to_ascii_lowercase();
            kind == name || (!group.is_empty() && kind == format!("{name}.{group}"))
        })
    }

    fn is(&self, parent: &ParentRef) -> bool {
        *self.api_version == parent.api_version
            && *self.kind == parent.kind
            && *self.plural == parent.plural
    }
}

/// What a parent is known by in the store: its kind, namespace and name (not its uid, so a
/// re-created parent continues its predecessor's history).
#[derive(Debug, PartialEq, Eq, Hash)]
struct ParentKey {
    kind: Arc<ParentKind>,
    namespace: Option<Box<str>>,
    name: Box<str>,
}

impl ParentKey {
    /// The key's own allocations (its kind's are counted once, with the kind).
    fn cost(&self) -> usize {
        // An `Arc` allocates its two counts beside the value.
        allocation(2 * size_of::<usize>() + size_of::<Self>())
            + allocation(self.namespace.as_ref().map_or(0, |n| n.len()))
            + allocation(self.name.len())
    }
}

/// A kind's names and the dictionaries its records are packed against.
struct KindEntry {
    names: Arc<ParentKind>,
    /// Records of the kind (with their case), at most 32 KiB each, oldest first: new records
    /// are packed against the newest. None is dropped, as packed records can only be read
    /// with theirs.
    dictionaries: Vec<Box<[u8]>>,
}

impl KindEntry {
    fn new(parent: &ParentRef) -> Self {
        Self {
            names: Arc::new(ParentKind {
                api_version: parent.api_version.as_str().into(),
                kind: parent.kind.as_str().into(),
                plural: parent.plural.as_str().into(),
            }),
            dictionaries: Vec::new(),
        }
    }

    fn cost(&self) -> usize {
        let names = &self.names;
        allocation(2 * size_of::<usize>() + size_of::<ParentKind>())
            + allocation(names.api_version.len())
            + allocation(names.kind.len())
            + allocation(names.plural.len())
            + allocation(self.dictionaries.capacity() * size_of::<Box<[u8]>>())
            + self
                .dictionaries
                .iter()
                .map(|d| allocation(d.len()))
                .sum::<usize>()
    }

    /// A record of the kind packed, against the newest dictionary; the record becomes the
    /// next dictionary when there is none yet or it packs poorly (see the module's doc).
    fn pack(
        &mut self,
        json: &str,
        case: Option<&str>,
        compress: &mut flate2::Compress,
    ) -> (u8, Packed, Option<Packed>) {
        let text = json.len() + case.map_or(0, str::len);
        let pack = |dictionary: &[u8], compress: &mut flate2::Compress| {
            Packed::new(json, case, dictionary, compress)
        };
        if let Some(newest) = self.dictionaries.last() {
            let (json, case) = pack(newest, compress);
            let packed = json.0.len() + case.as_ref().map_or(0, |c| c.0.len());
            let poorly = text >= DICTIONARY_MIN_TEXT && packed * 5 > text;
            if !poorly || self.dictionaries.len() == MAX_DICTIONARIES {
                return (self.generation(), json, case);
            }
        }
        let whole = [json, case.unwrap_or_default()].concat();
        let start = whole.len().saturating_sub(MAX_DICTIONARY_BYTES);
        self.dictionaries.push(whole.as_bytes()[start..].into());
        let (json, case) = pack(&whole.as_bytes()[start..], compress);
        (self.generation(), json, case)
    }

    /// The newest dictionary's place (at most [`MAX_DICTIONARIES`] - 1).
    fn generation(&self) -> u8 {
        u8::try_from(self.dictionaries.len().saturating_sub(1)).unwrap_or(u8::MAX)
    }
}

/// Recent reconcile records by parent.
pub struct ExplainStore {
    bounds: Bounds,
    inner: Mutex<Inner>,
}

/// A queue entry: a record, by parent and sequence number.
type Queued = (Arc<ParentKey>, u64);

#[derive(Default)]
struct Inner {
    /// Each parent's records, oldest first.
    parents: HashMap<Arc<ParentKey>, VecDeque<Entry>>,
    /// Records that are no longer their parent's newest, in the order they became history:
    /// the first to evict. An entry whose record is gone already is skipped.
    history: VecDeque<Queued>,
    /// Records in the order they came (each came as its parent's newest): evicted only when
    /// no history is left. An entry whose record is no longer the newest is skipped.
    newest: VecDeque<Queued>,
    /// The kinds of parent seen (a handful: one per policy).
    kinds: Vec<KindEntry>,
    /// Packs records, once the first comes.
    compressor: Option<flate2::Compress>,
    /// What the records, the parents' keys and record slots, and the kinds take; the map and
    /// the queues are counted from their capacity when needed ([`Inner::bytes`]).
    held: usize,
    /// Records held, over all parents.
    records: usize,
    next: u64,
}

struct Entry {
    seq: u64,
    /// Of a reconcile, the hash of the parent's uid as the record has it, which says its
    /// shard (see [`ExplainStore::forget`]); `None` for a webhook's answer.
    uid_hash: Option<u64>,
    /// Which of its kind's dictionaries the record was packed against.
    dictionary: u8,
    /// The record without its case.
    json: Packed,
    /// The case, while this is the parent's newest record.
    case: Option<Packed>,
    /// The reconcile changed something (or failed): kept over quiet ones.
    eventful: bool,
}

impl Entry {
    /// The allocations of the record's texts (its slot is counted with its parent).
    fn cost(&self) -> usize {
        self.json.cost() + self.case.as_ref().map_or(0, Packed::cost)
    }

    /// The whole record: the case goes back in as its last field. `dictionaries` are its
    /// kind's.
    fn record(&self, dictionaries: &[Box<[u8]>]) -> String {
        let dictionary = dictionaries
            .get(usize::from(self.dictionary))
            .map_or(&[][..], |d| &d[..]);
        let json = self
            .json
            .unpack(dictionary)
            .unwrap_or_else(|| "{}".to_owned());
        match (
            self.case
                .as_ref()
                .and_then(|case| case.unpack_after(&self.json, dictionary)),
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

/// A record's JSON or its case, packed: its length (4 bytes, little-endian), then the text
/// deflated against its kind's dictionary. A record's case continues the stream of its JSON
/// (one dictionary set up per record, not two: setting one up was most of the packing), so
/// it unpacks after the JSON; the JSON, flushed whole before the case, unpacks alone.
struct Packed(Box<[u8]>);

impl Packed {
    /// `json`, and `case` after it, deflated by `compress` (a raw stream, reset here) against
    /// `dictionary`.
    fn new(
        json: &str,
        case: Option<&str>,
        dictionary: &[u8],
        compress: &mut flate2::Compress,
    ) -> (Self, Option<Self>) {
        use flate2::FlushCompress;
        compress.reset();
        // Setting a dictionary on a fresh raw stream cannot fail; if it did, the text would
        // still deflate, only less well, and unpacking would report the record unreadable.
        let _ = compress.set_dictionary(dictionary);
        let json = match case {
            None => Self::deflate(json, compress, FlushCompress::Finish),
            Some(_) => Self::deflate(json, compress, FlushCompress::Sync),
        };
        let case = case.map(|case| Self::deflate(case, compress, FlushCompress::Finish));
        (json, case)
    }

    /// `text` through `compress`, until `flush` is done.
    fn deflate(text: &str, compress: &mut flate2::Compress, flush: flate2::FlushCompress) -> Self {
        use flate2::{FlushCompress, Status};
        let len = u32::try_from(text.len()).unwrap_or(u32::MAX);
        let mut bytes = Vec::with_capacity(text.len() / 4 + 64);
        bytes.extend_from_slice(&len.to_le_bytes());
        let start = compress.total_in();
        loop {
            let read = usize::try_from(compress.total_in() - start).unwrap_or(text.len());
            let status = compress.compress_vec(&text.as_bytes()[read..], &mut bytes, flush);
            let all_in = compress.total_in() - start == text.len() as u64;
            match status {
                Ok(Status::StreamEnd) | Err(_) => break,
                // A flush short of the end is done once it left room in the output.
                Ok(_)
                    if flush != FlushCompress::Finish
                        && all_in
                        && bytes.len() < bytes.capacity() =>
                {
                    break;
                }
                Ok(_) => bytes.reserve(bytes.capacity().max(64)),
            }
        }
        Self(bytes.into_boxed_slice())
    }

    fn cost(&self) -> usize {
        allocation(self.0.len())
    }

    /// The text, or `None` if it does not unpack with `dictionary`.
    fn unpack(&self, dictionary: &[u8]) -> Option<String> {
        let mut decompress = Self::decompressor(dictionary)?;
        self.inflate(&mut decompress)
    }

    /// The text of a case packed after `json`, or `None` if it does not unpack.
    fn unpack_after(&self, json: &Self, dictionary: &[u8]) -> Option<String> {
        let mut decompress = Self::decompressor(dictionary)?;
        json.inflate(&mut decompress)?;
        self.inflate(&mut decompress)
    }

    fn decompressor(dictionary: &[u8]) -> Option<flate2::Decompress> {
        let mut decompress = flate2::Decompress::new(false);
        decompress.set_dictionary(dictionary).ok()?;
        Some(decompress)
    }

    /// This part of the stream through `decompress`: its whole text, or `None`.
    fn inflate(&self, decompress: &mut flate2::Decompress) -> Option<String> {
        use flate2::{FlushDecompress, Status};
        let (len, deflated) = self.0.split_first_chunk::<4>()?;
        let len = usize::try_from(u32::from_le_bytes(*len)).ok()?;
        // Room for one byte more than the text, so the flush that ends a JSON packed before
        // its case (an empty block) is read too, and the case's part starts where it should.
        let mut text = Vec::with_capacity(len + 1);
        let start = decompress.total_in();
        let status = decompress.decompress_vec(deflated, &mut text, FlushDecompress::Sync);
        let all_in = decompress.total_in() - start == deflated.len() as u64;
        match status {
            Ok(Status::StreamEnd | Status::Ok | Status::BufError)
                if all_in && text.len() == len =>
            {
                String::from_utf8(text).ok()
            }
            _ => None,
        }
    }
}

/// A kind of parent, as a reader's right to see its parents is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentResource {
    /// The API group (empty for the core group).
    pub group: String,
    /// The resource, plural.
    pub resource: String,
    /// The API version the records were written at.
    pub api_version: String,
}

impl std::fmt::Display for ParentResource {
    /// As a reader names the kind to tell it from another: `myapps.example.com`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.group.as_str() {
            "" => write!(f, "{}", self.resource),
            group => write!(f, "{}.{group}", self.resource),
        }
    }
}

impl From<&ParentKind> for ParentResource {
    fn from(kind: &ParentKind) -> Self {
        Self {
            group: kind.group().to_owned(),
            resource: kind.plural.to_string(),
            api_version: kind.api_version.to_string(),
        }
    }
}

/// What a look-up among some kinds found.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The parent's records as JSON, newest first.
    Found {
        /// The records.
        records: Vec<String>,
    },
    /// No record of such a parent.
    NotFound,
    /// The kind names more than one kind of parent with that name; these.
    Ambiguous(Vec<ParentResource>),
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
    /// `case`), and `case`, dropping the oldest records as the bounds require. A record
    /// with a case takes it from the parent's older records (one case per parent). A record larger than the whole store is not kept.
    ///
    /// Past the per-parent bound, the oldest *quiet* record goes first (one that changed no
    /// child and did not fail: a resync, an echo of the reconcile's own writes), so the
    /// reconciles that did something stay to be explained.
    pub fn push(&self, parent: &ParentRef, json: String, case: Option<String>, eventful: bool) {
        let uid_hash = Some(crate::shards::uid_hash(&parent.uid));
        self.keep(parent, (json, case), eventful, uid_hash);
    }

    /// Keep `json`, the record of an admission webhook's answer about `parent`, as
    /// [`Self::push`] keeps a reconcile's. Any replica may answer a review, whatever the
    /// parent's shard: such a record is not let go with a shard ([`Self::forget`]).
    pub fn push_answer(&self, parent: &ParentRef, json: String, eventful: bool) {
        self.keep(parent, (json, None), eventful, None);
    }

    fn keep(
        &self,
        parent: &ParentRef,
        (json, case): (String, Option<String>),
        eventful: bool,
        uid_hash: Option<u64>,
    ) {
        if self.bounds.per_parent == 0 || self.bounds.max_bytes == 0 {
            return;
        }
        let mut inner = lock(&self.inner);
        let inner = &mut *inner;
        let (key, kind) = inner.key(parent);
        let compress = match &mut inner.compressor {
            Some(compress) => compress,
            none => {
                inner.held += COMPRESSOR_BYTES;
                none.insert(flate2::Compress::new(flate2::Compression::fast(), false))
            }
        };
        let kind = &mut inner.kinds[kind];
        let kind_before = kind.cost();
        let (dictionary, json, case) = kind.pack(&json, case.as_deref(), compress);
        inner.held = inner.held - kind_before + kind.cost();
        let entry = Entry {
            seq: 0,
            uid_hash,
            dictionary,
            json,
            case,
            eventful,
        };
        if entry.cost() > self.bounds.max_bytes {
            return;
        }
        // Out of the map while it changes, so its costs can be counted as it does; a known
        // parent keeps its key, shared by its queue entries.
        let (key, mut records, before) = match inner.parents.remove_entry(&key) {
            Some((shared, records)) => {
                let before = shared.cost() + slots(&records);
                (shared, records, before)
            }
            None => (Arc::new(key), VecDeque::new(), 0),
        };
        let seq = inner.next;
        inner.next += 1;
        if let Some(previous) = records.back() {
            inner.history.push_back((key.clone(), previous.seq));
        }
        // One case per parent, the newest reconcile's: a record without one (a webhook
        // answer) leaves the last reconcile's in place.
        if entry.case.is_some() {
            for older in &mut records {
                if let Some(case) = older.case.take() {
                    inner.held -= case.cost();
                }
            }
        }
        if records.len() >= self.bounds.per_parent {
            let quiet = records.iter().position(|e| !e.eventful).unwrap_or(0);
            if let Some(dropped) = records.remove(quiet) {
                inner.held -= dropped.cost();
                inner.records -= 1;
            }
        }
        // A parent's slots grow one at a time: most parents keep one or two records, and
        // `VecDeque` would otherwise double to four at once.
        if records.len() == records.capacity() {
            records.reserve_exact(1);
        }
        inner.held += entry.cost();
        inner.records += 1;
        records.push_back(Entry { seq, ..entry });
        inner.held = inner.held - before + key.cost() + slots(&records);
        inner.parents.insert(key.clone(), records);
        inner.newest.push_back((key, seq));
        while inner.bytes() > self.bounds.max_bytes {
            if let Some((key, seq)) = inner.history.pop_front() {
                inner.evict(&key, seq);
            } else if let Some((key, seq)) = inner.newest.pop_front() {
                inner.evict(&key, seq);
            } else {
                break;
            }
        }
        inner.compact();
    }

    /// Drop the records of reconciles of the parents whose uid hash `keep` does not keep (a
    /// sharded replica's, of the shards it gave back: their new holder records them from
    /// here), so what the store holds follows the replica's share. Webhook answers stay.
    /// Returns how many went.
    pub fn forget(&self, keep: impl Fn(u64) -> bool) -> usize {
        let keep = |hash: Option<u64>| hash.is_none_or(&keep);
        let mut inner = lock(&self.inner);
        let inner = &mut *inner;
        let mut dropped = 0;
        let mut emptied = Vec::new();
        for (key, records) in &mut inner.parents {
            if records.iter().all(|e| keep(e.uid_hash)) {
                continue;
            }
            let before = slots(records);
            records.retain(|entry| {
                let kept = keep(entry.uid_hash);
                if !kept {
                    inner.held -= entry.cost();
                    dropped += 1;
                }
                kept
            });
            if records.is_empty() {
                inner.held -= before + key.cost();
                emptied.push(key.clone());
            } else {
                records.shrink_to_fit();
                inner.held = inner.held - before + slots(records);
            }
        }
        for key in emptied {
            inner.parents.remove(&key);
        }
        inner.records -= dropped;
        // The queues' entries of what went are skipped, and compacted away in time.
        inner.compact();
        dropped
    }

    /// The kinds of parent the store has seen that `kind` names (as `kubectl` accepts a
    /// kind: its name or plural, any case, optionally with the group). Whoever answers a
    /// reader checks it may see such parents before it learns anything of their records.
    pub fn kinds_named(&self, kind: &str) -> Vec<ParentResource> {
        lock(&self.inner)
            .kinds
            .iter()
            .filter(|k| k.names.is_named(kind))
            .map(|k| ParentResource::from(&*k.names))
            .collect()
    }

    /// The records of the parent `kind` `namespace`/`name` (newest first, at most
    /// `history`), looking only among the kinds `among` (those the reader may see).
    pub fn lookup(
        &self,
        kind: &str,
        namespace: Option<&str>,
        name: &str,
        history: usize,
        among: &[ParentResource],
    ) -> Lookup {
        let inner = lock(&self.inner);
        let matches: Vec<_> = inner
            .parents
            .iter()
            .filter(|(key, _)| {
                &*key.name == name
                    && key.namespace.as_deref() == namespace
                    && key.kind.is_named(kind)
                    && among.contains(&ParentResource::from(&*key.kind))
            })
            .collect();
        match matches.as_slice() {
            [] => Lookup::NotFound,
            [(key, records)] => {
                let dictionaries = inner.dictionaries(&key.kind);
                Lookup::Found {
                    records: records
                        .iter()
                        .rev()
                        .take(history.max(1))
                        .map(|entry| entry.record(dictionaries))
                        .collect(),
                }
            }
            several => Lookup::Ambiguous(
                several
                    .iter()
                    .map(|(key, _)| ParentResource::from(&*key.kind))
                    .collect(),
            ),
        }
    }

    /// What the store takes from the allocator now, in bytes (what the bound counts).
    pub fn bytes(&self) -> usize {
        lock(&self.inner).bytes()
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

/// What a parent's record slots take (the records' texts are counted apart).
fn slots(records: &VecDeque<Entry>) -> usize {
    allocation(records.capacity() * size_of::<Entry>())
}

impl Inner {
    /// The store's whole cost: what is held, plus the map's and the queues' tables.
    fn bytes(&self) -> usize {
        // hashbrown keeps one control byte per bucket beside it, and up to 8 buckets per 7
        // entries of capacity.
        let bucket = size_of::<(Arc<ParentKey>, VecDeque<Entry>)>() + 1;
        let map = self.parents.capacity() * bucket * 8 / 7;
        let queued = self.history.capacity() + self.newest.capacity();
        self.held + allocation(map) + allocation(queued * size_of::<Queued>())
    }

    /// The key of `parent`, sharing its kind's names with the kind's other parents, and its
    /// kind's place in `kinds`.
    fn key(&mut self, parent: &ParentRef) -> (ParentKey, usize) {
        let kind = match self.kinds.iter().position(|k| k.names.is(parent)) {
            Some(known) => known,
            None => {
                let entry = KindEntry::new(parent);
                self.held += entry.cost();
                self.kinds.push(entry);
                self.kinds.len() - 1
            }
        };
        let key = ParentKey {
            kind: self.kinds[kind].names.clone(),
            namespace: parent.namespace.as_deref().map(Into::into),
            name: parent.name.as_str().into(),
        };
        (key, kind)
    }

    fn dictionaries(&self, kind: &Arc<ParentKind>) -> &[Box<[u8]>] {
        self.kinds
            .iter()
            .find(|k| Arc::ptr_eq(&k.names, kind))
            .map_or(&[], |k| &k.dictionaries)
    }

    /// Drop record `seq` of `key` if the parent still holds it.
    fn evict(&mut self, key: &Arc<ParentKey>, seq: u64) {
        let Some(records) = self.parents.get_mut(key) else {
            return;
        };
        let before = slots(records);
        if let Some(position) = records.iter().position(|e| e.seq == seq)
            && let Some(dropped) = records.remove(position)
        {
            self.held -= dropped.cost();
            self.records -= 1;
        }
        if records.is_empty() {
            self.held -= before + key.cost();
            self.parents.remove(key);
        } else {
            if records.len() * 2 <= records.capacity() {
                records.shrink_to_fit();
            }
            self.held = self.held - before + slots(records);
        }
    }

    /// Queue entries of records already gone (history a parent's own bound dropped) or no
    /// longer newest pile up for parents reconciled over and over; drop them once they
    /// outnumber the records, and give back the room they took.
    fn compact(&mut self) {
        let parents = &self.parents;
        if self.history.len() > 2 * self.records + 1024 {
            self.history.retain(|(key, seq)| {
                parents
                    .get(key)
                    .is_some_and(|records| records.iter().any(|e| e.seq == *seq))
            });
            self.history.shrink_to_fit();
        }
        if self.newest.len() > 2 * parents.len() + 1024 {
            self.newest.retain(|(key, seq)| {
                parents
                    .get(key)
                    .and_then(VecDeque::back)
                    .is_some_and(|e| e.seq == *seq)
            });
            self.newest.shrink_to_fit();
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

    /// A look-up among every kind the store has seen that `kind` names.
    fn look(
        store: &ExplainStore,
        kind: &str,
        ns: Option<&str>,
        name: &str,
        history: usize,
    ) -> Lookup {
        store.lookup(kind, ns, name, history, &store.kinds_named(kind))
    }

    fn found(lookup: Lookup) -> Vec<String> {
        match lookup {
            Lookup::Found { records, .. } => records.iter().map(ToString::to_string).collect(),
            other => panic!("expected records, got {other:?}"),
        }
    }

    #[test]
    fn a_case_packed_after_its_json_reads_back_and_the_json_reads_alone() {
        let mut compress = flate2::Compress::new(flate2::Compression::fast(), false);
        let dictionary = br#"{"apiVersion":"example.com/v1","kind":"MyApp"}"#;
        // Large enough that each part needs more output than it starts with.
        let json = format!("{{\"policy\":\"p\",\"noise\":\"{}\"}}", noise(1, 20_000));
        let case = format!(
            "{{\"parent\":{{\"kind\":\"MyApp\"}},\"x\":\"{}\"}}",
            noise(2, 30_000)
        );
        let (packed_json, packed_case) = Packed::new(&json, Some(&case), dictionary, &mut compress);
        let packed_case = packed_case.expect("a case");
        assert_eq!(
            packed_json.unpack(dictionary).as_deref(),
            Some(json.as_str())
        );
        assert_eq!(
            packed_case
                .unpack_after(&packed_json, dictionary)
                .as_deref(),
            Some(case.as_str())
        );
        let (alone, none) = Packed::new(&json, None, dictionary, &mut compress);
        assert!(none.is_none());
        assert_eq!(alone.unpack(dictionary).as_deref(), Some(json.as_str()));
    }

    #[test]
    fn a_record_without_a_case_leaves_the_last_reconciles_case() {
        let store = ExplainStore::new(Bounds {
            max_bytes: 1 << 20,
            per_parent: 3,
        });
        store.push(
            &parent("a"),
            r#"{"n":1}"#.into(),
            Some(r#"{"c":1}"#.into()),
            false,
        );
        let with_one_case = store.bytes();
        store.push(&parent("a"), r#"{"n":2}"#.into(), None, false);
        assert_eq!(
            found(look(&store, "MyApp", Some("ns"), "a", 10)),
            [r#"{"n":2}"#, r#"{"n":1,"case":{"c":1}}"#]
        );
        store.push(
            &parent("a"),
            r#"{"n":3}"#.into(),
            Some(r#"{"c":3}"#.into()),
            false,
        );
        assert_eq!(
            found(look(&store, "MyApp", Some("ns"), "a", 10)),
            [r#"{"n":3,"case":{"c":3}}"#, r#"{"n":2}"#, r#"{"n":1}"#]
        );
        assert!(store.bytes() > with_one_case);
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
            found(look(&store, "MyApp", Some("ns"), "a", 10)),
            [r#"{"n":"a3","case":{"c":1}}"#, r#"{"n":"a2"}"#],
            "only the newest record keeps its case"
        );
        assert_eq!(
            found(look(&store, "myapp", Some("ns"), "a", 1)),
            [r#"{"n":"a3","case":{"c":1}}"#]
        );
        assert_eq!(
            found(look(&store, "myapps.example.com", Some("ns"), "b", 5)),
            [r#"{"case":{}}"#]
        );
        assert_eq!(
            look(&store, "myapps", Some("other"), "a", 1),
            Lookup::NotFound
        );
        assert_eq!(look(&store, "widget", Some("ns"), "a", 1), Lookup::NotFound);
        // What a reader may not see is not looked in: its records stay unfound.
        assert_eq!(
            store.lookup("myapps", Some("ns"), "a", 1, &[]),
            Lookup::NotFound
        );
        assert_eq!(
            store.kinds_named("myapps.example.com"),
            [ParentResource {
                group: "example.com".into(),
                resource: "myapps".into(),
                api_version: "example.com/v1".into(),
            }]
        );
        assert!(store.kinds_named("widget").is_empty());
        assert_eq!(store.len(), 3);
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
            found(look(&store, "MyApp", Some("ns"), "a", 5)),
            ["6", "5", "1"]
        );
        for n in 7..=9 {
            store.push(&parent("a"), format!("{n}"), None, true);
        }
        assert_eq!(
            found(look(&store, "MyApp", Some("ns"), "a", 5)),
            ["9", "8", "7"]
        );
    }

    #[test]
    fn a_quiet_parent_keeps_its_last_record_while_a_busy_one_loses_history() {
        let store = ExplainStore::new(Bounds {
            max_bytes: COMPRESSOR_BYTES + (5 << 10),
            per_parent: 5,
        });
        store.push(&parent("quiet"), noise(0, 904), None, false);
        for n in 1..=10 {
            store.push(&parent("busy"), noise(n, 904), None, false);
            assert!(store.bytes() <= store.bounds().max_bytes);
        }
        assert!(
            matches!(look(&store, "MyApp", Some("ns"), "quiet", 5), Lookup::Found { records: r, .. } if r.len() == 1)
        );
        let busy = found(look(&store, "MyApp", Some("ns"), "busy", 5));
        assert!(
            busy.len() < 5,
            "{} records: the busy parent lost none",
            busy.len()
        );
        assert_eq!(busy[0], noise(10, 904), "the newest stays");
    }

    #[test]
    fn records_are_packed_as_they_come_and_served_whole() {
        let case = |n: &str| {
            format!(
                r#"{{"parent":{{"metadata":{{"name":"{n}","labels":"{}"}}}}}}"#,
                "n".repeat(4000)
            )
        };
        // Two cases' text (8 KiB) in 6,000 bytes: a's record is its kind's dictionary (counted
        // too), and both are packed against it.
        let store = ExplainStore::new(Bounds {
            max_bytes: COMPRESSOR_BYTES + 6000,
            per_parent: 5,
        });
        store.push(&parent("a"), r#"{"n":1}"#.into(), Some(case("a")), false);
        let first = store.bytes();
        store.push(&parent("b"), r#"{"n":2}"#.into(), Some(case("b")), false);
        assert!(
            store.bytes() <= COMPRESSOR_BYTES + 6000,
            "{} bytes",
            store.bytes()
        );
        assert!(
            store.bytes() - first < 500,
            "b's record took {} bytes",
            store.bytes() - first
        );
        assert_eq!(store.len(), 2, "nothing evicted");
        for (name, n) in [("a", 1), ("b", 2)] {
            assert_eq!(
                found(look(&store, "MyApp", Some("ns"), name, 1)),
                [format!(r#"{{"n":{n},"case":{}}}"#, case(name))]
            );
        }
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

    /// Push `records` as the newest of parents `app-00000`, `app-00001`, ….
    fn push_myapps(store: &ExplainStore, records: &[(String, String)]) {
        for (n, (json, case)) in records.iter().enumerate() {
            store.push(
                &parent(&format!("app-{n:05}")),
                json.clone(),
                Some(case.clone()),
                true,
            );
        }
    }

    /// A record as a look-up serves it: `json` with `case` as its last field.
    fn whole(json: &str, case: &str) -> String {
        format!("{},\"case\":{case}}}", &json[..json.len() - 1])
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
        // A third of the records' text beside the compressor: they fit packed.
        let store = ExplainStore::new(Bounds {
            max_bytes: COMPRESSOR_BYTES + text / 3,
            per_parent: 5,
        });
        push_myapps(&store, &records);
        // Deflating each record alone would not fit them: ~1.5 KB of every ~4.5 KB case was
        // left (BENCHMARKS.md, "Explain records").
        assert_eq!(store.len(), 200, "every parent keeps its record");
        for (n, (json, case)) in records.iter().enumerate() {
            assert_eq!(
                found(look(&store, "MyApp", Some("ns"), &format!("app-{n:05}"), 1)),
                [whole(json, case)]
            );
        }
    }

    fn dictionaries(store: &ExplainStore) -> usize {
        lock(&store.inner)
            .kinds
            .iter()
            .map(|k| k.dictionaries.len())
            .sum()
    }

    #[test]
    fn a_record_the_dictionary_does_not_know_becomes_the_next_one() {
        let store = ExplainStore::new(Bounds {
            max_bytes: 1 << 20,
            per_parent: 5,
        });
        // A first reconcile: no children yet, nothing like the records to come.
        store.push(
            &parent("first"),
            r#"{"result":"Created"}"#.into(),
            Some(r#"{"request":{}}"#.into()),
            true,
        );
        let records: Vec<_> = (0..100)
            .map(|n| myapp_record(&format!("app-{n:05}"), n))
            .collect();
        push_myapps(&store, &records);
        assert_eq!(
            dictionaries(&store),
            2,
            "the first MyApp record is the second"
        );
        let text: usize = records.iter().map(|(j, c)| j.len() + c.len()).sum();
        let packed: usize = lock(&store.inner)
            .parents
            .values()
            .flatten()
            .map(Entry::cost)
            .sum();
        assert!(
            packed * 8 < text,
            "{packed} bytes packed for {text} bytes of records"
        );
        assert_eq!(
            found(look(&store, "MyApp", Some("ns"), "first", 1)),
            [r#"{"result":"Created","case":{"request":{}}}"#],
            "packed against the first dictionary, still read with it"
        );
        let (json, case) = &records[42];
        assert_eq!(
            found(look(&store, "MyApp", Some("ns"), "app-00042", 1)),
            [whole(json, case)]
        );

        // Records nothing helps with stop making dictionaries at the limit.
        for n in 0..10 {
            store.push(&parent(&format!("noise-{n}")), noise(n, 2000), None, true);
        }
        assert_eq!(dictionaries(&store), MAX_DICTIONARIES);
        assert_eq!(
            found(look(&store, "MyApp", Some("ns"), "noise-7", 1)),
            [noise(7, 2000)]
        );
    }

    #[test]
    fn the_total_never_exceeds_the_bound_and_the_oldest_records_go_first() {
        let bounds = Bounds {
            max_bytes: COMPRESSOR_BYTES + 60_000,
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
        // ~1.2 KB a record (its text as allocated, its slot, its parent's key), less the
        // eviction queues' room.
        assert!((40..=50).contains(&store.len()), "{} records", store.len());
        // The last parents of the last round are what is left.
        assert_eq!(
            found(look(&store, "MyApp", Some("ns"), "p499", 3)),
            [noise(2499, 1000)]
        );
        assert!(matches!(
            look(&store, "MyApp", Some("ns"), "p0", 3),
            Lookup::NotFound
        ));
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
            found(look(&store, "MyApp", Some("ns"), "busy", 5)),
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
            matches!(look(&store, "myapp", Some("ns"), "a", 1), Lookup::Ambiguous(k) if k.len() == 2)
        );
        assert_eq!(
            found(look(&store, "myapp.other.com", Some("ns"), "a", 1)),
            ["b"]
        );
    }

    #[test]
    fn the_records_of_shards_given_back_go_and_the_rest_stay() {
        let store = ExplainStore::new(Bounds {
            max_bytes: 1 << 20,
            per_parent: 3,
        });
        // Uids as random as the API server's.
        let of = |i: u64| ParentRef {
            uid: noise(i + 1, 36),
            ..parent(&format!("p{i}"))
        };
        let push = |store: &ExplainStore, i: u64| {
            for n in 0..2 {
                let case = (n == 1).then(|| format!(r#"{{"c":{i}}}"#));
                store.push(&of(i), format!(r#"{{"n":{n}}}"#), case, true);
            }
        };
        let all: Vec<u64> = (0..40).collect();
        for &i in &all {
            push(&store, i);
        }
        let shard = |i: u64| crate::shards::shard_of(&of(i).uid, 2);
        let kept: Vec<u64> = all.iter().copied().filter(|&i| shard(i) == 1).collect();
        assert!(!kept.is_empty() && kept.len() < all.len());
        // A webhook's answer about a parent of a shard given back: any replica answers.
        let answered = *all
            .iter()
            .find(|&&i| shard(i) == 0)
            .expect("one of shard 0");
        store.push_answer(&of(answered), r#"{"answer":1}"#.into(), true);
        let before = store.bytes();
        let dropped = store.forget(|hash| crate::shards::shard_of_hash(hash, 2) == 1);
        assert_eq!(dropped, 2 * (all.len() - kept.len()));
        assert_eq!(store.len(), 2 * kept.len() + 1);
        assert!(store.bytes() < before);
        for &i in &all {
            let lookup = look(&store, "MyApp", Some("ns"), &format!("p{i}"), 10);
            if i == answered {
                assert_eq!(found(lookup), [r#"{"answer":1}"#], "the answer stays");
            } else if shard(i) == 1 {
                assert_eq!(found(lookup).len(), 2, "p{i}'s records stay");
            } else {
                assert!(matches!(lookup, Lookup::NotFound), "p{i}'s records went");
            }
        }
        // What is left costs what it would had only those been pushed.
        let only = ExplainStore::new(store.bounds());
        for &i in &kept {
            push(&only, i);
        }
        assert_eq!(store.len(), only.len() + 1);
    }
}
