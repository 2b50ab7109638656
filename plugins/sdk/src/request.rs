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
