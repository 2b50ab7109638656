//! `wasmctrl explain KIND/NAME`: why a parent looks the way it does, from the records the
//! host kept of its last reconciles (see [`crate::explain`]).
//!
//! The records live in the host's memory and are served on its listener at `/explain`. A
//! host run locally is asked directly (`--host`); a host deployed in a cluster is reached
//! through the API server's pod proxy, replica by replica (the pods behind its Service), so
//! the leader's records are found whichever replica a Service would have picked.
//!
//! The host answers only a caller who may `get` the parent, and it must see who that is: the
//! pod proxy keeps the caller's `Authorization` for itself, so the command sends the bearer
//! token of the kubeconfig's user again in `X-Wasmctrl-Authorization`, for the host to
//! review with the API server, and only over TLS. Reaching the pods takes `get` on
//! `pods/proxy` (and reading the Service and listing its pods) in the host's namespace: the
//! chart's explain-reader role. The token reaches whichever pods the host's Service selects,
//! so the host's namespace is trusted as the host is (whoever may create pods there may
//! already run them as the host's ServiceAccount).

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context as _, bail};
use clap::{Args, ValueEnum};
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};

use crate::explain::{ChildAction, Explained, Record, WebhookRecord};

/// Show a parent's last reconciles: what the plugin was asked and decided, what was written,
/// and how long each step took.
#[derive(Debug, Args)]
pub struct ExplainCommand {
    /// The parent as KIND/NAME; the kind as `kubectl` takes it (`myapp`, `myapps`,
    /// `myapps.example.com`).
    parent: String,
    /// The parent's namespace (default: the kubeconfig context's; `default` with `--host`).
    #[arg(short, long)]
    namespace: Option<String>,
    /// Show up to this many reconciles, newest first.
    #[arg(long, default_value_t = 1)]
    history: usize,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = ExplainFormat::Text)]
    output: ExplainFormat,
    /// Write the newest reconcile's request and answer to this file as a case for
    /// `wasmctrl plugin run --case` and `wasmctrl plugin replay`.
    #[arg(long, value_name = "CASE.yaml")]
    save: Option<PathBuf>,
    /// The host's listener, for a host run locally (`http://127.0.0.1:8080` with
    /// `--insecure-listen`, or `https://…`, asked with the kubeconfig user's token). Without
    /// it, the host deployed in the cluster is asked through the API server.
    #[arg(long, env = "WASMCTRL_HOST_URL")]
    host: Option<url::Url>,
    /// With `--host https://…`: accept the listener's certificate without checking it (the
    /// host makes a self-signed one unless given its own).
    #[arg(long)]
    insecure_skip_tls_verify: bool,
    /// The deployed host's Service, NAMESPACE/NAME: its pods are asked, over TLS when the
    /// Service's port is named `https` or has `appProtocol: https`.
    #[arg(long, default_value = "wasmctrl/wasmctrl-metrics")]
    service: String,
    /// Kubeconfig to use (default: `KUBECONFIG`, `~/.kube/config` or in-cluster).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Kubeconfig context.
    #[arg(long)]
    context: Option<String>,
}

/// Output formats of `explain`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ExplainFormat {
    /// For people.
    Text,
    /// The records as YAML.
    Yaml,
    /// The records as JSON.
    Json,
}

#[derive(serde::Deserialize)]
struct Records {
    records: Vec<Explained>,
}

impl ExplainCommand {
    /// Run the command: print, and save if asked.
    pub async fn run(self) -> anyhow::Result<()> {
        print!("{}", self.render().await?);
        Ok(())
    }

    /// What the command prints (and the case it saves, if asked).
    pub async fn render(&self) -> anyhow::Result<String> {
        let (kind, name) = self
            .parent
            .split_once('/')
            .filter(|(k, n)| !k.is_empty() && !n.is_empty())
            .with_context(|| format!("{:?} is not KIND/NAME (e.g. myapp/web)", self.parent))?;
        let query = |namespace: &str| {
            url::form_urlencoded::Serializer::new(String::new())
                .append_pair("kind", kind)
                .append_pair("namespace", namespace)
                .append_pair("name", name)
                .append_pair("history", &self.history.to_string())
                .finish()
        };
        let parent = format!("{kind}/{name}");
        let records = match &self.host {
            Some(host) => {
                let namespace = self.namespace.as_deref().unwrap_or("default");
                let mut url = host.join("explain").context("--host")?;
                url.set_query(Some(&query(namespace)));
                // A local host with `--insecure-listen` wants no token; one that checks
                // callers takes the kubeconfig user's, when there is a kubeconfig.
                let token = match url.scheme() {
                    "https" => match self.config().await {
                        Ok(config) => bearer(&config).await?,
                        Err(_) => None,
                    },
                    _ => None,
                };
                let answer = direct(&url, token, self.insecure_skip_tls_verify).await?;
                records_from(answer, &parent)?
            }
            None => {
                let config = self.config().await?;
                let token = bearer(&config).await?;
                let client = Client::try_from(config).context("building the Kubernetes client")?;
                let namespace = self
                    .namespace
                    .clone()
                    .unwrap_or_else(|| client.default_namespace().to_owned());
                let ask = Ask {
                    query: query(&namespace),
                    parent: &parent,
                    history: self.history,
                    token: token.as_ref(),
                };
                through_api_server(&client, &self.service, &ask).await?
            }
        };
        if let Some(path) = &self.save {
            let newest_reconcile = records.iter().find_map(|r| match r {
                Explained::Reconcile(record) => Some(record),
                Explained::Webhook(_) => None,
            });
            let case = newest_reconcile.and_then(|r| r.case.as_ref()).context(
                "the last reconcile did not call the plugin, so there is no case to save",
            )?;
            std::fs::write(path, case.to_yaml()?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(match self.output {
            ExplainFormat::Text => records
                .iter()
                .map(|record| match record {
                    Explained::Reconcile(record) => text(record),
                    Explained::Webhook(record) => webhook_text(record),
                })
                .collect::<Vec<_>>()
                .join("\n"),
            ExplainFormat::Yaml => crate::yaml::to_string(&records)?,
            ExplainFormat::Json => serde_json::to_string_pretty(&records)? + "\n",
        })
    }

    async fn config(&self) -> anyhow::Result<kube::Config> {
        let options = KubeConfigOptions {
            context: self.context.clone(),
            ..KubeConfigOptions::default()
        };
        let config = match &self.kubeconfig {
            Some(path) => {
                let kubeconfig = Kubeconfig::read_from(path)
                    .with_context(|| format!("reading kubeconfig {}", path.display()))?;
                kube::Config::from_custom_kubeconfig(kubeconfig, &options).await?
            }
            None if self.context.is_some() => kube::Config::from_kubeconfig(&options).await?,
            None => kube::Config::infer().await?,
        };
        Ok(config)
    }
}

/// The `Authorization: Bearer …` value the kubeconfig's user sends the API server (a static
/// token, a token file, or one an exec plugin or OIDC refresh yields), through kube's own
/// auth layer; `None` for a user who authenticates otherwise (a client certificate).
async fn bearer(config: &kube::Config) -> anyhow::Result<Option<http::HeaderValue>> {
    use kube::client::ConfigExt as _;
    use tower::{Layer as _, ServiceExt as _};
    let Some(layer) = config
        .auth_layer()
        .context("reading the kubeconfig's credentials")?
    else {
        return Ok(None);
    };
    // The layer wraps a service; this one sends nothing and hands back the header it was given.
    let capture = tower::service_fn(|request: http::Request<kube::client::Body>| async move {
        let header = request.headers().get(http::header::AUTHORIZATION).cloned();
        Ok::<_, tower::BoxError>(http::Response::new(header))
    });
    let header = layer
        .layer(capture)
        .oneshot(http::Request::new(kube::client::Body::empty()))
        .await
        .map_err(|error| anyhow::anyhow!("getting the kubeconfig user's token: {error}"))?
        .into_body();
    Ok(header.filter(|value| value.as_bytes().starts_with(b"Bearer ")))
}

/// What to ask each replica, and for whom.
struct Ask<'a> {
    query: String,
    parent: &'a str,
    history: usize,
    token: Option<&'a http::HeaderValue>,
}

/// One answer of a host: its status code and body.
struct Answer {
    status: u16,
    body: String,
}

async fn direct(
    url: &url::Url,
    token: Option<http::HeaderValue>,
    insecure: bool,
) -> anyhow::Result<Answer> {
    crate::ensure_crypto_provider();
    let client = reqwest::Client::builder()
        .danger_accept_invalid_certs(insecure)
        .build()
        .context("building the HTTP client")?;
    let mut request = client.get(url.clone());
    if let Some(token) = token {
        request = request.header(http::header::AUTHORIZATION, token);
    }
    let response = request
        .send()
        .await
        .with_context(|| format!("asking the host at {url}"))?;
    Ok(Answer {
        status: response.status().as_u16(),
        body: response.text().await?,
    })
}

/// The records in a host's answer; its message when it has none.
fn records_from(answer: Answer, parent: &str) -> anyhow::Result<Vec<Explained>> {
    match answer.status {
        200 => Ok(serde_json::from_str::<Records>(&answer.body)
            .context("the host's answer is not a list of records")?
            .records),
        401 => bail!(
            "{parent}: {} (the host reviews the kubeconfig user's bearer token; a user who \
             signs in with a client certificate has none to send: use a context with a token, \
             e.g. from your cluster's OIDC or exec login, or `kubectl create token`)",
            answer.body.trim()
        ),
        _ => bail!("{parent}: {}", answer.body.trim()),
    }
}

/// Ask every running pod of the host's Service through the API server's pod proxy; the
/// newest records win (the leader's; after a failover, both replicas may have some).
async fn through_api_server(
    client: &Client,
    service: &str,
    ask: &Ask<'_>,
) -> anyhow::Result<Vec<Explained>> {
    let Ask {
        query,
        parent,
        history,
        token,
    } = ask;
    let (service_namespace, service_name) = service
        .split_once('/')
        .with_context(|| format!("--service {service:?} is not NAMESPACE/NAME"))?;
    let found = Api::<Service>::namespaced(client.clone(), service_namespace)
        .get(service_name)
        .await
        .with_context(|| format!("reading the host's Service {service} (--service)"))?;
    let spec = found.spec.unwrap_or_default();
    let selector = spec
        .selector
        .filter(|s| !s.is_empty())
        .with_context(|| format!("Service {service} selects no pods"))?;
    // The pod proxy takes a port number: a named target port is resolved per pod.
    let service_port = spec
        .ports
        .unwrap_or_default()
        .into_iter()
        .next()
        .with_context(|| format!("Service {service} has no port"))?;
    let port = service_port
        .target_port
        .clone()
        .unwrap_or(IntOrString::Int(service_port.port));
    let scheme = if service_port.name.as_deref() == Some("https")
        || service_port.app_protocol.as_deref() == Some("https")
    {
        "https:"
    } else {
        ""
    };
    let labels = selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let pods = Api::<Pod>::namespaced(client.clone(), service_namespace)
        .list(&ListParams::default().labels(&labels))
        .await
        .with_context(|| format!("listing the pods of Service {service}"))?;
    let mut records = Vec::new();
    let mut refusals = Vec::new();
    for pod in pods
        .items
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
    {
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let Some(port) = pod_port(pod, &port) else {
            refusals.push(format!("{pod_name}: no container port named {port:?}"));
            continue;
        };
        let uri = format!(
            "/api/v1/namespaces/{service_namespace}/pods/{scheme}{pod_name}:{port}/proxy/explain?{query}"
        );
        let mut request = http::Request::get(&uri).body(kube::client::Body::empty())?;
        // The token goes only over TLS: a port in clear text is a host that checks no one.
        if let Some(token) = token.filter(|_| !scheme.is_empty()) {
            request.headers_mut().insert(
                http::HeaderName::from_static(crate::server::FORWARDED_AUTHORIZATION),
                (*token).clone(),
            );
        }
        let response = client
            .send(request)
            .await
            .with_context(|| format!("asking pod {pod_name} through the API server"))?;
        let status = response.status().as_u16();
        let body =
            String::from_utf8_lossy(&response.into_body().collect_bytes().await?).into_owned();
        match records_from(Answer { status, body }, parent) {
            Ok(found) => records.extend(found),
            Err(why) => refusals.push(format!("{pod_name}: {why:#}")),
        }
    }
    if records.is_empty() {
        if refusals.is_empty() {
            bail!("no running pod behind Service {service} to ask");
        }
        bail!(
            "no replica of the host has a record:\n  {}",
            refusals.join("\n  ")
        );
    }
    records.sort_by(|a, b| b.at().cmp(a.at()));
    records.truncate((*history).max(1));
    Ok(records)
}

/// The number of `port` on `pod`: itself, or the container port of that name.
fn pod_port(pod: &Pod, port: &IntOrString) -> Option<i32> {
    match port {
        IntOrString::Int(number) => Some(*number),
        IntOrString::String(name) => pod
            .spec
            .as_ref()?
            .containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| p.container_port),
    }
}

/// `Kind namespace/name`, as a record's first line names its object.
fn parent_named(parent: &crate::explain::ParentRef) -> String {
    match &parent.namespace {
        Some(ns) => format!("{} {ns}/{}", parent.kind, parent.name),
        None => format!("{} {}", parent.kind, parent.name),
    }
}

/// A webhook answer for people.
fn webhook_text(record: &WebhookRecord) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} {} answered by policy {}'s {} webhook at {}",
        parent_named(&record.parent),
        record.operation,
        if record.user.is_empty() {
            String::new()
        } else {
            format!("by {}", record.user)
        },
        record.policy,
        record.webhook,
        record.at
    );
    let _ = writeln!(
        out,
        "  outcome: {} in {:.1} ms",
        record.outcome, record.duration_ms
    );
    if let Some(plugin) = &record.plugin {
        let _ = writeln!(out, "  plugin:  {plugin}");
    }
    if let Some(conversion) = &record.conversion {
        let _ = writeln!(out, "  versions: {conversion}");
    }
    if let Some(message) = &record.message {
        let _ = writeln!(out, "  message: {message}");
    }
    for violation in &record.violations {
        let _ = writeln!(out, "  violation: {violation}");
    }
    for warning in &record.warnings {
        let _ = writeln!(out, "  warning: {warning}");
    }
    if !record.defaulted.is_empty() {
        let _ = writeln!(out, "  defaulted: {}", record.defaulted.join(", "));
    }
    out
}

/// A record for people.
fn text(record: &Record) -> String {
    let mut out = String::new();
    let parent = &record.parent;
    let _ = writeln!(
        out,
        "{} (generation {}) reconciled by policy {} at {}",
        parent_named(parent),
        parent.generation.map_or("-".to_owned(), |g| g.to_string()),
        record.policy,
        record.at
    );
    let _ = writeln!(
        out,
        "  result:  {:?} in {:.1} ms",
        record.result, record.duration_ms
    );
    if let Some(plugin) = &record.plugin {
        let _ = writeln!(out, "  plugin:  {plugin}");
    }
    let steps: Vec<_> = record
        .steps
        .iter()
        .map(|s| format!("{} {:.1}", s.step, s.ms))
        .collect();
    let _ = writeln!(out, "  steps (ms): {}", steps.join(", "));
    if let Some(error) = &record.error {
        let _ = writeln!(out, "  error:   {}: {}", error.reason, error.message);
    }
    if !record.children.is_empty() {
        let _ = writeln!(out, "  children:");
        for child in &record.children {
            let action = match child.action {
                ChildAction::Created => "created",
                ChildAction::Changed => "changed",
                ChildAction::Unchanged => "unchanged",
                ChildAction::Pruned => "pruned",
                ChildAction::Waiting => "waiting",
            };
            let _ = write!(out, "    {action:<10} {} {}", child.kind, child.name);
            if !child.changed.is_empty() {
                let _ = write!(out, ": {}", child.changed.join(", "));
            }
            if let Some(waiting_for) = &child.waiting_for {
                let _ = write!(out, ": waits for {waiting_for}");
            }
            out.push('\n');
        }
    }
    if let Some(status) = &record.status {
        let written = if status.written {
            "written"
        } else {
            "unchanged, not written"
        };
        let _ = writeln!(out, "  status ({written}):");
        let yaml = crate::yaml::to_string(&status.status).unwrap_or_default();
        for line in yaml.lines() {
            let _ = writeln!(out, "    {line}");
        }
    }
    if !record.events.is_empty() {
        let _ = writeln!(out, "  events:");
        for event in &record.events {
            let _ = writeln!(
                out,
                "    {} {}: {}",
                event.type_, event.reason, event.message
            );
        }
    }
    if let Some(shadow) = &record.shadow {
        let _ = writeln!(out, "  candidate (shadow): {shadow}");
    }
    out
}
