//! What the host does to a plugin's desired children before any of them reaches the cluster:
//! refuse what the policy does not allow, stamp ownership, and fingerprint each one so a
//! converged resync can skip the apply.
//!
//! Everything here is pure: it decides, the reconciler acts.

use std::collections::HashSet;

use serde_json::{Map, Value, json};
use sha2::{Digest as _, Sha256};

use crate::plugin::JsonObject;

/// Label every child carries: who manages it.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of [`MANAGED_BY_LABEL`].
pub const MANAGED_BY: &str = "wasmctrl";
/// Label every child carries: the policy whose plugin desired it. The host's child watches
/// select on it, so they cache only wasmctrl's children.
pub const POLICY_LABEL: &str = "wasmctrl.dev/policy";
/// Annotation holding the fingerprint of the desired object last applied.
pub const DESIRED_HASH_ANNOTATION: &str = "wasmctrl.dev/desired-hash";
/// Largest child the host applies. etcd refuses objects above about 1.5 MiB; a plugin that
/// produces one this big is almost certainly wrong.
pub const MAX_CHILD_BYTES: usize = 1 << 20;

/// A child kind the policy allows, as discovery resolved it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedKind {
    /// e.g. `apps/v1`.
    pub api_version: String,
    /// e.g. `Deployment`.
    pub kind: String,
    /// Whether objects of this kind live in a namespace.
    pub namespaced: bool,
}

/// The parent a set of children belongs to.
#[derive(Debug, Clone)]
pub struct ParentIdentity {
    /// The parent's `apiVersion`.
    pub api_version: String,
    /// The parent's `kind`.
    pub kind: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`; `None` for a cluster-scoped parent.
    pub namespace: Option<String>,
    /// `metadata.uid`.
    pub uid: String,
}

/// A validated child, stamped and ready to apply.
#[derive(Debug, Clone, PartialEq)]
pub struct DesiredChild {
    /// Index into the policy's allowed kinds.
    pub kind_index: usize,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`, when the kind is namespaced.
    pub namespace: Option<String>,
    /// The full object to apply, ownership and fingerprint included.
    pub object: Value,
    /// The fingerprint, also stored in [`DESIRED_HASH_ANNOTATION`].
    pub hash: String,
}

/// Why a desired child was refused. Any refusal fails the whole reconcile: nothing is applied
/// or pruned on the strength of a partly invalid answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidChild {
    /// The policy does not list this kind among its children.
    #[error("child {index} is a {api_version} {kind}, which the policy does not allow")]
    DisallowedKind {
        /// Position in the plugin's answer.
        index: usize,
        /// The child's `apiVersion`.
        api_version: String,
        /// The child's `kind`.
        kind: String,
    },
    /// `apiVersion`, `kind` or `metadata.name` is missing or not a string.
    #[error("child {index} has no {field}")]
    MissingField {
        /// Position in the plugin's answer.
        index: usize,
        /// The missing field.
        field: &'static str,
    },
    /// The name is not a valid object name.
    #[error("{kind} name {name:?} is invalid: {reason}")]
    InvalidName {
        /// The child's kind.
        kind: String,
        /// The refused name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The child names a namespace other than its parent's.
    #[error(
        "{kind} {name} is in namespace {namespace:?}; children must be in their parent's namespace {parent_namespace:?}"
    )]
    OtherNamespace {
        /// The child's kind.
        kind: String,
        /// The child's name.
        name: String,
        /// The namespace the plugin asked for.
        namespace: String,
        /// The parent's namespace.
        parent_namespace: String,
    },
    /// A cluster-scoped child of a namespaced parent, or a namespaced child of a
    /// cluster-scoped parent.
    #[error(
        "{kind} {name} is {child_scope}, its parent is {parent_scope}; children must share their parent's scope"
    )]
    ScopeMismatch {
        /// The child's kind.
        kind: String,
        /// The child's name.
        name: String,
        /// `namespaced` or `cluster-scoped`.
        child_scope: &'static str,
        /// `namespaced` or `cluster-scoped`.
        parent_scope: &'static str,
    },
    /// The plugin set ownerReferences itself; ownership is the host's to stamp.
    #[error("{kind} {name} sets metadata.ownerReferences; the host sets ownership")]
    OwnerReferencesSet {
        /// The child's kind.
        kind: String,
        /// The child's name.
        name: String,
    },
    /// The same kind and name twice.
    #[error("{kind} {name} is desired twice")]
    Duplicate {
        /// The child's kind.
        kind: String,
        /// The child's name.
        name: String,
    },
    /// The serialized child is bigger than [`MAX_CHILD_BYTES`].
    #[error("{kind} {name} is {bytes} bytes, above the {limit}-byte limit for one child")]
    TooLarge {
        /// The child's kind.
        kind: String,
        /// The child's name.
        name: String,
        /// Its serialized size.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
}

/// Validate every desired child and stamp the valid ones with ownership, labels and their
/// fingerprint. Returns every violation, not just the first, so one status update tells the
/// plugin author everything that is wrong.
pub fn prepare(
    desired: Vec<JsonObject>,
    allowed: &[AllowedKind],
    parent: &ParentIdentity,
    policy_label: &str,
) -> Result<Vec<DesiredChild>, Vec<InvalidChild>> {
    let mut prepared = Vec::with_capacity(desired.len());
    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    for (index, object) in desired.into_iter().enumerate() {
        match prepare_one(index, object, allowed, parent, policy_label) {
            Ok(child) => {
                let kind = &allowed[child.kind_index];
                if seen.insert((child.kind_index, child.name.clone())) {
                    prepared.push(child);
                } else {
                    problems.push(InvalidChild::Duplicate {
                        kind: kind.kind.clone(),
                        name: child.name,
                    });
                }
            }
            Err(problem) => problems.push(problem),
        }
    }
    if problems.is_empty() {
        Ok(prepared)
    } else {
        Err(problems)
    }
}

/// Check one desired child, in the order a user reads a refusal (what it is, its name, where
/// it goes, that it claims no owner), then stamp it and take its fingerprint.
fn prepare_one(
    index: usize,
    mut object: JsonObject,
    allowed: &[AllowedKind],
    parent: &ParentIdentity,
    policy_label: &str,
) -> Result<DesiredChild, InvalidChild> {
    let (kind_index, kind) = allowed_kind(index, &object, allowed)?;
    let metadata = match object
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()))
    {
        Value::Object(metadata) => metadata,
        _ => {
            return Err(InvalidChild::MissingField {
                index,
                field: "metadata.name",
            });
        }
    };
    let name = metadata
        .get("name")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or(InvalidChild::MissingField {
            index,
            field: "metadata.name",
        })?;
    if let Err(reason) = check_name(&name) {
        return Err(InvalidChild::InvalidName { kind, name, reason });
    }
    let (kind, name) = place(metadata, &allowed[kind_index], parent, kind, name)?;
    if metadata
        .get("ownerReferences")
        .is_some_and(|refs| !refs.is_null())
    {
        return Err(InvalidChild::OwnerReferencesSet { kind, name });
    }
    stamp(metadata, parent, policy_label);
    let hash = fingerprint(&mut object, &kind, &name)?;
    Ok(DesiredChild {
        kind_index,
        name,
        namespace: parent.namespace.clone(),
        object: Value::Object(object),
        hash,
    })
}

/// The index of the child's kind among the allowed kinds, and the kind's name.
fn allowed_kind(
    index: usize,
    object: &JsonObject,
    allowed: &[AllowedKind],
) -> Result<(usize, String), InvalidChild> {
    let text = |field: &'static str| {
        object
            .get(field)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or(InvalidChild::MissingField { index, field })
    };
    let api_version = text("apiVersion")?;
    let kind = text("kind")?;
    let kind_index = allowed
        .iter()
        .position(|a| a.api_version == api_version && a.kind == kind)
        .ok_or_else(|| InvalidChild::DisallowedKind {
            index,
            api_version: api_version.clone(),
            kind: kind.clone(),
        })?;
    Ok((kind_index, kind))
}

/// A child lives where its parent does: a namespaced child of a namespaced parent, in the
/// parent's namespace (filled in when the plugin left it out); a cluster-scoped child of a
/// cluster-scoped parent. Gives the kind and name back for the next check's error.
fn place(
    metadata: &mut JsonObject,
    allowed_kind: &AllowedKind,
    parent: &ParentIdentity,
    kind: String,
    name: String,
) -> Result<(String, String), InvalidChild> {
    let scope = |namespaced: bool| {
        if namespaced {
            "namespaced"
        } else {
            "cluster-scoped"
        }
    };
    if allowed_kind.namespaced != parent.namespace.is_some() {
        return Err(InvalidChild::ScopeMismatch {
            kind,
            name,
            child_scope: scope(allowed_kind.namespaced),
            parent_scope: scope(parent.namespace.is_some()),
        });
    }
    if let Some(parent_namespace) = &parent.namespace {
        match metadata.get("namespace") {
            None | Some(Value::Null) => {}
            Some(Value::String(ns)) if ns == parent_namespace => {}
            Some(other) => {
                return Err(InvalidChild::OtherNamespace {
                    kind,
                    name,
                    namespace: other
                        .as_str()
                        .map_or_else(|| other.to_string(), str::to_owned),
                    parent_namespace: parent_namespace.clone(),
                });
            }
        }
        metadata.insert("namespace".into(), json!(parent_namespace));
    }
    Ok((kind, name))
}

/// Make the parent the child's controller and label the child as the policy's.
fn stamp(metadata: &mut JsonObject, parent: &ParentIdentity, policy_label: &str) {
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
    // A plugin-supplied hash annotation would let it fake convergence.
    if let Some(Value::Object(annotations)) = metadata.get_mut("annotations") {
        annotations.remove(DESIRED_HASH_ANNOTATION);
    }
}

/// Check the stamped child's size and record its fingerprint on it, returning the
/// fingerprint.
fn fingerprint(object: &mut JsonObject, kind: &str, name: &str) -> Result<String, InvalidChild> {
    let serialized = serde_json::to_vec(&*object).unwrap_or_default();
    if serialized.len() > MAX_CHILD_BYTES {
        return Err(InvalidChild::TooLarge {
            kind: kind.to_owned(),
            name: name.to_owned(),
            bytes: serialized.len(),
            limit: MAX_CHILD_BYTES,
        });
    }
    let hash = hex::encode(&Sha256::digest(&serialized)[..16]);
    if let Some(Value::Object(metadata)) = object.get_mut("metadata") {
        object_field(metadata, "annotations").insert(DESIRED_HASH_ANNOTATION.into(), json!(hash));
    }
    Ok(hash)
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
fn object_field<'a>(object: &'a mut JsonObject, field: &str) -> &'a mut JsonObject {
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

/// A DNS-1123 subdomain, which every kind accepts as a name (some kinds are stricter; the API
/// server reports those).
pub fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("it is empty");
    }
    if name.len() > 253 {
        return Err("it is longer than 253 characters");
    }
    for label in name.split('.') {
        let bytes = label.as_bytes();
        let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        if bytes.is_empty()
            || !bytes.iter().all(|b| alnum(b) || *b == b'-')
            || !alnum(&bytes[0])
            || !alnum(&bytes[bytes.len() - 1])
        {
            return Err(
                "it must be lowercase letters, digits, '-' and '.', starting and ending with a letter or digit",
            );
        }
    }
    Ok(())
}

/// Whether the observed child already is what the plugin desires: it carries the fingerprint
/// of this exact desired object (so no field was dropped from the desire since the last
/// apply), and every desired field has the desired value (so nobody edited it by hand).
pub fn is_converged(desired: &DesiredChild, observed: &Value) -> bool {
    observed["metadata"]["annotations"][DESIRED_HASH_ANNOTATION].as_str()
        == Some(desired.hash.as_str())
        && is_subset(&desired.object, observed)
}

/// The paths of the desired fields whose observed value differs, at most `limit`, in key
/// order (`.spec.replicas`, `.metadata.labels.app (missing)`).
pub fn differences(desired: &Value, observed: &Value, limit: usize) -> Vec<String> {
    fn walk(
        desired: &Value,
        observed: &Value,
        path: &mut String,
        limit: usize,
        found: &mut Vec<String>,
    ) {
        match (desired, observed) {
            (Value::Object(want), Value::Object(have)) => {
                for (key, value) in want {
                    if found.len() >= limit {
                        return;
                    }
                    let len = path.len();
                    path.push('.');
                    path.push_str(key);
                    match have.get(key) {
                        Some(found_value) => walk(value, found_value, path, limit, found),
                        None if value.is_null() => {}
                        None => found.push(format!("{path} (missing)")),
                    }
                    path.truncate(len);
                }
            }
            (Value::Array(want), Value::Array(have)) if want.len() == have.len() => {
                for (i, (w, h)) in want.iter().zip(have).enumerate() {
                    if found.len() >= limit {
                        return;
                    }
                    let len = path.len();
                    path.push_str(&format!("[{i}]"));
                    walk(w, h, path, limit, found);
                    path.truncate(len);
                }
            }
            _ if is_subset(desired, observed) => {}
            _ => found.push(path.clone()),
        }
    }
    let mut found = Vec::new();
    walk(desired, observed, &mut String::new(), limit, &mut found);
    found
}

/// Whether every field of `desired` is in `observed` with an equal value. Fields the server
/// adds (defaults, status, other managers' fields) are ignored; a desired `null` matches an
/// absent field; numbers compare by value, so `1` equals `1.0`.
pub fn is_subset(desired: &Value, observed: &Value) -> bool {
    match (desired, observed) {
        (Value::Object(want), Value::Object(have)) => {
            want.iter().all(|(key, value)| match have.get(key) {
                Some(found) => is_subset(value, found),
                None => value.is_null(),
            })
        }
        (Value::Array(want), Value::Array(have)) => {
            want.len() == have.len() && want.iter().zip(have).all(|(w, h)| is_subset(w, h))
        }
        (Value::Number(want), Value::Number(have)) => {
            want == have || want.as_f64().is_some_and(|w| Some(w) == have.as_f64())
        }
        (Value::Null, Value::Null) => true,
        (want, have) => want == have,
    }
}

/// The value of [`POLICY_LABEL`] for a policy: its name when that fits a label value,
/// otherwise a prefix plus a hash, so long names still get a unique, valid label.
pub fn policy_label_value(policy: &str) -> String {
    if policy.len() <= 63 {
        return policy.to_owned();
    }
    let hash = hex::encode(&Sha256::digest(policy.as_bytes())[..5]);
    let prefix = policy[..52].trim_end_matches(['-', '.']);
    format!("{prefix}-{hash}")
}

/// The observed children no longer desired: same kind and name is the same child, whatever
/// its content. Each observed child is `(kind index, name)`; the result holds their positions
/// in `observed`, in order.
pub fn to_prune<'a>(
    observed: impl IntoIterator<Item = (usize, &'a str)>,
    desired: &[DesiredChild],
) -> Vec<usize> {
    let wanted: HashSet<(usize, &str)> = desired
        .iter()
        .map(|d| (d.kind_index, d.name.as_str()))
        .collect();
    observed
        .into_iter()
        .enumerate()
        .filter(|(_, child)| !wanted.contains(child))
        .map(|(position, _)| position)
        .collect()
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

    fn allowed() -> Vec<AllowedKind> {
        vec![
            AllowedKind {
                api_version: "apps/v1".into(),
                kind: "Deployment".into(),
                namespaced: true,
            },
            AllowedKind {
                api_version: "v1".into(),
                kind: "Namespace".into(),
                namespaced: false,
            },
        ]
    }

    fn parent() -> ParentIdentity {
        ParentIdentity {
            api_version: "example.com/v1".into(),
            kind: "MyApp".into(),
            name: "web".into(),
            namespace: Some("team-a".into()),
            uid: "uid-1".into(),
        }
    }

    fn object(value: Value) -> JsonObject {
        match value {
            Value::Object(map) => map,
            _ => panic!("not an object"),
        }
    }

    fn deployment(name: &str) -> JsonObject {
        object(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"replicas": 3},
        }))
    }

    #[test]
    fn stamps_namespace_ownership_labels_and_hash() {
        let children =
            prepare(vec![deployment("web")], &allowed(), &parent(), "myapp").expect("valid");
        let child = &children[0].object;
        assert_eq!(child["metadata"]["namespace"], "team-a");
        assert_eq!(child["metadata"]["labels"]["app"], "web");
        assert_eq!(child["metadata"]["labels"][MANAGED_BY_LABEL], "wasmctrl");
        assert_eq!(child["metadata"]["labels"][POLICY_LABEL], "myapp");
        let owner = &child["metadata"]["ownerReferences"][0];
        assert_eq!(owner["uid"], "uid-1");
        assert_eq!(owner["controller"], true);
        assert_eq!(owner["blockOwnerDeletion"], true);
        assert_eq!(
            child["metadata"]["annotations"][DESIRED_HASH_ANNOTATION],
            children[0].hash.as_str()
        );
    }

    #[test]
    fn the_hash_changes_with_the_desire_and_only_with_it() {
        let hash = |d: JsonObject| {
            prepare(vec![d], &allowed(), &parent(), "p").expect("ok")[0]
                .hash
                .clone()
        };
        let mut scaled = deployment("web");
        scaled["spec"]["replicas"] = json!(4);
        assert_eq!(hash(deployment("web")), hash(deployment("web")));
        assert_ne!(hash(deployment("web")), hash(scaled));
    }

    #[test]
    fn refuses_what_the_policy_does_not_allow() {
        let secret =
            object(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}));
        let mut elsewhere = deployment("web");
        elsewhere["metadata"]["namespace"] = json!("kube-system");
        let namespace =
            object(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "evil"}}));
        let mut owned = deployment("owned");
        owned["metadata"]["ownerReferences"] = json!([{"uid": "x"}]);
        let bad_name = deployment("Web_1");
        let nameless = object(json!({"apiVersion": "apps/v1", "kind": "Deployment"}));
        let problems = prepare(
            vec![
                secret,
                elsewhere,
                namespace,
                owned,
                bad_name,
                nameless,
                deployment("a"),
                deployment("a"),
            ],
            &allowed(),
            &parent(),
            "p",
        )
        .expect_err("all refused");
        let kinds: Vec<&str> = problems
            .iter()
            .map(|p| match p {
                InvalidChild::DisallowedKind { .. } => "kind",
                InvalidChild::OtherNamespace { .. } => "namespace",
                InvalidChild::ScopeMismatch { .. } => "scope",
                InvalidChild::OwnerReferencesSet { .. } => "owner",
                InvalidChild::InvalidName { .. } => "name",
                InvalidChild::MissingField { .. } => "missing",
                InvalidChild::Duplicate { .. } => "duplicate",
                InvalidChild::TooLarge { .. } => "size",
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "kind",
                "namespace",
                "scope",
                "owner",
                "name",
                "missing",
                "duplicate"
            ]
        );
        assert!(
            problems[1].to_string().contains("kube-system"),
            "{}",
            problems[1]
        );
    }

    #[test]
    fn refuses_oversized_children() {
        let mut big = deployment("big");
        big["spec"]["filler"] = json!("x".repeat(MAX_CHILD_BYTES));
        let problems = prepare(vec![big], &allowed(), &parent(), "p").expect_err("too big");
        assert!(matches!(problems[0], InvalidChild::TooLarge { .. }));
    }

    #[test]
    fn converged_means_same_hash_and_no_hand_edits() {
        let child = prepare(vec![deployment("web")], &allowed(), &parent(), "p")
            .expect("ok")
            .remove(0);
        let mut observed = child.object.clone();
        observed["metadata"]["resourceVersion"] = json!("42");
        observed["spec"]["strategy"] = json!({"type": "RollingUpdate"});
        observed["status"] = json!({"readyReplicas": 3});
        assert!(is_converged(&child, &observed));

        let mut edited = observed.clone();
        edited["spec"]["replicas"] = json!(1);
        assert!(
            !is_converged(&child, &edited),
            "a hand edit must be corrected"
        );

        let mut stale = observed;
        stale["metadata"]["annotations"][DESIRED_HASH_ANNOTATION] = json!("old");
        assert!(
            !is_converged(&child, &stale),
            "a dropped field must be applied away"
        );
    }

    #[test]
    fn the_first_difference_is_named_by_path() {
        let first_difference = |d: &Value, o: &Value| differences(d, o, 1).into_iter().next();
        let desired = json!({"spec": {"replicas": 3, "ports": [{"port": 80}]}});
        let observed = json!({"spec": {"replicas": 3, "ports": [{"port": 81}]}});
        assert_eq!(
            first_difference(&desired, &observed).as_deref(),
            Some(".spec.ports[0].port")
        );
        assert_eq!(first_difference(&desired, &desired), None);
        assert_eq!(
            first_difference(&json!({"a": 1}), &json!({})).as_deref(),
            Some(".a (missing)")
        );
    }

    #[test]
    fn every_difference_is_named_up_to_the_limit() {
        let desired =
            json!({"spec": {"replicas": 3, "image": "b", "ports": [{"port": 80}]}, "x": null});
        let observed =
            json!({"spec": {"replicas": 2, "image": "a", "ports": [{"port": 81}], "extra": 1}});
        assert_eq!(
            differences(&desired, &observed, 10),
            [".spec.image", ".spec.ports[0].port", ".spec.replicas"],
            "fields the server added and desired nulls are not differences"
        );
        assert_eq!(differences(&desired, &observed, 2).len(), 2);
        assert!(differences(&desired, &desired, 10).is_empty());
    }

    #[test]
    fn subset_rules() {
        assert!(is_subset(&json!({"a": 1}), &json!({"a": 1.0, "b": 2})));
        assert!(is_subset(&json!({"a": null}), &json!({})));
        assert!(!is_subset(&json!({"a": [1, 2]}), &json!({"a": [1]})));
        assert!(is_subset(
            &json!([{"port": 80}]),
            &json!([{"port": 80, "protocol": "TCP"}])
        ));
        assert!(!is_subset(&json!({"a": "1"}), &json!({"a": 1})));
    }

    #[test]
    fn names() {
        assert!(check_name("web-1.example").is_ok());
        for bad in ["", "-a", "a-", "A", "a_b", "a..b", &"a".repeat(254)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn long_policy_names_get_unique_valid_labels() {
        let long = "a".repeat(80);
        let label = policy_label_value(&long);
        assert!(label.len() <= 63, "{label}");
        assert_ne!(label, policy_label_value(&"a".repeat(81)));
        assert_eq!(policy_label_value("myapp"), "myapp");
    }

    #[test]
    fn children_no_longer_desired_are_pruned_by_kind_and_name() {
        let desired = |kind_index: usize, name: &str| DesiredChild {
            kind_index,
            name: name.to_owned(),
            namespace: Some("a".into()),
            object: json!({}),
            hash: String::new(),
        };
        let observed = [(0, "web"), (1, "web"), (0, "old"), (1, "gone")];
        assert_eq!(
            to_prune(observed, &[desired(0, "web"), desired(1, "web")]),
            [2, 3]
        );
        // A Service named like a desired Deployment is not that Deployment.
        assert_eq!(to_prune(observed, &[desired(0, "gone")]), [0, 1, 2, 3]);
        assert_eq!(to_prune(observed, &[]), [0, 1, 2, 3]);
        assert!(to_prune([], &[desired(0, "web")]).is_empty());
    }
}
