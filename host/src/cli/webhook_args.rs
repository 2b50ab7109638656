//! `wasmctrl run`'s webhook listener: where it listens, where the API server reaches it, and
//! where its certificate comes from.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use tokio_util::sync::CancellationToken;

use crate::admission::certs::Certificates;
use crate::admission::configurations::Endpoint;
use crate::admission::hosting::{self, Hosting, PairSource};
use crate::admission::server::{Answerers, ServingCertificate};
use crate::metrics::Metrics;

/// The webhooks policies ask for (`spec.admission`).
#[derive(Debug, Args)]
pub(super) struct WebhookArgs {
    /// Serve policies' webhooks over HTTPS on this address (e.g. `0.0.0.0:9443`), on every
    /// replica; `off` serves none (a policy that asks for webhooks says so in its status).
    #[arg(long, env = "WASMCTRL_WEBHOOK_LISTEN", default_value = "off")]
    webhook_listen: String,
    /// The Service in front of the hosts' webhook listeners, in the host's namespace, as
    /// `NAME` or `NAME:PORT` (port 443 by default): where the API server sends reviews.
    #[arg(long, env = "WASMCTRL_WEBHOOK_SERVICE", conflicts_with = "webhook_url")]
    webhook_service: Option<String>,
    /// Instead of a Service: the URL the API server reaches this host at (a host outside
    /// the cluster), `https://HOST:PORT`; the certificate covers HOST.
    #[arg(long, env = "WASMCTRL_WEBHOOK_URL")]
    webhook_url: Option<String>,
    /// The Secret the hosts keep their webhook CA and serving pair in, in the host's
    /// namespace: made by the first host, renewed by any, read by all.
    #[arg(
        long,
        env = "WASMCTRL_WEBHOOK_SECRET",
        default_value = "wasmctrl-webhook-tls"
    )]
    webhook_secret: String,
    /// Instead of the hosts' own Secret: a directory holding `tls.crt`, `tls.key` and
    /// `ca.crt` that someone else keeps current (cert-manager's Secret, mounted).
    #[arg(long, env = "WASMCTRL_WEBHOOK_CERT_DIR")]
    webhook_cert_dir: Option<PathBuf>,
    /// The ValidatingWebhookConfiguration and MutatingWebhookConfiguration (one name for
    /// both) that hold each policy's webhook: the chart makes them, so that the host's
    /// grant names them; a host run by hand makes them if they are missing.
    #[arg(
        long,
        env = "WASMCTRL_WEBHOOK_CONFIGURATION",
        default_value = crate::admission::configurations::DEFAULT_NAME
    )]
    webhook_configuration: String,
    /// The namespace of the Secret and the Service. Default: the namespace the host runs
    /// in.
    #[arg(long, env = "WASMCTRL_WEBHOOK_NAMESPACE")]
    webhook_namespace: Option<String>,
}

/// A webhook listener bound and certified, ready to serve.
pub(super) struct WebhookListener {
    tcp: tokio::net::TcpListener,
    presented: Arc<ServingCertificate>,
    answerers: Arc<Answerers>,
    keep_current: Option<(PairSource, crate::admission::certs::Issued)>,
    ca_bundle: tokio::sync::watch::Sender<String>,
}

impl WebhookArgs {
    /// Bind the listener and get its pair (`client` is ungated: any replica may make or
    /// renew the pair), with what policies need to serve through it; `None` when off.
    pub(super) async fn bind(
        &self,
        client: &kube::Client,
        own_namespace: Option<String>,
    ) -> anyhow::Result<Option<(WebhookListener, Hosting)>> {
        let address: SocketAddr = match self.webhook_listen.as_str() {
            "off" => return Ok(None),
            address => address.parse().with_context(|| {
                format!(
                    "--webhook-listen {address:?} is not an address like 0.0.0.0:9443 (or `off`)"
                )
            })?,
        };
        let namespace = self.webhook_namespace.clone().or(own_namespace);
        let (endpoint, names) = self.endpoint(namespace.as_deref())?;
        let source = match &self.webhook_cert_dir {
            Some(dir) => PairSource::Files(dir.clone()),
            None => {
                let namespace = namespace.as_deref().context(
                    "--webhook-listen needs the namespace of the webhook Secret: run in a pod or pass --webhook-namespace",
                )?;
                PairSource::Secret(Box::new(Certificates::new(
                    kube::Api::namespaced(client.clone(), namespace),
                    &self.webhook_secret,
                    names,
                )))
            }
        };
        let issued = source
            .current()
            .await
            .context("getting the webhook listener's certificate")?;
        let presented = ServingCertificate::new(&issued)?;
        let host_user = hosting::own_user(client).await?;
        let answerers = Answerers::new();
        let (ca_bundle, ca_bundle_rx) = tokio::sync::watch::channel(issued.ca_bundle.clone());
        let tcp = crate::server::bind(address).await?;
        tracing::info!(%address, ?endpoint, exempt = %host_user, "serving policies' webhooks over TLS");
        Ok(Some((
            WebhookListener {
                tcp,
                presented,
                answerers: answerers.clone(),
                keep_current: Some((source, issued)),
                ca_bundle,
            },
            Hosting {
                answerers,
                endpoint,
                configuration: self.webhook_configuration.clone(),
                ca_bundle: ca_bundle_rx,
                exempt_users: vec![host_user],
            },
        )))
    }

    /// Where the API server reaches the listener, and the names its certificate covers.
    fn endpoint(&self, namespace: Option<&str>) -> anyhow::Result<(Endpoint, Vec<String>)> {
        if let Some(url) = &self.webhook_url {
            let parsed: url::Url = url
                .parse()
                .with_context(|| format!("--webhook-url {url:?}"))?;
            anyhow::ensure!(
                parsed.scheme() == "https" && parsed.path() == "/" && parsed.query().is_none(),
                "--webhook-url {url:?}: the API server calls webhooks over https, at a URL with no path (https://HOST:PORT)"
            );
            let host = parsed
                .host_str()
                .with_context(|| format!("--webhook-url {url:?} names no host"))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            return Ok((
                Endpoint::Url(url.trim_end_matches('/').to_owned()),
                vec![host],
            ));
        }
        let service = self.webhook_service.as_deref().context(
            "--webhook-listen needs --webhook-service (in a cluster) or --webhook-url: where the API server reaches the hosts",
        )?;
        let namespace = namespace.context(
            "--webhook-service needs its namespace: run in a pod or pass --webhook-namespace",
        )?;
        let (name, port) = match service.split_once(':') {
            Some((name, port)) => (
                name,
                port.parse::<i32>()
                    .with_context(|| format!("--webhook-service {service:?}: bad port"))?,
            ),
            None => (service, 443),
        };
        let names = vec![
            format!("{name}.{namespace}.svc"),
            format!("{name}.{namespace}.svc.cluster.local"),
        ];
        Ok((
            Endpoint::Service {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                port,
            },
            names,
        ))
    }
}

impl WebhookListener {
    /// Serve until `stop`, keeping the pair current meanwhile.
    pub(super) async fn serve(
        mut self,
        metrics: Arc<Metrics>,
        stop: CancellationToken,
    ) -> anyhow::Result<()> {
        if let Some((source, issued)) = self.keep_current.take() {
            tokio::spawn(hosting::keep_pair_current(
                source,
                self.presented.clone(),
                issued,
                self.ca_bundle,
                stop.clone(),
            ));
        }
        crate::admission::server::serve(
            self.tcp,
            &self.presented,
            self.answerers,
            metrics,
            stop.cancelled_owned(),
        )
        .await
    }
}
