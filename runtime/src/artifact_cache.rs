//! Precompiled plugin artifacts on disk, so a plugin is compiled once per digest and engine
//! configuration, not once per process.
//!
//! Compiling a 1 MB component with Cranelift takes around a second on two cores; mapping its
//! precompiled form takes a fraction of a millisecond. This is what makes a restart, a
//! rollback or a second policy using the same plugin instant.
//!
//! wasmtime's own compilation cache is not used: it is keyed by the module's bytes rather than
//! by the digest a policy already names, and it compresses its entries, which makes every load
//! pay for decompression.
//!
//! Trust: an artifact is native code that wasmtime maps and runs without re-validating it, so
//! the cache directory must be writable by the host only (in a cluster, an `emptyDir`).

use std::hash::Hasher;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

use super::digest::Digest;

pub(crate) struct ArtifactCache {
    dir: PathBuf,
    /// Identifies the engine configuration and wasmtime version artifacts were compiled for.
    engine_key: String,
    /// The directory is kept under this many bytes of artifacts; the least recently used
    /// go first.
    max_bytes: u64,
}

impl ArtifactCache {
    pub(crate) fn new(dir: PathBuf, engine: &Engine, max_bytes: u64) -> std::io::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        // A directory that exists but cannot be written (a read-only root filesystem) must be
        // found now, not at the first store.
        let probe = dir.join(format!(".probe-{}", std::process::id()));
        std::fs::write(&probe, b"")?;
        let _ = std::fs::remove_file(&probe);
        remove_abandoned_temporaries(&dir);
        Ok(Self {
            dir,
            engine_key: engine_key(engine),
            max_bytes,
        })
    }

    fn path(&self, digest: &Digest) -> PathBuf {
        self.dir
            .join(format!("{}-{}.cwasm", digest.hex(), self.engine_key))
    }

    /// The cached artifact for `digest`, if there is a usable one. A corrupt or incompatible
    /// entry is removed and reported as a miss, so the caller recompiles.
    #[allow(unsafe_code)] // see the SAFETY comment inside
    pub(crate) fn load(&self, engine: &Engine, digest: &Digest) -> Option<Component> {
        let path = self.path(digest);
        if !path.exists() {
            return None;
        }
        // SAFETY: the file was written by `store` below from `Component::serialize` of the
        // same engine configuration (the key is in its name), into a directory only the host
        // writes to. wasmtime still checks the header and the compatibility hash.
        match unsafe { Component::deserialize_file(engine, &path) } {
            Ok(component) => {
                // The modification time is the recency eviction goes by.
                if let Ok(file) = std::fs::File::options().append(true).open(&path) {
                    let _ = file.set_modified(std::time::SystemTime::now());
                }
                Some(component)
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "discarding unusable precompiled plugin");
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// Store `component`'s artifact. Written to a temporary file and renamed, so a reader
    /// never sees half an artifact.
    pub(crate) fn store(&self, digest: &Digest, component: &Component) -> anyhow::Result<()> {
        let bytes = component.serialize()?;
        let path = self.path(digest);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, &bytes)?;
        std::fs::rename(&tmp, &path)?;
        self.evict(&path);
        Ok(())
    }

    /// Delete the least recently used artifacts until the directory fits `max_bytes`, never
    /// the one just written. A process that has an evicted artifact mapped keeps using it
    /// (the mapping outlives the file); the next load of that digest recompiles.
    fn evict(&self, keep: &Path) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut artifacts: Vec<(std::time::SystemTime, u64, PathBuf)> = entries
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "cwasm"))
            .filter_map(|e| {
                let meta = e.metadata().ok()?;
                Some((meta.modified().ok()?, meta.len(), e.path()))
            })
            .collect();
        let mut total: u64 = artifacts.iter().map(|(_, len, _)| len).sum();
        artifacts.sort();
        for (_, len, path) in artifacts {
            if total <= self.max_bytes {
                break;
            }
            if path != keep && std::fs::remove_file(&path).is_ok() {
                tracing::info!(path = %path.display(), "evicted a precompiled plugin from the cache");
                total -= len;
            }
        }
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Delete temporary files that a process killed between write and rename left behind: those
/// of processes that no longer run, and any older than an hour. They would otherwise fill the
/// directory outside the eviction bound, which counts only finished artifacts.
fn remove_abandoned_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let hour = std::time::Duration::from_secs(3600);
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(writer) = path
            .extension()
            .and_then(|x| x.to_str())
            .and_then(|x| x.strip_prefix("tmp"))
        else {
            continue;
        };
        let writer_alive = writer.parse::<u32>().is_ok_and(process_runs);
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_none_or(|age| age > hour);
        if (!writer_alive || old) && std::fs::remove_file(&path).is_ok() {
            tracing::info!(path = %path.display(), "removed an abandoned temporary artifact");
        }
    }
}

/// Whether process `pid` still runs, so that a temporary it writes may yet be renamed.
#[cfg(target_os = "linux")]
fn process_runs(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Outside Linux there is no `/proc` to look in: `kill(pid, 0)` asks the same question without
/// sending anything (`EPERM`: it runs, as another user).
#[cfg(all(unix, not(target_os = "linux")))]
#[allow(unsafe_code)] // see the SAFETY comment inside
fn process_runs(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        // 0 and below name process groups, not a writer.
        return false;
    }
    // SAFETY: signal 0 sends nothing; kill only checks that `pid` exists and may be signalled.
    let asked = unsafe { libc::kill(pid, 0) };
    asked == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A stable name for the engine's compatibility hash. wasmtime only promises that the hash
/// changes when compatibility does, so it is fed through SHA-256 to get a name that is the
/// same in every process.
fn engine_key(engine: &Engine) -> String {
    struct Sha256Hasher(Sha256);
    impl Hasher for Sha256Hasher {
        fn write(&mut self, bytes: &[u8]) {
            self.0.update(bytes);
        }
        fn finish(&self) -> u64 {
            0 // never used: the full digest is read below
        }
    }
    let mut hasher = Sha256Hasher(Sha256::new());
    std::hash::Hash::hash(&engine.precompile_compatibility_hash(), &mut hasher);
    hex::encode(&hasher.0.finalize()[..8])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporaries_of_dead_writers_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        // No process has pid u32::MAX - 1; this test's own process is alive.
        let dead = dir.path().join(format!("abc-key.tmp{}", u32::MAX - 1));
        let live = dir
            .path()
            .join(format!("def-key.tmp{}", std::process::id()));
        let artifact = dir.path().join("abc-key.cwasm");
        for path in [&dead, &live, &artifact] {
            std::fs::write(path, b"x").expect("write");
        }
        ArtifactCache::new(dir.path().into(), &Engine::default(), 1 << 20).expect("cache");
        assert!(!dead.exists(), "a dead writer's temporary is removed");
        assert!(live.exists(), "a live writer may still rename it");
        assert!(artifact.exists(), "artifacts are not temporaries");
    }

    /// The smallest component there is.
    const EMPTY_COMPONENT: &[u8] = b"\0asm\x0d\0\x01\0";

    #[test]
    fn the_cache_stays_under_its_bound_evicting_the_least_recently_used() {
        let engine = Engine::default();
        let component = Component::new(&engine, EMPTY_COMPONENT).expect("empty component");
        let size = component.serialize().expect("serialize").len() as u64;
        let dir = tempfile::tempdir().expect("tempdir");
        let cache =
            ArtifactCache::new(dir.path().into(), &engine, size * 2 + size / 2).expect("cache");
        let digests: Vec<Digest> = (0u8..3).map(|i| Digest::of(&[i])).collect();
        let pause = || std::thread::sleep(std::time::Duration::from_millis(20));
        cache.store(&digests[0], &component).expect("store");
        pause();
        cache.store(&digests[1], &component).expect("store");
        pause();
        // Using the first makes the second the least recently used.
        assert!(cache.load(&engine, &digests[0]).is_some());
        pause();
        cache.store(&digests[2], &component).expect("store");
        assert!(
            cache.load(&engine, &digests[0]).is_some(),
            "recently used: kept"
        );
        assert!(
            cache.load(&engine, &digests[1]).is_none(),
            "least recently used: evicted"
        );
        assert!(
            cache.load(&engine, &digests[2]).is_some(),
            "just written: kept"
        );
    }
}
