//! Webhook latency as the API server sees it: MyApps created one after another in three
//! namespaces, each judged by one validating webhook, on a fresh local control plane:
//!
//! - `no-op`: a bare HTTPS server that parses the review and allows it (TLS, HTTP and JSON:
//!   the floor any webhook pays);
//! - `host, no-op plugin`: the host's listener, a plugin whose validator allows everything
//!   (the host's path: routing, the plugin's sandbox, the answer);
//! - `host, MyApp`: the host's listener, MyApp's validator (its rules, on every create).
//!
//! Reported per webhook: the API server's own histogram
//! (`apiserver_admission_webhook_admission_duration_seconds`: p50 and p99, which its buckets
//! resolve to "≤ 5 ms" at best, and the share of calls under 5 ms, its first bucket), the host's own
//! (`wasmctrl_webhook_duration_seconds`), and each create's time at the client. The three are
//! interleaved create by create, so that they share the machine's state.
//!
//! Run with `cargo xtask bench webhooks` (`WASMCTRL_BENCH_CREATES`, default 500 per webhook).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use serde_json::json;
use wasmctrl::admission::certs::Certificates;
use wasmctrl::admission::configurations::{Configurations, Endpoint, Scope};
use wasmctrl::admission::review::{Answerer, FailurePolicy};
use wasmctrl::admission::server::{Answerers, ServingCertificate, serve};
use wasmctrl::metrics::Metrics;
use wasmctrl::plugin::{EngineOptions, Limits, PluginEngine};
use wasmctrl_e2e::{myapp, myapps};
use wasmctrl_testenv::cluster::admin_client;

wasmctrl::host_allocator!();

/// The webhooks measured: the configuration's policy path (and namespace), what it is.
const WEBHOOKS: [(&str, &str); 3] = [
    ("noop", "no-op"),
    ("plugin-noop", "host, no-op plugin"),
    ("myapp", "host, MyApp"),
];

fn main() -> std::process::ExitCode {
    wasmctrl_e2e::bench::main(|| {
        let creates = wasmctrl_e2e::bench::count_from_env("WASMCTRL_BENCH_CREATES", 500)?;
        wasmctrl_e2e::bench::on_fresh_control_plane("webhooks", |dir| async move {
            measure(&dir, creates).await
        })
    })
}

async fn measure(dir: &std::path::Path, creates: usize) -> anyhow::Result<String> {
    wasmctrl::ensure_crypto_provider();
    let client = admin_client(&dir.join("kubeconfig")).await?;
    wasmctrl_testenv::crds::install_repo_crds(&client).await?;
    for (name, _) in WEBHOOKS {
        let namespace: Namespace =
            serde_json::from_value(json!({"metadata": {"name": format!("bench-{name}")}}))?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &namespace)
            .await?;
    }
    let issued = Certificates::new(
        Api::<Secret>::namespaced(client.clone(), "default"),
        "webhook-bench",
        vec!["127.0.0.1".to_owned()],
    )
    .ensure()
    .await?;
    let certificate = ServingCertificate::new(&issued)?;
    let host_metrics = Arc::new(Metrics::new());
    let host_url = host_listener(&certificate, host_metrics.clone()).await?;
    let noop_url = noop_listener(&certificate).await?;
    let configurations = Configurations::new(client.clone(), "wasmctrl-bench");
    for (name, _) in WEBHOOKS {
        let scope = Scope {
            policy: name.to_owned(),
            group: "example.com".to_owned(),
            version: "v1".to_owned(),
            plural: "myapps".to_owned(),
            namespace: Some(format!("bench-{name}")),
            operations: vec!["CREATE".to_owned()],
            failure_policy: FailurePolicy::Fail,
            timeout_seconds: 5,
            exempt_users: Vec::new(),
        };
        let url = if name == "noop" { &noop_url } else { &host_url };
        configurations
            .reconcile(
                &scope,
                &Endpoint::Url(url.clone()),
                &issued.ca_bundle,
                true,
                false,
            )
            .await?;
    }
    // The configurations reach the API server's informer: MyApp's rule refuses a create.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let refused = myapps(&client, "bench-myapp")
            .create(
                &PostParams::default(),
                &serde_json::from_value(myapp("warm-up", 80, "nginx:1.27", None))?,
            )
            .await;
        if matches!(refused, Err(kube::Error::Api(ref s)) if s.code == 422) {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the webhook never judged: {refused:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = apiserver_metrics(&client).await?;
    let mut at_client: Vec<Vec<f64>> = vec![Vec::new(); WEBHOOKS.len()];
    for i in 0..creates {
        for (position, (name, _)) in WEBHOOKS.iter().enumerate() {
            let app: DynamicObject =
                serde_json::from_value(myapp(&format!("app-{i}"), 2, "nginx:1.27", None))?;
            let started = Instant::now();
            myapps(&client, &format!("bench-{name}"))
                .create(&PostParams::default(), &app)
                .await
                .with_context(|| format!("creating app-{i} for {name}"))?;
            at_client[position].push(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    let after = apiserver_metrics(&client).await?;
    let host_text = host_metrics.encode();
    let mut out = format!(
        "{creates} creates per webhook, interleaved; validating webhooks, failurePolicy Fail\n\n\
         | webhook | API server p50 | API server p99 | under 5 ms | host p50 | host p99 | create at the client p50 | p99 |\n\
         |---|---|---|---|---|---|---|---|\n"
    );
    for (position, (name, what)) in WEBHOOKS.iter().enumerate() {
        let webhook = format!("validate.{name}.webhooks.wasmctrl.dev");
        let seen = Histogram::from_text(
            &after,
            "apiserver_admission_webhook_admission_duration_seconds",
            &[("name", &webhook), ("operation", "CREATE")],
        )
        .minus(&Histogram::from_text(
            &before,
            "apiserver_admission_webhook_admission_duration_seconds",
            &[("name", &webhook), ("operation", "CREATE")],
        ));
        let host = (*name != "noop").then(|| {
            Histogram::from_text(
                &host_text,
                "wasmctrl_webhook_duration_seconds",
                &[("policy", name)],
            )
        });
        let mut client_ms = at_client[position].clone();
        client_ms.sort_by(f64::total_cmp);
        let ms = |q: Option<f64>| q.map_or("-".to_owned(), |s| format!("{:.2} ms", s * 1e3));
        // The API server's first bucket is 5 ms: a quantile inside it says no more than that.
        let coarse = |q: Option<f64>| match q {
            Some(s) if s <= seen.first_bound() => format!("≤ {:.0} ms", seen.first_bound() * 1e3),
            other => ms(other),
        };
        out.push_str(&format!(
            "| {what} | {} | {} | {:.1} % | {} | {} | {:.2} ms | {:.2} ms |\n",
            coarse(seen.quantile(0.5)),
            coarse(seen.quantile(0.99)),
            seen.share_under(0.005) * 100.0,
            ms(host.as_ref().and_then(|h| h.quantile(0.5))),
            ms(host.as_ref().and_then(|h| h.quantile(0.99))),
            percentile(&client_ms, 0.5),
            percentile(&client_ms, 0.99),
        ));
    }
    Ok(out)
}

/// The host's webhook listener, answering `plugin-noop` and `myapp`.
async fn host_listener(
    certificate: &Arc<ServingCertificate>,
    metrics: Arc<Metrics>,
) -> anyhow::Result<String> {
    let engine = PluginEngine::new(EngineOptions::default())?;
    let load = |name: &str| -> anyhow::Result<wasmctrl::plugin::Plugin> {
        let bytes = std::fs::read(wasmctrl_testenv::plugins::guest(name))?;
        Ok(engine.load(&bytes, None, Limits::default())?)
    };
    let answerers = Answerers::new();
    answerers.serve(
        "plugin-noop",
        Answerer::with_plugin(
            "plugin-noop",
            load("misbehave_plugin")?,
            Some("{}".to_owned()),
            "bench",
            FailurePolicy::Fail,
        ),
    );
    answerers.serve(
        "myapp",
        Answerer::with_plugin(
            "myapp",
            load("myapp_plugin")?,
            Some("{}".to_owned()),
            "bench",
            FailurePolicy::Fail,
        ),
    );
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("https://{}", tcp.local_addr()?);
    let certificate = certificate.clone();
    tokio::spawn(async move {
        if let Err(error) = serve(
            tcp,
            &certificate,
            answerers,
            metrics,
            std::future::pending(),
        )
        .await
        {
            eprintln!("the host's listener stopped: {error:#}");
        }
    });
    Ok(url)
}

/// A webhook that allows every write, with nothing between the review and the answer.
async fn noop_listener(certificate: &Arc<ServingCertificate>) -> anyhow::Result<String> {
    async fn allow(body: axum::body::Bytes) -> axum::response::Response {
        use axum::response::IntoResponse as _;
        let Ok(review) = serde_json::from_slice::<AdmissionReview<DynamicObject>>(&body) else {
            return axum::http::StatusCode::BAD_REQUEST.into_response();
        };
        let request: Result<AdmissionRequest<DynamicObject>, _> = review.try_into();
        let Ok(request) = request else {
            return axum::http::StatusCode::BAD_REQUEST.into_response();
        };
        axum::Json(AdmissionResponse::from(&request).into_review()).into_response()
    }
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("https://{}", tcp.local_addr()?);
    let tls = wasmctrl::server::tls::TlsListener::new(tcp, certificate.server_config())?;
    let router = axum::Router::new().route("/validate/{*policy}", axum::routing::post(allow));
    tokio::spawn(async move {
        if let Err(error) = axum::serve(tls, router).await {
            eprintln!("the no-op listener stopped: {error:#}");
        }
    });
    Ok(url)
}

async fn apiserver_metrics(client: &kube::Client) -> anyhow::Result<String> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    Ok(client.request_text(request).await?)
}

/// A Prometheus histogram's cumulative buckets (upper bound, count), as text exposes them.
struct Histogram(Vec<(f64, f64)>);

impl Histogram {
    /// The buckets of `name` whose labels include every one of `labels`, summed over the rest.
    fn from_text(text: &str, name: &str, labels: &[(&str, &str)]) -> Self {
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(&format!("{name}_bucket{{")) else {
                continue;
            };
            let Some((label_text, value)) = rest.rsplit_once("} ") else {
                continue;
            };
            if !labels
                .iter()
                .all(|(k, v)| label_text.contains(&format!("{k}=\"{v}\"")))
            {
                continue;
            }
            let Some(le) = label_text
                .split(',')
                .find_map(|l| l.strip_prefix("le=\""))
                .map(|l| l.trim_end_matches('"'))
            else {
                continue;
            };
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::NAN)
            };
            let count: f64 = value.trim().parse().unwrap_or(0.0);
            match buckets.iter_mut().find(|(bound, _)| *bound == le) {
                Some((_, total)) => *total += count,
                None => buckets.push((le, count)),
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Self(buckets)
    }

    fn minus(mut self, earlier: &Self) -> Self {
        for (bound, count) in &mut self.0 {
            if let Some((_, before)) = earlier.0.iter().find(|(b, _)| b == bound) {
                *count -= before;
            }
        }
        self
    }

    /// The first bucket's upper bound.
    fn first_bound(&self) -> f64 {
        self.0.first().map_or(f64::INFINITY, |(bound, _)| *bound)
    }

    fn total(&self) -> f64 {
        self.0.last().map_or(0.0, |(_, count)| *count)
    }

    /// As Prometheus' `histogram_quantile`: linear within the bucket the rank falls in.
    fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.total();
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(bound, count) in &self.0 {
            if count >= rank {
                if bound.is_infinite() {
                    return Some(lower.0);
                }
                let within = (rank - lower.1) / (count - lower.1).max(f64::MIN_POSITIVE);
                return Some(lower.0 + (bound - lower.0) * within);
            }
            lower = (bound, count);
        }
        None
    }

    /// The share of observations at or under `bound` (a bucket's bound).
    fn share_under(&self, bound: f64) -> f64 {
        let total = self.total();
        let under = self
            .0
            .iter()
            .find(|(b, _)| (*b - bound).abs() < 1e-12)
            .map_or(0.0, |(_, count)| *count);
        if total > 0.0 { under / total } else { 0.0 }
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}
