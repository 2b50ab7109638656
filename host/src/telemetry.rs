//! Logs and traces.
//!
//! Logs go to stderr through `tracing`, filtered by `WASMCTRL_LOG` (default `info`). Traces
//! are off unless the standard OpenTelemetry variable `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) names a collector. Then every reconcile is a span
//! (policy, parent) with its steps as child spans (`caches`, `finalizer`, `request`, `plugin`,
//! `validate`, `apply`, `prune`, `status`, `events`), exported over OTLP/HTTP in batches from a thread of their
//! own, whatever `WASMCTRL_LOG` says. `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_BSP_*` work as the OpenTelemetry SDK documents them.

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

/// The variables that turn trace export on.
const ENDPOINT_VARIABLES: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// What [`init`] set up; [`Telemetry::shutdown`] flushes the spans not yet exported.
#[must_use = "shut it down at exit, or the last spans are lost"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Export what is left and stop the exporter.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(error) = provider.shutdown()
        {
            eprintln!("warning: exporting the last traces: {error}");
        }
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One line of text per event; coloured only when stderr is a terminal, so `kubectl
    /// logs` and log files carry no escape sequences.
    #[default]
    Text,
    /// One JSON object per event, for a cluster's log pipeline.
    Json,
}

/// Install the process's `tracing` subscriber: logs to stderr in `format`, and traces to an
/// OTLP collector when one is configured. Fails if a subscriber is already installed.
pub fn init(format: LogFormat) -> anyhow::Result<Telemetry> {
    use std::io::IsTerminal as _;
    let filter = EnvFilter::try_from_env("WASMCTRL_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    let provider = exporting()
        .then(|| -> anyhow::Result<SdkTracerProvider> {
            // The exporter's HTTP client has no TLS provider of its own; the host's is ring.
            let _ = rustls::crypto::ring::default_provider().install_default();
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .build()
                .context("configuring the OTLP trace exporter (OTEL_EXPORTER_OTLP_*)")?;
            let resource = opentelemetry_sdk::Resource::builder()
                .with_service_name("wasmctrl")
                .build();
            Ok(SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource)
                .build())
        })
        .transpose()?;
    let traces = provider.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("wasmctrl"))
            .with_filter(
                Targets::new()
                    .with_target("wasmctrl", LevelFilter::INFO)
                    .with_default(LevelFilter::OFF),
            )
    });
    tracing_subscriber::registry()
        .with(logs)
        .with(traces)
        .try_init()
        .context("installing the tracing subscriber")?;
    Ok(Telemetry { provider })
}

/// Whether a collector is configured.
fn exporting() -> bool {
    ENDPOINT_VARIABLES
        .iter()
        .any(|name| std::env::var(name).is_ok_and(|value| !value.trim().is_empty()))
}
