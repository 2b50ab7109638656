//! The one wasmtime engine a host process shares between all its plugins: configuration,
//! the instance pool, the epoch clock that enforces deadlines, and loading.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Config, Enabled, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::artifact_cache::ArtifactCache;
use super::call_slots::CallSlots;
use super::call_threads::CallThreads;
use super::compiler::{Compiler, compile_config};
use super::contract::{self, PluginPre, Surface};
use super::digest::Digest;
use super::error::LoadError;
use super::limits::Limits;
use super::plugin::{EPOCH_TICK, Plugin, PluginInfo};
use super::sandbox::{MAX_TABLE_ELEMENTS, Sandbox};
use super::webhook::ServedWebhooks;

/// How much of each pooled memory and table stays mapped between calls. A Rust plugin's
/// 1 MiB stack, its data and the heap a reconcile uses fit well inside.
const KEEP_RESIDENT_BYTES: usize = 4 << 20;

/// Engine-wide settings. Per-plugin limits live in [`Limits`].
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Where precompiled artifacts are kept. `None` compiles every load.
    pub cache_dir: Option<PathBuf>,
    /// How many plugin calls may run at once, across all plugins. Sizes the instance pool;
    /// further calls wait for a slot instead of failing. Shared fairly between tenants
    /// (policies): each leaves a quarter of the slots (and at least one) to the others, and a
    /// freed slot goes to the waiting tenant that holds the fewest.
    pub max_concurrent_calls: u32,
    /// The largest memory cap any plugin may be given.
    pub max_memory_bytes: usize,
    /// The most plugin memory the calls in flight may reserve together: each call reserves
    /// its plugin's memory limit before it starts and waits while the budget is spent, so
    /// the host's memory stays bounded however many calls run. A plugin whose limit is
    /// above it is refused at load. `None`: no budget beyond the slots.
    pub memory_budget_bytes: Option<usize>,
    /// Bound on the precompiled-artifact cache on disk (least recently used evicted first).
    pub cache_max_bytes: u64,
    /// Where plugins the cache does not hold are compiled: a long-running host uses
    /// [`Compiler::Child`], so a compile's memory is bounded and kept out of the host.
    pub compiler: Compiler,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            cache_dir: None,
            max_concurrent_calls: 64,
            max_memory_bytes: 512 << 20,
            memory_budget_bytes: None,
            cache_max_bytes: 1 << 30,
            compiler: Compiler::InProcess,
        }
    }
}

/// Compiles, caches and instantiates plugins. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct PluginEngine {
    inner: Arc<EngineInner>,
}

struct EngineInner {
    engine: Engine,
    linker: Linker<Sandbox>,
    cache: Option<ArtifactCache>,
    compiler: Compiler,
    call_slots: Arc<CallSlots>,
    /// Where calls run: at most one thread per slot in use.
    call_threads: Arc<CallThreads>,
    max_memory_bytes: usize,
}

/// The memory budget for plugin calls in flight and what they reserve of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallMemory {
    /// The budget (`u64::MAX` as `usize::MAX` when there is none).
    pub budget_bytes: u64,
    /// What the calls running now reserve: the sum of their plugins' memory limits.
    pub reserved_bytes: u64,
}

/// What the instance pool keeps between calls: slots that held a plugin's memory keep the
/// pages it touched resident (up to `linear_memory_keep_resident` each) so the next call
/// there takes no page faults. That memory is part of the host's RSS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// Memory slots not in use that held a plugin's memory before.
    pub warm_memories: u32,
    /// Bytes kept resident in memory and table slots not in use.
    pub resident_bytes: u64,
}

impl PluginEngine {
    /// What the instance pool keeps between calls now.
    pub fn pool_usage(&self) -> PoolUsage {
        self.inner
            .engine
            .pooling_allocator_metrics()
            .map(|pool| PoolUsage {
                warm_memories: pool.unused_warm_memories(),
                resident_bytes: (pool.unused_memory_bytes_resident()
                    + pool.unused_table_bytes_resident()) as u64,
            })
            .unwrap_or_default()
    }

    /// Build the engine and start its epoch clock.
    pub fn new(options: EngineOptions) -> anyhow::Result<Self> {
        let engine = Engine::new(&engine_config(&options))?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
        contract::forbid_waiting(&mut linker)?;
        contract::wasmctrl::plugin::log::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)?;
        // Without a writable cache the host still runs: it compiles each plugin on every
        // start instead of taking the precompiled artifact from disk.
        let cache = options.cache_dir.and_then(|dir| {
            ArtifactCache::new(dir.clone(), &engine, options.cache_max_bytes)
                .inspect_err(|error| {
                    tracing::error!(
                        dir = %dir.display(),
                        %error,
                        "the plugin cache directory is not writable; running without a disk cache (plugins are compiled at every start). Mount a writable volume there or pass --cache-dir"
                    );
                })
                .ok()
        });
        start_epoch_clock(&engine).context("starting the plugin epoch clock")?;
        Ok(Self {
            inner: Arc::new(EngineInner {
                engine,
                linker,
                cache,
                compiler: options.compiler,
                call_slots: CallSlots::new(
                    options.max_concurrent_calls as usize,
                    options.memory_budget_bytes.unwrap_or(usize::MAX),
                ),
                call_threads: CallThreads::new(),
                max_memory_bytes: options.max_memory_bytes,
            }),
        })
    }

    /// Load a plugin from its bytes: verify the digest, compile (or take the precompiled
    /// artifact from the cache), check the contract, and pre-instantiate.
    ///
    /// This blocks for as long as compilation takes (up to seconds on a cache miss); call it
    /// off the async runtime, or use [`PluginEngine::load_async`].
    pub fn load(
        &self,
        bytes: &[u8],
        expected: Option<&Digest>,
        limits: Limits,
    ) -> Result<Plugin, LoadError> {
        self.check_limits(&limits)?;
        let digest = Digest::of(bytes);
        if let Some(expected) = expected
            && *expected != digest
        {
            return Err(LoadError::DigestMismatch {
                expected: *expected,
                actual: digest,
            });
        }
        check_is_component(bytes)?;

        let started = Instant::now();
        let cached = self
            .inner
            .cache
            .as_ref()
            .and_then(|cache| cache.load(&self.inner.engine, &digest));
        let from_cache = cached.is_some();
        let component = match cached {
            Some(component) => component,
            None => {
                let component = self.compile(bytes)?;
                if let Some(cache) = &self.inner.cache
                    && let Err(e) = cache.store(&digest, &component)
                {
                    tracing::warn!(dir = %cache.dir().display(), error = %e, "could not cache precompiled plugin");
                }
                component
            }
        };
        let load_time = started.elapsed();
        self.prepare(
            component,
            digest,
            Some(bytes.len()),
            limits,
            load_time,
            from_cache,
        )
    }

    /// Load a plugin by digest alone, from the precompiled-artifact cache, without its bytes.
    ///
    /// A cached artifact was compiled from bytes verified against this digest, so a caller
    /// that knows the digest it wants (a policy pins one; a rollback names the previous one)
    /// need neither fetch nor hash the component again. `Ok(None)` on a cache miss.
    pub fn load_cached(
        &self,
        digest: &Digest,
        limits: Limits,
    ) -> Result<Option<Plugin>, LoadError> {
        self.check_limits(&limits)?;
        let started = Instant::now();
        let Some(component) = self
            .inner
            .cache
            .as_ref()
            .and_then(|cache| cache.load(&self.inner.engine, digest))
        else {
            return Ok(None);
        };
        let load_time = started.elapsed();
        self.prepare(component, *digest, None, limits, load_time, true)
            .map(Some)
    }

    /// Compile `bytes` where the engine's [`Compiler`] says, and bring the artifact into this
    /// engine. Bringing it in costs a deserialization, a fraction of a millisecond against a
    /// compile's hundreds.
    fn compile(&self, bytes: &[u8]) -> Result<Component, LoadError> {
        let artifact = self.inner.compiler.artifact(bytes)?;
        // SAFETY: `artifact` was produced just now by an engine of this engine's compilation
        // settings (`compile_config`), in this process or in a child running this same
        // executable file, and handed over through a pipe only the two of them hold. wasmtime
        // still checks its header against this engine's settings.
        #[allow(unsafe_code)]
        let component = unsafe { Component::deserialize(&self.inner.engine, &artifact) };
        component.map_err(|e| LoadError::Sandbox(format!("loading the compiled plugin: {e:#}")))
    }

    fn check_limits(&self, limits: &Limits) -> Result<(), LoadError> {
        if limits.memory_bytes > self.inner.max_memory_bytes {
            return Err(LoadError::InvalidLimits(format!(
                "memory limit {} bytes is above the host's maximum of {} bytes",
                limits.memory_bytes, self.inner.max_memory_bytes
            )));
        }
        let budget = self.inner.call_slots.memory_budget();
        if limits.memory_bytes > budget {
            return Err(LoadError::InvalidLimits(format!(
                "memory limit {} bytes is above the host's budget of {budget} bytes for plugin calls in flight (--plugin-memory-budget-mib)",
                limits.memory_bytes
            )));
        }
        Ok(())
    }

    /// The memory budget for plugin calls in flight, and how much of it they reserve now
    /// (bytes).
    pub fn call_memory(&self) -> CallMemory {
        let slots = &self.inner.call_slots;
        CallMemory {
            budget_bytes: slots.memory_budget() as u64,
            reserved_bytes: slots.memory_reserved() as u64,
        }
    }

    /// What a component is, whether or not this host would run it: its digest, size, surface
    /// and compile time, and why it would be refused if it would. Compiles without the
    /// artifact cache, since the compile time is part of the answer.
    pub fn inspect(&self, bytes: &[u8]) -> Result<Inspection, LoadError> {
        check_is_component(bytes)?;
        let started = Instant::now();
        let component = Component::new(&self.inner.engine, bytes)
            .map_err(|e| LoadError::InvalidComponent(format!("{e:#}")))?;
        let compile_time = started.elapsed();
        let surface = Surface::of(&self.inner.engine, &component);
        let refusal = surface
            .check()
            .err()
            .or_else(|| {
                self.inner
                    .linker
                    .instantiate_pre(&component)
                    .err()
                    .map(|e| LoadError::WrongWorld(format!("{e:#}")))
            })
            .map(|e| e.to_string());
        let digest = Digest::of(bytes);
        let webhooks = match &refusal {
            Some(_) => Err("not asked: this host would refuse the plugin".to_owned()),
            None if !surface.exports_webhooks() => Ok(ServedWebhooks::default()),
            None => self
                .prepare(
                    component,
                    digest,
                    Some(bytes.len()),
                    Limits::default(),
                    compile_time,
                    false,
                )
                .map(|plugin| plugin.served_webhooks())
                .map_err(|e| e.to_string()),
        };
        Ok(Inspection {
            digest,
            size_bytes: bytes.len(),
            contract_version: surface.contract_version().map(str::to_owned),
            imports: surface.imports,
            exports: surface.exports,
            compile_time,
            refusal,
            webhooks,
        })
    }

    /// Check the contract and pre-instantiate: everything a call would otherwise repeat.
    fn prepare(
        &self,
        component: Component,
        digest: Digest,
        size_bytes: Option<usize>,
        limits: Limits,
        load_time: std::time::Duration,
        from_cache: bool,
    ) -> Result<Plugin, LoadError> {
        let surface = Surface::of(&self.inner.engine, &component);
        surface.check()?;
        let instance_pre = self
            .inner
            .linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::WrongWorld(format!("{e:#}")))?;
        let webhooks = surface
            .exports_webhooks()
            .then(|| contract::wit_webhooks::GuestIndices::new(&instance_pre))
            .transpose()
            .map_err(|e| LoadError::WrongWorld(format!("its webhooks export: {e:#}")))?;
        let pre =
            PluginPre::new(instance_pre).map_err(|e| LoadError::WrongWorld(format!("{e:#}")))?;
        Plugin::new(
            pre,
            webhooks,
            self.inner.call_slots.clone(),
            self.inner.call_threads.clone(),
            limits,
            PluginInfo {
                digest,
                size_bytes,
                contract_version: surface.contract_version().map(str::to_owned),
                imports: surface.imports,
                exports: surface.exports,
                load_time,
                from_cache,
            },
        )
    }

    /// [`PluginEngine::load`] on a blocking thread.
    pub async fn load_async(
        &self,
        bytes: Vec<u8>,
        expected: Option<Digest>,
        limits: Limits,
    ) -> Result<Plugin, LoadError> {
        let engine = self.clone();
        tokio::task::spawn_blocking(move || engine.load(&bytes, expected.as_ref(), limits))
            .await
            .map_err(|e| LoadError::Sandbox(format!("plugin load task failed: {e}")))?
    }
}

/// Reject what is obviously not a component with a message that says what it is instead.
/// wasmtime would also reject it, with a less helpful message.
fn check_is_component(bytes: &[u8]) -> Result<(), LoadError> {
    const MAGIC: &[u8] = b"\0asm";
    const CORE_MODULE: &[u8] = &[1, 0, 0, 0];
    const COMPONENT: &[u8] = &[0x0d, 0, 1, 0];
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(LoadError::InvalidComponent(
            "not a WebAssembly file (no \\0asm header)".to_owned(),
        ));
    }
    match &bytes[4..8] {
        COMPONENT => Ok(()),
        CORE_MODULE => Err(LoadError::InvalidComponent(
            "this is a core WebAssembly module, not a component; build the plugin for the wasm32-wasip2 target".to_owned(),
        )),
        other => Err(LoadError::InvalidComponent(format!(
            "unsupported WebAssembly version/layer {other:02x?}"
        ))),
    }
}

/// The engine configuration. Every choice here is about making a fresh sandbox per call
/// cheap and a hostile plugin harmless:
/// - the pooling allocator keeps instance slots (memories, tables) mapped and reuses them,
///   so a call does not pay for mmap/munmap;
/// - epoch interruption enforces deadlines at the cost of a counter check at loop heads
///   (fuel would cost far more per instruction);
/// - no async support: calls run synchronously on a blocking thread, which avoids allocating
///   a fiber stack per call.
fn engine_config(options: &EngineOptions) -> Config {
    let slots = options.max_concurrent_calls.max(1);
    let mut pool = PoolingAllocationConfig::default();
    pool.total_component_instances(slots)
        // A Rust plugin is a main module plus a few adapter shims.
        .total_core_instances(slots * 8)
        .max_core_instances_per_component(16)
        .total_memories(slots * 2)
        .total_tables(slots * 8)
        .max_tables_per_component(16)
        .max_memories_per_component(2)
        .max_memory_size(options.max_memory_bytes)
        .table_elements(MAX_TABLE_ELEMENTS)
        // Reset slots by rewriting only the pages a call dirtied (found with the
        // PAGEMAP_SCAN ioctl where the kernel has it) instead of dropping them with madvise:
        // the next call then takes no page faults and no TLB-shootdown IPIs. This is most of
        // the cost of a fresh instance otherwise.
        .pagemap_scan(Enabled::Auto)
        .linear_memory_keep_resident(KEEP_RESIDENT_BYTES)
        .table_keep_resident(KEEP_RESIDENT_BYTES);

    let mut config = compile_config();
    config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    config
}

/// A background thread that advances the engine's epoch every [`EPOCH_TICK`]. It holds only a
/// weak reference and exits once the engine is gone.
fn start_epoch_clock(engine: &Engine) -> std::io::Result<()> {
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("wasmctrl-epoch".into())
        .spawn(move || {
            while let Some(engine) = weak.upgrade() {
                engine.increment_epoch();
                drop(engine);
                std::thread::sleep(EPOCH_TICK);
            }
        })?;
    Ok(())
}

/// What [`PluginEngine::inspect`] finds out about a component.
#[derive(Debug, Clone)]
pub struct Inspection {
    /// Content digest of the bytes.
    pub digest: Digest,
    /// Size of the component in bytes.
    pub size_bytes: usize,
    /// The `wasmctrl:plugin` contract version the component exports, if any.
    pub contract_version: Option<String>,
    /// Names the component imports.
    pub imports: Vec<String>,
    /// Names the component exports.
    pub exports: Vec<String>,
    /// Time to compile it.
    pub compile_time: Duration,
    /// Why this host would refuse to load it (another contract version, another world, an
    /// import it does not provide); `None` when it would load.
    pub refusal: Option<String>,
    /// The webhooks it serves, as its `served` export answers (none for a plugin without the
    /// webhooks export); the call's error when that failed, or why it was not asked (a
    /// plugin this host would refuse).
    pub webhooks: Result<ServedWebhooks, String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_modules_and_garbage_are_told_apart() {
        let core = b"\0asm\x01\0\0\0";
        let err = check_is_component(core).expect_err("core module");
        assert!(err.to_string().contains("core WebAssembly module"), "{err}");
        let err = check_is_component(b"hello world").expect_err("garbage");
        assert!(err.to_string().contains("not a WebAssembly file"), "{err}");
        assert!(check_is_component(b"\0asm\x0d\0\x01\0").is_ok());
    }

    #[test]
    fn an_unwritable_cache_directory_leaves_the_engine_running_without_one() {
        // Under a regular file no directory can be made, whoever runs the test (even root,
        // whom a read-only mode bit would not stop).
        let file = std::env::temp_dir().join(format!("wasmctrl-not-a-dir-{}", std::process::id()));
        std::fs::write(&file, b"").unwrap_or_default();
        let engine = PluginEngine::new(EngineOptions {
            cache_dir: Some(file.join("artifacts")),
            ..EngineOptions::default()
        });
        let _ = std::fs::remove_file(&file);
        let engine = engine.unwrap_or_else(|e| panic!("the engine must start: {e:#}"));
        assert!(engine.inner.cache.is_none());
    }
}
