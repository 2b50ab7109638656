//! The threads plugin calls run on: at most one per call slot, reused most-recent-first, and
//! gone after a while idle.
//!
//! A plugin call is synchronous CPU work of tens of microseconds to its deadline, so it must
//! not run on an async worker. `block_in_place` would keep it on the caller's thread, but it
//! hands that worker's other tasks to a fresh thread for the duration; at thousands of calls
//! a second (a restarted host checking every parent) the runtime started threads faster than
//! they came back idle, ~100 of them, each with its stack and allocator cache. tokio's
//! blocking pool does the same (it starts a thread whenever none is idle at that instant).
//!
//! Here a call goes to an idle call thread, or to a new one when none is idle. Callers hold
//! a call slot (`CallSlots`) for as long as their call runs, including on the thread after
//! its caller went away, and a thread is idle again before its caller's slot is given back,
//! so there are never more call threads than slots in use at once (16 for a policy that
//! reconciles 16 parents at a time), however fast calls come. Idle threads wait on a stack:
//! the busiest stay warm, and one left idle for [`LINGER`] exits, handing its memory back.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// How long an idle call thread waits for work before it exits.
const LINGER: Duration = Duration::from_secs(10);

/// Work for a call thread: runs the call and returns what delivers its answer, which the
/// thread runs only once it is idle again.
type Job = Box<dyn FnOnce() -> Deliver + Send>;
type Deliver = Box<dyn FnOnce() + Send>;

/// The idle call threads, most recently idle last.
#[derive(Default)]
pub(crate) struct CallThreads {
    idle: Mutex<Vec<IdleThread>>,
    /// Numbers threads, so one that times out can find its own entry.
    next_id: std::sync::atomic::AtomicU64,
}

struct IdleThread {
    id: u64,
    jobs: mpsc::Sender<Job>,
}

impl CallThreads {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Run `work` on a call thread and wait for its result. The caller's tracing span is
    /// entered around it. `None` if no thread could be started or `work` panicked.
    ///
    /// If the caller stops waiting, `work` still runs to its end and its result, with
    /// whatever it owns (the caller's call slot), is dropped on the call thread.
    pub(crate) async fn run<T, F>(self: &Arc<Self>, work: F) -> Option<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let span = tracing::Span::current();
        let job: Job = Box::new(move || {
            let value = span.in_scope(work);
            Box::new(move || {
                // An error means the caller stopped waiting: the value is dropped here.
                let _ = answer.send(value);
            })
        });
        let idle = self.lock().pop();
        let unsent = match idle {
            Some(thread) => thread.jobs.send(job).err().map(|error| error.0),
            None => Some(job),
        };
        if let Some(job) = unsent {
            self.start(job)?;
        }
        answered.await.ok()
    }

    /// Start a call thread with its first job.
    fn start(self: &Arc<Self>, first: Job) -> Option<()> {
        let threads = self.clone();
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (jobs, incoming) = mpsc::channel();
        std::thread::Builder::new()
            .name("wasmctrl-call".into())
            .spawn(move || threads.serve(id, jobs, incoming, first))
            .inspect_err(|error| tracing::error!(%error, "cannot start a plugin call thread"))
            .ok()
            .map(drop)
    }

    /// A call thread's life: run a job, go back on the idle stack, deliver the answer, wait
    /// for the next job; exit after [`LINGER`] without one.
    fn serve(&self, id: u64, jobs: mpsc::Sender<Job>, incoming: mpsc::Receiver<Job>, first: Job) {
        let mut job = first;
        loop {
            let deliver = job();
            // Idle before the answer goes out: the caller's slot is given back only after,
            // so whoever gets that slot next finds this thread instead of starting one.
            self.lock().push(IdleThread {
                id,
                jobs: jobs.clone(),
            });
            deliver();
            job = loop {
                match incoming.recv_timeout(LINGER) {
                    Ok(next) => break next,
                    Err(RecvTimeoutError::Disconnected) => return,
                    Err(RecvTimeoutError::Timeout) => {
                        let mut idle = self.lock();
                        if let Some(position) = idle.iter().position(|thread| thread.id == id) {
                            idle.remove(position);
                            return;
                        }
                        // A caller took this thread off the stack: its job is on the way.
                    }
                }
            };
        }
    }

    /// How many threads wait for work now.
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<IdleThread>> {
        // The stack is consistent at every point a holder could panic.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn thread_name() -> String {
        std::thread::current().name().unwrap_or_default().to_owned()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fast_calls_from_many_tasks_use_no_more_threads_than_run_at_once() {
        let threads = CallThreads::new();
        let running = Arc::new(AtomicUsize::new(0));
        let most_at_once = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let threads = threads.clone();
                let running = running.clone();
                let most_at_once = most_at_once.clone();
                tokio::spawn(async move {
                    let mut seen = HashSet::new();
                    for _ in 0..400 {
                        let running = running.clone();
                        let most_at_once = most_at_once.clone();
                        let id = threads
                            .run(move || {
                                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                                most_at_once.fetch_max(now, Ordering::SeqCst);
                                std::hint::black_box((0..2_000u64).sum::<u64>());
                                running.fetch_sub(1, Ordering::SeqCst);
                                (std::thread::current().id(), thread_name())
                            })
                            .await
                            .expect("ran");
                        seen.insert(id);
                    }
                    seen
                })
            })
            .collect();
        let mut used = HashSet::new();
        for task in tasks {
            used.extend(task.await.expect("task"));
        }
        assert!(used.iter().all(|(_, name)| name == "wasmctrl-call"));
        // Each task has at most one call in flight, and a thread is idle before its answer
        // reaches the task, so 16 tasks never need a 17th thread.
        assert!(
            used.len() <= 16,
            "{} threads served 16 callers ({} calls at once at most)",
            used.len(),
            most_at_once.load(Ordering::SeqCst)
        );
        assert_eq!(threads.idle_count(), used.len());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn runs_on_a_current_thread_runtime_and_reuses_the_idle_thread() {
        let threads = CallThreads::new();
        let first = threads.run(std::thread::current).await.expect("ran");
        let second = threads.run(std::thread::current).await.expect("ran");
        assert_eq!(first.id(), second.id());
        assert_ne!(first.id(), std::thread::current().id());
        assert_eq!(threads.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_panicking_call_is_reported_and_later_calls_still_run() {
        let threads = CallThreads::new();
        let panicked = threads.run(|| -> u32 { panic!("plugin host bug") }).await;
        assert_eq!(panicked, None);
        assert_eq!(threads.run(|| 7).await, Some(7));
    }

    #[tokio::test]
    async fn a_call_whose_caller_went_away_finishes_and_drops_its_result_on_the_thread() {
        struct Guard(Arc<AtomicUsize>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let threads = CallThreads::new();
        let dropped = Arc::new(AtomicUsize::new(0));
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let guard = Guard(dropped.clone());
        let call = threads.run(move || {
            let _ = started_tx.send(());
            std::thread::sleep(Duration::from_millis(50));
            guard
        });
        // Start the call, then stop waiting for it.
        let _ = tokio::time::timeout(Duration::from_millis(5), call).await;
        started_rx.recv().expect("the call started");
        assert_eq!(dropped.load(Ordering::SeqCst), 0, "dropped while running");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while dropped.load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(dropped.load(Ordering::SeqCst), 1);
        assert_eq!(threads.idle_count(), 1);
    }
}
