//! Noticing that the bytes behind a plugin source may have changed (a replaced file, an
//! edited ConfigMap), so the swap can load them. HTTP and OCI sources are immutable by
//! convention (a new version is a new URL or tag), so they are not watched.

use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};
use notify::Watcher as _;
use tokio::sync::mpsc;

use crate::policy::PluginSource;
use crate::watch_backoff::WatchBackoff;

/// New bytes behind a source are picked up after this quiet period, so a file written in
/// several steps is read once, complete.
const SOURCE_SETTLE: Duration = Duration::from_millis(200);

/// Notices when the bytes behind a source may have changed.
pub(crate) struct SourceWatch {
    changes: mpsc::UnboundedReceiver<()>,
    /// Keeps the file watcher or the ConfigMap watch alive.
    _guard: Option<Box<dyn Send>>,
}

impl SourceWatch {
    /// Start watching `source`; a source kind that cannot change in place never reports.
    pub fn start(client: &Client, source: &PluginSource) -> Self {
        let (tx, changes) = mpsc::unbounded_channel();
        let guard: Option<Box<dyn Send>> = if let Some(file) = &source.file {
            watch_file(PathBuf::from(&file.path), tx).map(|w| Box::new(w) as Box<dyn Send>)
        } else if let Some(cm) = &source.config_map {
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), &cm.namespace);
            let config = watcher::Config::default().fields(&format!("metadata.name={}", cm.name));
            let task = tokio::spawn(async move {
                let mut events = std::pin::pin!(
                    crate::watch_lists::watcher(api, config)
                        .backoff(WatchBackoff::default())
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
    pub async fn changed(&mut self) {
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
