//! Validating, defaulting and converting the parent kind: the webhooks a plugin may serve
//! beside its reconciler, exported with [`export_plugin!`](crate::export_plugin).
//!
//! - A [`Validator`] allows or denies a create, update or delete, with reasons that name the
//!   field they are about, and warnings the client shows either way.
//! - A [`Defaulter`] fills in what a write left out. It reads the typed object and names the
//!   fields to set ([`Defaults::set`]); the SDK sets them on the object as it was written, so
//!   fields the plugin's type does not know are kept as they are.
//! - A [`Converter`] rewrites an object between two API versions of the kind, each its own
//!   Rust type. The SDK sets `apiVersion` and keeps `kind` and `metadata` as they were, as the
//!   API server requires.
//!
//! Like `reconcile` they are pure functions of their input, run in a fresh sandbox per call,
//! and the host checks every answer (a default may not rename the object; a conversion must
//! reach the version asked for). They run natively in `cargo test` through
//! [`TestAdmission`](crate::testing::TestAdmission) and [`convert_raw`].
//!
//! ```
//! use serde::{Deserialize, Serialize};
//! use wasmctrl_plugin_sdk::webhooks::{Admission, Defaulter, Defaults, Validator, Verdict};
//! use wasmctrl_plugin_sdk::testing::TestAdmission;
//! use wasmctrl_plugin_sdk::{Error, serde_json};
//!
//! #[derive(Deserialize)]
//! struct Cache {
//!     spec: CacheSpec,
//! }
//!
//! #[derive(Deserialize)]
//! struct CacheSpec {
//!     size: Option<u32>,
//! }
//!
//! struct CacheRules;
//!
//! impl Validator for CacheRules {
//!     type Parent = Cache;
//!     type Config = serde_json::Value;
//!
//!     fn validate(request: &Admission<Cache, serde_json::Value>) -> Result<Verdict, Error> {
//!         let mut verdict = Verdict::allow();
//!         if let Some(cache) = &request.object {
//!             if cache.spec.size.is_some_and(|size| size > 64) {
//!                 verdict.deny("spec.size", "must be at most 64");
//!             }
//!         }
//!         Ok(verdict)
//!     }
//! }
//!
//! impl Defaulter for CacheRules {
//!     type Parent = Cache;
//!     type Config = serde_json::Value;
//!
//!     fn apply_defaults(
//!         request: &Admission<Cache, serde_json::Value>,
//!         defaults: &mut Defaults,
//!     ) -> Result<(), Error> {
//!         if request.object.as_ref().is_some_and(|c| c.spec.size.is_none()) {
//!             defaults.set("spec.size", 8)?;
//!         }
//!         Ok(())
//!     }
//! }
//!
//! let too_big = serde_json::json!({"metadata": {"name": "c"}, "spec": {"size": 100}});
//! let verdict = TestAdmission::create(&too_big).validate::<CacheRules>()?;
//! assert_eq!(verdict.violations[0].field, "spec.size");
//!
//! let unsized_cache = serde_json::json!({"metadata": {"name": "c"}, "spec": {"tier": "gold"}});
//! let defaulted = TestAdmission::create(&unsized_cache).apply_defaults::<CacheRules>()?;
//! assert_eq!(defaulted.object["spec"], serde_json::json!({"tier": "gold", "size": 8}));
//! # Ok::<(), Error>(())
//! ```

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::Error;

/// The kind of write being admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// A new object.
    Create,
    /// A change to a stored object.
    Update,
    /// The removal of a stored object.
    Delete,
}

/// Who is writing, as the API server authenticated them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserInfo {
    /// The user name, e.g. `system:serviceaccount:team-a:deployer`.
    pub username: String,
    /// The groups the user is in.
    pub groups: Vec<String>,
}

/// One write, decoded into the plugin's types.
#[derive(Debug, Clone)]
pub struct Admission<P, C> {
    /// What the write does.
    pub operation: Operation,
    /// The object as it would be stored; `None` for a delete.
    pub object: Option<P>,
    /// The object as stored before the write; set for updates and deletes.
    pub old_object: Option<P>,
    /// Who is writing, when the host knows (the offline tools may not say).
    pub user: Option<UserInfo>,
    /// The policy's plugin config, or `C::default()` when it sets none.
    pub config: C,
}

/// Why a write is refused, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The field path, e.g. `spec.replicas`; empty for the object as a whole.
    pub field: String,
    /// What is wrong, for the person who wrote the object.
    pub message: String,
}

/// A [`Validator`]'s answer: allowed unless it holds a violation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Empty when the write is allowed.
    pub violations: Vec<Violation>,
    /// Shown to the client either way (`kubectl` prints them). The host keeps 16 at most.
    pub warnings: Vec<String>,
}

impl Verdict {
    /// A verdict that allows the write until [`Verdict::deny`] says otherwise.
    pub fn allow() -> Self {
        Self::default()
    }

    /// Deny the write because of `field` (a path such as `spec.replicas`, or empty).
    pub fn deny(&mut self, field: impl Into<String>, message: impl Into<String>) -> &mut Self {
        self.violations.push(Violation {
            field: field.into(),
            message: message.into(),
        });
        self
    }

    /// Tell the client something without denying the write.
    pub fn warn(&mut self, message: impl Into<String>) -> &mut Self {
        self.warnings.push(message.into());
        self
    }

    /// Whether the write is allowed.
    pub fn is_allowed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Allows or denies writes of the parent kind, beyond what its OpenAPI schema can say
/// (rules across fields, references that must parse, changes that are not allowed).
pub trait Validator {
    /// The parent's type.
    type Parent: DeserializeOwned;
    /// The policy's plugin configuration.
    type Config: DeserializeOwned + Default;

    /// Judge one write. An `Err` means the plugin could not decide (not that the write is
    /// wrong); the policy's failure policy says what then happens to the write.
    fn validate(request: &Admission<Self::Parent, Self::Config>) -> Result<Verdict, Error>;
}

/// The fields a [`Defaulter`] sets, by path, and the warnings it gives.
#[derive(Debug, Clone, Default)]
pub struct Defaults {
    sets: Vec<(Vec<String>, Value)>,
    warnings: Vec<String>,
}

impl Defaults {
    /// Set `path` (dot-separated keys, e.g. `spec.replicas`) to `value`, creating the
    /// objects on the way (an absent or `null` one). It overwrites what the write holds
    /// there, so check that a field is missing before defaulting it. Later sets of the same
    /// path win. For a key that holds a dot (an annotation such as `example.com/tier`), use
    /// [`Defaults::set_at`].
    pub fn set(&mut self, path: &str, value: impl Serialize) -> Result<&mut Self, Error> {
        if path.is_empty() || path.split('.').any(str::is_empty) {
            return Err(Error::permanent(format!(
                "default path {path:?} must be dot-separated keys such as spec.replicas"
            )));
        }
        self.set_at(&path.split('.').collect::<Vec<_>>(), value)
    }

    /// Set the field at `keys` (e.g. `["metadata", "annotations", "example.com/tier"]`) to
    /// `value`, as [`Defaults::set`] does. Lists are not entered: a path through a list is an
    /// error when applied.
    pub fn set_at(&mut self, keys: &[&str], value: impl Serialize) -> Result<&mut Self, Error> {
        if keys.is_empty() {
            return Err(Error::permanent("a default needs a field to set"));
        }
        let value = serde_json::to_value(value)?;
        self.sets
            .push((keys.iter().map(|k| (*k).to_owned()).collect(), value));
        Ok(self)
    }

    /// Tell the client something (shown with the write's response).
    pub fn warn(&mut self, message: impl Into<String>) -> &mut Self {
        self.warnings.push(message.into());
        self
    }

    /// Set every field on `object`.
    fn apply(self, object: &mut Value) -> Result<Vec<String>, Error> {
        for (keys, value) in self.sets {
            let Some((last, on_the_way)) = keys.split_last() else {
                continue;
            };
            let mut at = &mut *object;
            for key in on_the_way {
                if at.is_null() {
                    *at = Value::Object(serde_json::Map::new());
                }
                let Value::Object(map) = at else {
                    return Err(Error::permanent(format!(
                        "cannot set default {}: the object holds a non-object on the way",
                        keys.join(".")
                    )));
                };
                at = map
                    .entry(key.clone())
                    .or_insert_with(|| Value::Object(serde_json::Map::new()));
            }
            if at.is_null() {
                *at = Value::Object(serde_json::Map::new());
            }
            let Value::Object(map) = at else {
                return Err(Error::permanent(format!(
                    "cannot set default {}: the object holds a non-object on the way",
                    keys.join(".")
                )));
            };
            map.insert(last.clone(), value);
        }
        Ok(self.warnings)
    }
}

/// Fills in what a write of the parent kind left out: defaults that depend on other fields,
/// or that a schema default cannot compute.
pub trait Defaulter {
    /// The parent's type. It only needs the fields the defaulter reads: the fields it sets
    /// go onto the object as written, so nothing the type leaves out is lost.
    type Parent: DeserializeOwned;
    /// The policy's plugin configuration.
    type Config: DeserializeOwned + Default;

    /// Name the defaults for one create or update (`request.object` is always set).
    fn apply_defaults(
        request: &Admission<Self::Parent, Self::Config>,
        defaults: &mut Defaults,
    ) -> Result<(), Error>;
}

/// Converts the parent kind between two API versions, each its own Rust type: the newer
/// version the kind grew into and the older one it still serves. Neither type needs
/// `apiVersion` or `kind` fields; the SDK sets `apiVersion` and keeps `kind` and `metadata`.
///
/// Both directions must lose nothing the other can hold: the API server converts objects
/// back and forth as clients read and write either version, and `wasmctrl plugin test`
/// checks that a case comes back to where it started.
pub trait Converter {
    /// The older version's type.
    type Older: DeserializeOwned + Serialize;
    /// The newer version's type.
    type Newer: DeserializeOwned + Serialize;
    /// The older `apiVersion`, e.g. `example.com/v1alpha1`.
    const OLDER: &'static str;
    /// The newer `apiVersion`, e.g. `example.com/v1`.
    const NEWER: &'static str;

    /// Older to newer.
    fn upgrade(older: Self::Older) -> Result<Self::Newer, Error>;
    /// Newer to older.
    fn downgrade(newer: Self::Newer) -> Result<Self::Older, Error>;
}

/// A write as it crosses the boundary: objects as JSON text, like the WIT record. Build one
/// with [`TestAdmission`](crate::testing::TestAdmission).
#[derive(Debug, Clone)]
pub struct RawAdmission {
    /// What the write does.
    pub operation: Operation,
    /// The object as JSON.
    pub object: Option<String>,
    /// The old object as JSON.
    pub old_object: Option<String>,
    /// Who is writing.
    pub user: Option<UserInfo>,
    /// The plugin config as JSON, if any.
    pub config: Option<String>,
}

fn decode<P: DeserializeOwned, C: DeserializeOwned + Default>(
    raw: &RawAdmission,
) -> Result<Admission<P, C>, Error> {
    let object = |json: &Option<String>, what: &str| {
        json.as_deref()
            .map(|json| {
                serde_json::from_str(json).map_err(|e| {
                    Error::invalid_parent(format!("{what} does not match the plugin's type: {e}"))
                })
            })
            .transpose()
    };
    let config = match raw.config.as_deref() {
        None => C::default(),
        Some(json) => serde_json::from_str(json)
            .map_err(|e| Error::permanent(format!("plugin config is invalid: {e}")))?,
    };
    Ok(Admission {
        operation: raw.operation,
        object: object(&raw.object, "the object")?,
        old_object: object(&raw.old_object, "the old object")?,
        user: raw.user.clone(),
        config,
    })
}

/// Decode `raw` as the Wasm export does and run `V::validate`.
pub fn validate_raw<V: Validator>(raw: &RawAdmission) -> Result<Verdict, Error> {
    V::validate(&decode(raw)?)
}

/// A defaulted object as JSON, and the warnings to show.
#[derive(Debug, Clone, PartialEq)]
pub struct DefaultedRaw {
    /// The object with its defaults set.
    pub object: Value,
    /// Warnings for the client.
    pub warnings: Vec<String>,
}

/// Decode `raw` as the Wasm export does, run `D::apply_defaults` and set what it names on
/// the object as written.
pub fn default_raw<D: Defaulter>(raw: &RawAdmission) -> Result<DefaultedRaw, Error> {
    let written = raw
        .object
        .as_deref()
        .ok_or_else(|| Error::permanent("a default needs the object being written"))?;
    let mut object: Value = serde_json::from_str(written)
        .map_err(|e| Error::invalid_parent(format!("the object is not JSON: {e}")))?;
    let mut defaults = Defaults::default();
    D::apply_defaults(&decode(raw)?, &mut defaults)?;
    let warnings = defaults.apply(&mut object)?;
    Ok(DefaultedRaw { object, warnings })
}

/// Convert `object` (JSON) to `desired_api_version` with `C`, as the Wasm export does: an
/// object already at that version comes back as it is.
pub fn convert_raw<C: Converter>(object: &str, desired_api_version: &str) -> Result<String, Error> {
    let input: Value = serde_json::from_str(object)
        .map_err(|e| Error::invalid_parent(format!("the object is not JSON: {e}")))?;
    let from = input["apiVersion"].as_str().unwrap_or_default();
    if from == desired_api_version {
        return Ok(object.to_owned());
    }
    let read = |what| {
        move |e: serde_json::Error| {
            Error::invalid_parent(format!("the object does not match the {what} type: {e}"))
        }
    };
    let mut output = match (from, desired_api_version) {
        (older, newer) if older == C::OLDER && newer == C::NEWER => {
            let typed = serde_json::from_value(input.clone()).map_err(read(C::OLDER))?;
            serde_json::to_value(C::upgrade(typed)?)?
        }
        (newer, older) if newer == C::NEWER && older == C::OLDER => {
            let typed = serde_json::from_value(input.clone()).map_err(read(C::NEWER))?;
            serde_json::to_value(C::downgrade(typed)?)?
        }
        _ => {
            return Err(Error::permanent(format!(
                "this plugin converts between {} and {}, not from {from} to {desired_api_version}",
                C::OLDER,
                C::NEWER
            )));
        }
    };
    let Value::Object(fields) = &mut output else {
        return Err(Error::permanent("a converted object must be a JSON object"));
    };
    fields.insert("apiVersion".into(), desired_api_version.into());
    keep_what_a_conversion_keeps(&input, fields);
    Ok(output.to_string())
}

/// `kind` and `metadata` as they were, but for the labels and annotations of the converted
/// type when it has metadata (a conversion may keep there what the other version has no
/// field for); and `status` as it was when the converted type has none.
fn keep_what_a_conversion_keeps(input: &Value, output: &mut serde_json::Map<String, Value>) {
    match input.get("kind") {
        Some(kind) => output.insert("kind".into(), kind.clone()),
        None => output.remove("kind"),
    };
    let answered = output.remove("metadata");
    match input.get("metadata") {
        Some(Value::Object(metadata)) => {
            let mut metadata = metadata.clone();
            if let Some(Value::Object(answered)) = answered {
                for field in ["labels", "annotations"] {
                    match answered.get(field) {
                        Some(value) => metadata.insert(field.into(), value.clone()),
                        None => metadata.remove(field),
                    };
                }
            }
            output.insert("metadata".into(), Value::Object(metadata));
        }
        Some(other) => {
            output.insert("metadata".into(), other.clone());
        }
        None => {}
    }
    if output.get("status").is_none_or(Value::is_null)
        && let Some(status) = input.get("status")
    {
        output.insert("status".into(), status.clone());
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    use super::*;

    #[derive(Deserialize, Serialize)]
    struct Old {
        spec: OldSpec,
    }
    #[derive(Deserialize, Serialize)]
    struct OldSpec {
        host: String,
    }
    #[derive(Deserialize, Serialize)]
    struct New {
        spec: NewSpec,
    }
    #[derive(Deserialize, Serialize)]
    struct NewSpec {
        endpoint: Endpoint,
    }
    #[derive(Deserialize, Serialize)]
    struct Endpoint {
        host: String,
    }

    struct Versions;
    impl Converter for Versions {
        type Older = Old;
        type Newer = New;
        const OLDER: &'static str = "example.com/v1alpha1";
        const NEWER: &'static str = "example.com/v1";
        fn upgrade(older: Old) -> Result<New, Error> {
            Ok(New {
                spec: NewSpec {
                    endpoint: Endpoint {
                        host: older.spec.host,
                    },
                },
            })
        }
        fn downgrade(newer: New) -> Result<Old, Error> {
            Ok(Old {
                spec: OldSpec {
                    host: newer.spec.endpoint.host,
                },
            })
        }
    }

    #[test]
    fn a_conversion_round_trips_keeping_kind_and_metadata() {
        let old = json!({"apiVersion": "example.com/v1alpha1", "kind": "Widget",
                         "metadata": {"name": "w", "labels": {"a": "b"}},
                         "spec": {"host": "db"}});
        let new: Value = serde_json::from_str(
            &convert_raw::<Versions>(&old.to_string(), "example.com/v1").expect("up"),
        )
        .expect("json");
        assert_eq!(new["apiVersion"], "example.com/v1");
        assert_eq!(new["kind"], "Widget");
        assert_eq!(new["metadata"], old["metadata"]);
        assert_eq!(new["spec"], json!({"endpoint": {"host": "db"}}));
        let back: Value = serde_json::from_str(
            &convert_raw::<Versions>(&new.to_string(), "example.com/v1alpha1").expect("down"),
        )
        .expect("json");
        assert_eq!(back, old);
    }

    #[test]
    fn a_conversion_keeps_the_status_and_the_converted_labels() {
        let old = json!({"apiVersion": "example.com/v1alpha1", "kind": "Widget",
                         "metadata": {"name": "w", "uid": "u", "labels": {"a": "b"}},
                         "spec": {"host": "db"}, "status": {"ready": true}});
        let new: Value = serde_json::from_str(
            &convert_raw::<Versions>(&old.to_string(), "example.com/v1").expect("up"),
        )
        .expect("json");
        // The types know no status and no metadata: both come through as they were.
        assert_eq!(new["status"], json!({"ready": true}));
        assert_eq!(new["metadata"], old["metadata"]);

        /// Keeps the older host in an annotation, with metadata in both types.
        #[derive(Deserialize, Serialize)]
        struct Meta {
            metadata: serde_json::Map<String, Value>,
        }
        struct Annotating;
        impl Converter for Annotating {
            type Older = Meta;
            type Newer = Meta;
            const OLDER: &'static str = "example.com/v1alpha1";
            const NEWER: &'static str = "example.com/v1";
            fn upgrade(mut older: Meta) -> Result<Meta, Error> {
                older
                    .metadata
                    .insert("annotations".into(), json!({"kept": "x"}));
                older.metadata.remove("labels");
                older.metadata.insert("name".into(), json!("renamed"));
                Ok(older)
            }
            fn downgrade(newer: Meta) -> Result<Meta, Error> {
                Ok(newer)
            }
        }
        let new: Value = serde_json::from_str(
            &convert_raw::<Annotating>(&old.to_string(), "example.com/v1").expect("up"),
        )
        .expect("json");
        assert_eq!(
            new["metadata"],
            json!({"name": "w", "uid": "u", "annotations": {"kept": "x"}})
        );
    }

    #[test]
    fn a_conversion_between_versions_it_does_not_know_is_an_error() {
        let old = json!({"apiVersion": "example.com/v1alpha1", "kind": "Widget", "spec": {}});
        let err = convert_raw::<Versions>(&old.to_string(), "example.com/v2").expect_err("v2");
        assert!(err.to_string().contains("example.com/v2"), "{err}");
    }

    #[test]
    fn defaults_keep_what_the_type_does_not_know() {
        let mut object = json!({"spec": {"unknown": true}});
        let mut defaults = Defaults::default();
        defaults.set("spec.replicas", 1).expect("path");
        defaults.set("spec.template.tier", "gold").expect("path");
        defaults.apply(&mut object).expect("applies");
        assert_eq!(
            object,
            json!({"spec": {"unknown": true, "replicas": 1, "template": {"tier": "gold"}}})
        );
        assert!(Defaults::default().set("spec..x", 1).is_err());
        let mut annotated = json!({"metadata": {"name": "a", "annotations": null}});
        let mut defaults = Defaults::default();
        defaults
            .set_at(&["metadata", "annotations", "example.com/tier"], "gold")
            .expect("keys");
        defaults.apply(&mut annotated).expect("applies");
        assert_eq!(
            annotated["metadata"]["annotations"],
            json!({"example.com/tier": "gold"})
        );
        let mut scalar = json!({"spec": 3});
        let mut defaults = Defaults::default();
        defaults.set("spec.replicas", 1).expect("path");
        assert!(defaults.apply(&mut scalar).is_err());
    }
}
