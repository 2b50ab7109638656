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

    /// On an update, only what changes is judged: an object stored before a rule existed
    /// (or before it tightened) can still be edited, scaled back and finalized.
    fn validate(request: &Admission<MyApp, MyAppConfig>) -> Result<Verdict, Error> {
        let mut verdict = Verdict::allow();
        let (Operation::Create | Operation::Update, Some(app)) =
            (request.operation, &request.object)
        else {
            return Ok(verdict);
        };
        if app.metadata.deletion_timestamp.is_some() {
            return Ok(verdict); // on its way out: finalizers must be able to go
        }
        let old = request.old_object.as_ref().map(|old| &old.spec);
        let spec = &app.spec;
        if old.is_none_or(|old| old.replicas != spec.replicas)
            && !(1..=MAX_REPLICAS).contains(&spec.replicas)
        {
            verdict.deny(
                "spec.replicas",
                format!(
                    "must be between 1 and {MAX_REPLICAS}, got {}",
                    spec.replicas
                ),
            );
        }
        if old.is_none_or(|old| old.image != spec.image) {
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

/// Read `image` as `[domain[:port]/]path[:tag][@algorithm:hex]`, the reference grammar of
/// the OCI distribution spec (as `docker pull` reads it), to catch what a kubelet would fail
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
        check_digest(digest)?;
    }
    // A colon after the last slash starts the tag; one before it is a registry's port.
    let last_part = name.rsplit('/').next().unwrap_or(name);
    let (name, tag) = match last_part.split_once(':') {
        Some((_, tag)) => (&name[..name.len() - tag.len() - 1], Some(tag)),
        None => (name, None),
    };
    if let Some(tag) = tag {
        let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        let valid = !tag.is_empty()
            && tag.len() <= 128
            && tag.bytes().next().is_some_and(word)
            && tag.bytes().all(|b| word(b) || b == b'.' || b == b'-');
        if !valid {
            return Err(format!("tag {tag:?} is not valid"));
        }
    }
    if name.len() > 255 {
        return Err("the name is longer than 255 characters".into());
    }
    // The first part is a registry when it has a dot, a port or capitals, or is localhost.
    let path = match name.split_once('/') {
        Some((domain, path))
            if domain.contains(['.', ':'])
                || domain == "localhost"
                || domain.bytes().any(|b| b.is_ascii_uppercase()) =>
        {
            check_domain(domain)?;
            path
        }
        _ => name,
    };
    for component in path.split('/') {
        if !is_path_component(component) {
            return Err(format!(
                "{component:?} must be lowercase letters and digits, separated by one `.`, one or two `_`, or dashes"
            ));
        }
    }
    Ok(if digest.is_some() || tag.is_some_and(|t| t != "latest") {
        Pinned::Yes
    } else {
        Pinned::No
    })
}

/// `[a-z0-9]+` runs joined by `.`, `_`, `__` or any number of `-`.
fn is_path_component(component: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    let mut runs = component.split(|c: char| !alnum(c));
    let mut separators = component.split(alnum).filter(|s| !s.is_empty());
    !component.is_empty()
        && component.starts_with(alnum)
        && component.ends_with(alnum)
        && runs.all(|run| !run.is_empty())
        && separators.all(|sep| matches!(sep, "." | "_" | "__") || sep.bytes().all(|b| b == b'-'))
}

/// `host[:port]`: DNS labels of letters, digits and inner dashes, then digits.
fn check_domain(domain: &str) -> Result<(), String> {
    let (host, port) = match domain.split_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (domain, None),
    };
    let label_ok = |label: &str| {
        !label.is_empty()
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    };
    if !host.split('.').all(label_ok) {
        return Err(format!("registry {domain:?} is not a host name"));
    }
    if port.is_some_and(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit())) {
        return Err(format!(
            "registry {domain:?} has a port that is not a number"
        ));
    }
    Ok(())
}

/// `algorithm:encoded`; sha256 and sha512 must be lowercase hex of their length.
fn check_digest(digest: &str) -> Result<(), String> {
    let (algorithm, encoded) = digest
        .split_once(':')
        .ok_or("a digest is algorithm:hex, e.g. sha256:…")?;
    let hex = |len: usize| {
        encoded.len() == len
            && encoded
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let known = match algorithm {
        "sha256" => hex(64),
        "sha512" => hex(128),
        _ => {
            !algorithm.is_empty()
                && algorithm
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+._-".contains(&b))
                && encoded.len() >= 32
                && encoded
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"=_-".contains(&b))
        }
    };
    if known {
        Ok(())
    } else {
        Err(format!("digest {digest:?} is not valid for its algorithm"))
    }
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
    fn an_update_is_judged_on_what_it_changes() {
        // Stored before the bound existed: other edits, and scaling into bounds, go through.
        let stored = app(80, "nginx:1.27");
        let mut relabelled = stored.clone();
        relabelled["metadata"]["labels"] = json!({"tier": "web"});
        let verdict = TestAdmission::update(&relabelled, &stored)
            .validate::<MyAppRules>()
            .expect("decides");
        assert!(verdict.is_allowed(), "{verdict:?}");
        assert!(
            TestAdmission::update(&app(10, "nginx:1.27"), &stored)
                .validate::<MyAppRules>()
                .expect("decides")
                .is_allowed()
        );
        let verdict = TestAdmission::update(&app(90, "nginx:1.27"), &stored)
            .validate::<MyAppRules>()
            .expect("decides");
        assert_eq!(verdict.violations[0].field, "spec.replicas", "{verdict:?}");
        // A bad value on its way out does not hold the finalizer.
        let mut leaving = app(0, "NOT VALID");
        leaving["metadata"]["deletionTimestamp"] = json!("2026-12-06T00:00:00Z");
        assert!(
            TestAdmission::update(&leaving, &app(1, "nginx:1.27"))
                .validate::<MyAppRules>()
                .expect("decides")
                .is_allowed()
        );
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
