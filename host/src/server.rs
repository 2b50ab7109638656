//! The host's one HTTP listener: `/healthz` (the process is alive), `/readyz` (see
//! [`Readiness`]) and `/metrics` (Prometheus, OpenMetrics text). Served on every replica,
//! leader or not, so a standby's readiness and metrics are visible too.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::health::Readiness;
use crate::metrics::Metrics;

#[derive(Clone)]
struct Shared {
    readiness: Arc<Readiness>,
    metrics: Arc<Metrics>,
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
    readiness: Arc<Readiness>,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(Shared { readiness, metrics });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .context("serving health and metrics")
}

async fn readyz(State(shared): State<Shared>) -> impl IntoResponse {
    match shared.readiness.not_ready() {
        None => (StatusCode::OK, "ok".to_owned()),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
    }
}

async fn metrics_text(State(shared): State<Shared>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        shared.metrics.encode(),
    )
}
