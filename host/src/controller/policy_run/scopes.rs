//! Where a policy's finalizer may be: `status.finalizedScopes`, the parent kinds (and
//! namespaces) the policy ever put its finalizer on and has not yet released.
//!
//! A policy's spec only says where it finalizes *now*. Once its parent kind or namespace is
//! edited, the old parents still carry `wasmctrl.dev/<policy>`, and nothing watches them
//! any more: deleting one, or its namespace, would hang for ever. So a scope is written to the
//! policy's status before the first parent in it can get the finalizer, and taken off only
//! once every parent there was released.
//!
//! The list is written with a field manager of its own, by JSON patch testing the policy's
//! uid, so the status writer's server-side apply (which never sends this field) cannot undo
//! it, and a policy re-created under the same name never inherits another's scopes.

use anyhow::Context as _;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;

use crate::controller::kinds::ResolvedKind;
use crate::policy::{FinalizedScope, ReconcilePolicy};

/// The field manager of `status.finalizedScopes`.
const FIELD_MANAGER: &str = "wasmctrl-finalizers";

/// The scope a policy finalizes in when it runs over `parent` confined to `namespace`.
pub(crate) fn of(parent: &ResolvedKind, namespace: Option<&str>) -> FinalizedScope {
    FinalizedScope {
        api_version: parent.resource.api_version.clone(),
        kind: parent.resource.kind.clone(),
        namespace: namespace.filter(|_| parent.namespaced).map(str::to_owned),
    }
}

/// The API group of an `apiVersion` (`""` for the core group).
fn group(api_version: &str) -> &str {
    api_version.split_once('/').map_or("", |(group, _)| group)
}

/// Whether `a` and `b` name the same objects' kind: the same group and kind, whatever the
/// version (every version of a kind serves the same objects).
pub(crate) fn same_kind(a: &FinalizedScope, b: &FinalizedScope) -> bool {
    a.kind == b.kind && group(&a.api_version) == group(&b.api_version)
}

/// Whether every parent in `recorded` is also in `current`, so that releasing `recorded` would
/// only take the finalizer from parents the running policy holds.
pub(crate) fn covers(current: &FinalizedScope, recorded: &FinalizedScope) -> bool {
    same_kind(current, recorded)
        && (current.namespace.is_none() || current.namespace == recorded.namespace)
}

/// Within `stale`, the namespace whose parents the running policy (`current`) still holds and
/// a release must leave alone: only when `stale` spans every namespace of the same kind and
/// `current` is confined to one.
pub(crate) fn still_held(stale: &FinalizedScope, current: &FinalizedScope) -> Option<String> {
    (same_kind(stale, current) && stale.namespace.is_none())
        .then(|| current.namespace.clone())
        .flatten()
}

/// The scope a policy's spec names, before discovery: for a policy that cannot start yet.
pub(crate) fn named(policy: &ReconcilePolicy, host_namespace: Option<&str>) -> FinalizedScope {
    let parent = &policy.spec.parent;
    FinalizedScope {
        api_version: parent.api_version.clone(),
        kind: parent.kind.clone(),
        namespace: parent
            .namespace
            .clone()
            .or_else(|| host_namespace.map(str::to_owned)),
    }
}

/// Whether `recorded` is certainly outside what a policy naming `named` would finalize,
/// even before discovery says whether the kind is namespaced: another kind, or another
/// namespace than the one it is confined to.
pub(crate) fn certainly_left(named: &FinalizedScope, recorded: &FinalizedScope) -> bool {
    !same_kind(named, recorded)
        || matches!((&named.namespace, &recorded.namespace), (Some(a), Some(b)) if a != b)
}

/// The policy named `name` with `uid` as it is now, or `None` if it is gone or was replaced.
pub(crate) async fn fresh_policy(
    client: &Client,
    name: &str,
    uid: Option<&str>,
) -> anyhow::Result<Option<ReconcilePolicy>> {
    let policy = Api::<ReconcilePolicy>::all(client.clone())
        .get_opt(name)
        .await
        .with_context(|| format!("reading policy {name}"))?;
    Ok(policy.filter(|p| p.metadata.uid.as_deref() == uid))
}

/// The scopes recorded on `policy`.
pub(crate) fn recorded(policy: &ReconcilePolicy) -> Vec<FinalizedScope> {
    policy
        .status
        .as_ref()
        .map(|status| status.finalized_scopes.clone())
        .unwrap_or_default()
}

/// Record `scopes` on the policy named `name` with `uid`, if they differ from what it holds
/// now. The patch tests the uid: it never lands on a policy re-created under the same name
/// (nor on one that is gone, which needs no record).
pub(crate) async fn record(
    client: &Client,
    name: &str,
    uid: Option<&str>,
    scopes: &[FinalizedScope],
) -> anyhow::Result<()> {
    let Some(policy) = fresh_policy(client, name, uid).await? else {
        return Ok(());
    };
    if recorded(&policy) == scopes {
        return Ok(());
    }
    let uid = json!({"op": "test", "path": "/metadata/uid", "value": uid});
    let ops = match (&policy.status, scopes.is_empty()) {
        (None, _) => {
            json!([uid, {"op": "add", "path": "/status", "value": {"finalizedScopes": scopes}}])
        }
        (Some(_), true) => json!([uid, {"op": "remove", "path": "/status/finalizedScopes"}]),
        // "add" replaces a member that exists.
        (Some(_), false) => {
            json!([uid, {"op": "add", "path": "/status/finalizedScopes", "value": scopes}])
        }
    };
    let patch: json_patch::Patch = serde_json::from_value(ops)?;
    let written = Api::<ReconcilePolicy>::all(client.clone())
        .patch_status(
            name,
            &PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..PatchParams::default()
            },
            &Patch::<()>::Json(patch),
        )
        .await;
    match written {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(error) => {
            Err(error).with_context(|| format!("recording where policy {name} finalizes parents"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(api_version: &str, kind: &str, namespace: Option<&str>) -> FinalizedScope {
        FinalizedScope {
            api_version: api_version.into(),
            kind: kind.into(),
            namespace: namespace.map(str::to_owned),
        }
    }

    #[test]
    fn a_scope_covers_the_same_kind_in_any_version_and_within_its_namespace() {
        let everywhere = scope("example.com/v1", "Widget", None);
        let in_a = scope("example.com/v1", "Widget", Some("a"));
        let in_a_beta = scope("example.com/v1beta1", "Widget", Some("a"));
        assert!(
            covers(&everywhere, &in_a),
            "all namespaces hold namespace a"
        );
        assert!(
            covers(&in_a, &in_a_beta),
            "another version, the same objects"
        );
        assert!(
            !covers(&in_a, &everywhere),
            "a narrower scope leaves the others out"
        );
        assert!(!covers(
            &in_a,
            &scope("example.com/v1", "Widget", Some("b"))
        ));
        assert!(!covers(
            &in_a,
            &scope("example.com/v1", "Gadget", Some("a"))
        ));
        assert!(!covers(&in_a, &scope("other.com/v1", "Widget", Some("a"))));
        assert!(
            !covers(&everywhere, &scope("v1", "Widget", None)),
            "the core group is a group"
        );
    }

    #[test]
    fn before_discovery_only_another_kind_or_namespace_is_certainly_left() {
        let named = scope("example.com/v1", "Widget", Some("a"));
        assert!(certainly_left(
            &named,
            &scope("example.com/v1", "Gadget", Some("a"))
        ));
        assert!(certainly_left(
            &named,
            &scope("example.com/v1", "Widget", Some("b"))
        ));
        assert!(!certainly_left(
            &named,
            &scope("example.com/v2", "Widget", Some("a"))
        ));
        // Cluster-scoped parents are recorded without a namespace: still the policy's.
        assert!(!certainly_left(
            &named,
            &scope("example.com/v1", "Widget", None)
        ));
    }

    #[test]
    fn a_release_of_every_namespace_spares_the_one_still_held() {
        let everywhere = scope("example.com/v1", "Widget", None);
        let in_a = scope("example.com/v1", "Widget", Some("a"));
        assert_eq!(still_held(&everywhere, &in_a), Some("a".into()));
        assert_eq!(
            still_held(&in_a, &scope("example.com/v1", "Widget", Some("b"))),
            None
        );
        assert_eq!(
            still_held(&everywhere, &scope("example.com/v1", "Gadget", Some("a"))),
            None
        );
    }
}
