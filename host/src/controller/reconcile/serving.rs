//! What serves one policy's reconciles, and all a hot swap touches: the active plugin, the
//! candidate with its canary selector, and the candidate's shadow verdicts.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use kube::runtime::reflector::ObjectRef;

use kube::ResourceExt as _;
use kube::core::DynamicObject;

use crate::admission::review::{Answering, Choose, Chosen, Comparison, Hook};
use crate::controller::cache::cached::CachedObject;
use crate::plugin::{Plugin, Verdict};
use crate::policy::admission::ShadowWebhooks;

/// The swappable state of one policy: the active plugin, the candidate, and the candidate's
/// shadow verdicts. The swap task holds this, and nothing else of the policy's context.
pub(crate) struct Serving {
    /// The plugin and config serving this policy. Each reconcile takes what is active when
    /// it starts; a swap affects only reconciles that start after it.
    pub active: ArcSwap<ActivePlugin>,
    /// The candidate plugin, if the policy names one.
    pub candidate: arc_swap::ArcSwapOption<Candidate>,
    /// The candidate's shadow verdict per parent, since it was loaded.
    pub shadow: Mutex<HashMap<ObjectRef<CachedObject>, Shadowed>>,
    /// The candidate's shadow webhook answers, compared, since it was loaded.
    pub webhook_shadow: Mutex<WebhookShadow>,
}

/// A candidate's shadow webhook answers, compared with the active plugin's.
#[derive(Debug, Default)]
pub(crate) struct WebhookShadow {
    /// The candidate they are of: another candidate starts over.
    pub digest: Option<crate::plugin::Digest>,
    pub counts: ShadowWebhooks,
}

/// The candidate's shadow run for one parent.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Shadowed {
    pub verdict: Verdict,
    /// The children the active plugin answered.
    pub children: u64,
    /// Of those, the children the candidate's answer leaves out: what it would prune were it
    /// serving this parent.
    pub would_prune: u64,
}

impl From<Verdict> for Shadowed {
    /// A verdict with no children counted.
    fn from(verdict: Verdict) -> Self {
        Self {
            verdict,
            children: 0,
            would_prune: 0,
        }
    }
}

impl Serving {
    /// Serving `active`, with no candidate.
    pub fn new(active: ActivePlugin) -> Self {
        Self {
            active: ArcSwap::from_pointee(active),
            candidate: arc_swap::ArcSwapOption::empty(),
            shadow: Mutex::default(),
            webhook_shadow: Mutex::default(),
        }
    }

    /// The shadow webhook comparisons of the candidate now loaded (none without one, or
    /// before any).
    pub fn webhook_shadow(&self) -> Option<ShadowWebhooks> {
        let candidate = self.candidate.load_full()?;
        let shadow = crate::lock(&self.webhook_shadow);
        (shadow.digest.as_ref() == Some(candidate.serving.plugin.digest()))
            .then(|| shadow.counts.clone())
    }
}

/// Differences kept as examples.
const WEBHOOK_EXAMPLES: usize = 5;

impl Choose for Serving {
    /// The plugin reconciles would choose for the object as a parent, and the candidate in
    /// shadow for the others.
    fn choose(
        &self,
        hook: Hook,
        labels: &std::collections::BTreeMap<String, String>,
        uid: Option<&str>,
    ) -> Chosen {
        let selection = self.select(labels, uid);
        // A candidate that does not serve the webhook leaves its share to the active plugin
        // (its shadow comparisons say it would fail there).
        let served = selection.serving.plugin.served_webhooks();
        let serves = match hook {
            Hook::Validate => served.validate,
            Hook::Default => served.default,
        };
        let serving = if serves {
            selection.serving
        } else {
            self.active.load_full()
        };
        Chosen {
            answering: answering(&serving),
            shadow: selection.shadow.as_deref().map(answering),
        }
    }

    fn compared(
        &self,
        hook: Hook,
        object: Option<&DynamicObject>,
        shadow: &Answering,
        comparison: Comparison,
    ) {
        // Counted for the candidate loaded now only: one replaced meanwhile starts over.
        let Some(candidate) = self.candidate.load_full() else {
            return;
        };
        let digest = *candidate.serving.plugin.digest();
        if digest != *shadow.plugin.digest() {
            return;
        }
        let mut shadow = crate::lock(&self.webhook_shadow);
        if shadow.digest != Some(digest) {
            *shadow = WebhookShadow {
                digest: Some(digest),
                counts: ShadowWebhooks::default(),
            };
        }
        let counts = &mut shadow.counts;
        counts.evaluated += 1;
        let what = match comparison {
            Comparison::Same => return,
            Comparison::WouldDeny(message) => {
                counts.would_deny += 1;
                format!("would deny: {message}")
            }
            Comparison::WouldAllow => {
                counts.would_allow += 1;
                "would allow".to_owned()
            }
            Comparison::WouldDefaultDifferently => {
                counts.would_default_differently += 1;
                "would fill in other defaults".to_owned()
            }
            Comparison::WouldFail(why) => {
                counts.would_fail += 1;
                format!("would fail: {why}")
            }
        };
        let name = object.map_or_else(
            || "(unnamed)".to_owned(),
            |o| match &o.metadata.namespace {
                Some(ns) => format!("{ns}/{}", o.name_any()),
                None => o.name_any(),
            },
        );
        let example = crate::controller::reconcile::events::truncate(
            format!("{name} {}: {what}", hook.name()),
            512,
        );
        counts.examples.insert(0, example);
        counts.examples.truncate(WEBHOOK_EXAMPLES);
    }
}

fn answering(plugin: &ActivePlugin) -> Answering {
    Answering {
        plugin: plugin.plugin.clone(),
        config: plugin.config.clone(),
    }
}

impl Serving {
    /// Which plugin decides for a parent with these labels and uid, and which one shadows
    /// it: the candidate serves the parents its canary selector matches and those inside its
    /// rollout share, and shadows all others; a rolled-back candidate does neither; with no
    /// candidate, the active plugin serves alone.
    pub fn select(
        &self,
        labels: &std::collections::BTreeMap<String, String>,
        uid: Option<&str>,
    ) -> Selection {
        let candidate = self.candidate.load_full();
        match candidate {
            Some(candidate) if candidate.serves(labels, uid) => Selection {
                serving: candidate.serving.clone(),
                shadow: None,
            },
            candidate => Selection {
                serving: self.active.load_full(),
                shadow: candidate
                    .filter(|c| !c.is_stopped())
                    .map(|candidate| candidate.serving.clone()),
            },
        }
    }
}

impl Serving {
    /// The digest of the plugin that decides for every parent: a candidate whose rollout
    /// reached every parent, else the active plugin.
    pub fn digest_serving_all(&self) -> crate::plugin::Digest {
        match self.candidate.load_full() {
            Some(candidate)
                if !candidate.is_stopped() && candidate.percent.load(Ordering::Relaxed) == 100 =>
            {
                *candidate.serving.plugin.digest()
            }
            _ => *self.active.load().plugin.digest(),
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
    /// The share of parents (0 to 100) a rollout has the candidate serve now.
    pub percent: AtomicU8,
    /// Set when a rollout rolled the candidate back: it serves and shadows nothing.
    pub stopped: AtomicBool,
}

impl Candidate {
    /// A candidate serving the parents `canary` selects (none without one), and no share.
    pub fn new(serving: Arc<ActivePlugin>, canary: Option<kube::core::Selector>) -> Self {
        Self {
            serving,
            canary,
            percent: AtomicU8::new(0),
            stopped: AtomicBool::new(false),
        }
    }

    /// Whether the candidate decides for this parent.
    pub fn serves(
        &self,
        labels: &std::collections::BTreeMap<String, String>,
        uid: Option<&str>,
    ) -> bool {
        use kube::core::SelectorExt as _;
        if self.is_stopped() {
            return false;
        }
        self.canary
            .as_ref()
            .is_some_and(|selector| selector.matches(labels))
            || uid.is_some_and(|uid| in_share(uid, self.percent.load(Ordering::Relaxed)))
    }

    /// Whether a rollout rolled the candidate back.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }
}

/// Whether the parent with this uid is among the `percent` share a rollout serves with the
/// candidate. The bucket is a hash of the uid, so it is the same in every host and every
/// version, a parent stays in the share as it grows, and parents are spread evenly.
pub(crate) fn in_share(uid: &str, percent: u8) -> bool {
    use sha2::Digest as _;
    let hash = sha2::Sha256::digest(uid.as_bytes());
    let bucket = u16::from_be_bytes([hash[0], hash[1]]) % 100;
    bucket < u16::from(percent)
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
        Arc::new(Candidate::new(
            serving("candidate"),
            canary.map(|(key, value)| label_selector(key, value)),
        ))
    }

    #[test]
    fn without_a_candidate_the_active_plugin_serves_alone() {
        let state = Serving::new(ActivePlugin {
            plugin: crate::controller::testing::plugin(),
            config: Some("active".into()),
        });
        let selection = state.select(labels(&parent("a", "p", &[])), None);
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
        let selection = state.select(labels(&parent("a", "p", &[("tier", "canary")])), None);
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

        let selected = state.select(labels(&parent("a", "p", &[("tier", "canary")])), None);
        assert_eq!(selected.serving.config.as_deref(), Some("candidate"));
        assert!(
            selected.shadow.is_none(),
            "a canary parent is not also shadowed"
        );

        let other = state.select(labels(&parent("a", "q", &[("tier", "main")])), None);
        assert_eq!(other.serving.config.as_deref(), Some("active"));
        let shadow = other.shadow.expect("the others are shadowed");
        assert_eq!(shadow.config.as_deref(), Some("candidate"));

        // Removing the candidate takes effect at the next selection.
        state.candidate.store(None);
        let after = state.select(labels(&parent("a", "p", &[("tier", "canary")])), None);
        assert_eq!(after.serving.config.as_deref(), Some("active"));
        assert!(after.shadow.is_none());
    }

    #[test]
    fn a_rollout_share_is_stable_grows_as_a_superset_and_spreads_evenly() {
        let uids: Vec<String> = (0..2000).map(|i| format!("uid-{i}")).collect();
        let share = |percent| uids.iter().filter(|u| in_share(u, percent)).count();
        assert_eq!(share(0), 0);
        assert_eq!(share(100), uids.len());
        let ten = share(10);
        assert!((150..=250).contains(&ten), "about 10% of 2000: {ten}");
        let fifty = share(50);
        assert!((900..=1100).contains(&fifty), "about 50% of 2000: {fifty}");
        for uid in &uids {
            assert_eq!(in_share(uid, 10), in_share(uid, 10), "stable");
            assert!(!in_share(uid, 10) || in_share(uid, 50), "10% is inside 50%");
        }
    }

    #[test]
    fn a_candidate_serves_its_share_by_uid_and_nothing_once_stopped() {
        let state = Serving::new(ActivePlugin {
            plugin: crate::controller::testing::plugin(),
            config: Some("active".into()),
        });
        let candidate = candidate(None);
        state.candidate.store(Some(candidate.clone()));
        let inside = (0..100)
            .map(|i| format!("uid-{i}"))
            .find(|u| in_share(u, 10))
            .expect("some uid is in 10%");
        let outside = (0..100)
            .map(|i| format!("uid-{i}"))
            .find(|u| !in_share(u, 10))
            .expect("some uid is not");
        let p = parent("a", "p", &[]);
        assert!(
            state.select(labels(&p), Some(&inside)).shadow.is_some(),
            "0% serves none"
        );
        candidate.percent.store(10, Ordering::Relaxed);
        let served = state.select(labels(&p), Some(&inside));
        assert_eq!(served.serving.config.as_deref(), Some("candidate"));
        let other = state.select(labels(&p), Some(&outside));
        assert_eq!(other.serving.config.as_deref(), Some("active"));
        assert!(other.shadow.is_some());

        candidate.stopped.store(true, Ordering::Relaxed);
        for uid in [&inside, &outside] {
            let selection = state.select(labels(&p), Some(uid));
            assert_eq!(selection.serving.config.as_deref(), Some("active"));
            assert!(
                selection.shadow.is_none(),
                "a rolled-back candidate shadows nothing"
            );
        }
    }
}
