use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::Error;

/// What the host hands a plugin for one reconcile, decoded into the plugin's types.
#[derive(Debug)]
pub struct Request<P, C> {
    /// The parent object.
    pub parent: P,
    /// Observed children: objects of the allowed child kinds owned by this parent.
    pub children: Observed,
    /// Read-only related objects the policy asks for.
    pub related: Observed,
    /// The policy's plugin configuration, or `C::default()` when it sets none.
    pub config: C,
    /// True when the parent is being deleted and the host waits for
    /// [`Response::set_finalized`](crate::Response::set_finalized).
    pub finalizing: bool,
    /// `metadata.name`, read from the parent's JSON when the request was decoded.
    pub(crate) name: String,
    /// `metadata.namespace`, read with the name.
    pub(crate) namespace: Option<String>,
}

impl<P, C> Request<P, C> {
    /// The parent's `metadata.name`, never empty.
    ///
    /// The host calls a plugin only for a parent that has a name, so a plugin does not need to
    /// check the parent type's own (usually optional) `metadata.name`. It is read from the JSON
    /// the host sent, whatever the parent type keeps of it. A request whose parent has no name
    /// (possible only from a hand-made request, such as a test's) fails to decode, as an
    /// invalid parent, before the plugin runs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The parent's `metadata.namespace`: always `Some` for a namespaced parent (the host
    /// guarantees it), `None` for a cluster-scoped one.
    pub fn namespace(&self) -> Option<&str> {
        self.namespace.as_deref()
    }
}

/// The parent's identity, read apart from the plugin's parent type: that type may keep
/// `metadata` loosely (a `serde_json::Value`) or not at all.
#[derive(Deserialize)]
struct ParentHeader {
    #[serde(default)]
    metadata: ParentMeta,
}

#[derive(Deserialize, Default)]
struct ParentMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
}

/// The parent's `metadata.name` and `metadata.namespace`, from its JSON. An empty name counts
/// as none: the API server never stores one.
pub(crate) fn parent_identity(json: &str) -> Result<(String, Option<String>), Error> {
    let header: ParentHeader = serde_json::from_str(json)
        .map_err(|e| Error::invalid_parent(format!("parent metadata is malformed: {e}")))?;
    let name = header
        .metadata
        .name
        .filter(|name| !name.is_empty())
        .ok_or_else(|| Error::invalid_parent("the parent has no metadata.name"))?;
    Ok((name, header.metadata.namespace))
}

/// A set of observed objects, searchable by kind and name.
///
/// Objects stay JSON until asked for, so a plugin pays only for the objects it reads: the host
/// may send large children (a Deployment with its status) that a plugin never looks at.
#[derive(Debug, Default, Clone)]
pub struct Observed {
    objects: Vec<ObservedObject>,
}

/// One observed object: its identity, and its JSON text.
#[derive(Debug, Clone)]
pub struct ObservedObject {
    /// `apiVersion`, e.g. `apps/v1`.
    pub api_version: String,
    /// `kind`, e.g. `Deployment`.
    pub kind: String,
    /// `metadata.name`.
    pub name: String,
    /// The whole object as JSON.
    pub json: String,
}

/// Just enough of an object to identify it. serde skips everything else without building it.
#[derive(Deserialize)]
pub(crate) struct ObjectHeader {
    #[serde(rename = "apiVersion", default)]
    pub(crate) api_version: String,
    #[serde(default)]
    pub(crate) kind: String,
    #[serde(default)]
    pub(crate) metadata: HeaderMeta,
}

/// The identifying part of `metadata`.
#[derive(Deserialize, Default)]
pub(crate) struct HeaderMeta {
    #[serde(default)]
    pub(crate) name: String,
}

impl ObjectHeader {
    /// The identity of the object `json` holds.
    pub(crate) fn from_json(json: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(json)
    }
}

impl ObservedObject {
    /// An observed object from its JSON, reading its identity from it. The host sends the
    /// identity alongside the object, so this is only needed for objects built in tests.
    pub fn from_json(json: String) -> Result<Self, Error> {
        let header = ObjectHeader::from_json(&json)
            .map_err(|e| Error::permanent(format!("observed object is not valid JSON: {e}")))?;
        Ok(Self {
            api_version: header.api_version,
            kind: header.kind,
            name: header.metadata.name,
            json,
        })
    }
}

impl Observed {
    /// A set of observed objects.
    pub fn new(objects: Vec<ObservedObject>) -> Self {
        Self { objects }
    }

    /// All observed objects, in the order the host sent them.
    pub fn iter(&self) -> impl Iterator<Item = &ObservedObject> {
        self.objects.iter()
    }

    /// Number of observed objects.
    pub fn len(&self) -> usize {
        self.objects.len()
    }

    /// True when nothing was observed.
    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    /// The object of type `K` named `name`, decoded, if observed.
    pub fn get<K>(&self, name: &str) -> Result<Option<K>, Error>
    where
        K: k8s_openapi::Resource + DeserializeOwned,
    {
        self.find(K::API_VERSION, K::KIND, name)
            .map(|o| decode(o))
            .transpose()
    }

    /// Part of the object of type `K` named `name`: decoded into `T`, a type holding only the
    /// fields the plugin reads. serde skips everything else without building it, which is
    /// much cheaper than decoding a whole Deployment to read one status field.
    pub fn get_part<K, T>(&self, name: &str) -> Result<Option<T>, Error>
    where
        K: k8s_openapi::Resource,
        T: DeserializeOwned,
    {
        self.get_as(K::API_VERSION, K::KIND, name)
    }

    /// Every observed object of type `K`, decoded.
    pub fn list<K>(&self) -> Result<Vec<K>, Error>
    where
        K: k8s_openapi::Resource + DeserializeOwned,
    {
        self.objects
            .iter()
            .filter(|o| o.api_version == K::API_VERSION && o.kind == K::KIND)
            .map(decode)
            .collect()
    }

    /// The raw object with this identity, for kinds without a Rust type (custom resources).
    pub fn find(&self, api_version: &str, kind: &str, name: &str) -> Option<&ObservedObject> {
        self.objects
            .iter()
            .find(|o| o.api_version == api_version && o.kind == kind && o.name == name)
    }

    /// The raw object with this identity decoded into any serde type.
    pub fn get_as<T: DeserializeOwned>(
        &self,
        api_version: &str,
        kind: &str,
        name: &str,
    ) -> Result<Option<T>, Error> {
        self.find(api_version, kind, name).map(decode).transpose()
    }
}

fn decode<T: DeserializeOwned>(object: &ObservedObject) -> Result<T, Error> {
    serde_json::from_str(&object.json).map_err(|e| {
        Error::permanent(format!(
            "observed {} {:?} does not decode: {e}",
            object.kind, object.name
        ))
    })
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    use crate::testing::TestRequest;
    use crate::{Error, Reconciler, Request, Response};

    /// A parent type that keeps no metadata at all: the name still reaches the plugin.
    #[derive(Deserialize)]
    struct SpecOnly {
        #[allow(dead_code)]
        spec: serde_json::Value,
    }

    /// Reports the request's identity as its status.
    struct Identity;

    impl Reconciler for Identity {
        type Parent = SpecOnly;
        type Config = ();

        fn reconcile(request: &Request<SpecOnly, ()>) -> Result<Response, Error> {
            let mut response = Response::new();
            response.set_status(&json!({
                "name": request.name(),
                "namespace": request.namespace(),
            }))?;
            Ok(response)
        }
    }

    fn identity_of(parent: serde_json::Value) -> Result<serde_json::Value, Error> {
        TestRequest::new(&parent)
            .reconcile::<Identity>()?
            .status::<serde_json::Value>()
    }

    #[test]
    fn name_and_namespace_come_from_the_parent_json_whatever_the_parent_type_keeps() {
        let parent = json!({"metadata": {"name": "web", "namespace": "shop"}, "spec": {}});
        assert_eq!(
            identity_of(parent),
            Ok(json!({"name": "web", "namespace": "shop"}))
        );
    }

    #[test]
    fn a_cluster_scoped_parent_has_no_namespace() {
        let parent = json!({"metadata": {"name": "global"}, "spec": {}});
        assert_eq!(
            identity_of(parent),
            Ok(json!({"name": "global", "namespace": null}))
        );
    }

    #[test]
    fn a_parent_without_a_name_is_an_invalid_parent_and_the_plugin_is_not_called() {
        for metadata in [json!({}), json!({"name": ""}), json!({"name": null})] {
            let parent = json!({"metadata": metadata, "spec": {}});
            assert_eq!(
                identity_of(parent.clone()),
                Err(Error::invalid_parent("the parent has no metadata.name")),
                "{parent}"
            );
        }
    }

    #[test]
    fn a_parent_not_matching_the_plugin_type_is_reported_as_such_before_its_name() {
        let err = identity_of(json!({"metadata": {}})).expect_err("no spec");
        assert!(
            matches!(&err, Error::InvalidParent(m) if m.starts_with("parent does not match the plugin's type: missing field `spec`")),
            "{err}"
        );
    }

    #[test]
    fn a_name_that_is_not_a_string_is_an_invalid_parent() {
        let err = identity_of(json!({"metadata": {"name": 7}, "spec": {}})).expect_err("bad name");
        assert!(
            matches!(&err, Error::InvalidParent(m) if m.starts_with("parent metadata is malformed")),
            "{err}"
        );
    }
}
