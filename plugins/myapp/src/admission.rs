//! MyApp's admission rules: what the OpenAPI schema cannot say about a MyApp, checked when it
//! is written (a validator), and the port filled in when it is left out (a defaulter).

use wasmctrl_plugin_sdk::Error;
use wasmctrl_plugin_sdk::webhooks::{
    Admission, Defaulter, Defaults, Operation, Validator, Verdict,
};

use crate::types::{DEFAULT_PORT, MyApp, MyAppConfig};

/// The most replicas a MyApp may ask for: more is a typo far more often than a need.
pub const MAX_REPLICAS: i32 = 50;

/// Validates and defaults MyApps.
pub struct MyAppRules;

impl Validator for MyAppRules {
    type Parent = MyApp;
    type Config = MyAppConfig;

    fn validate(request: &Admission<MyApp, MyAppConfig>) -> Result<Verdict, Error> {
        let mut verdict = Verdict::allow();
        let (Operation::Create | Operation::Update, Some(app)) =
            (request.operation, &request.object)
        else {
            return Ok(verdict);
        };
        let spec = &app.spec;
        if !(1..=MAX_REPLICAS).contains(&spec.replicas) {
            verdict.deny(
                "spec.replicas",
                format!(
                    "must be between 1 and {MAX_REPLICAS}, got {}",
                    spec.replicas
                ),
            );
        }
        match image_reference(&spec.image) {
            Err(why) => {
                verdict.deny(
                    "spec.image",
                    format!("{:?} is not an image reference: {why}", spec.image),
                );
            }
            Ok(Pinned::No) => {
                verdict.warn(format!(
                    "spec.image {:?} has no tag or digest: every rollout may run a different image",
                    spec.image
                ));
            }
            Ok(Pinned::Yes) => {}
        }
        Ok(verdict)
    }
}

impl Defaulter for MyAppRules {
    type Parent = MyApp;
    type Config = MyAppConfig;

    fn apply_defaults(
        request: &Admission<MyApp, MyAppConfig>,
        defaults: &mut Defaults,
    ) -> Result<(), Error> {
        if request
            .object
            .as_ref()
            .is_some_and(|app| app.spec.port.is_none())
        {
            defaults.set("spec.port", DEFAULT_PORT)?;
        }
        Ok(())
    }
}

/// Whether an image reference names one image for good (a tag other than `latest`, or a
/// digest).
#[derive(Debug, PartialEq, Eq)]
enum Pinned {
    Yes,
    No,
}

/// Read `image` as `[registry[:port]/]repository[:tag][@sha256:<64 hex>]`, the reference
/// grammar of the OCI distribution spec, closely enough to catch what a kubelet would fail
/// to pull.
fn image_reference(image: &str) -> Result<Pinned, String> {
    if image.is_empty() {
        return Err("it is empty".into());
    }
    if image.chars().any(char::is_whitespace) {
        return Err("it contains whitespace".into());
    }
    let (name, digest) = match image.split_once('@') {
        Some((name, digest)) => (name, Some(digest)),
        None => (image, None),
    };
    if let Some(digest) = digest {
        let hex = digest
            .strip_prefix("sha256:")
            .ok_or("a digest must start with sha256:")?;
        if hex.len() != 64
            || !hex
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        {
            return Err("a sha256 digest is 64 lowercase hex digits".into());
        }
    }
    // A colon after the last slash starts the tag; one before it is a registry's port.
    let last_part = name.rsplit('/').next().unwrap_or(name);
    let (repository, tag) = match last_part.split_once(':') {
        Some((_, tag)) => (&name[..name.len() - tag.len() - 1], Some(tag)),
        None => (name, None),
    };
    if let Some(tag) = tag {
        let valid = !tag.is_empty()
            && tag.len() <= 128
            && tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
            && !tag.starts_with(['.', '-']);
        if !valid {
            return Err(format!("tag {tag:?} is not valid"));
        }
    }
    let path = match repository.split_once('/') {
        // A first part with a dot or a port, or `localhost`, is a registry host.
        Some((host, path)) if host.contains(['.', ':']) || host == "localhost" => path,
        _ => repository,
    };
    let components_valid = !path.is_empty()
        && path.split('/').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
                && part.starts_with(|c: char| c.is_ascii_alphanumeric())
        });
    if !components_valid {
        return Err(format!(
            "repository {path:?} must be lowercase letters, digits and separators (._-)"
        ));
    }
    Ok(if digest.is_some() || tag.is_some_and(|t| t != "latest") {
        Pinned::Yes
    } else {
        Pinned::No
    })
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};
    use wasmctrl_plugin_sdk::testing::TestAdmission;

    use super::*;

    fn app(replicas: i32, image: &str) -> Value {
        json!({
            "apiVersion": "example.com/v1", "kind": "MyApp",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"replicas": replicas, "image": image},
        })
    }

    #[test]
    fn replicas_must_be_within_bounds() {
        for (replicas, allowed) in [(0, false), (1, true), (50, true), (51, false)] {
            let verdict = TestAdmission::create(&app(replicas, "nginx:1.27"))
                .validate::<MyAppRules>()
                .expect("decides");
            assert_eq!(verdict.is_allowed(), allowed, "{replicas}: {verdict:?}");
            if !allowed {
                assert_eq!(verdict.violations[0].field, "spec.replicas");
            }
        }
    }

    #[test]
    fn image_references_are_read_as_a_kubelet_would() {
        for image in [
            "nginx:1.27",
            "registry.example.com:5000/team/app:v1.2.3",
            "localhost/app:dev",
            "ghcr.io/org/app@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ] {
            assert_eq!(image_reference(image), Ok(Pinned::Yes), "{image}");
        }
        for image in ["nginx", "nginx:latest", "registry.example.com:5000/app"] {
            assert_eq!(image_reference(image), Ok(Pinned::No), "{image}");
        }
        for image in [
            "",
            "Nginx:1",
            "nginx:",
            "nginx 1.27",
            "app@sha256:abc",
            "a//b:1",
            "nginx:-x",
        ] {
            assert!(image_reference(image).is_err(), "{image:?}");
        }
    }

    #[test]
    fn an_unpinned_image_is_allowed_with_a_warning() {
        let verdict = TestAdmission::create(&app(1, "nginx"))
            .validate::<MyAppRules>()
            .expect("decides");
        assert!(verdict.is_allowed());
        assert_eq!(verdict.warnings.len(), 1, "{verdict:?}");
    }

    #[test]
    fn a_delete_is_always_allowed() {
        let verdict = TestAdmission::delete(&app(0, "NOT VALID"))
            .validate::<MyAppRules>()
            .expect("decides");
        assert!(verdict.is_allowed());
    }

    #[test]
    fn the_port_is_defaulted_and_nothing_else_changes() {
        let written = app(2, "nginx:1.27");
        let defaulted = TestAdmission::create(&written)
            .apply_defaults::<MyAppRules>()
            .expect("defaults");
        let mut expected = written.clone();
        expected["spec"]["port"] = json!(DEFAULT_PORT);
        assert_eq!(defaulted.object, expected);
        let mut with_port = written;
        with_port["spec"]["port"] = json!(8080);
        let kept = TestAdmission::create(&with_port)
            .apply_defaults::<MyAppRules>()
            .expect("defaults");
        assert_eq!(kept.object, with_port);
    }
}
