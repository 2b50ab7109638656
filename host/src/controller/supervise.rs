//! Keeps one policy's task alive: a run that panics (a bug in the host, not a plugin's fault:
//! plugins trap inside their sandbox) would otherwise leave the policy without a controller
//! while its status still says `Ready=True`. A panicked run is reported and started again after
//! a delay that doubles with each panic in a row, and is forgotten once a run lasted.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt as _;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The delay before the first restart.
const FIRST_DELAY: Duration = Duration::from_secs(1);
/// The longest delay between restarts.
const MAX_DELAY: Duration = Duration::from_secs(60);
/// A run that lasted this long before it panicked starts the delays over.
const STEADY: Duration = Duration::from_secs(60);

/// How long to wait before restarting a run that panicked.
#[derive(Debug)]
pub(crate) struct RestartBackoff {
    next: Duration,
}

impl Default for RestartBackoff {
    fn default() -> Self {
        Self { next: FIRST_DELAY }
    }
}

impl RestartBackoff {
    /// The delay before the next run, after one that panicked having run for `ran_for`.
    pub fn after_panic(&mut self, ran_for: Duration) -> Duration {
        if ran_for >= STEADY {
            self.next = FIRST_DELAY;
        }
        let delay = self.next;
        self.next = (self.next * 2).min(MAX_DELAY);
        delay
    }
}

/// A run that panicked, as reported before the restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Crash {
    /// The panic's message.
    pub message: String,
    /// When the next run starts.
    pub restart_in: Duration,
}

/// Run `work` until it returns or `stop` is cancelled, starting it again (after
/// [`RestartBackoff`]'s delay) each time it panics while not stopped. `crashed` reports each
/// panic before the wait. A run that panics while stopping is not restarted.
pub(crate) async fn supervise<W, Fut, R, RFut>(
    policy: &str,
    stop: &CancellationToken,
    mut work: W,
    mut crashed: R,
) where
    W: FnMut() -> Fut,
    Fut: Future<Output = ()>,
    R: FnMut(Crash) -> RFut,
    RFut: Future<Output = ()>,
{
    let mut backoff = RestartBackoff::default();
    loop {
        let started = Instant::now();
        // The run shares nothing with the next one but what is behind `Arc`s and locks that
        // survive a panic (poison is ignored throughout the host), so unwinding is safe here.
        let Err(payload) = AssertUnwindSafe(work()).catch_unwind().await else {
            return;
        };
        let message = panic_message(&*payload);
        if stop.is_cancelled() {
            tracing::error!(%policy, panic = %message, "policy controller panicked while stopping");
            return;
        }
        let restart_in = backoff.after_panic(started.elapsed());
        tracing::error!(%policy, panic = %message, ?restart_in, "policy controller panicked; restarting it");
        tokio::select! {
            () = crashed(Crash { message, restart_in }) => {}
            () = stop.cancelled() => return,
        }
        tokio::select! {
            () = tokio::time::sleep(restart_in) => {}
            () = stop.cancelled() => return,
        }
    }
}

/// The text a panic was raised with.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn delays_double_to_a_minute_and_start_over_after_a_long_run() {
        let mut backoff = RestartBackoff::default();
        let short = Duration::from_millis(10);
        let delays: Vec<u64> = (0..8)
            .map(|_| backoff.after_panic(short).as_secs())
            .collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(backoff.after_panic(STEADY), FIRST_DELAY);
        assert_eq!(backoff.after_panic(short), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_run_is_reported_and_restarted_until_it_returns() {
        let stop = CancellationToken::new();
        let runs = Arc::new(Mutex::new(0u32));
        let crashes = Arc::new(Mutex::new(Vec::new()));
        let started = Instant::now();
        supervise(
            "p",
            &stop,
            || {
                let runs = runs.clone();
                async move {
                    let run = {
                        let mut runs = crate::lock(&runs);
                        *runs += 1;
                        *runs
                    };
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    assert!(run >= 3, "run {run} failed");
                }
            },
            |crash| {
                crate::lock(&crashes).push(crash);
                async {}
            },
        )
        .await;
        assert_eq!(*crate::lock(&runs), 3);
        let crashes = crate::lock(&crashes).clone();
        let delays: Vec<_> = crashes.iter().map(|c| c.restart_in.as_secs()).collect();
        assert_eq!(delays, [1, 2]);
        assert!(crashes[0].message.contains("run 1 failed"), "{crashes:?}");
        assert!(started.elapsed() >= Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn stopping_ends_the_wait_and_a_panic_while_stopping_is_not_restarted() {
        let stop = CancellationToken::new();
        let runs = Arc::new(Mutex::new(0u32));
        let waiting = supervise(
            "p",
            &stop,
            || {
                *crate::lock(&runs) += 1;
                async { panic!("always") }
            },
            |_| async {},
        );
        let stopper = async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            stop.cancel();
        };
        tokio::join!(waiting, stopper);
        assert_eq!(
            *crate::lock(&runs),
            2,
            "runs at 0 s and 1 s, stopped in the 2 s wait"
        );

        let stopped = CancellationToken::new();
        stopped.cancel();
        let mut calls = 0;
        supervise(
            "p",
            &stopped,
            || {
                calls += 1;
                async { panic!("while stopping") }
            },
            |_| async { unreachable!("no report while stopping") },
        )
        .await;
        assert_eq!(calls, 1);
    }
}
