//! What a plugin is shown: one set of rules, used by the host's reconciles and by `wasmctrl
//! plugin run --policy`, so an offline run can never show a plugin what a cluster would not
//! (or hide what it would).
//!
//! - A child is visible to its parent when the parent is its controller (by uid) and it is in
//!   the parent's namespace; an object that merely carries the policy's label, or that
//!   another parent controls, is not.
//! - A related object is visible when it is in the parent's namespace and the policy
//!   chooses it: every object of the kind, those its selector matches,
//!   or those the parent names.
//! - Both are shown in one order: by the kind's place in the policy, then by name.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::SelectorExt as _;

use super::parent::ParentIdentity;
use crate::controller::cache::related::RelatedBy;

/// Whether the object with `metadata` is `parent`'s child: in its namespace, with a
/// controller ownerReference to its uid.
pub(crate) fn child_visible(parent: &ParentIdentity, metadata: &ObjectMeta) -> bool {
    metadata.namespace == parent.namespace
        && metadata
            .owner_references
            .iter()
            .flatten()
            .any(|owner| owner.controller == Some(true) && owner.uid == parent.uid)
}

/// Why a related object is not shown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RelatedHidden {
    /// It lives in another namespace than the parent.
    OtherNamespace,
    /// Its labels do not match the policy's selector (this one, in words).
    SelectorMismatch(String),
    /// The parent's field (this path) does not name it; these are the names it does hold.
    NotNamed { path: String, names: Vec<String> },
}

/// Whether a related object (of a kind chosen `by`, with `metadata`) is shown to the plugin
/// for `parent`, whose names at the chosen path are `named` (asked only for a kind chosen by
/// name).
pub(crate) fn related_visible(
    parent: &ParentIdentity,
    by: &RelatedBy,
    metadata: &ObjectMeta,
    named: impl FnOnce() -> Vec<String>,
) -> Result<(), RelatedHidden> {
    if !related_in_scope(parent, metadata.namespace.as_deref()) {
        return Err(RelatedHidden::OtherNamespace);
    }
    match by {
        RelatedBy::All => Ok(()),
        RelatedBy::Selector(selector) => {
            let labels = metadata.labels.clone().unwrap_or_default();
            if selector.matches(&labels) {
                Ok(())
            } else {
                Err(RelatedHidden::SelectorMismatch(selector.to_string()))
            }
        }
        RelatedBy::Name(path) => {
            let names = named();
            let name = metadata.name.as_deref().unwrap_or_default();
            if names.iter().any(|n| n == name) {
                Ok(())
            } else {
                Err(RelatedHidden::NotNamed {
                    path: path.to_string(),
                    names,
                })
            }
        }
    }
}

/// Whether a related object in `namespace` is in the parent's scope: the parent's own
/// namespace (none for a cluster-scoped parent). The host's selected caches already hold
/// only what the selector matches, so this is all a reconcile checks of them.
pub(crate) fn related_in_scope(parent: &ParentIdentity, namespace: Option<&str>) -> bool {
    namespace == parent.namespace.as_deref()
}

/// Where an object is shown among its request's children or related objects: by the place
/// of its kind in the policy, then by name.
pub(crate) fn order(kind_position: usize, name: &str) -> (usize, &str) {
    (kind_position, name)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::controller::testing::team_a_parent;

    fn meta(value: serde_json::Value) -> ObjectMeta {
        serde_json::from_value(value).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_child_is_one_its_parent_controls_in_its_namespace() {
        let parent = team_a_parent();
        let owner = |uid: &str, controller: bool| {
            json!([{"apiVersion": "example.com/v1", "kind": "MyApp", "name": "web",
                    "uid": uid, "controller": controller}])
        };
        let ours = meta(
            json!({"name": "c", "namespace": "team-a", "ownerReferences": owner("uid-1", true)}),
        );
        assert!(child_visible(&parent, &ours));
        for other in [
            json!({"name": "c", "namespace": "team-b", "ownerReferences": owner("uid-1", true)}),
            json!({"name": "c", "namespace": "team-a", "ownerReferences": owner("uid-1", false)}),
            json!({"name": "c", "namespace": "team-a", "ownerReferences": owner("uid-2", true)}),
            json!({"name": "c", "namespace": "team-a"}),
        ] {
            assert!(!child_visible(&parent, &meta(other.clone())), "{other}");
        }
    }

    #[test]
    fn a_related_object_is_in_the_parents_namespace_and_chosen_by_the_policy() {
        let parent = team_a_parent();
        let object = meta(json!({"name": "db", "namespace": "team-a", "labels": {"tier": "db"}}));
        let none = Vec::new;
        assert_eq!(
            related_visible(&parent, &RelatedBy::All, &object, none),
            Ok(())
        );
        let elsewhere = meta(json!({"name": "db", "namespace": "team-b"}));
        assert_eq!(
            related_visible(&parent, &RelatedBy::All, &elsewhere, none),
            Err(RelatedHidden::OtherNamespace)
        );
        let selector = |value: &str| {
            RelatedBy::Selector(crate::controller::testing::label_selector("tier", value))
        };
        assert_eq!(
            related_visible(&parent, &selector("db"), &object, none),
            Ok(())
        );
        assert_eq!(
            related_visible(&parent, &selector("web"), &object, none),
            Err(RelatedHidden::SelectorMismatch("tier=web".into()))
        );
        let by_name = RelatedBy::Name(
            crate::controller::cache::related::FieldPath::parse("spec.db")
                .unwrap_or_else(|e| panic!("{e}")),
        );
        assert_eq!(
            related_visible(&parent, &by_name, &object, || vec!["db".into()]),
            Ok(())
        );
        assert_eq!(
            related_visible(&parent, &by_name, &object, || vec!["other".into()]),
            Err(RelatedHidden::NotNamed {
                path: "spec.db".into(),
                names: vec!["other".into()]
            })
        );
    }
}
