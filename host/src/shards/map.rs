//! Which shard a parent is in: its uid hashed as Kubernetes' server-side sharded list and
//! watch hashes it (see the parent module for why the uid).

/// The shard of the parent with `uid`, of `count` shards: the FNV-1a (64-bit) hash of the
/// uid's text, in which of `count` equal ranges of the hash space it falls.
pub fn shard_of(uid: &str, count: u32) -> u32 {
    shard_of_hash(uid_hash(uid), count)
}

/// The FNV-1a (64-bit) hash of `uid`'s text, which puts it in a shard ([`shard_of_hash`]):
/// for what keeps a parent's hash rather than its uid.
pub fn uid_hash(uid: &str) -> u64 {
    use std::hash::Hasher as _;
    let mut hasher = fnv::FnvHasher::default();
    // `write`, not `write_str`: the latter appends a separator byte to the hashed text.
    hasher.write(uid.as_bytes());
    hasher.finish()
}

/// The shard of `count` a uid of hash `hash` is in.
pub fn shard_of_hash(hash: u64, count: u32) -> u32 {
    let index = u128::from(hash) / range_width(count);
    u32::try_from(index).unwrap_or(u32::MAX)
}

/// The hash range of `shard` of `count`: from its start (inclusive) to its end (exclusive;
/// 2^64 for the last), as KEP-5866's `shardRange` takes them.
pub fn shard_range(shard: u32, count: u32) -> (u128, u128) {
    let width = range_width(count);
    let start = width * u128::from(shard);
    let end = (start + width).min(1 << 64);
    (start, end)
}

/// How much of the 64-bit hash space each of `count` shards covers (the last may cover a
/// little less): the range width kube-state-metrics' sharded watch uses.
fn range_width(count: u32) -> u128 {
    u128::from(u64::MAX) / u128::from(count.max(1)) + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uid_hashes_as_fnv_1a_and_falls_in_its_range() {
        // FNV-1a 64 of "a", from the algorithm's published test vectors.
        use std::hash::Hasher as _;
        let mut hasher = fnv::FnvHasher::default();
        hasher.write(b"a");
        assert_eq!(hasher.finish(), 0xaf63_dc4c_8601_ec8c);
        // 0xaf.. is in the upper half of two shards, the 11th of sixteen.
        assert_eq!(shard_of("a", 2), 1);
        assert_eq!(shard_of("a", 16), 0xa);
        assert_eq!(shard_of("a", 1), 0);
        for count in [1, 3, 12, 1000] {
            let uid = "6f1f3c4e-7a54-4d0b-9c55-1d9b5b4c2f10";
            let shard = shard_of(uid, count);
            assert!(shard < count);
            let (start, end) = shard_range(shard, count);
            let mut hasher = fnv::FnvHasher::default();
            hasher.write(uid.as_bytes());
            let hash = u128::from(hasher.finish());
            assert!(
                start <= hash && hash < end,
                "{count}: {start} <= {hash} < {end}"
            );
        }
    }

    #[test]
    fn the_ranges_cover_the_hash_space_once() {
        for count in [1u32, 2, 3, 7, 12, 64] {
            let mut next = 0u128;
            for shard in 0..count {
                let (start, end) = shard_range(shard, count);
                assert_eq!(
                    start, next,
                    "{count} shards: shard {shard} starts where the last ended"
                );
                assert!(end > start);
                next = end;
            }
            assert_eq!(next, 1 << 64, "{count} shards end at 2^64");
        }
    }

    #[test]
    fn uids_spread_over_the_shards() {
        let mut counts = [0u32; 12];
        for i in 0..12_000u32 {
            let uid = format!("{i:08x}-0000-4000-8000-{:012x}", u64::from(i) * 7919);
            counts[shard_of(&uid, 12) as usize] += 1;
        }
        for (shard, count) in counts.iter().enumerate() {
            assert!(
                (800..1200).contains(count),
                "shard {shard}: {count} of 12,000"
            );
        }
    }
}
