//! The state of one sandboxed call: everything a plugin can reach lives here, and a fresh one
//! is built for every call so nothing leaks between parents.

use wasmtime::ResourceLimiter;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::contract::wasmctrl::plugin::log::{self, Level};
use super::limits::{MAX_LOG_BYTES_PER_CALL, MAX_LOG_MESSAGE_BYTES, MAX_STDIO_BYTES_PER_CALL};

/// Store data for one call.
pub(crate) struct Sandbox {
    /// Built on first use: a Rust plugin that never touches WASI (the common case) never pays
    /// for it. See [`Sandbox::wasi`] for what it grants.
    wasi: Option<LazyWasi>,
    table: ResourceTable,
    pub(crate) memory: MemoryCap,
    pub(crate) log: GuestLog,
    /// For log attribution.
    plugin: String,
}

struct LazyWasi {
    ctx: WasiCtx,
    stdout: MemoryOutputPipe,
    stderr: MemoryOutputPipe,
}

impl Sandbox {
    pub(crate) fn new(plugin: String, memory_limit: usize) -> Self {
        Self {
            wasi: None,
            table: ResourceTable::new(),
            memory: MemoryCap::new(memory_limit),
            log: GuestLog::default(),
            plugin,
        }
    }

    /// Forward what the guest wrote to stdout/stderr to the host's log, line by line.
    pub(crate) fn forward_stdio(&mut self) {
        let Some(wasi) = &self.wasi else { return };
        for (stream, pipe) in [("stdout", &wasi.stdout), ("stderr", &wasi.stderr)] {
            let bytes = pipe.contents();
            let text = String::from_utf8_lossy(&bytes);
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                tracing::info!(plugin = %self.plugin, stream, "{line}");
            }
            // A plugin not built with the SDK reports a panic on stderr; one built with it
            // has already logged the panic at error level, which says more than stderr.
            if stream == "stderr"
                && !self.log.has_failure()
                && let Some(last) = text.lines().rfind(|l| !l.trim().is_empty())
            {
                self.log.remember_failure(last);
            }
        }
    }
}

impl WasiView for Sandbox {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        let wasi = self.wasi.get_or_insert_with(capability_free_wasi);
        WasiCtxView {
            ctx: &mut wasi.ctx,
            table: &mut self.table,
        }
    }
}

/// A WASI context with no capabilities: no preopened directories, no environment, no
/// arguments, an empty stdin, no network (every socket address is refused), and clocks
/// frozen at zero so time cannot leak into a decision. stdout and stderr go to small
/// in-memory pipes that the host forwards to its log after the call.
fn capability_free_wasi() -> LazyWasi {
    let stdout = MemoryOutputPipe::new(MAX_STDIO_BYTES_PER_CALL);
    let stderr = MemoryOutputPipe::new(MAX_STDIO_BYTES_PER_CALL);
    let ctx = WasiCtxBuilder::new()
        .stdout(stdout.clone())
        .stderr(stderr.clone())
        .wall_clock(FrozenClock)
        .monotonic_clock(FrozenClock)
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false)
        .socket_addr_check(|_, _| Box::pin(async { false }))
        .build();
    LazyWasi {
        ctx,
        stdout,
        stderr,
    }
}

impl log::Host for Sandbox {
    fn log(&mut self, level: Level, message: String) {
        let plugin = &self.plugin;
        let Some(message) = self.log.admit(message) else {
            return;
        };
        match level {
            Level::Trace => tracing::trace!(plugin = %plugin, "{message}"),
            Level::Debug => tracing::debug!(plugin = %plugin, "{message}"),
            Level::Info => tracing::info!(plugin = %plugin, "{message}"),
            Level::Warn => tracing::warn!(plugin = %plugin, "{message}"),
            Level::Error => {
                tracing::error!(plugin = %plugin, "{message}");
                self.log.remember_failure(&message);
            }
        }
    }
}

/// Bounds the plugin's log output per call and keeps its last error message, which is
/// usually the panic message explaining a trap.
#[derive(Default)]
pub(crate) struct GuestLog {
    bytes: usize,
    dropped: usize,
    last_failure: Option<String>,
}

impl GuestLog {
    /// The message to log (truncated), or `None` once the per-call budget is spent.
    fn admit(&mut self, mut message: String) -> Option<String> {
        if self.bytes >= MAX_LOG_BYTES_PER_CALL {
            self.dropped += 1;
            return None;
        }
        truncate_on_char_boundary(&mut message, MAX_LOG_MESSAGE_BYTES);
        self.bytes += message.len();
        Some(message)
    }

    /// Kept on one line: it ends up in conditions, events and the CLI's one-line errors.
    fn remember_failure(&mut self, message: &str) {
        let mut message = message.split_whitespace().collect::<Vec<_>>().join(" ");
        truncate_on_char_boundary(&mut message, MAX_LOG_MESSAGE_BYTES);
        self.last_failure = Some(message);
    }

    fn has_failure(&self) -> bool {
        self.last_failure.is_some()
    }

    /// The plugin's last error-level message, if any.
    pub(crate) fn last_failure(&mut self) -> Option<String> {
        self.last_failure.take()
    }

    /// Messages dropped because the budget was spent.
    pub(crate) fn dropped(&self) -> usize {
        self.dropped
    }
}

fn truncate_on_char_boundary(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
}

/// Caps linear memory growth, counted over every memory the plugin has: a component made of
/// several core modules, each with its own memory, gets one budget, not one per memory.
/// Refusing growth with an error (rather than returning `false`, which a Rust guest turns
/// into an abort with a generic message) makes the trap carry this type, so the host reports
/// "memory limit exceeded" precisely.
pub(crate) struct MemoryCap {
    limit: usize,
    /// Bytes of linear memory granted so far, all memories together.
    used: usize,
}

/// The error a refused memory growth traps with.
#[derive(Debug, thiserror::Error)]
#[error("memory limit of {limit} bytes exceeded (asked for {requested})")]
pub(crate) struct MemoryCapExceeded {
    pub(crate) limit: usize,
    pub(crate) requested: usize,
}

impl MemoryCap {
    fn new(limit: usize) -> Self {
        Self { limit, used: 0 }
    }
}

/// Tables hold function references; no honest plugin needs more than this many entries.
/// Also sizes the pooled table slots (see `engine_config`).
pub(crate) const MAX_TABLE_ELEMENTS: usize = 20_000;

impl ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        // A new memory is announced as a growth from 0, so creation counts too.
        let total = self.used.saturating_add(desired.saturating_sub(current));
        if total > self.limit {
            return Err(MemoryCapExceeded {
                limit: self.limit,
                requested: total,
            }
            .into());
        }
        self.used = total;
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }
}

/// A clock that always reads zero: plugins must decide from their input, not from time.
struct FrozenClock;

impl wasmtime_wasi::HostWallClock for FrozenClock {
    fn resolution(&self) -> std::time::Duration {
        std::time::Duration::from_secs(1)
    }
    fn now(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
}

impl wasmtime_wasi::HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_budget_drops_messages_past_the_limit() {
        let mut log = GuestLog::default();
        let big = "x".repeat(MAX_LOG_MESSAGE_BYTES * 2);
        let admitted = log.admit(big).expect("first message fits");
        assert!(admitted.len() <= MAX_LOG_MESSAGE_BYTES + '…'.len_utf8());
        let mut n = 1;
        while log.admit("y".repeat(1000)).is_some() {
            n += 1;
            assert!(n < 1000, "budget never ran out");
        }
        assert_eq!(log.dropped(), 1);
    }

    #[test]
    fn truncation_respects_utf8() {
        let mut s = "é".repeat(10);
        truncate_on_char_boundary(&mut s, 5);
        assert_eq!(s, "éé…");
    }
}
