//! Whether each of a policy's watches works. A kind the host cannot list (no RBAC, a CRD
//! removed, a broken conversion webhook) would otherwise leave its cache unsynced with no
//! word anywhere: reconciles would wait and the policy would still say `Ready=True`. Every
//! watch reports here; the policy's `Ready` condition names the kinds that fail and why.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kube::runtime::watcher;

use crate::controller::policy_run::status::State;

/// The last error of every watch that is failing now, by kind.
#[derive(Default)]
pub(crate) struct WatchHealth {
    failing: Mutex<BTreeMap<String, (&'static str, String)>>,
}

impl WatchHealth {
    /// Note what the watch of `kind` just yielded: an error marks it failing, anything
    /// else healthy.
    pub fn observe<K>(&self, kind: &str, event: &Result<watcher::Event<K>, watcher::Error>) {
        let mut failing = crate::lock(&self.failing);
        match event {
            Err(error) => {
                failing.insert(kind.to_owned(), classify(error));
            }
            Ok(_) => {
                failing.remove(kind);
            }
        }
    }

    /// The watch of `kind` fails with `reason` and `message` (from [`classify`]): for a
    /// watch another task runs on the policy's behalf.
    pub fn failing(&self, kind: &str, reason: &'static str, message: &str) {
        crate::lock(&self.failing).insert(kind.to_owned(), (reason, message.to_owned()));
    }

    /// The watch of `kind` works again.
    pub fn working(&self, kind: &str) {
        crate::lock(&self.failing).remove(kind);
    }

    /// The policy's `Ready` state while some watch fails: the first failing kind's reason,
    /// and every failing kind in the message.
    pub fn problem(&self) -> Option<State> {
        let failing = crate::lock(&self.failing);
        let (_, (reason, _)) = failing.iter().next()?;
        let message = failing
            .iter()
            .map(|(kind, (_, message))| format!("cannot watch {kind}: {message}"))
            .collect::<Vec<_>>()
            .join("; ");
        Some(State::failed(reason, message))
    }
}

/// One shard's watch of a kind fed per shard (see [`crate::controller::cache::per_shard`]),
/// reporting as a watch of its own: one shard failing is not hidden by the others working.
/// Its entry goes with it, when the shard is let go.
pub(crate) struct ShardWatch {
    health: Arc<WatchHealth>,
    name: String,
}

impl ShardWatch {
    /// The watch of `shard` of the kind named `kind`.
    pub fn new(health: Arc<WatchHealth>, kind: &str, shard: u32) -> Self {
        Self {
            health,
            name: format!("{kind} (shard {shard})"),
        }
    }

    pub fn observe<K>(&self, event: &Result<watcher::Event<K>, watcher::Error>) {
        self.health.observe(&self.name, event);
    }
}

impl Drop for ShardWatch {
    fn drop(&mut self) {
        self.health.working(&self.name);
    }
}

/// A condition reason and message for a watch error.
pub(crate) fn classify(error: &watcher::Error) -> (&'static str, String) {
    let code = match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => Some(status.code),
        watcher::Error::WatchError(status) => Some(status.code),
        _ => None,
    };
    let reason = match code {
        Some(403) => "Forbidden",
        Some(404) => "KindNotFound",
        _ => "WatchFailed",
    };
    (reason, error.to_string())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;

    use super::*;

    fn failed() -> Result<watcher::Event<ConfigMap>, watcher::Error> {
        Err(watcher::Error::NoResourceVersion)
    }

    #[test]
    fn one_shard_s_watch_failing_is_not_hidden_by_another_s_working_and_goes_with_its_shard() {
        let health = Arc::new(WatchHealth::default());
        let (zero, one) = (
            ShardWatch::new(health.clone(), "v1 ConfigMap", 0),
            ShardWatch::new(health.clone(), "v1 ConfigMap", 1),
        );
        zero.observe(&failed());
        one.observe(&Ok(watcher::Event::<ConfigMap>::InitDone));
        let problem = health.problem().expect("shard 0's watch fails");
        assert!(
            problem
                .message
                .contains("cannot watch v1 ConfigMap (shard 0)"),
            "{}",
            problem.message
        );
        drop(zero);
        assert!(health.problem().is_none(), "a shard let go fails no more");
        drop(one);
    }
}
