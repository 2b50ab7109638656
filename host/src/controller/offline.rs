//! The host's view of one reconcile, without a cluster: `wasmctrl plugin run --policy`.
//!
//! Given a policy, the same rules the controller applies decide what the plugin is shown and
//! what becomes of its answer: only children the parent controls (by uid, in its namespace)
//! of the policy's child kinds; only related objects of the policy's related kinds in the
//! parent's namespace that match their selector or that the parent names; the policy's
//! config and limits; then the
//! desired children validated and stamped (namespace, ownerReference, labels, fingerprint)
//! and the status with `observedGeneration` and the `Reconciled` condition added. What the
//! plugin is not shown is reported, so an author sees why.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::SelectorExt as _;
use serde_json::Value;

use crate::controller::cache::related::RelatedBy;
use crate::controller::labels;
use crate::controller::reconcile::children::{self, AllowedKind, InvalidChild};
use crate::controller::reconcile::parent::ParentIdentity;
use crate::controller::reconcile::request::is_controlled_by;
use crate::controller::reconcile::status::{self, Outcome};
use crate::plugin::{JsonObject, ObservedObject, ReconcileRequest, ReconcileResponse};
use crate::policy::ReconcilePolicySpec;

/// Why an offline run cannot proceed.
#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    /// The parent is not of the policy's parent kind, or lacks what the host needs.
    #[error("{0}")]
    Parent(String),
    /// The policy cannot be used as given.
    #[error("{0}")]
    Policy(String),
    /// The plugin's children are refused, as a reconcile in the cluster would refuse them.
    #[error("the host would refuse the plugin's children: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    InvalidChildren(Vec<InvalidChild>),
}

/// One policy, as the host would run it.
pub struct OfflinePolicy {
    policy_label: String,
    spec: ReconcilePolicySpec,
    allowed: Vec<AllowedKind>,
    related: Vec<RelatedBy>,
}

/// What the plugin is asked, and what the host would not show it.
pub struct OfflineRequest {
    /// The request, as the host would send it.
    pub request: ReconcileRequest,
    /// Objects given that the host would not pass on, and why.
    pub left_out: Vec<String>,
}

/// What the host would do with the plugin's answer.
pub struct OfflineAnswer {
    /// The children as the host would apply them.
    pub children: Vec<JsonObject>,
    /// The status as the host would write it.
    pub status: JsonObject,
}

impl OfflinePolicy {
    /// The policy named `name`; `namespaced(api_version, kind)` tells each child kind's scope
    /// (discovery, in a cluster).
    pub fn new(
        name: &str,
        spec: ReconcilePolicySpec,
        namespaced: impl Fn(&str, &str) -> Option<bool>,
    ) -> Result<Self, OfflineError> {
        let allowed = spec
            .children
            .iter()
            .map(|kind| {
                namespaced(&kind.api_version, &kind.kind)
                    .map(|namespaced| AllowedKind {
                        api_version: kind.api_version.clone(),
                        kind: kind.kind.clone(),
                        namespaced,
                    })
                    .ok_or_else(|| {
                        OfflineError::Policy(format!(
                            "the scope of child kind {} {} is not known offline: give its CustomResourceDefinition with --crd",
                            kind.api_version, kind.kind
                        ))
                    })
            })
            .collect::<Result<_, _>>()?;
        let related = spec
            .related
            .iter()
            .map(|rel| RelatedBy::of(rel).map_err(OfflineError::Policy))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            policy_label: labels::policy_label_value(name),
            spec,
            allowed,
            related,
        })
    }

    /// The parent's identity, if the policy reconciles it.
    pub fn parent(&self, parent: &Value) -> Result<ParentIdentity, OfflineError> {
        let text = |v: &Value| v.as_str().map(str::to_owned);
        let api_version = text(&parent["apiVersion"]).unwrap_or_default();
        let kind = text(&parent["kind"]).unwrap_or_default();
        let wanted = &self.spec.parent;
        if api_version != wanted.api_version || kind != wanted.kind {
            return Err(OfflineError::Parent(format!(
                "the parent is a {api_version} {kind}; the policy reconciles {} {}",
                wanted.api_version, wanted.kind
            )));
        }
        let namespace = text(&parent["metadata"]["namespace"]);
        if let Some(only) = &wanted.namespace
            && namespace.as_ref() != Some(only)
        {
            return Err(OfflineError::Parent(format!(
                "the parent is in namespace {namespace:?}; the policy reconciles {kind}s in {only:?} only"
            )));
        }
        Ok(ParentIdentity {
            api_version,
            kind,
            name: text(&parent["metadata"]["name"])
                .ok_or_else(|| OfflineError::Parent("the parent has no metadata.name".into()))?,
            namespace,
            uid: text(&parent["metadata"]["uid"]).unwrap_or_default(),
        })
    }

    /// The request the host would build from what is given: the parent, candidate children
    /// and related objects (as a cluster might hold them), and the config unless `config`
    /// overrides the policy's.
    pub fn request(
        &self,
        parent: &Value,
        children: Vec<Value>,
        related: Vec<Value>,
        config: Option<String>,
        finalizing: bool,
    ) -> Result<OfflineRequest, OfflineError> {
        let identity = self.parent(parent)?;
        let mut left_out = Vec::new();
        let mut kept_children = Vec::new();
        for child in children {
            let (api_version, kind, name, meta) = identify(&child);
            if !self
                .allowed
                .iter()
                .any(|a| a.api_version == api_version && a.kind == kind)
            {
                left_out.push(format!(
                    "child {kind} {name}: not one of the policy's child kinds"
                ));
            } else if !is_controlled_by(&identity, &meta) {
                left_out.push(format!(
                    "child {kind} {name}: not controlled by this parent (a controller ownerReference to uid {:?} in namespace {:?})",
                    identity.uid,
                    identity.namespace.as_deref().unwrap_or("")
                ));
            } else {
                kept_children.push(without_managed_fields(child));
            }
        }
        let mut kept_related = Vec::new();
        for object in related {
            let (api_version, kind, name, meta) = identify(&object);
            let matching = self
                .spec
                .related
                .iter()
                .zip(&self.related)
                .find(|(rel, _)| rel.api_version == api_version && rel.kind == kind);
            let labels = meta.labels.clone().unwrap_or_default();
            match matching {
                None => left_out.push(format!(
                    "related {kind} {name}: not one of the policy's related kinds"
                )),
                Some(_) if meta.namespace != identity.namespace => left_out.push(format!(
                    "related {kind} {name}: in namespace {:?}, not the parent's",
                    meta.namespace.as_deref().unwrap_or("")
                )),
                Some((_, RelatedBy::Selector(selector))) if !selector.matches(&labels) => left_out
                    .push(format!(
                    "related {kind} {name}: its labels do not match the policy's selector ({selector})"
                )),
                Some((_, RelatedBy::Name(path))) if !path.names(parent).contains(&name) => {
                    left_out.push(format!(
                        "related {kind} {name}: the parent's {path} does not name it{}",
                        match path.names(parent).as_slice() {
                            [] => " (it names nothing)".to_owned(),
                            names => format!(" (it names {})", names.join(", ")),
                        }
                    ));
                }
                Some(_) => kept_related.push(without_managed_fields(object)),
            }
        }
        kept_children.sort_by_key(|o| self.order(o, true));
        kept_related.sort_by_key(|o| self.order(o, false));
        let config = config.or_else(|| self.spec.plugin.config.as_ref().map(Value::to_string));
        Ok(OfflineRequest {
            request: ReconcileRequest {
                parent: parent.to_string(),
                children: kept_children
                    .iter()
                    .map(ObservedObject::from_value)
                    .collect(),
                related: kept_related
                    .iter()
                    .map(ObservedObject::from_value)
                    .collect(),
                config,
                finalizing,
            },
            left_out,
        })
    }

    /// The host's order: by the kind's place in the policy, then by name.
    fn order(&self, object: &Value, child: bool) -> (usize, String) {
        let (api_version, kind, name, _) = identify(object);
        let position = if child {
            self.allowed
                .iter()
                .position(|a| a.api_version == api_version && a.kind == kind)
        } else {
            self.spec
                .related
                .iter()
                .position(|r| r.api_version == api_version && r.kind == kind)
        };
        (position.unwrap_or(usize::MAX), name)
    }

    /// What the host would apply and write for `response`, now: every child
    /// validated and stamped, the status completed. Refused children fail the whole answer,
    /// as they fail a reconcile.
    pub fn answer(
        &self,
        parent: &Value,
        response: ReconcileResponse,
    ) -> Result<OfflineAnswer, OfflineError> {
        let identity = self.parent(parent)?;
        let desired = children::prepare(
            response.children,
            &self.allowed,
            &identity,
            &self.policy_label,
        )
        .map_err(OfflineError::InvalidChildren)?;
        let status = status::after_success(
            response.status,
            parent["metadata"]["generation"].as_i64(),
            parent.get("status"),
            &Outcome::success(desired.len()),
            &crate::controller::reconcile::status::now(),
        );
        Ok(OfflineAnswer {
            children: desired
                .into_iter()
                .filter_map(|c| match c.object {
                    Value::Object(object) => Some(object),
                    _ => None,
                })
                .collect(),
            status,
        })
    }
}

fn identify(object: &Value) -> (String, String, String, ObjectMeta) {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    // Metadata that does not decode (an ownerReference without its uid, say) counts as
    // having no owner and no labels, as the API server would never have stored it.
    let meta: ObjectMeta = serde_json::from_value(object["metadata"].clone()).unwrap_or_default();
    (
        text(&object["apiVersion"]),
        text(&object["kind"]),
        text(&object["metadata"]["name"]),
        meta,
    )
}

/// The host's watches drop `managedFields` before anything is cached.
fn without_managed_fields(mut object: Value) -> Value {
    if let Some(Value::Object(meta)) = object.get_mut("metadata") {
        meta.remove("managedFields");
    }
    object
}
