//! Where the calls of a misbehaving policy run. A plugin that runs into its deadline burns a
//! core for the whole deadline, and on a small machine that CPU is what every other policy,
//! the host and the API server need. So a policy whose call just ran out of time is
//! *penalized* for a while (see `CallSlots::penalize`): it may run one call at a time, and
//! that call runs on a thread of its own at the kernel's idle priority (`SCHED_IDLE`), which
//! gets CPU only when nothing else wants it. The deadline is wall-clock, so a starved call
//! still ends on time; a call that succeeds lifts the penalty.
//!
//! `SCHED_IDLE` is Linux's; the host runs in production on Linux. Elsewhere (macOS, for
//! trying the host on a workstation) the penalized call still runs one at a time on a thread
//! of its own, at normal priority: the penalty bounds how many cores a looping plugin takes,
//! not how much of the one it has.

use std::sync::Once;

/// Run `work` on a new thread at idle priority and wait for its result. `None` if the
/// thread could not be started or died.
pub(crate) async fn run_at_idle_priority<T, F>(work: F) -> Option<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    let span = tracing::Span::current();
    std::thread::Builder::new()
        .name("wasmctrl-idle-call".into())
        .spawn(move || {
            let _span = span.enter();
            lower_own_priority();
            let _ = tx.send(work());
        })
        .ok()?;
    rx.await.ok()
}

/// Put the calling thread in the `SCHED_IDLE` class. An unprivileged thread may always lower
/// its own priority; if the kernel or a seccomp profile refuses, the call still runs (one at
/// a time), and the refusal is logged once.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)] // see the SAFETY comment inside
fn lower_own_priority() {
    // SAFETY: `sched_param` is plain data; all zeroes is priority 0, what SCHED_IDLE needs.
    let param: libc::sched_param = unsafe { std::mem::zeroed() };
    // The raw system call, not libc's wrapper: musl's `sched_setscheduler` always fails
    // (ENOSYS), as POSIX gives it a per-process meaning Linux does not have.
    // SAFETY: with pid 0, sched_setscheduler changes only the calling thread's scheduling
    // policy; it reads `param`, a valid local, and touches no other memory.
    let result = unsafe {
        libc::syscall(
            libc::SYS_sched_setscheduler,
            0,
            libc::SCHED_IDLE,
            &raw const param,
        )
    };
    if result != 0 {
        static WARNED: Once = Once::new();
        let error = std::io::Error::last_os_error();
        WARNED.call_once(|| {
            tracing::warn!(%error, "cannot run penalized plugin calls at idle priority; they still run one at a time");
        });
    }
}

/// No idle scheduling class outside Linux: the call runs at normal priority, still one at a
/// time (see the module docs). Said once, so that a workstation's logs do not claim more.
#[cfg(not(target_os = "linux"))]
fn lower_own_priority() {
    static SAID: Once = Once::new();
    SAID.call_once(|| {
        tracing::info!(
            "penalized plugin calls run one at a time at normal priority: idle priority (SCHED_IDLE) is Linux's"
        );
    });
}

#[cfg(test)]
mod tests {
    /// What it checks is Linux's scheduling class.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    #[allow(unsafe_code)] // see the SAFETY comment inside
    async fn work_runs_on_a_thread_of_idle_priority() {
        use super::run_at_idle_priority;

        let policy = run_at_idle_priority(|| {
            // SAFETY: sched_getscheduler(0) only reads the calling thread's policy.
            unsafe { libc::sched_getscheduler(0) }
        })
        .await
        .expect("ran");
        assert_eq!(policy, libc::SCHED_IDLE);
    }
}
