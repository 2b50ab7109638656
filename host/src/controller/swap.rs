//! Hot swap: a running policy controller's plugin is replaced without restarting anything.
//!
//! The swapper watches for a new plugin spec (source, digest or config in the policy) and for
//! new bytes behind the current source (a replaced file, an edited ConfigMap). It loads the
//! new plugin off the reconcile path (fetch, verify the digest, compile or take the
//! precompiled artifact, check the contract), then swaps it in with one atomic store:
//! reconciles already running finish on the old plugin, every later one uses the new one.
//! Then every parent is re-enqueued so all converge to the new logic at the controller's
//! normal concurrency. A plugin that fails to load never replaces a working one: the policy
//! keeps the old one and reports `PluginLoaded=False` with the cause.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::core::Selector;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, ResourceExt as _};
use notify::Watcher as _;
use tokio::sync::{Mutex, mpsc, watch};

use super::context::{ActivePlugin, Candidate, Serving, lock};
use super::policy_controller::{Shared, load_from, load_plugin};
use super::policy_status::{PolicyStatusWriter, State};
use crate::plugin::{Digest, Plugin};
use crate::policy::{CandidateSpec, PluginSource, PluginSpec, ReconcilePolicy};

/// Plugins kept loaded after they are swapped out, so swapping back to one (a rollback) is
/// a pointer swap.
const RECENT_PLUGINS: usize = 4;

/// New bytes behind a source are picked up after this quiet period, so a file written in
/// several steps is read once, complete.
const SOURCE_SETTLE: Duration = Duration::from_millis(200);

/// Run until the controller stops: apply plugin updates as they come.
pub(crate) async fn run(
    serving: Arc<Serving>,
    shared: Arc<Shared>,
    mut policy: Arc<ReconcilePolicy>,
    mut updates: watch::Receiver<Arc<ReconcilePolicy>>,
    status: Arc<Mutex<PolicyStatusWriter>>,
    requeue_all: mpsc::UnboundedSender<()>,
) {
    let mut recent: VecDeque<Plugin> = VecDeque::new();
    let mut source_changes = SourceWatch::start(&shared, &policy.spec.plugin.source);
    let mut candidate: Option<CandidateSpec> = None;
    loop {
        sync_candidate(
            &serving,
            &shared,
            &policy,
            &mut candidate,
            &status,
            &requeue_all,
        )
        .await;
        status.lock().await.flush().await;
        tokio::select! {
            changed = updates.changed() => {
                if changed.is_err() {
                    return;
                }
                let next = updates.borrow_and_update().clone();
                let old_source = policy.spec.plugin.source.clone();
                policy = next;
                status.lock().await.set_generation(policy.metadata.generation);
                if policy.spec.plugin.source != old_source {
                    source_changes = SourceWatch::start(&shared, &policy.spec.plugin.source);
                }
            }
            () = source_changes.changed() => {
                tracing::info!(policy = %policy.name_any(), "plugin source changed");
            }
        }
        swap_to(
            &serving,
            &shared,
            &policy,
            &mut recent,
            &status,
            &requeue_all,
        )
        .await;
    }
}

/// Load what `policy` names and make it active, unless it already is.
async fn swap_to(
    serving: &Serving,
    shared: &Shared,
    policy: &ReconcilePolicy,
    recent: &mut VecDeque<Plugin>,
    status: &Mutex<PolicyStatusWriter>,
    requeue_all: &mpsc::UnboundedSender<()>,
) {
    let name = policy.name_any();
    let spec = &policy.spec.plugin;
    let config = config_text(spec);
    let current = serving.active.load_full();
    let pinned = spec
        .digest
        .as_deref()
        .and_then(|d| d.parse::<Digest>().ok());

    // A pinned digest that is already loaded needs neither a fetch nor a compile.
    let known = pinned.and_then(|digest| {
        std::iter::once(&current.plugin)
            .chain(recent.iter())
            .find(|p| {
                *p.digest() == digest
                    && p.limits() == &super::policy_controller::limits(policy.spec.limits.as_ref())
            })
            .cloned()
    });
    let started = std::time::Instant::now();
    let plugin = match known {
        Some(plugin) => plugin,
        None => match load_plugin(policy, shared).await {
            Ok(plugin) => plugin,
            Err(error) => {
                let (reason, message) = (error.reason(), error.to_string());
                tracing::warn!(policy = %name, reason, %message, active = %current.plugin.digest(), "new plugin refused; the active one keeps serving");
                shared.metrics.plugin_swapped(&name, "refused");
                status.lock().await.set_plugin(
                    State::failed(
                        reason,
                        format!("{message}; still serving {}", current.plugin.digest()),
                    ),
                    None,
                );
                return;
            }
        },
    };
    let mut status = status.lock().await;
    status.set_plugin(
        State::ok("Loaded", format!("plugin {} loaded", plugin.digest())),
        Some(plugin.digest()),
    );
    if plugin.digest() == current.plugin.digest()
        && config == current.config
        && plugin.limits() == current.plugin.limits()
    {
        return;
    }
    let from = *current.plugin.digest();
    serving.active.store(Arc::new(ActivePlugin {
        plugin: plugin.clone(),
        config,
    }));
    status.set_active_since_now();
    let _ = requeue_all.send(());
    let to = plugin.digest().to_string();
    shared.metrics.set_active_plugin(&name, Some(&to));
    let result = if recent.iter().any(|p| p.digest() == plugin.digest()) {
        "rolled_back"
    } else {
        "swapped"
    };
    shared.metrics.plugin_swapped(&name, result);
    tracing::info!(policy = %name, %from, to = %plugin.digest(), load_time = ?started.elapsed(), "plugin swapped; re-enqueuing every parent");
    if from != *plugin.digest() {
        recent.retain(|p| p.digest() != plugin.digest() && *p.digest() != from);
        recent.push_front(current.plugin.clone());
        recent.truncate(RECENT_PLUGINS);
    }
}

/// Load, replace or drop the candidate plugin when the policy's candidate changed.
async fn sync_candidate(
    serving: &Serving,
    shared: &Shared,
    policy: &ReconcilePolicy,
    loaded: &mut Option<CandidateSpec>,
    status: &Mutex<PolicyStatusWriter>,
    requeue_all: &mpsc::UnboundedSender<()>,
) {
    let wanted = policy.spec.plugin.candidate.clone();
    if wanted == *loaded {
        return;
    }
    let name = policy.name_any();
    let Some(spec) = &wanted else {
        serving.candidate.store(None);
        lock(&serving.shadow).clear();
        status.lock().await.set_candidate(None, None);
        *loaded = None;
        let _ = requeue_all.send(());
        tracing::info!(policy = %name, "candidate plugin removed");
        return;
    };
    let limits = super::policy_controller::limits(policy.spec.limits.as_ref());
    let canary = match spec
        .canary
        .as_ref()
        .map(|c| Selector::try_from(c.selector.clone()))
        .transpose()
    {
        Ok(canary) => canary,
        Err(error) => {
            let state = State::failed("InvalidSelector", format!("canary selector: {error}"));
            status.lock().await.set_candidate(Some(state), None);
            return;
        }
    };
    let name = policy.name_any();
    match load_from(shared, &name, &spec.source, spec.digest.as_deref(), limits).await {
        Ok(plugin) => {
            let config = spec
                .config
                .as_ref()
                .filter(|c| !c.is_null())
                .map(ToString::to_string)
                .or_else(|| config_text(&policy.spec.plugin));
            let digest = *plugin.digest();
            let mode = if canary.is_some() { "canary" } else { "shadow" };
            serving.candidate.store(Some(Arc::new(Candidate {
                serving: ActivePlugin { plugin, config },
                canary,
            })));
            lock(&serving.shadow).clear();
            let message = format!("candidate {digest} loaded ({mode})");
            status
                .lock()
                .await
                .set_candidate(Some(State::ok("Loaded", message)), Some(&digest));
            *loaded = wanted;
            let _ = requeue_all.send(());
            tracing::info!(policy = %name, %digest, mode, "candidate plugin loaded; re-evaluating every parent");
        }
        Err(error) => {
            let (reason, message) = (error.reason(), error.to_string());
            tracing::warn!(policy = %name, reason, %message, "candidate plugin refused");
            status
                .lock()
                .await
                .set_candidate(Some(State::failed(reason, message)), None);
        }
    }
}

/// The config a plugin is called with, as text (`None` when absent or null).
pub(crate) fn config_text(spec: &PluginSpec) -> Option<String> {
    spec.config
        .as_ref()
        .filter(|c| !c.is_null())
        .map(ToString::to_string)
}

/// Notices when the bytes behind a source may have changed.
struct SourceWatch {
    changes: mpsc::UnboundedReceiver<()>,
    /// Keeps the file watcher or the ConfigMap watch alive.
    _guard: Option<Box<dyn Send>>,
}

impl SourceWatch {
    fn start(shared: &Shared, source: &PluginSource) -> Self {
        let (tx, changes) = mpsc::unbounded_channel();
        let guard: Option<Box<dyn Send>> = if let Some(file) = &source.file {
            watch_file(PathBuf::from(&file.path), tx).map(|w| Box::new(w) as Box<dyn Send>)
        } else if let Some(cm) = &source.config_map {
            let api: Api<ConfigMap> = Api::namespaced(shared.client.clone(), &cm.namespace);
            let config = watcher::Config::default().fields(&format!("metadata.name={}", cm.name));
            let task = tokio::spawn(async move {
                let mut events = std::pin::pin!(
                    watcher(api, config)
                        .backoff(super::watch_backoff::WatchBackoff::default())
                        .applied_objects()
                );
                let mut first = true;
                while let Some(event) = events.next().await {
                    // The initial listing is the version already loaded.
                    if event.is_ok() && !std::mem::take(&mut first) && tx.send(()).is_err() {
                        return;
                    }
                }
            });
            Some(Box::new(AbortOnDrop(task)))
        } else {
            None
        };
        Self {
            changes,
            _guard: guard,
        }
    }

    /// Resolves once the source changed and then stayed quiet for a moment.
    async fn changed(&mut self) {
        if self.changes.recv().await.is_none() {
            return std::future::pending().await;
        }
        tokio::time::sleep(SOURCE_SETTLE).await;
        while self.changes.try_recv().is_ok() {}
    }
}

/// Watch the directory holding `path` (so an atomic rename over the file is seen) and
/// report events that concern the file.
fn watch_file(path: PathBuf, tx: mpsc::UnboundedSender<()>) -> Option<notify::RecommendedWatcher> {
    let dir = path
        .parent()
        .map(PathBuf::from)
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or_else(|| PathBuf::from("."));
    let name = path.file_name()?.to_owned();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if let Ok(event) = event
            && !event.kind.is_access()
            && event.paths.iter().any(|p| p.file_name() == Some(&name))
        {
            let _ = tx.send(());
        }
    })
    .map_err(|e| tracing::warn!(error = %e, "cannot watch plugin files; file changes need a policy update"))
    .ok()?;
    if let Err(error) = watcher.watch(&dir, notify::RecursiveMode::NonRecursive) {
        tracing::warn!(dir = %dir.display(), %error, "cannot watch the plugin's directory; file changes need a policy update");
        return None;
    }
    Some(watcher)
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
