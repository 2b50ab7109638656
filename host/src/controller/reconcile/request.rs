//! What a plugin is asked: the parent, the children the caches show it controls, and the
//! related objects the policy chooses for it. One builder for a reconcile and for
//! finalizing, so both see the same world.

use std::sync::Arc;

use kube::ResourceExt as _;
use kube::core::DynamicObject;

use crate::controller::cache::cached::CachedObject;
use crate::controller::cache::named_objects::NamedError;
use crate::controller::cache::related::{RelatedBytes, RelatedLimit};
use crate::controller::cache::stores::{ChildCache, Related, RelatedCache};
use crate::controller::reconcile::error::ReconcileError;
use crate::controller::reconcile::parent::ParentIdentity;
use crate::controller::reconcile::serving::ActivePlugin;
use crate::controller::reconcile::visibility;
use crate::plugin::{ObservedObject, ReconcileRequest};

/// A child the parent has: the index of its kind in the policy's allowed kinds, and the
/// cached object.
pub(crate) type Observed = (usize, Arc<CachedObject>);

/// Children in `caches` whose controller is this parent (by uid, in its namespace), with the
/// index of their kind, in a stable order (kind, then name). An object that merely carries
/// the policy's label, or that another parent controls, is not this parent's child. Found
/// through each cache's controller index, so the cost is the parent's children, not all.
pub(crate) fn observed_children(parent: &ParentIdentity, caches: &[ChildCache]) -> Vec<Observed> {
    let mut observed = Vec::new();
    for (index, cache) in caches.iter().enumerate() {
        let mut children: Vec<_> = cache
            .by_controller
            .get(&parent.uid)
            .iter()
            .filter_map(|key| cache.store.get(key))
            .filter(|child| visibility::child_visible(parent, &child.metadata))
            .collect();
        children.sort_by(|a, b| {
            visibility::order(index, a.metadata.name.as_deref().unwrap_or_default()).cmp(
                &visibility::order(index, b.metadata.name.as_deref().unwrap_or_default()),
            )
        });
        observed.extend(children.into_iter().map(|child| (index, child)));
    }
    observed
}

/// The related objects the plugin is shown for `parent`, in the policy's order of kinds, each
/// kind in name order: from the caches for kinds chosen by selector, read (when not current)
/// for kinds chosen by name. At most [`RelatedBytes`]' limit of them: the objects are
/// counted as they are taken, and the first past the limit fails the request, before the
/// rest are copied or read.
pub(crate) async fn related(
    parent: &DynamicObject,
    identity: &ParentIdentity,
    related: &[Related],
    mut bytes: RelatedBytes,
) -> Result<Vec<ObservedObject>, ReconcileError> {
    let too_large = |limit: RelatedLimit| ReconcileError::RelatedTooLarge {
        parent: identity.to_string(),
        limit,
    };
    let mut objects = Vec::new();
    for kind in related {
        match kind {
            Related::Selected(cache) => {
                for object in selected_objects(identity, cache) {
                    let object = observed_object(&object);
                    bytes.take(&object).map_err(too_large)?;
                    objects.push(object);
                }
            }
            Related::Named(named) => match named.named_by(parent, &mut bytes).await {
                Ok(named) => objects.extend(named),
                Err(NamedError::Read(error)) => return Err(error.into()),
                Err(NamedError::Limit(limit)) => return Err(too_large(limit)),
            },
        }
    }
    Ok(objects)
}

/// Objects of a selected kind in the parent's namespace (the watch already applied the
/// selector), in name order, found through the cache's namespace index.
fn selected_objects(parent: &ParentIdentity, cache: &RelatedCache) -> Vec<Arc<CachedObject>> {
    let namespace = parent.namespace.clone().unwrap_or_default();
    let mut objects: Vec<_> = cache
        .by_namespace
        .get(&namespace)
        .iter()
        .filter_map(|key| cache.store.get(key))
        .filter(|o| visibility::related_in_scope(parent, o.metadata.namespace.as_deref()))
        .collect();
    objects.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    objects
}

/// The request for `parent` with its `observed` children and `related` objects, served by
/// `serving`.
pub(crate) fn build(
    parent: &DynamicObject,
    observed: &[Observed],
    related: Vec<ObservedObject>,
    serving: &ActivePlugin,
    finalizing: bool,
) -> ReconcileRequest {
    ReconcileRequest {
        parent: serde_json::to_string(parent).unwrap_or_default(),
        children: observed.iter().map(|(_, o)| observed_object(o)).collect(),
        related,
        config: serving.config.clone(),
        finalizing,
    }
}

/// A cached object as the plugin is shown it.
pub(crate) fn observed_object(object: &Arc<CachedObject>) -> ObservedObject {
    let (api_version, kind) = object
        .types
        .as_ref()
        .map(|t| (t.api_version.clone(), t.kind.clone()))
        .unwrap_or_default();
    ObservedObject {
        api_version,
        kind,
        name: object.name_any(),
        json: object.to_json(),
    }
}

#[cfg(test)]
mod tests {
    //! The caches are real kube-runtime stores, filled as a watch would fill them.

    use serde_json::json;

    use super::*;
    use crate::controller::cache::field_ownership::CreatedFields;
    use crate::controller::cache::store_index;
    use crate::controller::testing::{self, config_maps};

    fn object(namespace: &str, name: &str, controller_uid: Option<(&str, bool)>) -> CachedObject {
        let owners: Vec<_> = controller_uid
            .map(|(uid, controller)| {
                json!({"apiVersion": "example.com/v1", "kind": "MyApp", "name": "p",
                       "uid": uid, "controller": controller})
            })
            .into_iter()
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "ownerReferences": owners},
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn parent() -> ParentIdentity {
        ParentIdentity {
            api_version: "example.com/v1".into(),
            kind: "MyApp".into(),
            name: "p".into(),
            namespace: Some("a".into()),
            uid: "uid-p".into(),
            shard: None,
        }
    }

    #[test]
    fn only_children_this_parent_controls_in_its_namespace_are_observed() {
        let (store, by_controller) = testing::indexed_store(
            Arc::new(config_maps()),
            vec![
                object("a", "mine-2", Some(("uid-p", true))),
                object("a", "mine-1", Some(("uid-p", true))),
                object("a", "owned-not-controlled", Some(("uid-p", false))),
                object("a", "another-parents", Some(("uid-q", true))),
                object("a", "labelled-only", None),
                object("b", "same-uid-elsewhere", Some(("uid-p", true))),
            ],
            store_index::controller_uid,
        );
        let caches = [ChildCache {
            resource: Arc::new(config_maps()),
            store,
            by_controller,
            created: Arc::new(CreatedFields::new("wasmctrl/test".into())),
            pending: Default::default(),
        }];
        let observed: Vec<_> = observed_children(&parent(), &caches)
            .into_iter()
            .map(|(index, child)| (index, child.name_any()))
            .collect();
        assert_eq!(
            observed,
            [(0, "mine-1".to_owned()), (0, "mine-2".to_owned())],
            "this parent's children only, in name order"
        );
    }

    /// A kind chosen by selector whose cache holds `objects`.
    fn selected(objects: Vec<CachedObject>) -> Related {
        let (store, by_namespace) =
            testing::indexed_store(Arc::new(config_maps()), objects, store_index::namespace);
        Related::Selected(RelatedCache {
            store,
            by_namespace,
        })
    }

    async fn related_of(
        kinds: &[Related],
        bytes: RelatedBytes,
    ) -> Result<Vec<ObservedObject>, ReconcileError> {
        related(&testing::parent("a", "p", &[]), &parent(), kinds, bytes).await
    }

    #[tokio::test]
    async fn related_objects_come_from_the_parents_namespace_only() {
        let kinds = [selected(vec![
            object("a", "here-b", None),
            object("a", "here-a", None),
            object("b", "there", None),
        ])];
        let related = related_of(&kinds, RelatedBytes::default())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<_> = related.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["here-a", "here-b"]);
        assert_eq!(related[0].kind, "ConfigMap");
        assert!(related[0].json.contains(r#""name":"here-a""#));
    }

    #[tokio::test]
    async fn related_objects_past_the_request_limit_fail_it_naming_the_parent() {
        let kinds = [selected(vec![
            object("a", "one", None),
            object("a", "two", None),
        ])];
        let all = related_of(&kinds, RelatedBytes::default())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let total: usize = all.iter().map(|o| o.json.len()).sum();
        assert!(
            related_of(&kinds, RelatedBytes::with_limit(total))
                .await
                .is_ok()
        );
        let error = related_of(&kinds, RelatedBytes::with_limit(total - 1))
            .await
            .err()
            .unwrap_or_else(|| panic!("one byte over the limit passed"));
        assert_eq!(error.reason(), "RelatedTooLarge");
        let message = error.to_string();
        assert!(
            message.starts_with("MyApp a/p: its related objects come to more than")
                && message.contains(&format!("({total} bytes up to ConfigMap two)")),
            "{message}"
        );
    }
}
