//! The default memory budget for plugin calls in flight (`--plugin-memory-budget-mib`).
//!
//! Every call reserves its plugin's memory limit from the budget before it runs, so the
//! budget is what all calls together may touch. In a pod the container's memory limit must
//! hold the host itself, the compiles running beside it (child processes in the same
//! cgroup), the buffers of fetches in flight and the calls; the default is what the limit
//! leaves once the others are counted. Outside a memory-limited cgroup it is half the machine's memory, at most 4 GiB.

use std::path::Path;

/// What the host keeps for itself beside calls and compiles: watches and caches, the explain
/// records, the instance pool's warm pages, buffers of plugin fetches.
pub const HOST_RESERVE_MIB: u64 = 256;
/// The smallest budget the default gives: one call of the default 64 MiB limit.
const FLOOR_MIB: u64 = 64;
/// The most the default takes outside a cgroup limit.
const UNCONTAINED_MAX_MIB: u64 = 4096;

/// The default budget, in MiB, with `others_mib` taken by compiles and fetch buffers at
/// once: read from the cgroup's memory limit, else from the machine's memory.
pub fn default_budget_mib(others_mib: u64) -> u64 {
    derive_budget_mib(
        cgroup_memory_limit(Path::new("/sys/fs/cgroup")),
        machine_memory(Path::new("/proc/meminfo")),
        others_mib,
    )
}

/// The budget from a cgroup memory limit (bytes) if there is one, else from the machine's
/// memory (bytes), with `compiles_mib` taken by compiles.
fn derive_budget_mib(cgroup_limit: Option<u64>, machine: Option<u64>, compiles_mib: u64) -> u64 {
    match cgroup_limit {
        Some(limit) => (limit >> 20)
            .saturating_sub(HOST_RESERVE_MIB)
            .saturating_sub(compiles_mib)
            .max(FLOOR_MIB),
        None => machine
            .map_or(UNCONTAINED_MAX_MIB, |bytes| (bytes >> 20) / 2)
            .clamp(FLOOR_MIB, UNCONTAINED_MAX_MIB),
    }
}

/// The memory limit of the cgroup the host runs in (v2 `memory.max`, else v1
/// `memory.limit_in_bytes`), or `None` when there is none.
fn cgroup_memory_limit(root: &Path) -> Option<u64> {
    let read = |path: &Path| std::fs::read_to_string(path).ok();
    if let Some(max) = read(&root.join("memory.max")) {
        return max.trim().parse().ok();
    }
    let v1 = read(&root.join("memory/memory.limit_in_bytes"))?;
    // v1 says "no limit" with a huge number (a page-rounded i64::MAX).
    v1.trim().parse().ok().filter(|limit| *limit < 1 << 60)
}

/// The machine's memory from `/proc/meminfo` (`MemTotal`), in bytes.
fn machine_memory(meminfo: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(meminfo).ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib << 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cgroup_limit_holds_the_host_the_compiles_and_the_budget() {
        // The chart's pod: 1280 MiB, one compile of 384 MiB.
        assert_eq!(derive_budget_mib(Some(1280 << 20), None, 384), 640);
        // A limit too small for all three still lets one default call run.
        assert_eq!(derive_budget_mib(Some(512 << 20), None, 384), FLOOR_MIB);
        // Outside a cgroup: half the machine, at most 4 GiB.
        assert_eq!(derive_budget_mib(None, Some(4 << 30), 384), 2048);
        assert_eq!(
            derive_budget_mib(None, Some(64 << 30), 384),
            UNCONTAINED_MAX_MIB
        );
        assert_eq!(derive_budget_mib(None, None, 0), UNCONTAINED_MAX_MIB);
    }

    #[test]
    fn cgroup_limits_are_read_from_v2_then_v1_and_max_means_none() {
        let dir = tempfile::tempdir().expect("a directory");
        assert_eq!(cgroup_memory_limit(dir.path()), None);
        std::fs::create_dir(dir.path().join("memory")).expect("v1 directory");
        std::fs::write(
            dir.path().join("memory/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .expect("v1 file");
        assert_eq!(cgroup_memory_limit(dir.path()), None, "v1 without a limit");
        std::fs::write(
            dir.path().join("memory/memory.limit_in_bytes"),
            "536870912\n",
        )
        .expect("v1 file");
        assert_eq!(cgroup_memory_limit(dir.path()), Some(512 << 20));
        std::fs::write(dir.path().join("memory.max"), "max\n").expect("v2 file");
        assert_eq!(cgroup_memory_limit(dir.path()), None, "v2 without a limit");
        std::fs::write(dir.path().join("memory.max"), "1342177280\n").expect("v2 file");
        assert_eq!(cgroup_memory_limit(dir.path()), Some(1280 << 20));
        let meminfo = dir.path().join("meminfo");
        std::fs::write(&meminfo, "MemTotal:       16384000 kB\nMemFree: 1 kB\n").expect("meminfo");
        assert_eq!(machine_memory(&meminfo), Some(16_384_000 << 10));
    }
}
