use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Error;
use crate::request::ObjectHeader;

/// A plugin's decision for one parent: the complete desired children and the parent's status.
///
/// Children are serialized when added, so the response holds JSON text, which is what crosses
/// the Wasm boundary; nothing is encoded twice.
#[derive(Debug, Default, Clone)]
pub struct Response {
    pub(crate) children: Vec<String>,
    pub(crate) status: Option<String>,
    pub(crate) requeue_after: Option<Duration>,
    pub(crate) events: Vec<Event>,
    pub(crate) finalized: bool,
}

/// An event to record on the parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Normal or Warning.
    pub kind: EventType,
    /// CamelCase reason, e.g. `ScaledUp`.
    pub reason: String,
    /// Human-readable message.
    pub message: String,
}

/// The Kubernetes event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Something expected happened.
    Normal,
    /// Something the user should look at.
    Warning,
}

/// Writing a response: `add_*` appends, `set_*` replaces. Each returns the response, so calls
/// chain.
impl Response {
    /// An empty decision: no children (every owned child would be pruned), status untouched.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a desired child: a full manifest with `apiVersion`, `kind` and `metadata.name`.
    /// k8s-openapi types serialize their `apiVersion` and `kind` themselves.
    pub fn add_child<T: Serialize + ?Sized>(&mut self, child: &T) -> Result<&mut Self, Error> {
        self.children.push(serde_json::to_string(child)?);
        Ok(self)
    }

    /// Add a desired child that is already JSON text (e.g. rendered from a template). It is
    /// not checked here; the host rejects a response whose children are not JSON objects.
    pub fn add_child_json(&mut self, json: String) -> &mut Self {
        self.children.push(json);
        self
    }

    /// Set the parent's desired status (serialized as a JSON object).
    pub fn set_status<T: Serialize + ?Sized>(&mut self, status: &T) -> Result<&mut Self, Error> {
        self.status = Some(serde_json::to_string(status)?);
        Ok(self)
    }

    /// Ask to be reconciled again after `delay`, even if nothing changes: for state the host
    /// cannot watch (an external system, a deadline). The host raises delays below one second.
    pub fn set_requeue_after(&mut self, delay: Duration) -> &mut Self {
        self.requeue_after = Some(delay);
        self
    }

    /// Record an event on the parent, for what a user watching `kubectl describe` should see.
    pub fn add_event(
        &mut self,
        kind: EventType,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> &mut Self {
        self.events.push(Event {
            kind,
            reason: reason.into(),
            message: message.into(),
        });
        self
    }

    /// Declare clean-up complete while finalizing; lets the host remove its finalizer and the
    /// parent go.
    pub fn set_finalized(&mut self) -> &mut Self {
        self.finalized = true;
        self
    }
}

/// Reading a response back, for tests and tools (and plugins that wrap another reconciler).
/// The readers are named for what they return; `*_json` ones return the JSON text that
/// crosses to the host, the others decode it and say why when they cannot.
impl Response {
    /// The desired child of type `K` named `name`, decoded.
    ///
    /// Fails, with a message saying which, when no desired child has that kind and name, when
    /// that child does not decode as `K`, or when a child is not JSON at all (the host would
    /// refuse the response).
    pub fn child<K>(&self, name: &str) -> Result<K, Error>
    where
        K: k8s_openapi::Resource + DeserializeOwned,
    {
        let mut seen = Vec::with_capacity(self.children.len());
        for (index, json) in self.children.iter().enumerate() {
            let header = ObjectHeader::from_json(json).map_err(|e| {
                Error::permanent(format!("desired child #{index} is not a JSON object: {e}"))
            })?;
            if header.api_version == K::API_VERSION
                && header.kind == K::KIND
                && header.metadata.name == name
            {
                return serde_json::from_str(json).map_err(|e| {
                    Error::permanent(format!(
                        "desired {} {name:?} does not decode as {}: {e}",
                        K::KIND,
                        short_type_name::<K>()
                    ))
                });
            }
            seen.push(format!("{} {:?}", header.kind, header.metadata.name));
        }
        let seen = if seen.is_empty() {
            "none".to_owned()
        } else {
            seen.join(", ")
        };
        Err(Error::permanent(format!(
            "no desired {} {} named {name:?} (the desired children: {seen})",
            K::API_VERSION,
            K::KIND
        )))
    }

    /// The desired children as JSON text, in the order they were added.
    pub fn children_json(&self) -> &[String] {
        &self.children
    }

    /// The desired status decoded into `T`. Fails when the response sets no status (see
    /// [`status_json`](Self::status_json) to test for that) or the status does not decode.
    pub fn status<T: DeserializeOwned>(&self) -> Result<T, Error> {
        let json = self
            .status
            .as_deref()
            .ok_or_else(|| Error::permanent("the response sets no status"))?;
        serde_json::from_str(json).map_err(|e| {
            Error::permanent(format!(
                "the desired status does not decode as {}: {e}",
                short_type_name::<T>()
            ))
        })
    }

    /// The desired status as JSON text; `None` leaves the parent's status as it is.
    pub fn status_json(&self) -> Option<&str> {
        self.status.as_deref()
    }

    /// The requested requeue delay, if any.
    pub fn requeue_after(&self) -> Option<Duration> {
        self.requeue_after
    }

    /// The events to record, in the order they were added.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Whether clean-up is declared complete.
    pub fn is_finalized(&self) -> bool {
        self.finalized
    }
}

/// `T`'s name without module paths (`Vec<MyStatus>`, not `alloc::vec::Vec<my_plugin::MyStatus>`),
/// short enough for a test failure message.
fn short_type_name<T: ?Sized>() -> String {
    let full = std::any::type_name::<T>();
    let mut short = String::with_capacity(full.len());
    let mut path = String::new();
    for c in full.chars() {
        if c.is_alphanumeric() || c == '_' || c == ':' {
            path.push(c);
        } else {
            short.push_str(path.rsplit("::").next().unwrap_or_default());
            path.clear();
            short.push(c);
        }
    }
    short.push_str(path.rsplit("::").next().unwrap_or_default());
    short
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::{ConfigMap, Service};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use serde_json::json;

    use super::*;

    fn config_map(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            data: Some([("key".to_owned(), "value".to_owned())].into()),
            ..ConfigMap::default()
        }
    }

    fn message(error: Error) -> String {
        match error {
            Error::Permanent(m) => m,
            other => panic!("expected a permanent error, got {other}"),
        }
    }

    #[test]
    fn child_finds_a_desired_child_by_kind_and_name() -> Result<(), Error> {
        let mut response = Response::new();
        response
            .add_child(&config_map("a"))?
            .add_child(&config_map("b"))?;
        let b: ConfigMap = response.child("b")?;
        assert_eq!(b, config_map("b"));
        Ok(())
    }

    #[test]
    fn child_names_what_is_there_when_nothing_matches() -> Result<(), Error> {
        let mut response = Response::new();
        response.add_child(&config_map("web"))?;
        let missing = message(response.child::<Service>("web").expect_err("no Service"));
        assert_eq!(
            missing,
            r#"no desired v1 Service named "web" (the desired children: ConfigMap "web")"#
        );
        let empty = message(Response::new().child::<ConfigMap>("web").expect_err("none"));
        assert!(empty.ends_with("(the desired children: none)"), "{empty}");
        Ok(())
    }

    #[test]
    fn child_reports_a_child_that_does_not_decode_as_the_type() {
        let mut response = Response::new();
        response.add_child_json(
            json!({"apiVersion": "apps/v1", "kind": "Deployment",
                   "metadata": {"name": "web"}, "spec": {"replicas": "three"}})
            .to_string(),
        );
        let error = message(
            response
                .child::<Deployment>("web")
                .expect_err("bad replicas"),
        );
        assert!(
            error.starts_with(
                "desired Deployment \"web\" does not decode as Deployment: invalid type: string \"three\""
            ),
            "{error}"
        );
    }

    #[test]
    fn child_reports_a_child_that_is_not_json() {
        let mut response = Response::new();
        response.add_child_json("{\"kind\": ".to_owned());
        let error = message(response.child::<ConfigMap>("web").expect_err("not JSON"));
        assert!(
            error.starts_with("desired child #0 is not a JSON object"),
            "{error}"
        );
    }

    #[test]
    fn status_decodes_or_says_why_not() -> Result<(), Error> {
        let mut response = Response::new();
        assert_eq!(
            response.status::<serde_json::Value>(),
            Err(Error::permanent("the response sets no status"))
        );
        response.set_status(&json!({"ready": "yes"}))?;
        assert_eq!(
            response.status::<serde_json::Value>()?,
            json!({"ready": "yes"})
        );
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct Typed {
            ready: bool,
        }
        let error = message(response.status::<Typed>().expect_err("not a bool"));
        assert!(
            error.starts_with("the desired status does not decode as Typed: invalid type"),
            "{error}"
        );
        Ok(())
    }

    #[test]
    fn type_names_in_messages_drop_module_paths() {
        assert_eq!(short_type_name::<Deployment>(), "Deployment");
        assert_eq!(
            short_type_name::<Option<Vec<serde_json::Value>>>(),
            "Option<Vec<Value>>"
        );
        assert_eq!(
            short_type_name::<std::collections::BTreeMap<String, u8>>(),
            "BTreeMap<String, u8>"
        );
    }

    #[test]
    fn readers_return_what_the_writers_set() {
        let mut response = Response::new();
        assert_eq!(
            (response.requeue_after(), response.is_finalized()),
            (None, false)
        );
        response
            .set_requeue_after(Duration::from_secs(30))
            .add_event(EventType::Warning, "Stuck", "waiting")
            .set_finalized();
        assert_eq!(response.requeue_after(), Some(Duration::from_secs(30)));
        assert!(response.is_finalized());
        assert_eq!(
            response.events(),
            [Event {
                kind: EventType::Warning,
                reason: "Stuck".into(),
                message: "waiting".into(),
            }]
        );
        assert!(response.children_json().is_empty());
        assert_eq!(response.status_json(), None);
    }
}
