//! Logging from a plugin into the host's structured log.
//!
//! Inside Wasm the messages go through the contract's `log` import, so the host attributes
//! them to the plugin and the parent and bounds their size. Natively (in `cargo test`) they go
//! to stderr, where the test harness captures them.

/// Severity of a log message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Very detailed tracing.
    Trace,
    /// Debugging detail.
    Debug,
    /// Normal operation.
    Info,
    /// Something unexpected that was handled.
    Warn,
    /// A failure.
    Error,
}

/// Write `message` at `level`.
pub fn write(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    {
        use crate::bindings::wasmctrl::plugin::log::{Level as Wit, log};
        let level = match level {
            Level::Trace => Wit::Trace,
            Level::Debug => Wit::Debug,
            Level::Info => Wit::Info,
            Level::Warn => Wit::Warn,
            Level::Error => Wit::Error,
        };
        log(level, message);
    }
    #[cfg(not(target_arch = "wasm32"))]
    eprintln!("[{level:?}] {message}");
}

/// Log at info level with `format!` syntax.
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Info, &::std::format!($($arg)*)) };
}

/// Log at debug level with `format!` syntax.
#[macro_export]
macro_rules! debug {
    ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Debug, &::std::format!($($arg)*)) };
}

/// Log at warn level with `format!` syntax.
#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Warn, &::std::format!($($arg)*)) };
}

/// Log at error level with `format!` syntax.
#[macro_export]
macro_rules! error {
    ($($arg:tt)*) => { $crate::log::write($crate::log::Level::Error, &::std::format!($($arg)*)) };
}
