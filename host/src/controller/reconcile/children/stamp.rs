//! Ownership: the host, not the plugin, makes the parent its children's controller and labels
//! them as the policy's; and it changes only objects whose controller is that parent.

use serde_json::{Map, Value, json};

use crate::controller::labels::{
    DESIRED_HASH_ANNOTATION, MANAGED_BY, MANAGED_BY_LABEL, POLICY_LABEL, SHARD_LABEL,
};
use crate::controller::reconcile::parent::ParentIdentity;
use crate::plugin::JsonObject;

/// Make the parent the child's controller and label the child as the policy's.
pub(crate) fn stamp(metadata: &mut JsonObject, parent: &ParentIdentity, policy_label: &str) {
    metadata.insert(
        "ownerReferences".into(),
        json!([{
            "apiVersion": parent.api_version,
            "kind": parent.kind,
            "name": parent.name,
            "uid": parent.uid,
            "controller": true,
            "blockOwnerDeletion": true,
        }]),
    );
    let labels = object_field(metadata, "labels");
    labels.insert(MANAGED_BY_LABEL.into(), json!(MANAGED_BY));
    labels.insert(POLICY_LABEL.into(), json!(policy_label));
    if let Some(shard) = &parent.shard {
        labels.insert(SHARD_LABEL.into(), json!(shard));
    }
    // A plugin-supplied hash annotation would let it fake convergence.
    if let Some(Value::Object(annotations)) = metadata.get_mut("annotations") {
        annotations.remove(DESIRED_HASH_ANNOTATION);
    }
}

/// `None` when the controller of an object with these ownerReferences is the parent with
/// `parent_uid`; otherwise who controls it instead, in words for a `ChildConflict` message.
pub fn foreign_controller(
    owners: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference],
    parent_uid: &str,
) -> Option<String> {
    match owners.iter().find(|owner| owner.controller == Some(true)) {
        Some(owner) if owner.uid == parent_uid => None,
        Some(owner) => Some(format!(
            "its controller is {} {} (uid {})",
            owner.kind, owner.name, owner.uid
        )),
        None => Some("it has no controller".to_owned()),
    }
}

/// `object[field]` as a JSON object, created (or replaced, if it is not an object) as needed.
pub(crate) fn object_field<'a>(object: &'a mut JsonObject, field: &str) -> &'a mut JsonObject {
    let slot = object
        .entry(field)
        .or_insert_with(|| Value::Object(Map::new()));
    if !slot.is_object() {
        *slot = Value::Object(Map::new());
    }
    match slot {
        Value::Object(map) => map,
        _ => unreachable!("just made an object"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(
        uid: &str,
        controller: Option<bool>,
    ) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "e2e.wasmctrl.dev/v1".into(),
            kind: "Widget".into(),
            name: format!("w-{uid}"),
            uid: uid.into(),
            controller,
            block_owner_deletion: None,
        }
    }

    #[test]
    fn only_a_child_this_parent_controls_is_ours() {
        assert_eq!(foreign_controller(&[owner("me", Some(true))], "me"), None);
        assert_eq!(
            foreign_controller(&[], "me").as_deref(),
            Some("it has no controller")
        );
        assert_eq!(
            foreign_controller(&[owner("me", None)], "me").as_deref(),
            Some("it has no controller"),
            "a plain ownerReference is not control"
        );
        let other = foreign_controller(&[owner("me", None), owner("other", Some(true))], "me")
            .expect("controlled by another");
        assert!(other.contains("Widget w-other (uid other)"), "{other}");
    }
}
