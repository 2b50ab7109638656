use std::time::Duration;

/// What one plugin call may consume. Every call gets a fresh sandbox with these limits.
///
/// The defaults fit a reconcile decision comfortably (a typical call takes tens of
/// microseconds and well under a megabyte) while stopping a runaway plugin long before it
/// hurts the host or the other parents sharing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Wall-clock time for one call, instantiation included.
    pub timeout: Duration,
    /// Linear memory the plugin may grow to, in bytes.
    pub memory_bytes: usize,
    /// Total bytes of children, status and events one call may return.
    pub max_output_bytes: usize,
    /// Number of desired children one call may return.
    pub max_children: usize,
    /// Wall-clock time for one webhook call (validate, default, convert), instantiation
    /// included. Apart from `timeout` because the API server waits for the answer while a
    /// client's write hangs on it: it must stay well inside the webhook's own timeout
    /// (10 s by default, 30 s at most).
    pub webhook_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            timeout: Duration::from_millis(500),
            memory_bytes: 64 << 20,
            max_output_bytes: 4 << 20,
            max_children: 500,
            webhook_timeout: Duration::from_secs(2),
        }
    }
}

/// Bounds on what a plugin may write to the host's log in one call, so a chatty or hostile
/// plugin cannot flood it.
pub(crate) const MAX_LOG_MESSAGE_BYTES: usize = 4 << 10;
pub(crate) const MAX_LOG_BYTES_PER_CALL: usize = 64 << 10;
/// Capacity of the guest's stdout and stderr pipes, per call.
pub(crate) const MAX_STDIO_BYTES_PER_CALL: usize = 16 << 10;
