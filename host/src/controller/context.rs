//! What one policy's reconciles share: the caches they read, the plugin serving state a hot
//! swap replaces, and the bookkeeping behind the policy's status and metrics.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use kube::Client;
use kube::core::ApiResource;
use kube::runtime::reflector::{ObjectRef, Store};

use super::backoff::Backoff;
use super::cached::CachedObject;
use super::children::AllowedKind;
use super::events::EventSink;
use super::store_index::StoreIndex;
use crate::metrics::Metrics;
use crate::plugin::{Digest, Plugin, Verdict};

/// A child kind as one policy's reconciles see it: the cache of the children it already has.
/// Its index is its index in [`Caches::allowed`].
pub(crate) struct ChildCache {
    pub resource: Arc<ApiResource>,
    pub store: Store<CachedObject>,
    /// The children by their controller's uid.
    pub by_controller: Arc<StoreIndex<CachedObject>>,
    /// Updates written that the cache has not shown yet.
    pub pending: super::pending_writes::PendingWrites,
    /// Children whose create-time fields must be handed over before an apply.
    pub created: Arc<super::field_ownership::CreatedFields>,
}

/// A related kind, as the policy chooses its objects.
pub(crate) enum Related {
    /// All of a namespace, or those a selector matches: the watch holds exactly those.
    Selected(RelatedCache),
    /// Those a field of the parent names, read when first needed.
    Named(Arc<super::related::NamedObjects>),
}

/// A related kind chosen by selector (or not at all): a cache of the objects the plugin may
/// read.
pub(crate) struct RelatedCache {
    pub store: Store<CachedObject>,
    /// The objects by namespace.
    pub by_namespace: Arc<StoreIndex<CachedObject>>,
}

/// Everything one policy's reconciles share: who they act as, the caches they read, the
/// plugins that decide, and what earlier reconciles ended with.
pub(crate) struct PolicyContext {
    pub client: Client,
    pub policy: String,
    /// Value of the policy label stamped on children.
    pub policy_label: String,
    /// Server-side apply field manager for children and status.
    pub field_manager: String,
    /// The finalizer this policy holds on parents, when it asks for one.
    pub finalizer: Option<String>,
    pub parent: Arc<ApiResource>,
    pub resync: Duration,
    pub events: EventSink,
    pub metrics: Arc<Metrics>,
    /// Parents waiting for a reconcile, for `workqueue_depth`.
    pub queue: Arc<super::queue::QueueGauge>,
    /// A standby reconciles nothing; its caches stay warm for a takeover.
    pub leadership: Arc<crate::leader::Leadership>,
    /// What the reconciles read.
    pub caches: Caches,
    /// What serves the policy's reconciles: all a hot swap touches.
    pub serving: Arc<Serving>,
    /// What earlier reconciles ended with.
    pub outcomes: Outcomes,
    /// Where each reconcile leaves its record.
    pub explain: Arc<crate::explain::Explain>,
}

/// The caches of a policy's children and related objects.
pub(crate) struct Caches {
    /// The child kinds the policy allows, in the order of `children`.
    pub allowed: Vec<AllowedKind>,
    pub children: Vec<ChildCache>,
    /// In the order of the policy's `related`.
    pub related: Vec<Related>,
    /// Becomes true once every child and related cache has listed its objects.
    pub ready: tokio::sync::watch::Receiver<bool>,
}

/// What a policy's reconciles ended with, for retries and the policy's counts.
pub(crate) struct Outcomes {
    /// Retry delays of the failing parents.
    pub backoff: Backoff<ObjectRef<CachedObject>>,
    /// Parents whose last reconcile succeeded, and the plugin that decided it.
    pub reconciled: Mutex<HashMap<ObjectRef<CachedObject>, Option<Digest>>>,
    /// Status writes the parents' cache has not shown yet.
    pub status_writes: super::pending_writes::PendingWrites,
}

impl Outcomes {
    /// No parent reconciled yet; failures back off from `base` to `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            backoff: Backoff::new(base, max),
            reconciled: Mutex::default(),
            status_writes: Default::default(),
        }
    }
}

/// The swappable state of one policy: the active plugin, the candidate, and the candidate's
/// shadow verdicts. The swap task holds this, and nothing else of the policy's context.
pub(crate) struct Serving {
    /// The plugin and config serving this policy. Each reconcile takes what is active when
    /// it starts; a swap affects only reconciles that start after it.
    pub active: ArcSwap<ActivePlugin>,
    /// The candidate plugin, if the policy names one.
    pub candidate: arc_swap::ArcSwapOption<Candidate>,
    /// The candidate's shadow verdict per parent, since it was loaded.
    pub shadow: Mutex<HashMap<ObjectRef<CachedObject>, Verdict>>,
}

impl Serving {
    /// Serving `active`, with no candidate.
    pub fn new(active: ActivePlugin) -> Self {
        Self {
            active: ArcSwap::from_pointee(active),
            candidate: arc_swap::ArcSwapOption::empty(),
            shadow: Mutex::default(),
        }
    }
}

impl Serving {
    /// Which plugin decides for a parent with these labels, and which one shadows it: the
    /// candidate serves the parents its canary selector matches and shadows all others; with
    /// no candidate, the active plugin serves alone.
    pub fn select(&self, labels: &std::collections::BTreeMap<String, String>) -> Selection {
        use kube::core::SelectorExt as _;
        let candidate = self.candidate.load_full();
        match candidate {
            Some(candidate)
                if candidate
                    .canary
                    .as_ref()
                    .is_some_and(|selector| selector.matches(labels)) =>
            {
                Selection {
                    serving: candidate.serving.clone(),
                    shadow: None,
                }
            }
            shadow => Selection {
                serving: self.active.load_full(),
                shadow: shadow.map(|candidate| candidate.serving.clone()),
            },
        }
    }
}

/// The plugins one reconcile uses, chosen when it starts.
pub(crate) struct Selection {
    /// The plugin whose answer is applied.
    pub serving: Arc<ActivePlugin>,
    /// A candidate called on the same request for comparison only.
    pub shadow: Option<Arc<ActivePlugin>>,
}

/// The plugin serving a policy and the config it is called with, swapped as one.
pub(crate) struct ActivePlugin {
    pub plugin: Plugin,
    pub config: Option<String>,
}

/// A candidate plugin: serving the parents its canary selector matches, and evaluated in
/// shadow for all others.
pub(crate) struct Candidate {
    pub serving: Arc<ActivePlugin>,
    pub canary: Option<kube::core::Selector>,
}

pub(crate) use crate::lock;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::testing::{label_selector, parent, serving};

    fn labels(parent: &kube::core::DynamicObject) -> &std::collections::BTreeMap<String, String> {
        use kube::ResourceExt as _;
        parent.labels()
    }

    fn candidate(canary: Option<(&str, &str)>) -> Arc<Candidate> {
        Arc::new(Candidate {
            serving: serving("candidate"),
            canary: canary.map(|(key, value)| label_selector(key, value)),
        })
    }

    #[test]
    fn without_a_candidate_the_active_plugin_serves_alone() {
        let state = Serving::new(ActivePlugin {
            plugin: crate::controller::testing::plugin(),
            config: Some("active".into()),
        });
        let selection = state.select(labels(&parent("a", "p", &[])));
        assert_eq!(selection.serving.config.as_deref(), Some("active"));
        assert!(selection.shadow.is_none());
    }

    #[test]
    fn a_candidate_without_a_canary_shadows_every_parent() {
        let state = Serving::new(ActivePlugin {
            plugin: crate::controller::testing::plugin(),
            config: Some("active".into()),
        });
        state.candidate.store(Some(candidate(None)));
        let selection = state.select(labels(&parent("a", "p", &[("tier", "canary")])));
        assert_eq!(selection.serving.config.as_deref(), Some("active"));
        let shadow = selection.shadow.expect("a shadow");
        assert_eq!(shadow.config.as_deref(), Some("candidate"));
    }

    #[test]
    fn a_canary_serves_the_parents_it_selects_and_shadows_the_others() {
        let state = Serving::new(ActivePlugin {
            plugin: crate::controller::testing::plugin(),
            config: Some("active".into()),
        });
        state
            .candidate
            .store(Some(candidate(Some(("tier", "canary")))));

        let selected = state.select(labels(&parent("a", "p", &[("tier", "canary")])));
        assert_eq!(selected.serving.config.as_deref(), Some("candidate"));
        assert!(
            selected.shadow.is_none(),
            "a canary parent is not also shadowed"
        );

        let other = state.select(labels(&parent("a", "q", &[("tier", "main")])));
        assert_eq!(other.serving.config.as_deref(), Some("active"));
        let shadow = other.shadow.expect("the others are shadowed");
        assert_eq!(shadow.config.as_deref(), Some("candidate"));

        // Removing the candidate takes effect at the next selection.
        state.candidate.store(None);
        let after = state.select(labels(&parent("a", "p", &[("tier", "canary")])));
        assert_eq!(after.serving.config.as_deref(), Some("active"));
        assert!(after.shadow.is_none());
    }
}
