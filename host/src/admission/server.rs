//! The webhook listener: HTTPS on a port of its own, on every replica, where the API server
//! sends the AdmissionReviews of the kinds whose policies serve webhooks.
//!
//! - `POST /validate/{policy}` and `POST /default/{policy}`, where `{policy}` is a cluster
//!   policy's name or `{namespace}/{name}` for a namespaced one (the path the host writes
//!   into the webhook configurations it owns), and `POST /convert/{policy}`, the conversion
//!   webhook of a cluster policy's parent CRD (see [`super::conversion`]).
//! - Who may call: anyone who reaches the port and completes the TLS handshake. The API
//!   server is told the CA to trust (the configurations' `caBundle`); the host checks nothing
//!   else a peer could forge, because a review grants nothing: it only asks the plugin what
//!   it would say about an object the caller sends, writes nothing, and is bounded in size
//!   ([`MAX_REVIEW_BYTES`]) and time (the plugin's webhook deadline), its calls sharing the
//!   policy's call slots. What a peer other than the API server can do is spend those slots,
//!   so only the API server should reach the port (a NetworkPolicy).
//! - A policy this replica does not serve (yet: its plugin still loading) gets
//!   `503 Service Unavailable`, so the API server applies the configuration's own failure
//!   policy; a body that is no AdmissionReview gets `400`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use kube::core::conversion::{ConversionRequest, ConversionReview};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use super::certs::Issued;
use super::conversion::Converter;
use super::review::{Answerer, Hook, answer, unanswered};
use crate::metrics::Metrics;

/// The largest AdmissionReview read: an object and its old version at the API server's own
/// request limit (3 MiB each), and the review around them.
pub const MAX_REVIEW_BYTES: usize = 7 << 20;
/// How long a conversion waits for a place among its team's reviews in flight before it
/// fails (it has no failure policy to fall back on, and fails the read that needed it).
pub const CONVERSION_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// Reviews read and answered at once; more wait. With [`MAX_REVIEW_BYTES`] it bounds the
/// memory reviews hold (the API server sends a few at a time; its own timeout is 30 s at
/// most).
pub const MAX_REVIEWS_IN_FLIGHT: usize = 32;
/// The longest a review may take from its first byte to its answer, reading the body
/// included: a client that sends slowly is cut off (the API server's timeout is 30 s at
/// most, and the plugin's deadline far less).
pub const REVIEW_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Reviews of one tenant (a team's namespace, or a cluster policy) answered at once; a
/// review past them gets its policy's failure policy at once, so that no team's busy or
/// slow webhooks hold the listener's reviews from another's.
pub const MAX_REVIEWS_PER_TENANT: usize = 8;
/// How metrics label a request for a policy this replica does not serve: the path is the
/// caller's to choose, so it never becomes a label of its own.
const UNKNOWN_POLICY: &str = "(none)";

/// Who answers each policy's webhooks on this replica: its active plugin, registered by the
/// policy's controller when it loads one and removed when it stops.
#[derive(Default)]
pub struct Answerers {
    by_policy: Mutex<HashMap<String, Arc<Answerer>>>,
    /// Who converts each policy's parent kind: kept apart from the admission webhooks,
    /// since a CRD's conversion outlives them (it is served until no stored object needs it).
    converters: Mutex<HashMap<String, Arc<Converter>>>,
    /// Each tenant's reviews in flight.
    by_tenant: Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
}

impl Answerers {
    /// An empty registry.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// `answerer` answers `policy`'s webhooks from now on.
    pub fn serve(&self, policy: &str, answerer: Answerer) {
        crate::lock(&self.by_policy).insert(policy.to_owned(), Arc::new(answerer));
    }

    /// `policy`'s webhooks are answered no more (503: the API server's failure policy).
    pub fn stop(&self, policy: &str) {
        crate::lock(&self.by_policy).remove(policy);
    }

    fn get(&self, policy: &str) -> Option<Arc<Answerer>> {
        crate::lock(&self.by_policy).get(policy).cloned()
    }

    /// `converter` converts `policy`'s parent kind from now on.
    pub fn convert(&self, policy: &str, converter: Converter) {
        crate::lock(&self.converters).insert(policy.to_owned(), Arc::new(converter));
    }

    /// `policy`'s parent kind is converted no more (503: the read fails).
    pub fn stop_converting(&self, policy: &str) {
        crate::lock(&self.converters).remove(policy);
    }

    /// Whether this replica converts `policy`'s parent kind.
    pub fn converts(&self, policy: &str) -> bool {
        crate::lock(&self.converters).contains_key(policy)
    }

    fn converter(&self, policy: &str) -> Option<Arc<Converter>> {
        crate::lock(&self.converters).get(policy).cloned()
    }

    /// A place among `tenant`'s reviews in flight, if one is free.
    fn admit(&self, tenant: &str) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.slots(tenant).try_acquire_owned().ok()
    }

    fn slots(&self, tenant: &str) -> Arc<tokio::sync::Semaphore> {
        crate::lock(&self.by_tenant)
            .entry(tenant.to_owned())
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(MAX_REVIEWS_PER_TENANT)))
            .clone()
    }
}

#[derive(Clone)]
struct Served {
    answerers: Arc<Answerers>,
    metrics: Arc<Metrics>,
}

/// The listener's routes.
pub fn router(answerers: Arc<Answerers>, metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/validate/{*policy}", post(validate))
        .route("/default/{*policy}", post(default))
        .route("/convert/{*policy}", post(convert))
        .layer(
            tower::ServiceBuilder::new()
                .layer(axum::error_handling::HandleErrorLayer::new(
                    |_: tower::BoxError| async {
                        (StatusCode::REQUEST_TIMEOUT, "the review took too long")
                    },
                ))
                // The timeout outside the limit: a review waiting for its turn is bounded too.
                .layer(tower::timeout::TimeoutLayer::new(REVIEW_TIMEOUT))
                .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
                    MAX_REVIEWS_IN_FLIGHT,
                )),
        )
        .layer(DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .with_state(Served { answerers, metrics })
}

async fn validate(
    State(served): State<Served>,
    Path(policy): Path<String>,
    body: Bytes,
) -> Response {
    review(Hook::Validate, &served, &policy, &body).await
}

async fn default(
    State(served): State<Served>,
    Path(policy): Path<String>,
    body: Bytes,
) -> Response {
    review(Hook::Default, &served, &policy, &body).await
}

async fn convert(
    State(served): State<Served>,
    Path(policy): Path<String>,
    body: Bytes,
) -> Response {
    const WEBHOOK: &str = "convert";
    let Some(converter) = served.answerers.converter(&policy) else {
        served
            .metrics
            .webhook_request(UNKNOWN_POLICY, WEBHOOK, "unserved", None);
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("this replica converts no kind of policy {policy} (yet)"),
        )
            .into_response();
    };
    let request = match serde_json::from_slice::<ConversionReview>(&body)
        .map_err(|e| e.to_string())
        .and_then(|review| {
            ConversionRequest::try_from(review).map_err(|_| "the review has no request".to_owned())
        }) {
        Ok(request) => request,
        Err(why) => {
            served
                .metrics
                .webhook_request(&policy, WEBHOOK, "malformed", None);
            return (
                StatusCode::BAD_REQUEST,
                format!("not a ConversionReview: {why}"),
            )
                .into_response();
        }
    };
    drop(body);
    let started = std::time::Instant::now();
    // A conversion waits a little for its turn among its team's reviews rather than failing
    // at once: it has no failure policy, and a read fails with it. The wait is bounded so a
    // team's busy conversions cannot hold the listener's reviews from another's.
    let slots = served.answerers.slots(&converter.tenant);
    let Ok(Ok(_in_flight)) = tokio::time::timeout(CONVERSION_WAIT, slots.acquire_owned()).await
    else {
        served
            .metrics
            .webhook_request(&policy, WEBHOOK, "failed", Some(started.elapsed()));
        let busy = kube::core::conversion::ConversionResponse::for_request(request).failure(
            kube::core::Status::failure(
                &format!(
                    "{MAX_REVIEWS_PER_TENANT} reviews of policy {policy}'s team were being answered for {CONVERSION_WAIT:?}: try again"
                ),
                "ConversionBusy",
            ),
        );
        return json_answer(&busy.into_review());
    };
    let (response, outcome) = super::conversion::answer(&converter, request).await;
    served
        .metrics
        .webhook_request(&policy, WEBHOOK, outcome, Some(started.elapsed()));
    json_answer(&response.into_review())
}

/// `answer` as the response body.
fn json_answer(answer: &impl serde::Serialize) -> Response {
    match serde_json::to_vec(answer) {
        Ok(body) => (
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the answer cannot be sent: {error}"),
        )
            .into_response(),
    }
}

async fn review(hook: Hook, served: &Served, policy: &str, body: &[u8]) -> Response {
    let Some(answerer) = served.answerers.get(policy) else {
        served
            .metrics
            .webhook_request(UNKNOWN_POLICY, hook.name(), "unserved", None);
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("this replica serves no webhooks of policy {policy} (yet)"),
        )
            .into_response();
    };
    let request = match serde_json::from_slice::<AdmissionReview<DynamicObject>>(body)
        .map_err(|e| e.to_string())
        .and_then(|review| {
            let request: Result<AdmissionRequest<DynamicObject>, _> = review.try_into();
            request.map_err(|_| "the review has no request".to_owned())
        }) {
        Ok(request) => request,
        Err(why) => {
            served
                .metrics
                .webhook_request(policy, hook.name(), "malformed", None);
            return (
                StatusCode::BAD_REQUEST,
                format!("not an AdmissionReview: {why}"),
            )
                .into_response();
        }
    };
    let started = std::time::Instant::now();
    let (response, outcome) = match served.answerers.admit(&answerer.tenant) {
        Some(_in_flight) => answer(hook, &answerer, &request).await,
        None => unanswered(
            hook,
            &answerer,
            &request,
            &format!(
                "{MAX_REVIEWS_PER_TENANT} reviews of this policy's team are being answered already"
            ),
        ),
    };
    served
        .metrics
        .webhook_request(policy, hook.name(), outcome, Some(started.elapsed()));
    json_answer(&response.into_review())
}

/// Serve the webhooks on `tcp`, presenting `certificate`, until `shutdown` completes.
pub async fn serve(
    tcp: tokio::net::TcpListener,
    certificate: &Arc<ServingCertificate>,
    answerers: Arc<Answerers>,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let tls = crate::server::tls::TlsListener::new(tcp, certificate.server_config())
        .context("serving webhooks over TLS")?;
    axum::serve(tls, router(answerers, metrics))
        .with_graceful_shutdown(shutdown)
        .await
        .context("serving webhooks over TLS")
}

/// The serving pair the listener presents, swapped in place when the pair is renewed: new
/// connections get the new one, connections already open keep theirs.
#[derive(Debug)]
pub struct ServingCertificate(ArcSwap<CertifiedKey>);

impl ServingCertificate {
    /// A listener's certificate, presenting `issued`.
    pub fn new(issued: &Issued) -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Self(ArcSwap::from_pointee(certified(issued)?))))
    }

    /// Present `issued` from now on.
    pub fn replace(&self, issued: &Issued) -> anyhow::Result<()> {
        self.0.store(Arc::new(certified(issued)?));
        Ok(())
    }

    /// The TLS settings of a listener that presents this certificate.
    pub fn server_config(self: &Arc<Self>) -> Arc<rustls::ServerConfig> {
        crate::server::tls::with_resolver(self.clone())
    }
}

impl ResolvesServerCert for ServingCertificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

fn certified(issued: &Issued) -> anyhow::Result<CertifiedKey> {
    crate::server::tls::certified_pem(issued.certificate.as_bytes(), issued.key.as_bytes())
}
