//! What serves one policy's reconciles, and all a hot swap touches: the active plugin, the
//! candidate with its canary selector, and the candidate's shadow verdicts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use kube::runtime::reflector::ObjectRef;

use crate::controller::cache::cached::CachedObject;
use crate::plugin::{Plugin, Verdict};

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
