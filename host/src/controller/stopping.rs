//! Stopping the host in bounded time.
//!
//! On its stop signal the host cancels every task it runs (one per policy, the loop that
//! turns NamespacedReconcilePolicies into ReconcilePolicies, the tasks that release a deleted
//! policy's parents) and waits for them: reconciles in flight finish, writes complete. That
//! wait must end whatever a task is doing — a plugin fetch that drips, a compile, a load
//! waiting for a permit, a reconcile inside a slow plugin call, a write that waits for
//! leadership — because the pod's grace period ends anyway (and a test's time with it), and
//! a host that never returns also never releases its lease. So every task is registered
//! here with where it stands; [`drain`] waits for them up to the drain time, then aborts what
//! is left and says, by name and step, what held the stop.
//!
//! An aborted task stops at its next `await`: nothing it was about to write is written, and
//! a plugin call already running finishes on its own thread within the plugin's deadline.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt as _;
use kube::runtime::reflector::Store;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How often [`drain`] looks whether every task has ended.
const POLL: Duration = Duration::from_millis(20);
/// How long aborted tasks get to drop what they hold before [`drain`] returns.
const ABORT_GRACE: Duration = Duration::from_secs(1);

/// Where one task of the host stands, in words for a person reading why a stop hung
/// ("loading its plugin", "finishing its reconciles in flight").
#[derive(Debug)]
pub(crate) struct Step(Mutex<Cow<'static, str>>);

impl Step {
    fn new(step: &'static str) -> Self {
        Self(Mutex::new(Cow::Borrowed(step)))
    }

    /// The task moved on to `step`.
    pub fn set(&self, step: impl Into<Cow<'static, str>>) {
        *crate::lock(&self.0) = step.into();
    }

    fn get(&self) -> String {
        crate::lock(&self.0).to_string()
    }
}

/// Every task the host runs that a stop must wait for, with where each stands.
#[derive(Debug, Default)]
pub struct Activity {
    tasks: Mutex<Vec<Tracked>>,
}

#[derive(Debug)]
struct Tracked {
    name: String,
    step: Arc<Step>,
    handle: AbortHandle,
}

impl Activity {
    /// A [`Step`] that starts at `step`, for a task to [`track`](Self::track) once spawned.
    pub(crate) fn step(step: &'static str) -> Arc<Step> {
        Arc::new(Step::new(step))
    }

    /// Track the spawned task `handle`, named `name`, standing at `step`.
    pub(crate) fn track(&self, name: impl Into<String>, step: Arc<Step>, handle: AbortHandle) {
        let mut tasks = crate::lock(&self.tasks);
        tasks.retain(|t| !t.handle.is_finished());
        tasks.push(Tracked {
            name: name.into(),
            step,
            handle,
        });
    }

    /// The tasks still running, each as `NAME: STEP`, sorted.
    pub fn still_running(&self) -> Vec<String> {
        let mut running: Vec<String> = crate::lock(&self.tasks)
            .iter()
            .filter(|t| !t.handle.is_finished())
            .map(|t| format!("{}: {}", t.name, t.step.get()))
            .collect();
        running.sort();
        running
    }

    fn all_finished(&self) -> bool {
        crate::lock(&self.tasks)
            .iter()
            .all(|t| t.handle.is_finished())
    }

    /// Abort every task still running: for a host whose run is dropped, or whose stop ran
    /// out of time.
    pub fn abort_all(&self) {
        for task in crate::lock(&self.tasks).iter() {
            task.handle.abort();
        }
    }
}

/// Aborts every task of an [`Activity`] when dropped.
pub(crate) struct AbortOnDrop(pub Arc<Activity>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort_all();
    }
}

/// The host's tasks did not all end within the drain time after its stop signal; they were
/// aborted.
#[derive(Debug, thiserror::Error)]
#[error(
    "the host's tasks did not stop within {} s of the stop signal and were abandoned: {}",
    within.as_secs_f32(),
    held.join("; ")
)]
pub struct StopTimedOut {
    /// The drain time.
    pub within: Duration,
    /// What was still running when it ran out, as [`Activity::still_running`] says it.
    pub held: Vec<String>,
}

/// Wait until every task in `activity` has ended (their stop tokens are cancelled by the
/// caller), at most `within`; then abort the rest and name them, giving them up to
/// [`ABORT_GRACE`] more to drop what they hold.
pub(crate) async fn drain(activity: &Activity, within: Duration) -> Result<(), StopTimedOut> {
    let deadline = Instant::now() + within;
    while !activity.all_finished() {
        if Instant::now() >= deadline {
            let held = activity.still_running();
            if held.is_empty() {
                // The last one ended between the two looks.
                return Ok(());
            }
            tracing::error!(?within, still_running = ?held, "the host did not stop in time; abandoning what is left");
            activity.abort_all();
            let grace = Instant::now() + ABORT_GRACE;
            while !activity.all_finished() && Instant::now() < grace {
                tokio::time::sleep(POLL).await;
            }
            return Err(StopTimedOut { within, held });
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(())
}

/// Run `controller` (a kube-runtime controller's stream, driven to its end, built with
/// `graceful_shutdown_on(stop)` over the store `parents`) until it ends.
///
/// kube-runtime holds every reconcile until the controller's store has had its first list,
/// and on a graceful shutdown it goes on waiting for that list although it no longer polls
/// the watch that would deliver it: a stop that comes before the first list would never end
/// (a host stopped right after a policy started hung this way). With no first list nothing
/// can have started, so then the controller ends with the stop; otherwise its reconciles in
/// flight finish first.
pub(crate) async fn until_controller_ends<K>(
    controller: impl Future<Output = ()>,
    parents: &Store<K>,
    stop: &CancellationToken,
) where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    let stopped_before_first_list = async {
        stop.cancelled().await;
        // The stop also ended the watch, so whether the store is ready is settled now.
        if parents.wait_until_ready().now_or_never().is_some() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        () = controller => {}
        () = stopped_before_first_list => {
            tracing::debug!("stopped before the parents' first list: nothing was in flight");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tasks_that_end_are_waited_for_and_those_that_hang_are_aborted_and_named() {
        let activity = Activity::default();
        let quick = tokio::spawn(tokio::time::sleep(Duration::from_millis(50)));
        activity.track("quick", Activity::step("sleeping"), quick.abort_handle());
        let hung = tokio::spawn(std::future::pending::<()>());
        let step = Activity::step("starting");
        step.set("waiting for nothing");
        activity.track("policy \"hung\"", step, hung.abort_handle());

        let started = Instant::now();
        let stopped = drain(&activity, Duration::from_millis(300)).await;
        let Err(timed_out) = stopped else {
            panic!("a pending task was not reported");
        };
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(timed_out.held, ["policy \"hung\": waiting for nothing"]);
        assert!(
            timed_out.to_string().contains("within 0.3 s"),
            "{timed_out}"
        );
        assert!(quick.is_finished());
        assert!(hung.await.is_err_and(|e| e.is_cancelled()));
        assert!(activity.still_running().is_empty());
    }

    #[tokio::test]
    async fn a_drain_with_nothing_left_returns_at_once() {
        let activity = Activity::default();
        let done = tokio::spawn(async {});
        activity.track("done", Activity::step("done"), done.abort_handle());
        let _ = done.await;
        let started = Instant::now();
        assert!(drain(&activity, Duration::from_secs(10)).await.is_ok());
        assert!(started.elapsed() < Duration::from_millis(500));
    }

    /// A kube-runtime controller over ConfigMaps fed by `objects` (a trigger that then stays
    /// open, as a watch does), stopping gracefully on `stop`; each reconcile sleeps `takes`
    /// and then counts itself in `done`.
    fn config_map_controller(
        parents: Store<k8s_openapi::api::core::v1::ConfigMap>,
        objects: Vec<k8s_openapi::api::core::v1::ConfigMap>,
        stop: &CancellationToken,
        takes: Duration,
        done: Arc<std::sync::atomic::AtomicUsize>,
    ) -> impl Future<Output = ()> {
        use futures::StreamExt as _;
        use kube::runtime::controller::{Action, Controller};
        let trigger =
            futures::stream::iter(objects.into_iter().map(Ok)).chain(futures::stream::pending());
        Controller::for_stream(trigger, parents)
            .graceful_shutdown_on(stop.clone().cancelled_owned())
            .run(
                move |_, _: Arc<()>| {
                    let done = done.clone();
                    async move {
                        tokio::time::sleep(takes).await;
                        done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        Ok::<_, kube::Error>(Action::await_change())
                    }
                },
                |_, _, _| Action::await_change(),
                Arc::new(()),
            )
            .for_each(|_| async {})
    }

    #[tokio::test]
    async fn a_controller_stopped_before_its_first_list_ends_with_the_stop() {
        // The writer lives on but never lists, as a watch cut off by the stop.
        let (parents, _writer) = kube::runtime::reflector::store();
        let stop = CancellationToken::new();
        let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let bare = config_map_controller(
            parents.clone(),
            Vec::new(),
            &stop,
            Duration::ZERO,
            done.clone(),
        );
        stop.cancel();
        // What kube-runtime does alone: it waits for a list that can no longer come. When
        // this changes, `until_controller_ends` can go.
        assert!(
            tokio::time::timeout(Duration::from_millis(300), bare)
                .await
                .is_err(),
            "kube-runtime's controller now ends on a stop before its first list"
        );
        let stop = CancellationToken::new();
        let controller =
            config_map_controller(parents.clone(), Vec::new(), &stop, Duration::ZERO, done);
        stop.cancel();
        let ended = tokio::time::timeout(
            Duration::from_secs(5),
            until_controller_ends(controller, &parents, &stop),
        )
        .await;
        assert!(ended.is_ok(), "the controller did not end with its stop");
    }

    #[tokio::test]
    async fn a_controller_stopped_mid_reconcile_finishes_that_reconcile_first() {
        use kube::runtime::watcher::Event;
        let parent = k8s_openapi::api::core::v1::ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some("parent".to_owned()),
                namespace: Some("default".to_owned()),
                ..Default::default()
            },
            ..Default::default()
        };
        let (parents, mut writer) = kube::runtime::reflector::store();
        writer.apply_watcher_event(&Event::Init);
        writer.apply_watcher_event(&Event::InitApply(parent.clone()));
        writer.apply_watcher_event(&Event::InitDone);
        let stop = CancellationToken::new();
        let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let controller = config_map_controller(
            parents.clone(),
            vec![parent],
            &stop,
            Duration::from_millis(300),
            done.clone(),
        );
        let stopping = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            stop.cancel();
        };
        let (ended, ()) = tokio::join!(
            tokio::time::timeout(
                Duration::from_secs(5),
                until_controller_ends(controller, &parents, &stop)
            ),
            stopping
        );
        assert!(
            ended.is_ok(),
            "the controller did not end after its reconcile"
        );
        assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 1);
    }
}
