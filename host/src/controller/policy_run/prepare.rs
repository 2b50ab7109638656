//! Preparing a policy to run: its plugin, its kinds, and every check that must pass before a
//! controller starts. Each step either yields what the next needs or the `Ready=False` state
//! that says why the policy waits; the policy controller retries until all pass.

use kube::{Client, ResourceExt as _};

use crate::controller::cache::related::RelatedBy;
use crate::controller::kinds::{self, KindError, ResolvedKind};
use crate::controller::policy_run::identity::{self, Acting};
use crate::controller::policy_run::parent_claims;
use crate::controller::policy_run::permissions;
use crate::controller::policy_run::shared::Shared;
use crate::controller::policy_run::status::{PolicyStatusWriter, State};
use crate::plugin::Plugin;
use crate::policy::{KindRef, ReconcilePolicy, ReconcilePolicySpec};
use crate::registry::PluginRequest;

/// The resolved pieces a controller needs.
pub(crate) struct Parts {
    pub plugin: Plugin,
    /// The client the policy acts through, and who it acts as.
    pub acting: Acting,
    pub parent: ResolvedKind,
    pub children: Vec<(KindRef, ResolvedKind)>,
    /// In the order of the policy's `related`.
    pub related: Vec<(ResolvedKind, RelatedBy)>,
}

/// Load the plugin (once: `plugin` keeps it between attempts) and pass every check. On
/// failure the reason is in `status` and `None` is returned, for the caller to try again.
pub(crate) async fn prepare(
    policy: &ReconcilePolicy,
    shared: &Shared,
    status: &mut PolicyStatusWriter,
    plugin: &mut Option<Plugin>,
) -> Option<Parts> {
    let plugin = match plugin {
        Some(plugin) => plugin.clone(),
        None => plugin.insert(load(policy, shared, status).await?).clone(),
    };
    match check(policy, shared).await {
        Ok((acting, (parent, children, related))) => Some(Parts {
            plugin,
            acting,
            parent,
            children,
            related,
        }),
        Err(problem) => {
            status.set_ready(problem);
            None
        }
    }
}

type Kinds = (
    ResolvedKind,
    Vec<(KindRef, ResolvedKind)>,
    Vec<(ResolvedKind, RelatedBy)>,
);

/// The checks, in order: an identity to act as, kinds served, parent kind not taken,
/// namespace usable, permissions granted (to that identity), related objects chosen in a
/// usable way.
async fn check(policy: &ReconcilePolicy, shared: &Shared) -> Result<(Acting, Kinds), State> {
    let spec = &policy.spec;
    let host_namespace = shared.options.namespace.as_deref();
    let acting = shared.identities.acting_for(policy)?;
    identity::verify(&acting).await?;
    let (parent, children, related) = resolve_kinds(&acting.client, policy).await?;
    parent_unclaimed(&shared.client, policy).await?;
    if let Some(problem) = parent_scope_problem(policy, &parent, host_namespace) {
        return Err(problem);
    }
    let resolved = permissions::Resolved {
        parent: &parent,
        children: children.iter().map(|(_, kind)| kind).collect(),
        related: related.iter().collect(),
    };
    if let Some(forbidden) = permissions::check(&acting, spec, host_namespace, &resolved).await {
        tracing::warn!(policy = %policy.name_any(), message = %forbidden.message, "missing permissions");
        return Err(forbidden);
    }
    let related = related_choices(spec, related)?;
    Ok((acting, (parent, children, related)))
}

/// Obtain the policy's plugin from the registry, reporting the result on the policy.
async fn load(
    policy: &ReconcilePolicy,
    shared: &Shared,
    status: &mut PolicyStatusWriter,
) -> Option<Plugin> {
    let name = policy.name_any();
    match shared
        .registry
        .obtain(&name, PluginRequest::active(policy))
        .await
    {
        Ok(obtained) => {
            let info = obtained.plugin.info();
            tracing::info!(policy = %name, digest = %info.digest, origin = ?obtained.origin, from_cache = info.from_cache, load_time = ?info.load_time, "plugin loaded");
            status.set_plugin(
                State::ok("Loaded", format!("plugin {} loaded", info.digest)),
                Some(&info.digest),
            );
            Some(obtained.plugin)
        }
        Err(error) => {
            let (reason, message) = (error.reason(), error.to_string());
            tracing::warn!(policy = %name, reason, %message, "plugin not loaded");
            status.set_plugin(State::failed(reason, message.clone()), None);
            status.set_ready(State::failed("PluginNotLoaded", message));
            None
        }
    }
}

/// Every kind the policy names, through discovery: a kind not served yet waits.
async fn resolve_kinds(
    client: &Client,
    policy: &ReconcilePolicy,
) -> Result<
    (
        ResolvedKind,
        Vec<(KindRef, ResolvedKind)>,
        Vec<ResolvedKind>,
    ),
    State,
> {
    let spec = &policy.spec;
    let resolve_all = async {
        let parent = kinds::resolve(client, &spec.parent.kind_ref()).await?;
        let mut children = Vec::new();
        for child in &spec.children {
            children.push((child.clone(), kinds::resolve(client, child).await?));
        }
        let mut related = Vec::new();
        for rel in &spec.related {
            let kind = KindRef {
                api_version: rel.api_version.clone(),
                kind: rel.kind.clone(),
            };
            related.push(kinds::resolve(client, &kind).await?);
        }
        Ok::<_, KindError>((parent, children, related))
    };
    resolve_all.await.map_err(|error| {
        let reason = match error {
            KindError::NotFound { .. } => "KindNotFound",
            KindError::Discovery { .. } => "DiscoveryFailed",
        };
        tracing::info!(policy = %policy.name_any(), %error, "waiting for kinds");
        State::failed(reason, error.to_string())
    })
}

/// No older policy reconciles the same parents.
async fn parent_unclaimed(client: &Client, policy: &ReconcilePolicy) -> Result<(), State> {
    let parent = &policy.spec.parent;
    match parent_claims::claimed_by(client, policy).await {
        Ok(None) => Ok(()),
        Ok(Some(other)) => {
            tracing::warn!(policy = %policy.name_any(), %other, "parent kind taken");
            Err(State::failed(
                "ParentKindTaken",
                format!(
                    "policy {other} already reconciles {} {}{}; give both a different spec.parent.namespace, or delete one",
                    parent.api_version,
                    parent.kind,
                    parent
                        .namespace
                        .as_deref()
                        .map(|ns| format!(" in namespace {ns}"))
                        .unwrap_or_default()
                ),
            ))
        }
        Err(error) => Err(State::failed(
            "DiscoveryFailed",
            format!("listing ReconcilePolicies to check who reconciles this parent kind: {error}"),
        )),
    }
}

/// Why `spec.parent.namespace` cannot work with this parent kind or this host, if it cannot.
fn parent_scope_problem(
    policy: &ReconcilePolicy,
    parent: &ResolvedKind,
    host_namespace: Option<&str>,
) -> Option<State> {
    let namespace = policy.spec.parent.namespace.as_deref()?;
    if !parent.namespaced {
        return Some(State::failed(
            "InvalidNamespace",
            format!(
                "{} is cluster-scoped; spec.parent.namespace {namespace:?} cannot apply",
                parent.resource.kind
            ),
        ));
    }
    match host_namespace {
        Some(host) if host != namespace => Some(State::failed(
            "NamespaceNotWatched",
            format!("spec.parent.namespace is {namespace:?}, but this host watches only {host:?}"),
        )),
        _ => None,
    }
}

/// Each related kind with how its objects are chosen.
fn related_choices(
    spec: &ReconcilePolicySpec,
    related: Vec<ResolvedKind>,
) -> Result<Vec<(ResolvedKind, RelatedBy)>, State> {
    spec.related
        .iter()
        .zip(related)
        .map(|(rel, kind)| {
            RelatedBy::of(rel)
                .map(|by| (kind, by))
                .map_err(|message| State::failed("InvalidRelated", message))
        })
        .collect()
}
