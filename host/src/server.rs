//! The host's one HTTP listener, served on every replica, leader or not:
//!
//! - `/healthz`: the process is alive;
//! - `/readyz`: see [`Readiness`];
//! - `/metrics`: Prometheus, OpenMetrics text;
//! - `/explain?kind=K&namespace=NS&name=N&history=H`: the parent's recent reconcile records
//!   as JSON, newest first (see [`crate::explain`]). In a cluster, `wasmctrl explain` reaches
//!   it through the API server's service proxy, so reading a record takes the same
//!   permission as reading the host's Service; no new port is opened. A standby has no
//!   records: it reconciles nothing.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::explain::{Explain, Lookup};
use crate::health::Readiness;
use crate::metrics::Metrics;

/// What the listener serves.
#[derive(Clone)]
pub struct Endpoints {
    /// For `/readyz`.
    pub readiness: Arc<Readiness>,
    /// For `/metrics`.
    pub metrics: Arc<Metrics>,
    /// For `/explain`.
    pub explain: Arc<Explain>,
}

/// Bind `address`; a clear error if it is taken.
pub async fn bind(address: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("listening on {address} for health and metrics (--listen)"))
}

/// Serve until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    endpoints: Endpoints,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    axum::serve(listener, router(endpoints))
        .with_graceful_shutdown(shutdown)
        .await
        .context("serving health and metrics")
}

fn router(endpoints: Endpoints) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/explain", get(explain))
        .with_state(endpoints)
}

async fn readyz(State(endpoints): State<Endpoints>) -> impl IntoResponse {
    match endpoints.readiness.not_ready() {
        None => (StatusCode::OK, "ok".to_owned()),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
    }
}

async fn metrics_text(State(endpoints): State<Endpoints>) -> impl IntoResponse {
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

async fn explain(
    State(endpoints): State<Endpoints>,
    Query(query): Query<ExplainQuery>,
) -> Response {
    let namespace = query.namespace.as_deref().filter(|ns| !ns.is_empty());
    let lookup = endpoints
        .explain
        .store
        .lookup(&query.kind, namespace, &query.name, query.history);
    match lookup {
        Lookup::Found(records) => (
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
                kinds.join(", ")
            ),
        )
            .into_response(),
    }
}
