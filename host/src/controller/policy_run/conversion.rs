//! A policy's conversion (`spec.conversion`): its plugin converts the parent kind between
//! API versions, as the parent CRD's conversion webhook, answered on every replica.
//!
//! - **Before the controller starts** ([`prepare`]), the policy's plugin converts on this
//!   replica and the CRD sends the API server to the hosts: the leader writes it, a standby
//!   waits to see it written. Nothing of the policy reads or writes a parent before, since a
//!   write at a version the API server could not convert to would lose the fields of the
//!   other version (pruned). A policy whose conversion cannot be served does not start; its
//!   `Ready` says why.
//! - **While it runs** ([`PolicyConversion`]), the active plugin converts (a hot swap
//!   converts with the new one from its first review), and the leader keeps the stanza as
//!   it should be: written again when the CA bundle changes or someone else changed it.
//! - **When it stops asking, or goes** ([`retire`]), the leader puts the CRD's conversion
//!   back as it was, unless objects are still stored at a version only the webhook can read
//!   them from: then the plugin keeps converting, `ConversionServed` says why (`StillNeeded`)
//!   and what to do (`wasmctrl migrate`), and the stanza goes back once they are rewritten.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt as _;

use crate::admission::conversion::{ConvertedKind, Converter};
use crate::admission::crd_conversion::{CrdConversion, CrdError, Restored, Served, crd_name};
use crate::admission::hosting::Hosting;
use crate::controller::kinds::ResolvedKind;
use crate::controller::labels::CONVERSION_FINALIZER;
use crate::controller::reconcile::serving::Serving;
use crate::plugin::Plugin;
use crate::policy::ReconcilePolicy;
use crate::policy::conversion::{ConversionSpec, ConversionStatus};

use super::release::set_finalizer_of_policy;
use super::shared::Shared;
use super::status::{PolicyStatusWriter, State};

/// The condition that says whether the conversion asked for is served.
const CONDITION: &str = "ConversionServed";
/// How often the leader checks the CRD's stanza (and, once the policy stops asking, whether
/// it can be put back).
const CHECK: Duration = Duration::from_secs(30);
/// How long a standby waits for the leader to point the CRD at the hosts before it reports
/// that it cannot start (and tries again).
const STANDBY_WAIT: Duration = Duration::from_secs(30);
/// How long the leader gives the API servers to take up a CRD's new conversion stanza
/// before the policy reads or writes a parent at a version only the webhook can give.
const SETTLE: Duration = Duration::from_secs(2);

/// Before `policy`'s controller starts: when it asks for conversion, its `plugin` converts
/// on this replica, and the CRD of `parent` sends the API server to the hosts. The state
/// that keeps the policy from starting when it cannot be so.
pub(crate) async fn prepare(
    policy: &ReconcilePolicy,
    shared: &Shared,
    plugin: &Plugin,
    parent: &ResolvedKind,
    status: &mut PolicyStatusWriter,
) -> Result<(), State> {
    let Some(asked) = &policy.spec.conversion else {
        return Ok(());
    };
    let refused = |state: State| {
        let message = format!("its conversion cannot be served: {}", state.message);
        Err(State::failed(state.reason, message))
    };
    let Some(hosting) = &shared.webhooks else {
        return refused(State::failed(
            "WebhooksOff",
            "this host serves no webhooks: run it with --webhook-listen and --webhook-service (the chart's webhooks.enabled)",
        ));
    };
    if !plugin.served_webhooks().convert {
        return refused(not_served(plugin));
    }
    let name = policy.name_any();
    let fixed = plugin.clone();
    hosting.answerers.convert(
        &name,
        converter(
            policy,
            shared,
            &parent.resource.plural,
            Arc::new(move || fixed.clone()),
        ),
    );
    let crd = CrdConversion::new(
        &shared.client,
        &crd_name(&parent.resource.plural, &parent.resource.group),
    );
    let waiting_since = tokio::time::Instant::now();
    loop {
        if shared.leadership.is_leader() {
            // Before the CRD points here: the policy stays until it is put back (its
            // finalizer), and its status names the CRD to put back.
            let held = set_finalizer_of_policy(
                &shared.client,
                &name,
                policy.metadata.uid.as_deref(),
                CONVERSION_FINALIZER,
                true,
            )
            .await;
            if let Err(error) = held {
                return refused(State::failed("CrdNotWritten", format!("{error:#}")));
            }
            if status.conversion().is_none_or(|c| c.crd != crd.name()) {
                report_served(status, &crd, asked, Vec::new());
                status.set_optional(CONDITION, None);
                status.flush().await;
            }
            let ca_bundle = hosting.ca_bundle.borrow().clone();
            let served = Served {
                policy: &name,
                versions: &asked.versions,
                endpoint: &hosting.endpoint,
                ca_bundle: &ca_bundle,
            };
            return match crd.ensure(&served).await {
                Ok(standing) => {
                    if standing.written {
                        // The API server takes up a CRD's change from its own watch of
                        // CRDs: the controller's first reads and writes wait for it.
                        tokio::time::sleep(SETTLE).await;
                    }
                    report_served(status, &crd, asked, standing.stored_versions);
                    Ok(())
                }
                Err(CrdError::Refused { reason, message }) => {
                    refused(State::failed(reason, message))
                }
                Err(error) => refused(State::failed("CrdNotWritten", format!("{error:#}"))),
            };
        }
        match points_here(&crd, &name).await {
            Ok(true) => return Ok(()),
            Ok(false) if waiting_since.elapsed() >= STANDBY_WAIT => {
                return refused(State::failed(
                    "WaitingForLeader",
                    format!(
                        "CRD {} does not send its conversions to the hosts yet: the leader writes it",
                        crd.name()
                    ),
                ));
            }
            Ok(false) => {}
            Err(error) => {
                return refused(State::failed("CrdNotWritten", format!("{error:#}")));
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            () = shared.leadership.until_leader() => {}
        }
    }
}

/// Whether the CRD's conversion is `policy`'s.
async fn points_here(crd: &CrdConversion, policy: &str) -> anyhow::Result<bool> {
    crd.owner()
        .await
        .map(|owner| owner.as_deref() == Some(policy))
}

fn not_served(plugin: &Plugin) -> State {
    State::failed(
        "ConvertNotServed",
        format!(
            "the plugin ({}) does not serve convert: build it with the SDK's `webhooks` feature and export a converter",
            plugin.digest().short()
        ),
    )
}

/// The converter of `policy`'s parent kind (of resource `plural`), converting with the
/// plugin `plugin` returns.
fn converter(
    policy: &ReconcilePolicy,
    shared: &Shared,
    plural: &str,
    plugin: Arc<dyn Fn() -> Plugin + Send + Sync>,
) -> Converter {
    let parent = &policy.spec.parent;
    Converter {
        policy: policy.name_any(),
        tenant: crate::policy::namespaced::tenant(policy),
        plugin,
        kind: ConvertedKind {
            api_version: parent.api_version.clone(),
            kind: parent.kind.clone(),
            plural: plural.to_owned(),
        },
        explain: Some(shared.options.explain.clone()),
    }
}

/// As soon as `policy`'s `plugin` is loaded, before any check that could keep the policy
/// from starting: when the CRD's conversion was pointed at the hosts for it (`converted`),
/// this replica converts with that plugin, since every read of the kind at another version
/// than stored needs it, whether or not the policy's controller starts.
pub(crate) fn convert_early(
    policy: &ReconcilePolicy,
    shared: &Shared,
    plugin: &Plugin,
    converted: Option<&ConversionStatus>,
) {
    let (Some(hosting), Some(converted)) = (&shared.webhooks, converted) else {
        return;
    };
    if !plugin.served_webhooks().convert {
        return;
    }
    let plural = converted.crd.split('.').next().unwrap_or_default();
    let fixed = plugin.clone();
    hosting.answerers.convert(
        &policy.name_any(),
        converter(policy, shared, plural, Arc::new(move || fixed.clone())),
    );
}

fn report_served(
    status: &mut PolicyStatusWriter,
    crd: &CrdConversion,
    asked: &ConversionSpec,
    stored_versions: Vec<String>,
) {
    let since = status
        .conversion()
        .filter(|c| c.crd == crd.name() && c.versions == asked.versions)
        .map_or_else(|| Time(jiff::Timestamp::now()), |c| c.since.clone());
    status.set_conversion(Some(ConversionStatus {
        crd: crd.name().to_owned(),
        versions: asked.versions.clone(),
        stored_versions,
        since,
    }));
    status.set_optional(
        CONDITION,
        Some(State::ok(
            "Served",
            format!(
                "CRD {} converts between {} through the plugin, on every replica",
                crd.name(),
                asked.versions.join(", ")
            ),
        )),
    );
}

/// One running policy's conversion, beside its controller.
pub(crate) struct PolicyConversion {
    name: String,
    asked: Option<ConversionSpec>,
    crd: String,
    converter: Converter,
    /// The version its controller reads and writes parents at.
    parent_version: String,
    uid: Option<String>,
    serving: Arc<Serving>,
    status: Arc<tokio::sync::Mutex<PolicyStatusWriter>>,
}

impl PolicyConversion {
    /// The conversion of `policy`, whose parents are `parent`, by the plugins `serving`
    /// serves.
    pub fn new(
        policy: &ReconcilePolicy,
        shared: &Shared,
        parent: &ResolvedKind,
        serving: Arc<Serving>,
        status: Arc<tokio::sync::Mutex<PolicyStatusWriter>>,
    ) -> Self {
        let active = serving.clone();
        Self {
            name: policy.name_any(),
            asked: policy.spec.conversion.clone(),
            crd: crd_name(&parent.resource.plural, &parent.resource.group),
            converter: converter(
                policy,
                shared,
                &parent.resource.plural,
                Arc::new(move || active.active.load().plugin.clone()),
            ),
            parent_version: parent.resource.version.clone(),
            uid: policy.metadata.uid.clone(),
            serving,
            status,
        }
    }

    /// Serve the conversion until dropped (never completes).
    pub async fn serve(self, shared: &Shared) {
        let Some(hosting) = shared.webhooks.clone() else {
            return std::future::pending().await;
        };
        let crd = CrdConversion::new(&shared.client, &self.crd);
        match self.asked.clone() {
            Some(asked) => self.keep(shared, &hosting, &crd, &asked).await,
            None => self.put_back(shared, &hosting, &crd).await,
        }
        std::future::pending().await
    }

    /// The policy asks: the active plugin converts, and the leader keeps the stanza.
    async fn keep(
        &self,
        shared: &Shared,
        hosting: &Hosting,
        crd: &CrdConversion,
        asked: &ConversionSpec,
    ) {
        hosting
            .answerers
            .convert(&self.name, self.converter.clone());
        let mut ca_bundle = hosting.ca_bundle.clone();
        let mut leading = shared.leadership.subscribe();
        loop {
            if shared.leadership.is_leader() {
                let bundle = ca_bundle.borrow_and_update().clone();
                let served = Served {
                    policy: &self.name,
                    versions: &asked.versions,
                    endpoint: &hosting.endpoint,
                    ca_bundle: &bundle,
                };
                let plugin = self.serving.active.load().plugin.clone();
                let result = crd.ensure(&served).await;
                let mut status = self.status.lock().await;
                match result {
                    Ok(standing) if plugin.served_webhooks().convert => {
                        if standing.written {
                            tracing::info!(policy = %self.name, crd = %crd.name(), "the CRD's conversion points at the hosts again");
                        }
                        report_served(&mut status, crd, asked, standing.stored_versions);
                    }
                    Ok(_) => status.set_optional(CONDITION, Some(not_served(&plugin))),
                    Err(CrdError::Refused { reason, message }) => {
                        status.set_optional(CONDITION, Some(State::failed(reason, message)));
                    }
                    Err(error) => {
                        tracing::warn!(policy = %self.name, error = %format!("{error:#}"), "could not check the CRD's conversion");
                        status.set_optional(
                            CONDITION,
                            Some(State::failed("CrdNotWritten", format!("{error:#}"))),
                        );
                    }
                }
                status.flush().await;
            }
            tokio::select! {
                () = tokio::time::sleep(CHECK) => {}
                Ok(()) = ca_bundle.changed() => {}
                Ok(()) = leading.changed() => {}
            }
        }
    }

    /// The policy asks no more (or never did): once it served the conversion, the leader
    /// puts the CRD's stanza back as soon as no stored object needs it; until then the
    /// active plugin keeps converting.
    async fn put_back(&self, shared: &Shared, hosting: &Hosting, crd: &CrdConversion) {
        if self.status.lock().await.conversion().is_none() {
            return;
        }
        loop {
            let outcome = if shared.leadership.is_leader() {
                match crd.restore(&self.name, Some(&self.parent_version)).await {
                    Ok(restored) => set_finalizer_of_policy(
                        &shared.client,
                        &self.name,
                        self.uid.as_deref(),
                        CONVERSION_FINALIZER,
                        false,
                    )
                    .await
                    .map(|()| restored)
                    .map_err(CrdError::Api),
                    Err(error) => Err(error),
                }
            } else {
                match points_here(crd, &self.name).await {
                    Ok(true) => Err(CrdError::Refused {
                        reason: "StillNeeded",
                        message: "the leader puts the CRD's conversion back".to_owned(),
                    }),
                    Ok(false) => Ok(Restored::NotOurs),
                    Err(error) => Err(CrdError::Api(error)),
                }
            };
            let mut status = self.status.lock().await;
            match outcome {
                Ok(restored) => {
                    hosting.answerers.stop_converting(&self.name);
                    if restored == Restored::Restored {
                        tracing::info!(policy = %self.name, crd = %crd.name(), "the CRD's conversion is back as it was before the policy");
                    }
                    status.set_conversion(None);
                    status.set_optional(CONDITION, None);
                    status.flush().await;
                    return;
                }
                Err(CrdError::Refused { reason, message }) => {
                    if !hosting.answerers.converts(&self.name) {
                        hosting
                            .answerers
                            .convert(&self.name, self.converter.clone());
                    }
                    status.set_optional(CONDITION, Some(State::failed(reason, message)));
                }
                Err(error) => {
                    tracing::warn!(policy = %self.name, error = %format!("{error:#}"), "could not put the CRD's conversion back");
                    if !hosting.answerers.converts(&self.name) {
                        hosting
                            .answerers
                            .convert(&self.name, self.converter.clone());
                    }
                    status.set_optional(
                        CONDITION,
                        Some(State::failed("CrdNotWritten", format!("{error:#}"))),
                    );
                }
            }
            status.flush().await;
            drop(status);
            tokio::time::sleep(CHECK).await;
        }
    }
}

/// A policy that is being deleted: the leader puts its parent CRD's conversion back, and
/// this replica converts no more. An error while objects still need the webhook (then the
/// plugin of the policy's last controller keeps converting, and the policy's status says
/// why it stays).
pub(crate) async fn retire(policy: &ReconcilePolicy, shared: &Shared) -> anyhow::Result<()> {
    let name = policy.name_any();
    if !policy
        .finalizers()
        .iter()
        .any(|f| f == CONVERSION_FINALIZER)
    {
        return Ok(());
    }
    let restored = match policy.status.as_ref().and_then(|s| s.conversion.as_ref()) {
        Some(converted) => {
            CrdConversion::new(&shared.client, &converted.crd)
                .restore(&name, None)
                .await
        }
        // The finalizer came first, and the CRD was never pointed here.
        None => Ok(Restored::NotOurs),
    };
    match restored {
        Ok(_) => {
            if let Some(hosting) = &shared.webhooks {
                hosting.answerers.stop_converting(&name);
            }
            set_finalizer_of_policy(
                &shared.client,
                &name,
                policy.metadata.uid.as_deref(),
                CONVERSION_FINALIZER,
                false,
            )
            .await
        }
        Err(CrdError::Refused { reason, message }) => {
            let mut status = PolicyStatusWriter::new(
                kube::Api::all(shared.client.clone()),
                policy,
                shared.leadership.clone(),
            );
            status.set_optional(CONDITION, Some(State::failed(reason, message.clone())));
            status.flush().await;
            anyhow::bail!("the policy stays until its conversion can be put back: {message}")
        }
        Err(error) => Err(anyhow::Error::new(error).context("putting the CRD's conversion back")),
    }
}

/// A policy that is being deleted while its parent CRD's conversion still points at it: this
/// replica converts with its plugin (loaded again if no controller of it ran here since the
/// host started), until the stanza is put back.
pub(crate) async fn keep_converting_while_retiring(policy: &ReconcilePolicy, shared: &Shared) {
    let name = policy.name_any();
    let (Some(hosting), Some(converted)) = (
        &shared.webhooks,
        policy.status.as_ref().and_then(|s| s.conversion.as_ref()),
    ) else {
        return;
    };
    if hosting.answerers.converts(&name)
        || !policy
            .finalizers()
            .iter()
            .any(|f| f == CONVERSION_FINALIZER)
    {
        return;
    }
    match shared
        .registry
        .obtain(&name, crate::registry::PluginRequest::active(policy))
        .await
    {
        Ok(obtained) => convert_early(policy, shared, &obtained.plugin, Some(converted)),
        Err(error) => {
            tracing::warn!(policy = %name, error = %error, "cannot load the plugin of a deleted policy whose CRD's conversion still points at it: reads that need a conversion fail until it is put back");
        }
    }
}
