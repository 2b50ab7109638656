//! An AdmissionReview answered by a policy's plugin, as the API server will send it: denials
//! with their fields as causes, defaults as a JSON patch, warnings, and a plugin that fails
//! answered by the failure policy — never left unanswered.

mod support;

use std::time::{Duration, Instant};

use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use serde_json::{Value, json};
use support::guest_bytes;
use wasmctrl::admission::review::{Answerer, FailurePolicy, Hook, answer};
use wasmctrl::plugin::{EngineOptions, Limits, Plugin, PluginEngine};

fn load(name: &str, limits: Limits) -> Plugin {
    PluginEngine::new(EngineOptions::default())
        .expect("engine")
        .load(&guest_bytes(name), None, limits)
        .expect("loads")
}

fn answerer(plugin: Plugin, config: Value, failure_policy: FailurePolicy) -> Answerer {
    Answerer::with_plugin(
        "ReconcilePolicy/myapp",
        plugin,
        Some(config.to_string()),
        "policy/myapp",
        failure_policy,
    )
}

fn myapp(replicas: i64, image: &str) -> Value {
    json!({
        "apiVersion": "example.com/v1", "kind": "MyApp",
        "metadata": {"name": "web", "namespace": "default", "uid": "u-1"},
        "spec": {"replicas": replicas, "image": image},
    })
}

/// The request of an AdmissionReview as the API server sends it.
fn review(
    operation: &str,
    object: Option<Value>,
    old_object: Option<Value>,
) -> AdmissionRequest<DynamicObject> {
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "example.com", "version": "v1", "kind": "MyApp"},
            "resource": {"group": "example.com", "version": "v1", "resource": "myapps"},
            "name": "web",
            "namespace": "default",
            "operation": operation,
            "userInfo": {"username": "jane", "groups": ["dev"]},
            "object": object,
            "oldObject": old_object,
            "dryRun": false,
        },
    });
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_value(review).expect("an AdmissionReview");
    review.try_into().expect("a request")
}

#[tokio::test]
async fn a_denial_names_each_field_and_warnings_reach_the_client() {
    let myapp_rules = answerer(
        load("myapp_plugin", Limits::default()),
        json!({}),
        FailurePolicy::Fail,
    );
    let (response, outcome) = answer(
        Hook::Validate,
        &myapp_rules,
        &review("CREATE", Some(myapp(80, "Nginx 1")), None),
    )
    .await;
    assert_eq!(outcome, "denied");
    assert!(!response.allowed);
    assert_eq!(response.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
    assert_eq!(response.result.code, 422);
    assert_eq!(response.result.reason, "Invalid");
    assert!(
        response
            .result
            .message
            .starts_with("MyApp \"web\" is invalid: spec.replicas: must be between 1 and 50"),
        "{}",
        response.result.message
    );
    let causes = &response.result.details.as_ref().expect("details").causes;
    let fields: Vec<&str> = causes.iter().map(|c| c.field.as_str()).collect();
    assert_eq!(fields, ["spec.replicas", "spec.image"]);

    let (response, outcome) = answer(
        Hook::Validate,
        &myapp_rules,
        &review("CREATE", Some(myapp(2, "nginx")), None),
    )
    .await;
    assert_eq!(outcome, "allowed");
    assert!(response.allowed);
    assert_eq!(
        response.warnings.as_ref().map(Vec::len),
        Some(1),
        "{response:?}"
    );

    // An update that leaves an old out-of-bounds value alone goes through.
    let (response, _) = answer(
        Hook::Validate,
        &myapp_rules,
        &review(
            "UPDATE",
            Some(myapp(80, "nginx:1.27")),
            Some(myapp(80, "nginx:1.26")),
        ),
    )
    .await;
    assert!(response.allowed, "{response:?}");
}

#[tokio::test]
async fn defaults_go_back_as_a_json_patch() {
    let myapp_rules = answerer(
        load("myapp_plugin", Limits::default()),
        json!({}),
        FailurePolicy::Fail,
    );
    let written = myapp(2, "nginx:1.27");
    let (response, outcome) = answer(
        Hook::Default,
        &myapp_rules,
        &review("CREATE", Some(written.clone()), None),
    )
    .await;
    assert_eq!(outcome, "patched");
    assert!(response.allowed);
    let patch: json_patch::Patch =
        serde_json::from_slice(response.patch.as_deref().expect("a patch")).expect("JSON patch");
    let mut patched = written.clone();
    json_patch::patch(&mut patched, &patch).expect("applies");
    let mut expected = written;
    expected["spec"]["port"] = json!(80);
    assert_eq!(patched, expected);

    // Nothing to default: no patch.
    let (response, outcome) = answer(
        Hook::Default,
        &myapp_rules,
        &review("CREATE", Some(expected), None),
    )
    .await;
    assert_eq!(outcome, "allowed");
    assert!(response.patch.is_none());
}

#[tokio::test]
async fn a_failing_plugin_denies_under_fail_and_admits_with_a_warning_under_ignore() {
    let limits = Limits {
        webhook_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let plugin = load("misbehave_plugin", limits);
    for (behavior, says) in [
        ("panic", "deliberate panic in a webhook"),
        ("loop", "deadline"),
        ("error", "the webhook cannot decide"),
        ("rename", "metadata.name"),
    ] {
        let hook = if behavior == "rename" {
            Hook::Default
        } else {
            Hook::Validate
        };
        let request = review("CREATE", Some(myapp(1, "a:1")), None);
        let closed = answerer(
            plugin.clone(),
            json!({"behavior": behavior}),
            FailurePolicy::Fail,
        );
        let started = Instant::now();
        let (response, outcome) = answer(hook, &closed, &request).await;
        assert!(started.elapsed() < Duration::from_secs(3), "{behavior}");
        assert_eq!(outcome, "failed_closed", "{behavior}");
        assert!(!response.allowed, "{behavior}");
        assert_eq!(response.result.code, 500, "{behavior}");
        let message = &response.result.message;
        assert!(
            message.contains("ReconcilePolicy/myapp could not") && message.contains(says),
            "{behavior}: {message}"
        );

        let open = answerer(
            plugin.clone(),
            json!({"behavior": behavior}),
            FailurePolicy::Ignore,
        );
        let (response, outcome) = answer(hook, &open, &request).await;
        assert_eq!(outcome, "failed_open", "{behavior}");
        assert!(response.allowed, "{behavior}");
        assert!(response.patch.is_none(), "{behavior}");
        let warning = &response.warnings.as_ref().expect("a warning")[0];
        assert!(
            warning.contains("admitted without the") && warning.contains(says),
            "{behavior}: {warning}"
        );
    }
}

#[tokio::test]
async fn a_webhook_the_plugin_does_not_serve_admits_the_write_unjudged_and_says_so() {
    // A plugin swapped in without the webhook, until the leader removes its entry: there is
    // nothing to judge the write by, whatever the failure policy.
    let without = answerer(
        load("myapp_v2_plugin", Limits::default()),
        json!({}),
        FailurePolicy::Fail,
    );
    let (response, outcome) = answer(
        Hook::Validate,
        &without,
        &review("CREATE", Some(myapp(1, "a:1")), None),
    )
    .await;
    assert_eq!(outcome, "unserved");
    assert!(response.allowed);
    let warnings = response.warnings.unwrap_or_default();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("does not serve the validate webhook")),
        "{warnings:?}"
    );
}

mod listener {
    use std::sync::Arc;

    use axum::body::Body;
    use http::{Request, StatusCode};
    use serde_json::{Value, json};
    use tower::ServiceExt as _;
    use wasmctrl::admission::review::FailurePolicy;
    use wasmctrl::admission::server::{Answerers, MAX_REVIEW_BYTES, router};
    use wasmctrl::metrics::Metrics;
    use wasmctrl::plugin::Limits;

    use super::{answerer, load, myapp};

    fn review_body(object: Value) -> Vec<u8> {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u-7",
                "kind": {"group": "example.com", "version": "v1", "kind": "MyApp"},
                "resource": {"group": "example.com", "version": "v1", "resource": "myapps"},
                "name": "web", "namespace": "team-a", "operation": "CREATE",
                "userInfo": {"username": "jane"},
                "object": object,
            },
        })
        .to_string()
        .into_bytes()
    }

    async fn post(router: &axum::Router, path: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
        let response = router
            .clone()
            .oneshot(
                Request::post(path)
                    .header("content-type", "application/json")
                    .body(Body::from(body))
                    .expect("a request"),
            )
            .await
            .expect("answered");
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("a body");
        (status, body.to_vec())
    }

    #[tokio::test]
    async fn reviews_are_answered_per_policy_and_bounded() {
        let answerers = Answerers::new();
        let metrics = Arc::new(Metrics::new());
        let router = router(answerers.clone(), metrics.clone());

        // Not served here (yet): 503, so the API server applies its own failure policy.
        let (status, _) = post(
            &router,
            "/validate/team-a/myapp",
            review_body(myapp(80, "a:1")),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);

        answerers.serve(
            "team-a/myapp",
            answerer(
                load("myapp_plugin", Limits::default()),
                json!({}),
                FailurePolicy::Fail,
            ),
        );
        let (status, body) = post(
            &router,
            "/validate/team-a/myapp",
            review_body(myapp(80, "a:1")),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let review: Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(review["kind"], "AdmissionReview");
        assert_eq!(review["response"]["uid"], "u-7");
        assert_eq!(review["response"]["allowed"], false);
        assert_eq!(
            review["response"]["status"]["details"]["causes"][0]["field"],
            "spec.replicas"
        );
        let (status, body) = post(
            &router,
            "/default/team-a/myapp",
            review_body(myapp(2, "a:1")),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        let review: Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(review["response"]["patchType"], "JSONPatch");

        // Not a review, or one too large: refused before any plugin call.
        let (status, _) = post(&router, "/validate/team-a/myapp", b"{}".to_vec()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let (status, _) = post(
            &router,
            "/validate/team-a/myapp",
            vec![b' '; MAX_REVIEW_BYTES + 1],
        )
        .await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);

        // Counted per policy, webhook and result.
        let text = metrics.encode();
        for series in [
            r#"wasmctrl_webhook_requests_total{policy="(none)",webhook="validate",result="unserved"} 1"#,
            r#"wasmctrl_webhook_requests_total{policy="team-a/myapp",webhook="validate",result="denied"} 1"#,
            r#"wasmctrl_webhook_requests_total{policy="team-a/myapp",webhook="default",result="patched"} 1"#,
            r#"wasmctrl_webhook_requests_total{policy="team-a/myapp",webhook="validate",result="malformed"} 1"#,
        ] {
            assert!(text.contains(series), "{series}\n{text}");
        }

        // Stopped: 503 again.
        answerers.stop("team-a/myapp");
        let (status, _) = post(
            &router,
            "/validate/team-a/myapp",
            review_body(myapp(80, "a:1")),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_team_cannot_hold_more_than_its_share_of_reviews() {
        use wasmctrl::admission::server::MAX_REVIEWS_PER_TENANT;
        let answerers = Answerers::new();
        let router = router(answerers.clone(), Arc::new(Metrics::new()));
        let limits = Limits {
            webhook_timeout: std::time::Duration::from_millis(1500),
            ..Limits::default()
        };
        // Every review of this policy loops until its deadline: its team's share is taken.
        answerers.serve(
            "team-a/myapp",
            answerer(
                load("misbehave_plugin", limits),
                json!({"behavior": "loop"}),
                FailurePolicy::Fail,
            ),
        );
        let slow: Vec<_> = (0..MAX_REVIEWS_PER_TENANT)
            .map(|_| {
                let router = router.clone();
                tokio::spawn(async move {
                    post(
                        &router,
                        "/validate/team-a/myapp",
                        review_body(myapp(1, "a:1")),
                    )
                    .await
                })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        // One more is answered at once, under the policy's failure policy, not queued.
        let started = std::time::Instant::now();
        let (status, body) = post(
            &router,
            "/validate/team-a/myapp",
            review_body(myapp(1, "a:1")),
        )
        .await;
        assert!(started.elapsed() < std::time::Duration::from_millis(500));
        assert_eq!(status, StatusCode::OK);
        let review: Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(review["response"]["allowed"], false);
        let message = review["response"]["status"]["message"]
            .as_str()
            .unwrap_or_default();
        assert!(message.contains("are being answered already"), "{message}");
        for review in slow {
            let (status, _) = review.await.expect("joined");
            assert_eq!(status, StatusCode::OK);
        }
    }
}
