//! Field ownership: of children the host created, and of the parent status fields the host
//! applied (a failure's status apply must carry exactly those, see [`applied_status`]).
//!
//! Children are created with a plain create (so an existing object of the same name is
//! detected, never taken over), which records their fields under the host's field manager
//! with operation `Update`. Later changes are server-side applies, recorded under the same
//! manager with operation `Apply` — a different owner as far as the API server is concerned.
//! Left alone, a field the plugin stops setting would stay, still owned by the `Update`
//! entry. So before the first apply to such a child, its `Update` entry is handed over to the
//! `Apply` entry (as `kubectl` does when it upgrades client-side-applied objects); from then
//! on, a field the plugin drops is removed.
//!
//! The watch marks children that still have such an entry, so converged children cost
//! nothing: the hand-over happens only on the first real change, and only once.

use std::collections::HashSet;
use std::sync::Mutex;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry, ObjectMeta};
use kube::api::{Patch, PatchParams};
use kube::core::DynamicObject;
use kube::{Api, ResourceExt as _};
use serde_json::{Value, json};

/// Children whose create-time fields are still owned by an `Update` entry of the host's
/// field manager, each kept as a hash of its namespace and name: a child costs 8 bytes
/// rather than two strings, and a lookup allocates nothing. Two children whose hashes
/// collide (odds about 1 in 10^11 among 20,000 children) count as one: one may be handed
/// over needlessly (a read), or, once the other is forgotten, applied without its hand-over
/// (a field its plugin stops setting would stay). The hash is keyed at random per policy
/// run, so no one can choose names that collide.
pub(crate) struct CreatedFields {
    manager: String,
    marked: Mutex<HashSet<u64>>,
    keys: std::hash::RandomState,
}

impl CreatedFields {
    pub fn new(manager: String) -> Self {
        Self {
            manager,
            marked: Mutex::new(HashSet::new()),
            keys: std::hash::RandomState::new(),
        }
    }

    /// A child's key among the marked ones.
    fn child_key(&self, namespace: Option<&str>, name: &str) -> u64 {
        use std::hash::BuildHasher as _;
        self.keys.hash_one((namespace, name))
    }

    /// Look at a child as the watch delivers it, before its managed fields are dropped.
    pub fn note(&self, metadata: &ObjectMeta) {
        let key = self.child_key(
            metadata.namespace.as_deref(),
            metadata.name.as_deref().unwrap_or_default(),
        );
        let created_only = metadata
            .managed_fields
            .iter()
            .flatten()
            .any(|entry| self.is_ours(entry, "Update"));
        let mut marked = self.lock();
        if created_only {
            marked.insert(key);
        } else {
            marked.remove(&key);
        }
    }

    /// Whether the child still needs its fields handed over before an apply.
    pub fn needs_hand_over(&self, namespace: Option<&str>, name: &str) -> bool {
        self.lock().contains(&self.child_key(namespace, name))
    }

    /// Forget a child that was deleted.
    pub fn forget(&self, metadata: &ObjectMeta) {
        let key = self.child_key(
            metadata.namespace.as_deref(),
            metadata.name.as_deref().unwrap_or_default(),
        );
        self.lock().remove(&key);
    }

    /// Forget children that are not among `cached` (namespace, name) any more.
    pub fn retain_cached<'a>(&self, cached: impl Iterator<Item = (Option<&'a str>, &'a str)>) {
        let cached: HashSet<u64> = cached
            .map(|(namespace, name)| self.child_key(namespace, name))
            .collect();
        self.lock().retain(|key| cached.contains(key));
    }

    /// Hand the `Update` entry of the host's manager over to its `Apply` entry on the live
    /// object. The patch tests the resourceVersion it read, so a concurrent change fails the
    /// patch (422) instead of losing an entry. Such changes are common: the controller-manager
    /// writes a new Deployment's status right after its creation. So the hand-over reads the
    /// object again and retries, a few times, before it reports the failure.
    ///
    /// Returns the resourceVersion the hand-over wrote, if it wrote one.
    pub async fn hand_over(
        &self,
        api: &Api<DynamicObject>,
        name: &str,
    ) -> Result<Option<String>, kube::Error> {
        const ATTEMPTS: usize = 3;
        let mut attempt = 1;
        loop {
            let live = api.get(name).await?;
            let Some(entries) = handed_over(live.managed_fields(), &self.manager) else {
                return Ok(None);
            };
            let patch: json_patch::Patch = serde_json::from_value(json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": live.metadata.resource_version},
                {"op": "replace", "path": "/metadata/managedFields", "value": entries},
            ]))
            .map_err(kube::Error::SerdeError)?;
            // The answer's metadata is all the host reads of it.
            match api
                .patch_metadata(name, &PatchParams::default(), &Patch::<()>::Json(patch))
                .await
            {
                Ok(patched) => return Ok(patched.metadata.resource_version),
                Err(kube::Error::Api(status)) if status.code == 422 && attempt < ATTEMPTS => {
                    tracing::debug!(%name, attempt, "the child changed during the field hand-over; reading it again");
                    attempt += 1;
                }
                Err(error) => return Err(error),
            }
        }
    }

    fn is_ours(&self, entry: &ManagedFieldsEntry, operation: &str) -> bool {
        is_entry(entry, &self.manager, operation, "")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        // A set of names; a panic elsewhere cannot leave it inconsistent.
        crate::lock(&self.marked)
    }
}

/// `entries` with `manager`'s `Update` entry folded into its `Apply` entry (or turned into
/// one); `None` if there is nothing to hand over.
pub(crate) fn handed_over(
    entries: &[ManagedFieldsEntry],
    manager: &str,
) -> Option<Vec<ManagedFieldsEntry>> {
    let fields = CreatedFields::new(manager.to_owned());
    let update = entries.iter().position(|e| fields.is_ours(e, "Update"))?;
    let mut entries = entries.to_vec();
    let update = entries.remove(update);
    match entries.iter_mut().find(|e| fields.is_ours(e, "Apply")) {
        Some(apply) => {
            let mut merged = apply
                .fields_v1
                .take()
                .map_or_else(|| json!({}), |FieldsV1(value)| value);
            if let Some(FieldsV1(created)) = update.fields_v1 {
                union(&mut merged, created);
            }
            apply.fields_v1 = Some(FieldsV1(merged));
        }
        None => entries.push(ManagedFieldsEntry {
            operation: Some("Apply".into()),
            ..update
        }),
    }
    Some(entries)
}

/// Whether `entry` records `manager`'s `operation` on `subresource` (empty: the object itself).
fn is_entry(entry: &ManagedFieldsEntry, manager: &str, operation: &str, subresource: &str) -> bool {
    entry.manager.as_deref() == Some(manager)
        && entry.operation.as_deref() == Some(operation)
        && entry.subresource.as_deref().unwrap_or_default() == subresource
}

/// The part of an object's `status` that `manager` owns by apply on the status subresource,
/// as the object's `managedFields` say.
pub(crate) fn applied_status(
    metadata: &ObjectMeta,
    manager: &str,
    status: Option<&Value>,
) -> serde_json::Map<String, Value> {
    let owned = metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|entry| is_entry(entry, manager, "Apply", "status"))
        .find_map(|entry| entry.fields_v1.as_ref())
        .and_then(|fields| fields.0.get("f:status"));
    match (status, owned) {
        (Some(status), Some(fields)) => match owned_fields(status, fields) {
            Value::Object(object) => object,
            _ => Default::default(),
        },
        _ => Default::default(),
    }
}

/// The part of `value` that `fields` (a `fieldsV1` tree) names. A map's fields are named one
/// by one (`f:<key>`); anything else (a leaf, a list) is owned whole.
fn owned_fields(value: &Value, fields: &Value) -> Value {
    let named: Vec<(&str, &Value)> = fields
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(key, sub)| key.strip_prefix("f:").map(|key| (key, sub)))
        .collect();
    match value {
        Value::Object(object) if !named.is_empty() => Value::Object(
            named
                .into_iter()
                .filter_map(|(key, sub)| {
                    object
                        .get(key)
                        .map(|found| (key.to_owned(), owned_fields(found, sub)))
                })
                .collect(),
        ),
        _ => value.clone(),
    }
}

/// Merge field set `other` into `into` (both FieldsV1 trees: objects whose keys are fields).
fn union(into: &mut Value, other: Value) {
    match (into, other) {
        (Value::Object(into), Value::Object(other)) => {
            for (key, value) in other {
                match into.get_mut(&key) {
                    Some(existing) => union(existing, value),
                    None => {
                        into.insert(key, value);
                    }
                }
            }
        }
        (into, other) if into.is_null() => *into = other,
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(manager: &str, operation: &str, fields: Value) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            api_version: Some("v1".into()),
            fields_type: Some("FieldsV1".into()),
            fields_v1: Some(FieldsV1(fields)),
            manager: Some(manager.into()),
            operation: Some(operation.into()),
            subresource: None,
            time: None,
        }
    }

    fn child(namespace: &str, name: &str, entries: Vec<ManagedFieldsEntry>) -> ObjectMeta {
        ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            managed_fields: Some(entries),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn a_child_is_marked_while_its_create_entry_stands_and_forgotten_when_gone() {
        let created = CreatedFields::new("wasmctrl/p".into());
        let create = || entry("wasmctrl/p", "Update", json!({}));
        created.note(&child("a", "web", vec![create()]));
        created.note(&child("a", "db", vec![create()]));
        created.note(&child(
            "b",
            "web",
            vec![entry("kubectl", "Update", json!({}))],
        ));
        assert!(created.needs_hand_over(Some("a"), "web"));
        assert!(created.needs_hand_over(Some("a"), "db"));
        // Another namespace's child of that name, another manager's entry.
        assert!(!created.needs_hand_over(Some("b"), "web"));
        assert!(!created.needs_hand_over(None, "web"));
        // Handed over: the watch brings it back with an apply entry only.
        let apply = entry("wasmctrl/p", "Apply", json!({}));
        created.note(&child("a", "db", vec![apply]));
        assert!(!created.needs_hand_over(Some("a"), "db"));
        created.note(&child("a", "db", vec![create()]));
        created.forget(&child("a", "db", Vec::new()));
        assert!(!created.needs_hand_over(Some("a"), "db"));
        // A re-list keeps those still cached.
        created.note(&child("a", "db", vec![create()]));
        created.retain_cached([(Some("a"), "db")].into_iter());
        assert!(created.needs_hand_over(Some("a"), "db"));
        assert!(!created.needs_hand_over(Some("a"), "web"));
    }

    #[test]
    fn a_lone_create_entry_becomes_the_apply_entry() {
        let created = entry("wasmctrl/p", "Update", json!({"f:data": {"f:k": {}}}));
        let other = entry("kubectl", "Update", json!({"f:data": {"f:x": {}}}));
        let entries = handed_over(&[created, other.clone()], "wasmctrl/p").expect("changed");
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0], other, "other managers are untouched");
        assert_eq!(entries[1].operation.as_deref(), Some("Apply"));
        assert_eq!(
            entries[1].fields_v1,
            Some(FieldsV1(json!({"f:data": {"f:k": {}}})))
        );
    }

    #[test]
    fn a_create_entry_is_folded_into_an_existing_apply_entry() {
        let created = entry(
            "wasmctrl/p",
            "Update",
            json!({"f:data": {"f:old": {}}, "f:metadata": {"f:labels": {"f:a": {}}}}),
        );
        let applied = entry("wasmctrl/p", "Apply", json!({"f:data": {"f:k": {}}}));
        let entries = handed_over(&[applied, created], "wasmctrl/p").expect("changed");
        assert_eq!(entries.len(), 1);
        assert_eq!(
            entries[0].fields_v1,
            Some(FieldsV1(
                json!({"f:data": {"f:k": {}, "f:old": {}}, "f:metadata": {"f:labels": {"f:a": {}}}})
            ))
        );
    }

    #[test]
    fn nothing_to_hand_over_without_a_create_entry() {
        let applied = entry("wasmctrl/p", "Apply", json!({}));
        let someone = entry("wasmctrl/other", "Update", json!({}));
        assert_eq!(handed_over(&[applied, someone], "wasmctrl/p"), None);
    }

    #[test]
    fn a_failure_carries_the_status_fields_its_manager_owns_and_no_others() {
        let metadata: ObjectMeta = serde_json::from_value(json!({
            "managedFields": [
                {"manager": "wasmctrl/p", "operation": "Apply", "subresource": "status",
                 "fieldsType": "FieldsV1",
                 "fieldsV1": {"f:status": {"f:readyReplicas": {}, "f:conditions": {},
                                           "f:endpoints": {"f:web": {}}}}},
                {"manager": "someone-else", "operation": "Apply", "subresource": "status",
                 "fieldsType": "FieldsV1",
                 "fieldsV1": {"f:status": {"f:theirs": {}, "f:endpoints": {"f:admin": {}}}}},
                {"manager": "wasmctrl/p", "operation": "Update",
                 "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {}}}},
            ],
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let status = json!({
            "readyReplicas": 3,
            "theirs": "kept by its owner",
            "endpoints": {"web": "10.0.0.1", "admin": "10.0.0.2"},
            "conditions": [{"type": "Reconciled", "status": "True"}],
        });
        let owned = applied_status(&metadata, "wasmctrl/p", Some(&status));
        assert_eq!(
            Value::Object(owned),
            json!({
                "readyReplicas": 3,
                "endpoints": {"web": "10.0.0.1"},
                "conditions": [{"type": "Reconciled", "status": "True"}],
            })
        );
        assert!(applied_status(&metadata, "wasmctrl/other", Some(&status)).is_empty());
        assert!(applied_status(&metadata, "wasmctrl/p", None).is_empty());
    }
}
