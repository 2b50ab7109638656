//! The explain store's bound is what its records take from the allocator: an operator sizes
//! the host's pod by `--explain-memory-mib`, so the figure must be the memory, not the text.
//!
//! This binary runs on the host's allocator with a count of what each thread holds (its own
//! binary: the count is global, and only this test allocates while it runs).

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;

use wasmctrl::explain::{Bounds, ExplainStore, ParentRef};

/// The host's allocator, counting the bytes it hands this thread (by the size it really
/// gives, as jemalloc rounds a request to its size class).
struct Counting;

thread_local! {
    static HELD: Cell<isize> = const { Cell::new(0) };
}

static ALLOCATOR: wasmctrl::Allocator = wasmctrl::Allocator {};

fn count(bytes: isize) {
    // Threads being torn down no longer count; nothing of this test's runs then.
    let _ = HELD.try_with(|held| held.set(held.get() + bytes));
}

#[allow(unsafe_code)]
fn usable(ptr: *mut u8) -> isize {
    // SAFETY: `ptr` is a live allocation of `ALLOCATOR`.
    isize::try_from(unsafe { tikv_jemallocator::usable_size(ptr) }).unwrap_or(isize::MAX)
}

// SAFETY: every call is passed on to `ALLOCATOR` unchanged; the count reads sizes of live
// allocations only.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let ptr = unsafe { ALLOCATOR.alloc(layout) };
        if !ptr.is_null() {
            count(usable(ptr));
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-usable(ptr));
        // SAFETY: the caller's contract, passed on.
        unsafe { ALLOCATOR.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let before = usable(ptr);
        // SAFETY: the caller's contract, passed on.
        let moved = unsafe { ALLOCATOR.realloc(ptr, layout, new_size) };
        if !moved.is_null() {
            count(usable(moved) - before);
        }
        moved
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn held() -> isize {
    HELD.with(Cell::get)
}

fn parent(name: &str) -> ParentRef {
    ParentRef {
        api_version: "example.com/v1".into(),
        kind: "MyApp".into(),
        plural: "myapps".into(),
        namespace: Some("default".into()),
        name: name.into(),
        uid: format!("4f6c{:028x}", name.len()),
        generation: Some(1),
        resource_version: None,
    }
}

/// A MyApp reconcile's record and case, as the host writes them: names, uids, versions and
/// times differ from one to the next.
fn record(name: &str, n: u64) -> (String, String) {
    let json = format!(
        r#"{{"at":"2026-12-01T10:{:02}:{:02}.{:03}Z","policy":"myapp","parent":{{"apiVersion":"example.com/v1","kind":"MyApp","plural":"myapps","namespace":"default","name":"{name}","uid":"{:032x}","generation":1,"resourceVersion":"{}"}},"plugin":"sha256:0cac4dbc48263a0f88152a4f6af0effbdc55b9155700beaca5221701fdd8d19b","result":"Reconciled","durationMs":{}.{:03},"steps":[{{"step":"plugin","ms":0.0{}}},{{"step":"apply","ms":{}.{}}}],"children":[{{"kind":"Deployment","name":"{name}","action":"Created"}},{{"kind":"Service","name":"{name}","action":"Unchanged"}}],"status":{{"written":true}},"events":[]}}"#,
        n % 60,
        (n * 7) % 60,
        (n * 31) % 1000,
        n.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        100_000 + n * 3,
        n % 13,
        (n * 17) % 1000,
        n % 90 + 10,
        n % 7,
        n % 10,
    );
    let case = format!(
        r#"{{"request":{{"parent":{{"apiVersion":"example.com/v1","kind":"MyApp","metadata":{{"name":"{name}","namespace":"default","uid":"{:032x}","generation":1}},"spec":{{"image":"nginx:1.27","replicas":{},"port":80}}}},"children":[]}},"answer":{{"children":[{{"apiVersion":"apps/v1","kind":"Deployment","metadata":{{"name":"{name}","labels":{{"app":"{name}"}}}},"spec":{{"replicas":{},"selector":{{"matchLabels":{{"app":"{name}"}}}},"template":{{"metadata":{{"labels":{{"app":"{name}"}}}},"spec":{{"containers":[{{"name":"app","image":"nginx:1.27","ports":[{{"containerPort":80}}]}}]}}}}}}}},{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}"}},"spec":{{"selector":{{"app":"{name}"}},"ports":[{{"port":80,"targetPort":80}}]}}}}],"status":{{"observedGeneration":1,"readyReplicas":{}}}}}}}"#,
        n.wrapping_mul(0xC2B2_AE3D_27D4_EB4F),
        n % 3 + 1,
        n % 3 + 1,
        n % 2,
    );
    (json, case)
}

#[test]
fn the_bound_counts_what_the_records_take_from_the_allocator() {
    const MIB: usize = 1 << 20;
    let bounds = Bounds {
        max_bytes: 4 * MIB,
        per_parent: 10,
    };
    let before = held();
    let store = ExplainStore::new(bounds);
    // 10,000 parents reconciled three times: the store fills, then evicts.
    let mut n = 0;
    for _round in 0..3 {
        for parent_n in 0..10_000 {
            n += 1;
            let name = format!("app-{parent_n:05}");
            let (json, case) = record(&name, n);
            store.push(&parent(&name), json, Some(case), n % 3 == 0);
            if n % 1000 == 0 {
                let taken = usize::try_from(held() - before).unwrap_or_default();
                let counted = store.bytes();
                assert!(
                    counted <= bounds.max_bytes,
                    "{counted} bytes counted, over the bound"
                );
                // What the count cannot see: the allocator's rounding of a map or queue
                // table it estimates, and the mutex. Counting only the text held about
                // 1.5× of it.
                assert!(
                    taken.abs_diff(counted) < counted / 20 + 4096,
                    "after {n} records: {taken} bytes taken from the allocator, {counted} counted"
                );
            }
        }
    }
    assert!(
        store.len() > 5_000,
        "{} records: the store should keep most parents' last reconcile",
        store.len()
    );
    drop(store);
    assert!(
        (held() - before).abs() < 1024,
        "{} bytes still held after the store went",
        held() - before
    );
}
