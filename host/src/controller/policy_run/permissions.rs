//! Before a policy's controller starts, the host asks the API server whether the policy's
//! identity (its ServiceAccount, or the host itself) may do what the policy needs: one
//! SelfSubjectAccessReview per verb and resource, made through the client the policy acts
//! through. A missing permission becomes `Ready=False, Forbidden` naming who lacks exactly
//! what — instead of a cache that never syncs and a log line nobody reads.

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};

use crate::controller::kinds::ResolvedKind;
use crate::controller::policy_run::identity::Acting;
use crate::controller::policy_run::status::State;
use crate::policy::ReconcilePolicySpec;
use crate::policy::permissions::{self, KindScope, Permission};

/// How a policy's kinds resolved, for computing what it needs.
pub(crate) struct Resolved<'a> {
    pub parent: &'a ResolvedKind,
    pub children: Vec<&'a ResolvedKind>,
    pub related: Vec<&'a ResolvedKind>,
}

/// `Forbidden` with what is missing, or `None` when the policy's identity holds every
/// permission the policy needs. A review that cannot be made is logged and does not hold the
/// policy up: the watches will say the same thing, later.
pub(crate) async fn check(
    acting: &Acting,
    spec: &ReconcilePolicySpec,
    host_namespace: Option<&str>,
    kinds: &Resolved<'_>,
) -> Option<State> {
    let known: Vec<&ResolvedKind> = std::iter::once(kinds.parent)
        .chain(kinds.children.iter().copied())
        .chain(kinds.related.iter().copied())
        .collect();
    let needed = permissions::required(spec, host_namespace, |api_version, kind| {
        known
            .iter()
            .find(|k| k.resource.api_version == api_version && k.resource.kind == kind)
            .map(|k| KindScope {
                group: k.resource.group.clone(),
                resource: k.resource.plural.clone(),
                namespaced: k.namespaced,
            })
            .ok_or(())
    })
    .ok()?;
    let api: Api<SelfSubjectAccessReview> = Api::all(acting.client.clone());
    let reviews = needed.into_iter().map(|permission| {
        let api = api.clone();
        async move {
            let allowed = allowed(&api, &permission).await;
            (permission, allowed)
        }
    });
    let mut missing = Vec::new();
    for (permission, allowed) in futures::future::join_all(reviews).await {
        match allowed {
            Ok(true) => {}
            Ok(false) => missing.push(permission),
            Err(error) => {
                tracing::warn!(error = %error, resource = %permission.resource, verb = permission.verb, who = %acting.who(), "could not review the policy's permission");
                return None;
            }
        }
    }
    (!missing.is_empty()).then(|| {
        State::failed(
            "Forbidden",
            format!(
                "{} may not {}; grant it (see `wasmctrl rbac`)",
                acting.who(),
                permissions::describe(&missing)
            ),
        )
    })
}

async fn allowed(
    api: &Api<SelfSubjectAccessReview>,
    permission: &Permission,
) -> Result<bool, kube::Error> {
    let (resource, subresource) = match permission.resource.split_once('/') {
        Some((resource, subresource)) => (resource, Some(subresource.to_owned())),
        None => (permission.resource.as_str(), None),
    };
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                group: Some(permission.group.clone()),
                resource: Some(resource.to_owned()),
                subresource,
                verb: Some(permission.verb.to_owned()),
                namespace: permission.namespace.clone(),
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    let answer = api.create(&PostParams::default(), &review).await?;
    Ok(answer.status.is_some_and(|status| status.allowed))
}
