//! Whole-answer validation: every desired child is checked against what the policy allows
//! (kind, name, namespace, scope, no ownerReferences of its own, size) and the answer's
//! order is checked ([`order`]); the valid ones are stamped and fingerprinted, and any
//! refusal refuses the whole answer with every violation listed, so nothing is applied or
//! pruned on the strength of a partly invalid answer.

use std::collections::HashSet;

use serde_json::{Map, Value, json};
use sha2::{Digest as _, Sha256};

use super::stamp::{object_field, stamp};
use super::{order, readiness};
use crate::controller::labels::{
    DEPENDS_ON_ANNOTATION, DESIRED_HASH_ANNOTATION, READY_WHEN_ANNOTATION, TEARDOWN_FINALIZER,
};
use crate::controller::reconcile::parent::ParentIdentity;
use crate::plugin::JsonObject;

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
    /// Positions (in the validated answer) of the children this one waits for: it is
    /// applied only once they exist and are ready.
    pub depends_on: Vec<usize>,
}

impl DesiredChild {
    /// The child by kind index, namespace and name, as a reconcile's decisions know it.
    pub fn key(&self) -> crate::controller::reconcile::decisions::ChildKey<'_> {
        (self.kind_index, self.namespace.as_deref(), &self.name)
    }
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
    /// A child depends on a child the answer does not hold.
    #[error("{kind} {name} depends on {dependency}, which is not among the children of the answer")]
    UnknownDependency {
        /// The child's kind.
        kind: String,
        /// The child's name.
        name: String,
        /// The dependency, as `Kind/name`.
        dependency: String,
    },
    /// A child's ordering annotations cannot be read.
    #[error("{kind} {name}: {reason}")]
    InvalidOrder {
        /// The child's kind.
        kind: String,
        /// The child's name.
        name: String,
        /// What is wrong with them.
        reason: String,
    },
    /// Children depend on each other in a circle, so none of them could be applied first.
    #[error("the children's order has a cycle: {path}")]
    Cycle {
        /// The children along the cycle, `Kind/name → … → Kind/name`.
        path: String,
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
    let (ordered, depended) = depended_on(&desired);
    for (index, object) in desired.into_iter().enumerate() {
        match prepare_one(index, object, allowed, parent, policy_label, &depended) {
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
    if !problems.is_empty() {
        return Err(problems);
    }
    for child in &prepared {
        if let Some(expression) = order::ready_when(&child.object)
            && let Err(reason) = readiness::compile(expression)
        {
            problems.push(InvalidChild::InvalidOrder {
                kind: allowed[child.kind_index].kind.clone(),
                name: child.name.clone(),
                reason: format!("{READY_WHEN_ANNOTATION}: {reason}"),
            });
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    // Resolved only for an answer that orders something: an unordered one costs nothing.
    if ordered {
        let edges = order::resolve(prepared.iter().map(|child| {
            (
                allowed[child.kind_index].kind.as_str(),
                child.name.as_str(),
                &child.object,
            )
        }))
        .map_err(|problems| {
            problems
                .into_iter()
                .map(InvalidChild::from)
                .collect::<Vec<_>>()
        })?;
        for (child, depends_on) in prepared.iter_mut().zip(edges) {
            child.depends_on = depends_on;
        }
    }
    Ok(prepared)
}

impl From<order::OrderProblem> for InvalidChild {
    fn from(problem: order::OrderProblem) -> Self {
        match problem {
            order::OrderProblem::Unknown {
                kind,
                name,
                dependency,
            } => Self::UnknownDependency {
                kind,
                name,
                dependency,
            },
            order::OrderProblem::Unreadable { kind, name, reason } => {
                Self::InvalidOrder { kind, name, reason }
            }
            order::OrderProblem::Cycle { path } => Self::Cycle { path },
        }
    }
}

/// Whether any child of the answer orders itself (has the dependency annotation), and the
/// children some child names as a dependency, as `(kind, name)`: each gets the teardown
/// finalizer. Unreadable annotations name nothing here; ordering refuses them.
fn depended_on(desired: &[JsonObject]) -> (bool, HashSet<(String, String)>) {
    let mut ordered = false;
    let mut depended = HashSet::new();
    for object in desired {
        let Some(value) = object
            .get("metadata")
            .and_then(|metadata| metadata.get("annotations"))
            .and_then(|annotations| annotations.get(DEPENDS_ON_ANNOTATION))
            .filter(|value| !value.is_null())
        else {
            continue;
        };
        ordered = true;
        let named = value.as_str().map(order::parse).and_then(Result::ok);
        depended.extend(
            named
                .into_iter()
                .flatten()
                .map(|dependency| (dependency.kind, dependency.name)),
        );
    }
    (ordered, depended)
}

/// Check one desired child, in the order a user reads a refusal (what it is, its name, where
/// it goes, that it claims no owner), then stamp it and take its fingerprint.
fn prepare_one(
    index: usize,
    mut object: JsonObject,
    allowed: &[AllowedKind],
    parent: &ParentIdentity,
    policy_label: &str,
    depended: &HashSet<(String, String)>,
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
    if depended.contains(&(kind.clone(), name.clone())) {
        hold_for_dependents(metadata);
    }
    let hash = fingerprint(&mut object, &kind, &name)?;
    Ok(DesiredChild {
        kind_index,
        name,
        namespace: parent.namespace.clone(),
        object: Value::Object(object),
        hash,
        depends_on: Vec::new(),
    })
}

/// Give a child that others depend on the teardown finalizer, so it outlives them.
fn hold_for_dependents(metadata: &mut JsonObject) {
    let finalizers = metadata
        .entry("finalizers")
        .or_insert_with(|| Value::Array(Vec::new()));
    if !finalizers.is_array() {
        *finalizers = Value::Array(Vec::new());
    }
    if let Value::Array(finalizers) = finalizers
        && !finalizers.iter().any(|f| f == TEARDOWN_FINALIZER)
    {
        finalizers.push(json!(TEARDOWN_FINALIZER));
    }
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::controller::labels::{MANAGED_BY_LABEL, POLICY_LABEL};
    use crate::controller::testing::{
        allowed_kinds as allowed, deployment, object, team_a_parent as parent,
    };

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
                InvalidChild::UnknownDependency { .. }
                | InvalidChild::InvalidOrder { .. }
                | InvalidChild::Cycle { .. } => "order",
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
    fn ordered_children_resolve_and_what_others_need_is_held_for_them() {
        let after = |name: &str, depends: &str| {
            let mut child = deployment(name);
            child["metadata"]["annotations"] = json!({ DEPENDS_ON_ANNOTATION: depends });
            child
        };
        let children = prepare(
            vec![
                after("app", "Deployment/db"),
                deployment("db"),
                deployment("other"),
            ],
            &allowed(),
            &parent(),
            "p",
        )
        .expect("valid");
        assert_eq!(children[0].depends_on, vec![1]);
        assert!(children[1].depends_on.is_empty());
        let finalizers = |child: &DesiredChild| child.object["metadata"]["finalizers"].clone();
        assert_eq!(finalizers(&children[1]), json!([TEARDOWN_FINALIZER]));
        assert_eq!(
            finalizers(&children[0]),
            Value::Null,
            "nothing depends on app"
        );
        assert_eq!(finalizers(&children[2]), Value::Null);
        // The finalizer is part of the desire, so of its fingerprint.
        let alone = prepare(vec![deployment("db")], &allowed(), &parent(), "p").expect("valid");
        assert_ne!(alone[0].hash, children[1].hash);

        let cycle = prepare(
            vec![after("a", "Deployment/b"), after("b", "Deployment/a")],
            &allowed(),
            &parent(),
            "p",
        )
        .expect_err("a cycle");
        assert_eq!(
            cycle[0].to_string(),
            "the children's order has a cycle: Deployment/a → Deployment/b → Deployment/a"
        );
        let unknown = prepare(
            vec![after("a", "Deployment/gone")],
            &allowed(),
            &parent(),
            "p",
        )
        .expect_err("unknown");
        assert!(matches!(unknown[0], InvalidChild::UnknownDependency { .. }));
        let mut bad_rule = deployment("a");
        bad_rule["metadata"]["annotations"] =
            json!({ crate::controller::labels::READY_WHEN_ANNOTATION: "self.(" });
        let refused = prepare(vec![bad_rule], &allowed(), &parent(), "p").expect_err("bad CEL");
        assert!(
            refused[0].to_string().contains("not a CEL expression"),
            "{}",
            refused[0]
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
    fn names() {
        assert!(check_name("web-1.example").is_ok());
        for bad in ["", "-a", "a-", "A", "a_b", "a..b", &"a".repeat(254)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
