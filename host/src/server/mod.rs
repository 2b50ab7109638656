//! The host's one listener, served on every replica, leader or not:
//!
//! - `/healthz`: the process is alive;
//! - `/readyz`: see [`Readiness`];
//! - `/metrics`: Prometheus, OpenMetrics text;
//! - `/explain?kind=K&namespace=NS&name=N&history=H`: the parent's recent reconcile records
//!   as JSON, newest first (see [`crate::explain`]). A standby has no records: it
//!   reconciles nothing.
//!
//! By default the listener speaks TLS and `/metrics` and `/explain` answer only a caller
//! whose bearer token the API server accepts and whose own rights cover what is asked (see
//! [`access`]); `/healthz` and `/readyz` stay open for the kubelet. `--insecure-listen`
//! serves plain HTTP to anyone, for a host run on a developer's machine.
//!
//! The token comes in `Authorization: Bearer …`, or in `X-Wasmctrl-Authorization` with the
//! same value: the API server's pod proxy, which `wasmctrl explain` goes through, removes
//! `Authorization` after checking it, and forwards other headers as they are.

pub mod access;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use axum::Router;
use axum::extract::{ConnectInfo, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::explain::{Explain, Lookup};
use crate::health::Readiness;
use crate::metrics::Metrics;
use access::{Caller, Needs, Reviewer};

/// The header `wasmctrl explain` carries the caller's token in through the pod proxy.
pub const FORWARDED_AUTHORIZATION: &str = "x-wasmctrl-authorization";

/// What the listener serves.
#[derive(Clone)]
pub struct Endpoints {
    /// For `/readyz`.
    pub readiness: Arc<Readiness>,
    /// For `/metrics`.
    pub metrics: Arc<Metrics>,
    /// For `/explain`.
    pub explain: Arc<Explain>,
    /// Who may read `/metrics` and `/explain`, and over what.
    pub access: Access,
}

/// Who may read `/metrics` and `/explain`.
#[derive(Clone)]
pub enum Access {
    /// Anyone who reaches the port, over plain HTTP (`--insecure-listen`).
    Open,
    /// Over TLS, callers the API server vouches for, each for what its own rights allow.
    Reviewed {
        /// Asks the API server who a caller is and what it may do.
        reviewer: Arc<Reviewer>,
        /// The listener's TLS.
        tls: Arc<rustls::ServerConfig>,
    },
}

/// Bind `address`; a clear error if it is taken.
pub async fn bind(address: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("listening on {address} for health, metrics and explain"))
}

/// Serve until `shutdown` completes: plain HTTP when access is open, TLS otherwise.
pub async fn serve(
    listener: tokio::net::TcpListener,
    endpoints: Endpoints,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    match endpoints.access.clone() {
        Access::Open => axum::serve(listener, with_peers(router(endpoints)))
            .with_graceful_shutdown(shutdown)
            .await
            .context("serving health, metrics and explain"),
        Access::Reviewed { tls, .. } => {
            let listener = tls::TlsListener::new(listener, tls)
                .context("serving health, metrics and explain over TLS")?;
            axum::serve(listener, with_peers(router(endpoints)))
                .with_graceful_shutdown(shutdown)
                .await
                .context("serving health, metrics and explain over TLS")
        }
    }
}

/// The address a request came from, for the per-client bound on token reviews.
#[derive(Debug, Clone, Copy)]
struct Peer(SocketAddr);

impl
    axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, tokio::net::TcpListener>>
    for Peer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        Self(*stream.remote_addr())
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, tls::TlsListener>>
    for Peer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, tls::TlsListener>) -> Self {
        Self(*stream.remote_addr())
    }
}

/// `router` with each request's client address.
fn with_peers(
    router: Router,
) -> axum::extract::connect_info::IntoMakeServiceWithConnectInfo<Router, Peer> {
    router.into_make_service_with_connect_info::<Peer>()
}

fn router(endpoints: Endpoints) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/explain", get(explain))
        .with_state(endpoints)
}

/// Why a request is not answered.
enum Refusal {
    /// No token, or one the API server does not accept.
    Unauthenticated(&'static str),
    /// The caller may not do what the request needs.
    Forbidden(String),
    /// The API server could not be asked.
    Unavailable(String),
    /// The client has too many tokens under review; it may try again in a second.
    TooMany(String),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Self::Unauthenticated(why) => (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer realm=\"wasmctrl\"")],
                why,
            )
                .into_response(),
            Self::Forbidden(why) => (StatusCode::FORBIDDEN, why).into_response(),
            Self::Unavailable(why) => (StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
            Self::TooMany(why) => (
                StatusCode::TOO_MANY_REQUESTS,
                [(header::RETRY_AFTER, "1")],
                why,
            )
                .into_response(),
        }
    }
}

/// Who is asking, or why the request goes unanswered; `None` when access is open.
async fn caller(
    access: &Access,
    headers: &HeaderMap,
    peer: SocketAddr,
) -> Result<Option<Caller>, Refusal> {
    let Access::Reviewed { reviewer, .. } = access else {
        return Ok(None);
    };
    let token = [header::AUTHORIZATION.as_str(), FORWARDED_AUTHORIZATION]
        .iter()
        .find_map(|name| headers.get(*name))
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|token| !token.is_empty())
        .ok_or(Refusal::Unauthenticated(
            "a bearer token is required (Authorization: Bearer TOKEN)",
        ))?;
    match reviewer.caller(token, peer.ip()).await {
        Ok(Some(caller)) => Ok(Some(caller)),
        Ok(None) => Err(Refusal::Unauthenticated(
            "the API server does not accept this token",
        )),
        Err(busy @ access::ReviewError::ClientBusy(_)) => Err(Refusal::TooMany(busy.to_string())),
        Err(error) => {
            // The caller is not known yet: the cause goes to the log, not to them.
            tracing::warn!(%error, "cannot review a caller's token");
            Err(Refusal::Unavailable(
                "cannot check the caller's token with the API server now; try again".to_owned(),
            ))
        }
    }
}

/// Refuse unless `caller` (when access is reviewed) may do what `needs` names.
async fn authorize(access: &Access, caller: Option<&Caller>, needs: Needs) -> Result<(), Refusal> {
    let (reviewer, caller) = match (access, caller) {
        (Access::Open, _) => return Ok(()),
        (Access::Reviewed { reviewer, .. }, Some(caller)) => (reviewer, caller),
        // Reviewed access never grants a caller nobody vouched for.
        (Access::Reviewed { .. }, None) => {
            return Err(Refusal::Unauthenticated("a bearer token is required"));
        }
    };
    match reviewer.allows(caller, &needs).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(Refusal::Forbidden(format!(
            "{} may not {needs}",
            caller.username
        ))),
        Err(error) => {
            tracing::warn!(%error, "cannot review a caller's access");
            Err(Refusal::Unavailable(format!(
                "cannot check the caller's access with the API server: {error}"
            )))
        }
    }
}

async fn readyz(State(endpoints): State<Endpoints>) -> impl IntoResponse {
    match endpoints.readiness.not_ready() {
        None => (StatusCode::OK, "ok".to_owned()),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
    }
}

async fn metrics_text(
    State(endpoints): State<Endpoints>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    headers: HeaderMap,
) -> Response {
    let access = &endpoints.access;
    let checked = match caller(access, &headers, peer).await {
        Ok(caller) => authorize(access, caller.as_ref(), Needs::Path("/metrics")).await,
        Err(refusal) => Err(refusal),
    };
    if let Err(refusal) = checked {
        return refusal.into_response();
    }
    let store = &endpoints.explain.store;
    endpoints
        .metrics
        .set_explain_store(store.bytes(), store.len());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        endpoints.metrics.encode(),
    )
        .into_response()
}

/// Which parent `/explain` is asked about.
#[derive(Debug, serde::Deserialize)]
struct ExplainQuery {
    kind: String,
    namespace: Option<String>,
    name: String,
    #[serde(default = "one")]
    history: usize,
}

fn one() -> usize {
    1
}

/// The records of one parent, for a caller who may `get` that parent.
async fn explain(
    State(endpoints): State<Endpoints>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    headers: HeaderMap,
    Query(query): Query<ExplainQuery>,
) -> Response {
    let access = &endpoints.access;
    let caller = match caller(access, &headers, peer).await {
        Ok(caller) => caller,
        Err(refusal) => return refusal.into_response(),
    };
    let namespace = query.namespace.as_deref().filter(|ns| !ns.is_empty());
    let store = &endpoints.explain.store;
    // Whether the host holds a record of a parent is itself something of that parent: the
    // caller's rights are checked on every kind its words name before anything is looked
    // up, and the records of kinds it may not see are not looked in. A caller who may see
    // none is refused the same way whatever the store holds.
    let mut readable = Vec::new();
    let mut refused = None;
    for kind in store.kinds_named(&query.kind) {
        let needs = Needs::Get {
            group: kind.group.clone(),
            resource: kind.resource.clone(),
            namespace: namespace.map(str::to_owned),
            name: query.name.clone(),
        };
        match authorize(access, caller.as_ref(), needs).await {
            Ok(()) => readable.push(kind),
            Err(refusal) => {
                refused.get_or_insert(refusal);
            }
        }
    }
    if readable.is_empty()
        && let Some(refusal) = refused
    {
        return refusal.into_response();
    }
    match store.lookup(&query.kind, namespace, &query.name, query.history, &readable) {
        Lookup::Found { records } => (
            [(header::CONTENT_TYPE, "application/json")],
            format!("{{\"records\":[{}]}}", records.join(",")),
        )
            .into_response(),
        Lookup::NotFound => (
            StatusCode::NOT_FOUND,
            format!(
                "this host has no record of {} {}{}: no policy it runs has reconciled it since it started, or its records were evicted (--explain-memory-mib), or this replica is a standby",
                query.kind,
                namespace.map(|ns| format!("{ns}/")).unwrap_or_default(),
                query.name
            ),
        )
            .into_response(),
        Lookup::Ambiguous(kinds) => (
            StatusCode::BAD_REQUEST,
            format!(
                "{} names more than one kind with a parent {}: say which, one of {}",
                query.kind,
                query.name,
                kinds
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
            .into_response(),
    }
}
