//! Preparing a policy to run: its plugin, its kinds, and every check that must pass before a
//! controller starts. Each step either yields what the next needs or the `Ready=False` state
//! that says why the policy waits; the policy controller retries until all pass.

use kube::{Client, ResourceExt as _};

use crate::controller::cache::related::RelatedBy;
use crate::controller::kinds::{self, KindError, ResolvedKind};
use crate::controller::policy_run::identity::{self, Acting};
use crate::controller::policy_run::parent_claims::{self, Stand, Standing};
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
///
/// `standing` tells the host whether the policy was refused its parent kind; once every
/// check passed, the policy holds the kind (`status.claimedParent`, written before its
/// controller starts).
pub(crate) async fn prepare(
    policy: &ReconcilePolicy,
    shared: &Shared,
    status: &mut PolicyStatusWriter,
    plugin: &mut Option<Plugin>,
    standing: &Standing,
) -> Option<Parts> {
    standing.set(Stand::Preparing);
    // Whom the policy acts as is settled before its plugin is fetched: a policy the API
    // server refuses the host to act as (or that names no one where one is required) makes
    // the host fetch and compile nothing (a team policy in a namespace the host may not act
    // in cannot send it to an address of the team's choosing).
    let acting = match acting(policy, shared).await {
        Ok(acting) => acting,
        Err(problem) => {
            status.set_claimed_parent(None);
            if plugin.is_none() {
                // Not fetched for this generation: an earlier `PluginLoaded=True` would
                // otherwise claim it.
                status.set_plugin(
                    State::failed(
                        "IdentityPending",
                        "the plugin is fetched once the policy may act as its identity (see Ready)",
                    ),
                    None,
                );
            }
            status.set_ready(problem);
            return None;
        }
    };
    let plugin = match plugin {
        Some(plugin) => plugin.clone(),
        None => plugin.insert(load(policy, shared, status).await?).clone(),
    };
    super::conversion::convert_early(policy, shared, &plugin, status.conversion());
    let checked = match check(policy, shared, acting).await {
        Ok((acting, kinds)) => {
            // Last: the CRD sends its conversions to the hosts only once the policy can run.
            super::conversion::prepare(policy, shared, &plugin, &kinds.0, status)
                .await
                .map(|()| (acting, kinds))
        }
        Err(problem) => Err(problem),
    };
    match checked {
        Ok((acting, (parent, children, related))) => {
            status.set_claimed_parent(Some(policy.spec.parent.clone()));
            Some(Parts {
                plugin,
                acting,
                parent,
                children,
                related,
            })
        }
        Err(problem) => {
            // A policy that cannot start holds no kind: only one whose controller runs
            // keeps others out (see `parent_claims`).
            status.set_claimed_parent(None);
            if problem.reason == PARENT_KIND_TAKEN {
                standing.set(Stand::Refused);
            }
            status.set_ready(problem);
            None
        }
    }
}

/// The reason of a policy refused its parent kind.
const PARENT_KIND_TAKEN: &str = "ParentKindTaken";

type Kinds = (
    ResolvedKind,
    Vec<(KindRef, ResolvedKind)>,
    Vec<(ResolvedKind, RelatedBy)>,
);

/// The identity `policy` acts as, if the host may act as it.
async fn acting(policy: &ReconcilePolicy, shared: &Shared) -> Result<Acting, State> {
    let acting = shared.identities.acting_for(policy)?;
    identity::verify(&acting).await?;
    Ok(acting)
}

/// The checks after the identity, in order: kinds served, no child resource listed twice,
/// parent kind not taken, namespace usable, permissions granted (to that identity), related
/// objects chosen in a usable way.
async fn check(
    policy: &ReconcilePolicy,
    shared: &Shared,
    acting: Acting,
) -> Result<(Acting, Kinds), State> {
    let spec = &policy.spec;
    let host_namespace = shared.options.namespace.as_deref();
    let (parent, children, related) = resolve_kinds(&acting.client, policy).await?;
    if let Some(problem) = duplicate_child_resource(&children) {
        tracing::warn!(policy = %policy.name_any(), message = %problem.message, "child resource listed twice");
        return Err(problem);
    }
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
                State::ok("Loaded", loaded_message(&info.digest, &obtained.signers)),
                Some(&info.digest),
            );
            status.set_active_signers(obtained.signers);
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

/// `PluginLoaded`'s message: the digest, and who signed it when signatures are required.
pub(crate) fn loaded_message(
    digest: &crate::plugin::Digest,
    signers: &[crate::policy::Signer],
) -> String {
    if signers.is_empty() {
        return format!("plugin {digest} loaded");
    }
    let by: Vec<String> = signers.iter().map(ToString::to_string).collect();
    format!("plugin {digest} loaded, signed by {}", by.join(", "))
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

/// Two child kinds that discovery resolved to one resource, if any: two versions of it (e.g.
/// `autoscaling/v1` and `autoscaling/v2` HorizontalPodAutoscaler, or two versions of a CRD).
/// Each kind's cache would hold the same objects, and the one the plugin did not answer in
/// would be pruned and re-created on every reconcile; the policy must list the resource once.
/// Overlaps with the parent or a related kind are allowed: a child of the parent's own kind is
/// a parent too, and reading objects of a child kind (e.g. ConfigMaps) prunes nothing.
fn duplicate_child_resource(children: &[(KindRef, ResolvedKind)]) -> Option<State> {
    children.iter().enumerate().find_map(|(i, (first, a))| {
        let (second, _) = children[i + 1..].iter().find(|(_, b)| {
            a.resource.group == b.resource.group && a.resource.plural == b.resource.plural
        })?;
        let resource = match a.resource.group.as_str() {
            "" => a.resource.plural.clone(),
            group => format!("{}.{group}", a.resource.plural),
        };
        Some(State::failed(
            "DuplicateResource",
            format!(
                "spec.children lists {} {} and {} {}, two versions of one resource ({resource}): each would see the other's objects and prune them; list it once",
                first.api_version, first.kind, second.api_version, second.kind
            ),
        ))
    })
}

/// No other policy that outranks this one holds the parent kind (see [`parent_claims`]).
async fn parent_unclaimed(client: &Client, policy: &ReconcilePolicy) -> Result<(), State> {
    match parent_claims::claimed_by(client, policy).await {
        Ok(None) => Ok(()),
        Ok(Some(other)) => {
            let holder = other.name_any();
            let (ours, theirs) = (&policy.spec.parent, &other.spec.parent);
            tracing::warn!(policy = %policy.name_any(), %holder, "parent kind taken");
            let namespace = ours
                .namespace
                .as_deref()
                .map(|ns| format!(" in namespace {ns}"))
                .unwrap_or_default();
            let version = if ours.api_version == theirs.api_version {
                String::new()
            } else {
                format!(
                    " (the same kind as {} {}: versions do not keep parents apart)",
                    ours.api_version, ours.kind
                )
            };
            let why = if parent_claims::is_teams(policy) && !parent_claims::is_teams(&other) {
                "it is an admin's cluster policy, which a team's policy never takes a kind from; ask the cluster's admin"
            } else {
                "it holds the kind: its controller runs for it; give both a different spec.parent.namespace, or delete one"
            };
            Err(State::failed(
                PARENT_KIND_TAKEN,
                format!(
                    "policy {holder} already reconciles {} {}{namespace}{version}: {why}",
                    theirs.api_version, theirs.kind,
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kube::core::{ApiResource, GroupVersionKind};

    use super::*;

    fn child(group: &str, version: &str, kind: &str, plural: &str) -> (KindRef, ResolvedKind) {
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let resource = ApiResource::from_gvk_with_plural(&gvk, plural);
        (
            KindRef {
                api_version: resource.api_version.clone(),
                kind: kind.to_owned(),
            },
            ResolvedKind {
                resource: Arc::new(resource),
                namespaced: true,
            },
        )
    }

    #[test]
    fn two_versions_of_one_child_resource_are_refused_naming_both() {
        let hpa = |version| {
            child(
                "autoscaling",
                version,
                "HorizontalPodAutoscaler",
                "horizontalpodautoscalers",
            )
        };
        let config_maps = child("", "v1", "ConfigMap", "configmaps");
        let refused = duplicate_child_resource(&[hpa("v1"), config_maps.clone(), hpa("v2")])
            .expect("refused");
        assert_eq!(refused.reason, "DuplicateResource");
        assert!(
            refused.message.contains(
                "autoscaling/v1 HorizontalPodAutoscaler and autoscaling/v2 HorizontalPodAutoscaler"
            ) && refused
                .message
                .contains("horizontalpodautoscalers.autoscaling"),
            "{}",
            refused.message
        );
        // One version of each resource is fine, and a kind of the same name in another group
        // is another resource.
        let other_group = child(
            "example.com",
            "v1",
            "HorizontalPodAutoscaler",
            "horizontalpodautoscalers",
        );
        assert_eq!(
            duplicate_child_resource(&[hpa("v2"), config_maps, other_group]),
            None
        );
    }
}
