//! The webhooks this plugin serves for {{kind}}, beside its reconciler: a validator, a
//! defaulter and a converter. The host calls each in a sandbox, like `reconcile`, and checks
//! what it answers; `wasmctrl plugin test` runs the cases in `cases/` against them.
//!
//! - [`{{kind}}Rules`] validates every create and update (`spec.replicas` within bounds, an
//!   image without whitespace) and defaults `spec.replicas` to 1 when it is left out.
//! - [`{{kind}}Versions`] converts between `{{group}}/{{older_version}}` (which called the
//!   replica count `count`) and `{{group}}/{{version}}`. Change both types to your versions'
//!   shapes, or drop the converter (and `converter:` in `lib.rs`) while the kind has one.

use serde::{Deserialize, Serialize};
use wasmctrl_plugin_sdk::Error;
use wasmctrl_plugin_sdk::webhooks::{
    Admission, Converter, Defaulter, Defaults, Operation, Validator, Verdict,
};

use crate::{Config, {{kind}}, {{kind}}Spec, {{kind}}Status};

/// The most replicas a {{kind}} may ask for.
pub const MAX_REPLICAS: i32 = 100;

/// Validates and defaults {{kind}}s.
pub struct {{kind}}Rules;

impl Validator for {{kind}}Rules {
    type Parent = {{kind}};
    type Config = Config;

    fn validate(request: &Admission<{{kind}}, Config>) -> Result<Verdict, Error> {
        let mut verdict = Verdict::allow();
        let (Operation::Create | Operation::Update, Some(parent)) =
            (request.operation, &request.object)
        else {
            return Ok(verdict); // deletes are always allowed
        };
        if parent.metadata.deletion_timestamp.is_some() {
            return Ok(verdict); // on its way out: its finalizers must be able to go
        }
        // On an update only what changes is judged, so an object stored before a rule
        // existed can still be edited.
        let old = request.old_object.as_ref().map(|old| &old.spec);
        let replicas = parent.spec.replicas;
        if old.is_none_or(|old| old.replicas != replicas) && replicas > MAX_REPLICAS {
            verdict.deny(
                "spec.replicas",
                format!("must be at most {MAX_REPLICAS}, got {replicas}"),
            );
        }
        let image = &parent.spec.image;
        if old.is_none_or(|old| &old.image != image) && image.chars().any(char::is_whitespace) {
            verdict.deny("spec.image", "must not contain whitespace");
        }
        Ok(verdict)
    }
}

/// What the defaulter reads of a {{kind}} as written: only the fields it may fill in, so a
/// write that leaves them out still decodes (the fields it sets go onto the object as written).
#[derive(Deserialize)]
pub struct Written {
    spec: WrittenSpec,
}

#[derive(Deserialize)]
struct WrittenSpec {
    replicas: Option<i32>,
}

impl Defaulter for {{kind}}Rules {
    type Parent = Written;
    type Config = Config;

    fn apply_defaults(request: &Admission<Written, Config>, defaults: &mut Defaults) -> Result<(), Error> {
        if request
            .object
            .as_ref()
            .is_some_and(|written| written.spec.replicas.is_none())
        {
            defaults.set("spec.replicas", 1)?;
        }
        Ok(())
    }
}

/// A {{kind}} at `{{group}}/{{older_version}}`.
#[derive(Serialize, Deserialize)]
pub struct Older{{kind}} {
    /// Kept as it is by every conversion (the SDK sees to it).
    #[serde(default)]
    pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    /// The older spec.
    pub spec: Older{{kind}}Spec,
    /// The status, the same in both versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<{{kind}}Status>,
}

/// The spec at `{{group}}/{{older_version}}`: the replica count was called `count`.
#[derive(Serialize, Deserialize)]
pub struct Older{{kind}}Spec {
    /// The container image to run.
    pub image: String,
    /// How many pods to run.
    pub count: i32,
}

/// Converts {{kind}}s between `{{older_version}}` and `{{version}}`.
pub struct {{kind}}Versions;

impl Converter for {{kind}}Versions {
    type Older = Older{{kind}};
    type Newer = {{kind}};
    const OLDER: &'static str = "{{group}}/{{older_version}}";
    const NEWER: &'static str = "{{group}}/{{version}}";

    fn upgrade(older: Older{{kind}}) -> Result<{{kind}}, Error> {
        Ok({{kind}} {
            metadata: older.metadata,
            spec: {{kind}}Spec {
                image: older.spec.image,
                replicas: older.spec.count,
            },
            status: older.status,
        })
    }

    fn downgrade(newer: {{kind}}) -> Result<Older{{kind}}, Error> {
        Ok(Older{{kind}} {
            metadata: newer.metadata,
            spec: Older{{kind}}Spec {
                image: newer.spec.image,
                count: newer.spec.replicas,
            },
            status: newer.status,
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use wasmctrl_plugin_sdk::testing::{TestAdmission, convert_raw};

    use super::*;

    fn written(spec: serde_json::Value) -> serde_json::Value {
        json!({
            "apiVersion": "{{group}}/{{version}}", "kind": "{{kind}}",
            "metadata": {"name": "example", "namespace": "default"},
            "spec": spec,
        })
    }

    #[test]
    fn too_many_replicas_are_denied_on_the_field() {
        let verdict = TestAdmission::create(&written(json!({"image": "nginx:1.27", "replicas": 500})))
            .validate::<{{kind}}Rules>()
            .expect("decides");
        assert!(!verdict.is_allowed());
        assert_eq!(verdict.violations[0].field, "spec.replicas");
        let allowed = TestAdmission::create(&written(json!({"image": "nginx:1.27", "replicas": 3})))
            .validate::<{{kind}}Rules>()
            .expect("decides");
        assert!(allowed.is_allowed(), "{allowed:?}");
    }

    #[test]
    fn replicas_default_to_one_and_nothing_else_changes() {
        let defaulted = TestAdmission::create(&written(json!({"image": "nginx:1.27"})))
            .apply_defaults::<{{kind}}Rules>()
            .expect("defaults");
        assert_eq!(defaulted.object, written(json!({"image": "nginx:1.27", "replicas": 1})));
    }

    #[test]
    fn a_conversion_comes_back_to_where_it_started() {
        let newer = written(json!({"image": "nginx:1.27", "replicas": 2}));
        let older: serde_json::Value = serde_json::from_str(
            &convert_raw::<{{kind}}Versions>(&newer.to_string(), "{{group}}/{{older_version}}")
                .expect("downgrades"),
        )
        .expect("json");
        assert_eq!(older["spec"], json!({"image": "nginx:1.27", "count": 2}));
        let back: serde_json::Value = serde_json::from_str(
            &convert_raw::<{{kind}}Versions>(&older.to_string(), "{{group}}/{{version}}")
                .expect("upgrades"),
        )
        .expect("json");
        assert_eq!(back, newer);
    }
}
