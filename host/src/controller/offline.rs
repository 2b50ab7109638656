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

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::Value;

use crate::controller::cache::cached::CachedObject;
use crate::controller::cache::related::{self, RelatedBy, RelatedBytes};
use crate::controller::labels;
use crate::controller::reconcile::children::{self, AllowedKind, InvalidChild};
use crate::controller::reconcile::parent::ParentIdentity;
use crate::controller::reconcile::request;
use crate::controller::reconcile::status::{self, Outcome};
use crate::controller::reconcile::visibility::{self, RelatedHidden};
use crate::plugin::{JsonObject, ReconcileRequest, ReconcileResponse};
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
    /// A child or related object given is not a Kubernetes object.
    #[error("{0}")]
    Object(String),
    /// The parent asks for more related objects than one request may carry, as a reconcile
    /// in the cluster would refuse it.
    #[error("{0}")]
    RelatedTooLarge(String),
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
        // Parsed as a reconcile parses it. A parent written by hand may lack the uid the API
        // server gives every object; offline it is empty (children then name no owner uid).
        let mut object: DynamicObject = serde_json::from_value(parent.clone())
            .map_err(|e| OfflineError::Parent(format!("the parent is not a {kind}: {e}")))?;
        object.metadata.uid.get_or_insert_with(String::new);
        let (group, version) = api_version.split_once('/').unwrap_or(("", &api_version));
        let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, &kind));
        ParentIdentity::of(&object, &resource)
            .map_err(|field| OfflineError::Parent(format!("the parent has no {field}")))
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
        let too_large = |limit| OfflineError::RelatedTooLarge(format!("{identity}: {limit}"));
        for (spec, by) in self.spec.related.iter().zip(&self.related) {
            if let RelatedBy::Name(path) = by {
                related::within_name_limit(&spec.kind, path, path.names(parent))
                    .map_err(too_large)?;
            }
        }
        let mut left_out = Vec::new();
        let mut kept_children = Vec::new();
        for child in children {
            let (api_version, kind, name, meta) = identify(&child);
            let position = self
                .allowed
                .iter()
                .position(|a| a.api_version == api_version && a.kind == kind);
            match position {
                None => left_out.push(format!(
                    "child {kind} {name}: not one of the policy's child kinds"
                )),
                Some(_) if !visibility::child_visible(&identity, &meta) => left_out.push(format!(
                    "child {kind} {name}: not controlled by this parent (a controller ownerReference to uid {:?} in namespace {:?})",
                    identity.uid,
                    identity.namespace.as_deref().unwrap_or("")
                )),
                Some(position) => kept_children.push((position, name, cached(child)?)),
            }
        }
        let mut kept_related = Vec::new();
        for object in related {
            let (api_version, kind, name, meta) = identify(&object);
            let matching = self
                .spec
                .related
                .iter()
                .position(|rel| rel.api_version == api_version && rel.kind == kind);
            let Some(position) = matching else {
                left_out.push(format!(
                    "related {kind} {name}: not one of the policy's related kinds"
                ));
                continue;
            };
            let by = &self.related[position];
            let named = || match by {
                RelatedBy::Name(path) => path.names(parent),
                RelatedBy::All | RelatedBy::Selector(_) => Vec::new(),
            };
            match visibility::related_visible(&identity, by, &meta, named) {
                Ok(()) => kept_related.push((position, name, cached(object)?)),
                Err(RelatedHidden::OtherNamespace) => left_out.push(format!(
                    "related {kind} {name}: in namespace {:?}, not the parent's",
                    meta.namespace.as_deref().unwrap_or("")
                )),
                Err(RelatedHidden::SelectorMismatch(selector)) => left_out.push(format!(
                    "related {kind} {name}: its labels do not match the policy's selector ({selector})"
                )),
                Err(RelatedHidden::NotNamed { path, names }) => left_out.push(format!(
                    "related {kind} {name}: the parent's {path} does not name it{}",
                    match names.as_slice() {
                        [] => " (it names nothing)".to_owned(),
                        names => format!(" (it names {})", names.join(", ")),
                    }
                )),
            }
        }
        let config = config.or_else(|| self.spec.plugin.config.as_ref().map(Value::to_string));
        // The parent as a reconcile sends it: read back from the host's cached form.
        let parent = cached(parent.clone())
            .map_err(|e| OfflineError::Parent(e.to_string()))?
            .to_dynamic();
        let parent = serde_json::to_string(&parent)
            .map_err(|e| OfflineError::Parent(format!("the parent does not serialize: {e}")))?;
        let related = shown(kept_related);
        let mut bytes = RelatedBytes::default();
        for object in &related {
            bytes.take(object).map_err(too_large)?;
        }
        Ok(OfflineRequest {
            request: ReconcileRequest {
                parent,
                children: shown(kept_children),
                related,
                config,
                finalizing,
            },
            left_out,
        })
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

/// `object` as the host caches what its watches deliver (`managedFields` dropped, the body
/// kept as text), so the plugin is sent what a reconcile would send of it (keys in the order
/// and with the escapes serde_json writes, where a watch keeps the API server's).
fn cached(mut object: Value) -> Result<Arc<CachedObject>, OfflineError> {
    if let Some(Value::Object(meta)) = object.get_mut("metadata") {
        meta.remove("managedFields");
    }
    CachedObject::from_value(object).map(Arc::new).map_err(|e| {
        OfflineError::Object(format!("an object given is not a Kubernetes object: {e}"))
    })
}

/// Objects in the order the host shows them (by their kind's place in the policy, then by
/// name), as the plugin is sent them.
fn shown(
    mut objects: Vec<(usize, String, Arc<CachedObject>)>,
) -> Vec<crate::plugin::ObservedObject> {
    objects.sort_by(|a, b| visibility::order(a.0, &a.1).cmp(&visibility::order(b.0, &b.1)));
    objects
        .iter()
        .map(|(_, _, object)| request::observed_object(object))
        .collect()
}

#[cfg(test)]
mod tests {
    //! The offline run and a reconcile, given the same objects, must ask the plugin the same
    //! thing, to the byte.

    use serde_json::json;

    use super::*;
    use crate::controller::cache::field_ownership::CreatedFields;
    use crate::controller::cache::store_index;
    use crate::controller::cache::stores::{ChildCache, Related, RelatedCache};
    use crate::controller::testing::{self, config_maps};

    fn object(value: Value) -> CachedObject {
        CachedObject::from_value(value).unwrap_or_else(|e| panic!("{e}"))
    }

    fn owned(name: &str, namespace: &str, uid: &str, data: &str) -> Value {
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {
                "name": name, "namespace": namespace, "uid": format!("uid-{name}"),
                "resourceVersion": "7", "labels": {"wasmctrl.dev/policy": "p", "x": "y"},
                "annotations": {"note": "kept"},
                "ownerReferences": [{"apiVersion": "example.com/v1", "kind": "MyApp", "name": "web",
                                     "uid": uid, "controller": true, "blockOwnerDeletion": true}],
            },
            "data": {"k": data},
        })
    }

    fn secret(name: &str, namespace: &str, tier: &str) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace, "labels": {"tier": tier}},
            "type": "Opaque", "data": {"password": "c2VjcmV0"},
        })
    }

    #[tokio::test]
    async fn an_offline_run_asks_the_plugin_exactly_what_a_reconcile_asks() {
        let parent = json!({
            "apiVersion": "example.com/v1", "kind": "MyApp",
            "metadata": {"name": "web", "namespace": "a", "uid": "uid-web", "generation": 3,
                         "labels": {"app": "web"}, "resourceVersion": "42"},
            "spec": {"replicas": 2, "image": "nginx"},
            "status": {"observedGeneration": 2},
        });
        let children = vec![
            owned("web-b", "a", "uid-web", "2"),
            owned("web-a", "a", "uid-web", "1"),
            owned("other-parents", "a", "uid-other", "3"),
            owned("elsewhere", "b", "uid-web", "4"),
        ];
        let related = vec![
            secret("db-b", "a", "db"),
            secret("db-a", "a", "db"),
            secret("cache", "a", "cache"),
            secret("db-elsewhere", "b", "db"),
        ];
        let spec: ReconcilePolicySpec = serde_json::from_value(json!({
            "parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
            "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
            "related": [{"apiVersion": "v1", "kind": "Secret",
                         "selector": {"matchLabels": {"tier": "db"}}}],
            "plugin": {"source": {"file": {"path": "/p.wasm"}}, "config": {"greeting": "hi"}},
        }))
        .unwrap_or_else(|e| panic!("{e}"));

        // Offline, as `wasmctrl plugin run --policy` builds it.
        let offline = OfflinePolicy::new("p", spec, |_, _| Some(true))
            .unwrap_or_else(|e| panic!("{e}"))
            .request(&parent, children.clone(), related.clone(), None, false)
            .unwrap_or_else(|e| panic!("{e}"));

        // Live: the caches a watch would fill (the selector already applied to the related
        // kind's watch), then the request a reconcile builds.
        let (child_store, by_controller) = testing::indexed_store(
            Arc::new(config_maps()),
            children.into_iter().map(object).collect(),
            store_index::controller_uid,
        );
        let child_caches = [ChildCache {
            resource: Arc::new(config_maps()),
            store: child_store,
            by_controller,
            created: Arc::new(CreatedFields::new("wasmctrl/p".into())),
            pending: Default::default(),
        }];
        let secrets = kube::core::ApiResource::erase::<k8s_openapi::api::core::v1::Secret>(&());
        let (related_store, by_namespace) = testing::indexed_store(
            Arc::new(secrets),
            related
                .into_iter()
                .filter(|s| s["metadata"]["labels"]["tier"] == "db")
                .map(object)
                .collect(),
            store_index::namespace,
        );
        let related_caches = [Related::Selected(RelatedCache {
            store: related_store,
            by_namespace,
        })];
        let cached_parent = object(parent.clone()).to_dynamic();
        let identity = ParentIdentity::of(&cached_parent, &testing::myapps())
            .unwrap_or_else(|e| panic!("{e}"));
        let observed = request::observed_children(&identity, &child_caches);
        let related = request::related(
            &cached_parent,
            &identity,
            &related_caches,
            RelatedBytes::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let serving = testing::serving(r#"{"greeting":"hi"}"#);
        let live = request::build(&cached_parent, &observed, related, &serving, false);

        let names = |objects: &[crate::plugin::ObservedObject]| {
            objects.iter().map(|o| o.name.clone()).collect::<Vec<_>>()
        };
        assert_eq!(names(&live.children), ["web-a", "web-b"]);
        assert_eq!(names(&live.related), ["db-a", "db-b"]);
        assert_eq!(offline.request.parent, live.parent, "the parent");
        assert_eq!(offline.request.config, live.config, "the config");
        assert_eq!(offline.request.finalizing, live.finalizing);
        for (what, offline, live) in [
            ("children", &offline.request.children, &live.children),
            ("related", &offline.request.related, &live.related),
        ] {
            assert_eq!(
                names(offline),
                names(live),
                "{what}: the same objects, in order"
            );
            for (o, l) in offline.iter().zip(live) {
                assert_eq!(
                    (&o.api_version, &o.kind, &o.json),
                    (&l.api_version, &l.kind, &l.json),
                    "{what} {}: the same bytes",
                    o.name
                );
            }
        }
        assert_eq!(offline.left_out.len(), 4, "{:?}", offline.left_out);
    }

    #[test]
    fn an_offline_run_refuses_a_parent_naming_more_objects_than_a_reconcile_reads() {
        let spec: ReconcilePolicySpec = serde_json::from_value(json!({
            "parent": {"apiVersion": "example.com/v1", "kind": "MyApp"},
            "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
            "related": [{"apiVersion": "v1", "kind": "Secret", "nameFrom": "spec.secrets"}],
            "plugin": {"source": {"file": {"path": "/p.wasm"}}},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let policy =
            OfflinePolicy::new("p", spec, |_, _| Some(true)).unwrap_or_else(|e| panic!("{e}"));
        let parent = |count: usize| {
            let secrets: Vec<String> = (0..count).map(|i| format!("s{i}")).collect();
            json!({
                "apiVersion": "example.com/v1", "kind": "MyApp",
                "metadata": {"name": "web", "namespace": "a", "uid": "uid-web"},
                "spec": {"secrets": secrets},
            })
        };
        let limit = related::MAX_NAMES_PER_FIELD;
        assert!(
            policy
                .request(&parent(limit), vec![], vec![], None, false)
                .is_ok()
        );
        let refused = policy.request(&parent(limit + 1), vec![], vec![], None, false);
        assert!(
            matches!(&refused, Err(OfflineError::RelatedTooLarge(message))
                if message.starts_with("MyApp a/web: its spec.secrets names 65 Secret objects")),
            "{:?}",
            refused.err().map(|e| e.to_string())
        );
    }
}
