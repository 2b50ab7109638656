//! A running policy's webhooks (`spec.admission`), beside its controller.
//!
//! - **Every replica** answers them: the policy's plugins are registered with the host's
//!   listener while the controller runs, chosen per object as reconciles choose them per
//!   parent (see [`Serving`]'s `Choose`), so a standby answers as the leader does. The
//!   registration outlives a restart of the controller (the previous plugins answer until
//!   the next are loaded) and goes when the policy goes, stops asking or cannot start.
//! - **The leader** keeps the policy's entries in the installation's two webhook
//!   configurations: for what the policy asks and the active plugin serves, with the CA
//!   bundle of the pair the listeners present, written again when that changes and every
//!   [`REWRITE`]. When the host shuts down, the leader relaxes a `Fail` webhook to `Ignore`
//!   until a controller serves it again: no webhook that refuses every write may outlive
//!   what answers it.
//! - A policy that stops asking, cannot start, goes, or moves to another host has its
//!   entries removed.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt as _;

use crate::admission::configurations::Scope;
use crate::admission::hosting::Hosting;
use crate::admission::review::{Answerer, FailurePolicy};
use crate::controller::kinds::ResolvedKind;
use crate::controller::reconcile::backoff::Backoff;
use crate::controller::reconcile::serving::Serving;
use crate::policy::ReconcilePolicy;
use crate::policy::admission::{AdmissionSpec, ServedWebhook};

use super::identity::Acting;
use super::shared::Shared;
use super::status::{PolicyStatusWriter, State};

/// The condition that says whether the webhooks asked for are served.
const CONDITION: &str = "WebhooksServed";
/// How often the leader checks what it should serve (the active plugin may have been
/// swapped for one that serves other webhooks).
const CHECK: Duration = Duration::from_secs(5);
/// How often the leader writes its entries even when it wrote them as they should be: an
/// edit by someone else, or an entry removed, is undone within this (a configuration
/// deleted whole comes back with the chart, whose grant lets the host make none).
const REWRITE: Duration = Duration::from_secs(60);

/// One running policy's webhooks.
pub(crate) struct PolicyWebhooks {
    name: String,
    asked: Option<AdmissionSpec>,
    scope: Scope,
    tenant: String,
    serving: Arc<Serving>,
    status: Arc<tokio::sync::Mutex<PolicyStatusWriter>>,
    /// What the leader applied last: the webhooks and the CA bundle.
    applied: tokio::sync::Mutex<Option<Applied>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Applied {
    validate: bool,
    default: bool,
    failure_policy: FailurePolicy,
    ca_bundle: String,
}

impl PolicyWebhooks {
    /// The webhooks of `policy`, whose parents are `parent` (in `namespace`, when confined),
    /// answered by `serving` as `acting`.
    pub fn new(
        policy: &ReconcilePolicy,
        shared: &Shared,
        (parent, namespace): (&ResolvedKind, Option<&str>),
        acting: &Acting,
        serving: Arc<Serving>,
        status: Arc<tokio::sync::Mutex<PolicyStatusWriter>>,
    ) -> Self {
        let name = policy.name_any();
        let asked = policy
            .spec
            .admission
            .clone()
            .filter(AdmissionSpec::serves_any);
        let mut scope = scope_of(policy, shared, parent, namespace);
        scope
            .exempt_users
            .extend(acting.account.as_ref().map(|a| a.user_name()));
        Self {
            name,
            asked,
            scope,
            tenant: crate::policy::namespaced::tenant(policy),
            serving,
            status,
            applied: tokio::sync::Mutex::new(None),
        }
    }

    /// Serve the webhooks until dropped (never completes).
    pub async fn serve(&self, shared: &Shared) {
        let Some(asked) = &self.asked else {
            self.not_asked(shared).await;
            return std::future::pending().await;
        };
        let refusal = match (&shared.webhooks, asked.problem()) {
            (None, _) => Some(State::failed(
                "WebhooksOff",
                "this host serves no webhooks: run it with --webhook-listen and --webhook-service (the chart's webhooks.enabled)",
            )),
            (Some(_), Some(problem)) => Some(State::failed("InvalidAdmission", problem)),
            (Some(_), None) => None,
        };
        let Some(hosting) = shared.webhooks.as_ref().filter(|_| refusal.is_none()) else {
            self.not_asked(shared).await;
            let mut status = self.status.lock().await;
            status.set_optional(CONDITION, refusal);
            status.flush().await;
            return std::future::pending().await;
        };
        // Registered until another controller of the policy replaces it or the policy stops
        // asking or goes: across a restart (and a panic) the previous plugins answer until
        // the next ones are loaded.
        hosting.answerers.serve(
            &self.name,
            Answerer::choosing(
                &self.name,
                self.serving.clone(),
                &self.tenant,
                self.scope.failure_policy,
            )
            .explained(shared.options.explain.clone()),
        );
        self.keep_configurations(shared, hosting, asked).await;
    }

    /// The leader's part: the configurations as the policy asks and the plugin serves,
    /// written again every [`REWRITE`] whatever it last wrote (someone may have edited or
    /// removed them).
    async fn keep_configurations(&self, shared: &Shared, hosting: &Hosting, asked: &AdmissionSpec) {
        let mut ca_bundle = hosting.ca_bundle.clone();
        let mut leading = shared.leadership.subscribe();
        let retry = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let mut written_at = tokio::time::Instant::now();
        loop {
            let served = self.serving.active.load().plugin.served_webhooks();
            let want = Applied {
                validate: asked.validate && served.validate,
                default: asked.default && served.default,
                failure_policy: self.scope.failure_policy,
                ca_bundle: ca_bundle.borrow_and_update().clone(),
            };
            let mut wait = CHECK;
            let mut problem = None;
            let leading_now = shared.leadership.is_leader();
            let shown = if leading_now {
                let mut applied = self.applied.lock().await;
                if applied.as_ref() != Some(&want) || written_at.elapsed() >= REWRITE {
                    match self.apply(shared, hosting, &want).await {
                        Ok(()) => {
                            retry.succeeded(&());
                            *applied = Some(want.clone());
                            written_at = tokio::time::Instant::now();
                        }
                        Err(error) => {
                            tracing::warn!(policy = %self.name, error = %format!("{error:#}"), "could not write the policy's webhook configurations");
                            wait = retry.failed(&()).delay;
                            problem = Some(format!("{error:#}"));
                        }
                    }
                }
                applied.clone()
            } else {
                // A standby reports nothing (its status is the leader's to write).
                Some(want.clone())
            };
            self.report(hosting, asked, shown.as_ref(), problem).await;
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                Ok(()) = ca_bundle.changed() => {}
                Ok(()) = leading.changed() => {
                    // A new leader writes what it serves: a relaxed webhook is restored.
                    *self.applied.lock().await = None;
                }
            }
        }
    }

    async fn apply(
        &self,
        shared: &Shared,
        hosting: &Hosting,
        want: &Applied,
    ) -> anyhow::Result<()> {
        let scope = Scope {
            failure_policy: want.failure_policy,
            ..self.scope.clone()
        };
        hosting
            .configurations(&shared.client)
            .reconcile(
                &scope,
                &hosting.endpoint,
                &want.ca_bundle,
                want.validate,
                want.default,
            )
            .await
    }

    /// `status.webhooks` and the condition, from what is served.
    async fn report(
        &self,
        hosting: &Hosting,
        asked: &AdmissionSpec,
        served: Option<&Applied>,
        problem: Option<String>,
    ) {
        let (validate, default) = served.map_or((false, false), |s| (s.validate, s.default));
        let mut status = self.status.lock().await;
        let configuration = hosting.configuration.clone();
        let failure_policy = self.scope.failure_policy;
        let served: Vec<ServedWebhook> = [("validate", validate), ("default", default)]
            .into_iter()
            .filter(|(_, on)| *on)
            .map(|(webhook, _)| {
                let same = status.webhooks().iter().find(|w| {
                    w.webhook == webhook
                        && w.configuration == configuration
                        && w.failure_policy == failure_policy
                });
                ServedWebhook {
                    webhook: webhook.to_owned(),
                    configuration: configuration.clone(),
                    failure_policy,
                    since: same.map_or_else(|| Time(jiff::Timestamp::now()), |w| w.since.clone()),
                }
            })
            .collect();
        let missing: Vec<&str> = [
            ("validate", asked.validate && !validate),
            ("default", asked.default && !default),
        ]
        .into_iter()
        .filter_map(|(webhook, missing)| missing.then_some(webhook))
        .collect();
        let state = if let Some(problem) = problem {
            State::failed(
                "ConfigurationNotWritten",
                format!("could not write the webhook configurations: {problem}"),
            )
        } else if !missing.is_empty() {
            State::failed(
                "WebhookNotServed",
                format!(
                    "the active plugin ({}) does not serve {}: build it with the SDK's `webhooks` feature and export them",
                    self.serving.active.load().plugin.digest().short(),
                    missing.join(" or ")
                ),
            )
        } else {
            State::ok(
                "Served",
                format!(
                    "{} served for {} by every replica (configuration {configuration})",
                    served
                        .iter()
                        .map(|w| w.webhook.as_str())
                        .collect::<Vec<_>>()
                        .join(" and "),
                    self.scope.plural
                ),
            )
        };
        status.set_webhooks(served);
        status.set_optional(CONDITION, Some(state));
        status.flush().await;
    }

    /// The policy asks for no webhook (or this host serves none): the leader removes what an
    /// earlier version served (two reads when there is none).
    async fn not_asked(&self, shared: &Shared) {
        if let Some(hosting) = &shared.webhooks {
            hosting.answerers.stop(&self.name);
        }
        if let Some(hosting) = &shared.webhooks {
            let retry = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
            loop {
                shared.leadership.until_leader().await;
                match hosting
                    .configurations(&shared.client)
                    .remove(&self.name)
                    .await
                {
                    Ok(()) => break,
                    Err(error) => {
                        tracing::warn!(policy = %self.name, error = %format!("{error:#}"), "could not remove the webhooks the policy no longer asks for");
                        tokio::time::sleep(retry.failed(&()).delay).await;
                    }
                }
            }
        }
        let mut status = self.status.lock().await;
        status.set_webhooks(Vec::new());
        status.set_optional(CONDITION, None);
        status.flush().await;
    }

    /// The controller stopped. A policy that is gone (or going) has its answerer and its
    /// entries removed. When the host is shutting down, the leader relaxes a `Fail` webhook
    /// to `Ignore` until a controller serves it again (the next leader's, or this host's
    /// when it comes back): no webhook that refuses writes outlives what answers it. A
    /// restart of the controller changes nothing: the answerer registered answers until the
    /// next controller replaces it. One attempt each; a failure is logged.
    pub async fn finish(&self, shared: &Shared) {
        let Some(hosting) = &shared.webhooks else {
            return;
        };
        let shutting_down = shared
            .shutting_down
            .load(std::sync::atomic::Ordering::Acquire);
        if !shutting_down && self.gone(shared).await {
            hosting.answerers.stop(&self.name);
            if shared.leadership.is_leader()
                && let Err(error) = hosting
                    .configurations(&shared.client)
                    .remove(&self.name)
                    .await
            {
                tracing::warn!(policy = %self.name, error = %format!("{error:#}"), "could not remove the webhooks of a policy this host no longer runs");
            }
            return;
        }
        if !shutting_down || !shared.leadership.is_leader() {
            return;
        }
        let applied = self.applied.lock().await.clone();
        let Some(applied) = applied.filter(|a| a.failure_policy == FailurePolicy::Fail) else {
            return;
        };
        let relaxed = Applied {
            failure_policy: FailurePolicy::Ignore,
            ..applied
        };
        match self.apply(shared, hosting, &relaxed).await {
            Ok(()) => {
                tracing::info!(policy = %self.name, "webhooks relaxed to failurePolicy Ignore until a controller of the policy serves them again");
            }
            Err(error) => {
                tracing::warn!(policy = %self.name, error = %format!("{error:#}"), "could not relax the policy's webhooks");
            }
        }
    }
}

impl PolicyWebhooks {
    /// Whether this host runs the policy no more: deleted (or being deleted), or no longer
    /// matching its `--policy-selector` (moved to another host). Unknown (the API server
    /// does not answer within [`GONE_CHECK`]) counts as still here: its webhooks stay.
    async fn gone(&self, shared: &Shared) -> bool {
        let policies: kube::Api<ReconcilePolicy> = kube::Api::all(shared.client.clone());
        let found = match tokio::time::timeout(GONE_CHECK, policies.get_opt(&self.name)).await {
            Ok(Ok(found)) => found,
            Ok(Err(error)) => {
                tracing::warn!(policy = %self.name, error = %error, "cannot tell whether the policy is gone; keeping its webhooks");
                return false;
            }
            Err(_) => {
                tracing::warn!(policy = %self.name, "the API server did not say whether the policy is gone; keeping its webhooks");
                return false;
            }
        };
        let Some(policy) = found else {
            return true;
        };
        let selected = shared
            .options
            .policy_selector
            .as_deref()
            .is_none_or(|text| {
                crate::policy::placement::PolicySelector::parse(text)
                    .is_ok_and(|selector| selector.matches(policy.labels()))
            });
        policy.metadata.deletion_timestamp.is_some() || !selected
    }
}

/// How long a stopping controller waits to learn whether its policy is gone.
const GONE_CHECK: Duration = Duration::from_secs(5);

/// A policy that cannot start answers no review: its answerer goes, and the leader removes
/// its entries (logged when it cannot) and says so in `status`.
pub(crate) async fn remove_unanswered(
    policy: &ReconcilePolicy,
    shared: &Shared,
    status: &mut PolicyStatusWriter,
) {
    let Some(hosting) = &shared.webhooks else {
        return;
    };
    let name = policy.name_any();
    hosting.answerers.stop(&name);
    if !shared.leadership.is_leader() {
        return;
    }
    status.set_webhooks(Vec::new());
    if policy.spec.admission.is_some() {
        status.set_optional(
            CONDITION,
            Some(State::failed(
                "PolicyNotRunning",
                "the policy's controller is not running (Ready says why): its webhooks are removed until it runs",
            )),
        );
    }
    if let Err(error) = hosting.configurations(&shared.client).remove(&name).await {
        tracing::warn!(policy = %name, error = %format!("{error:#}"), "could not remove the webhook configurations of a policy that cannot start");
    }
}

fn scope_of(
    policy: &ReconcilePolicy,
    shared: &Shared,
    parent: &ResolvedKind,
    namespace: Option<&str>,
) -> Scope {
    let asked = policy.spec.admission.clone().unwrap_or_default();
    let resource = &parent.resource;
    Scope {
        policy: policy.name_any(),
        group: resource.group.clone(),
        version: resource.version.clone(),
        plural: resource.plural.clone(),
        namespace: namespace.filter(|_| parent.namespaced).map(str::to_owned),
        operations: asked.operations(),
        failure_policy: asked.failure_policy(),
        timeout_seconds: i32::try_from(asked.timeout_seconds()).unwrap_or(30),
        exempt_users: shared
            .webhooks
            .as_ref()
            .map(|h| h.exempt_users.clone())
            .unwrap_or_default(),
    }
}
