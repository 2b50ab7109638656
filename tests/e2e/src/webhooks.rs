//! A host's webhook listener as the tests run it: on 127.0.0.1, with a serving pair the
//! hosts' own `Certificates` keep in a Secret of the test's namespace, reached by URL.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};
use wasmctrl::admission::certs::Certificates;
use wasmctrl::admission::configurations::Endpoint;
use wasmctrl::admission::hosting::Hosting;
use wasmctrl::admission::server::{Answerers, ServingCertificate, serve};
use wasmctrl::metrics::Metrics;

/// A replica's webhook listener on 127.0.0.1, with the pair from the Secret.
pub struct Listener {
    /// Where it listens.
    pub address: std::net::SocketAddr,
    /// The CA bundle of its pair, PEM.
    pub ca_bundle: String,
    /// The serving certificate it started with, PEM.
    pub pem: String,
    /// Who answers on it.
    pub answerers: Arc<Answerers>,
    /// The certificate it presents (replaceable).
    pub certificate: Arc<ServingCertificate>,
    /// Its metrics.
    pub metrics: Arc<Metrics>,
    /// Its task (abort it to stop the listener).
    pub task: tokio::task::JoinHandle<()>,
}

impl Listener {
    /// A listener presenting the pair in Secret `secret` of `ns` (made if missing).
    pub async fn start(client: &Client, ns: &str, secret: &str) -> anyhow::Result<Self> {
        wasmctrl::ensure_crypto_provider();
        let issued = Certificates::new(
            Api::<Secret>::namespaced(client.clone(), ns),
            secret,
            vec!["127.0.0.1".to_owned()],
        )
        .ensure()
        .await?;
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = tcp.local_addr()?;
        let certificate = ServingCertificate::new(&issued)?;
        let answerers = Answerers::new();
        let metrics = Arc::new(Metrics::new());
        let (serving, presented, counted) =
            (answerers.clone(), certificate.clone(), metrics.clone());
        let task = tokio::spawn(async move {
            let served = serve(tcp, &presented, serving, counted, std::future::pending()).await;
            if let Err(error) = served {
                eprintln!("the webhook listener stopped: {error:#}");
            }
        });
        Ok(Self {
            address,
            pem: issued.certificate,
            ca_bundle: issued.ca_bundle,
            answerers,
            certificate,
            metrics,
            task,
        })
    }

    /// Reviews this listener answered.
    pub fn answered(&self) -> f64 {
        crate::metric_sum(&self.metrics, "wasmctrl_webhook_requests_total", &[])
    }
}

/// A webhook listener on 127.0.0.1 with a pair from Secret `secret`: its URL, CA bundle and
/// answerers.
pub async fn listener(
    client: &Client,
    ns: &str,
    secret: &str,
) -> anyhow::Result<(String, String, Arc<Answerers>)> {
    let listener = Listener::start(client, ns, secret).await?;
    Ok((
        format!("https://{}", listener.address),
        listener.ca_bundle,
        listener.answerers,
    ))
}

/// What `wasmctrl run` hands a host serving webhooks on `url` (configuration
/// `wasmctrl-<ns>`), with `ca_bundle` that never changes.
pub fn hosting(ns: &str, url: &str, answerers: &Arc<Answerers>, ca_bundle: &str) -> Hosting {
    // The sender goes: the CA bundle never changes here.
    let (_, ca_bundle) = tokio::sync::watch::channel(ca_bundle.to_owned());
    Hosting {
        answerers: answerers.clone(),
        endpoint: Endpoint::Url(url.to_owned()),
        configuration: format!("wasmctrl-{ns}"),
        ca_bundle,
        exempt_users: vec!["system:serviceaccount:wasmctrl:wasmctrl".to_owned()],
    }
}

/// The webhook answers `host` keeps on record for `kind` `name` in `ns`, newest first.
pub fn webhook_records(
    host: &crate::HostUnderTest,
    kind: &str,
    ns: &str,
    name: &str,
) -> anyhow::Result<Vec<wasmctrl::explain::WebhookRecord>> {
    use anyhow::Context as _;
    use wasmctrl::explain::{Explained, Lookup};
    let store = &host.explain.store;
    let Lookup::Found { records } =
        store.lookup(kind, Some(ns), name, 50, &store.kinds_named(kind))
    else {
        anyhow::bail!("no record of {kind} {name}");
    };
    let mut found = Vec::new();
    for record in records {
        if let Explained::Webhook(record) = serde_json::from_str(&record).context("a record")? {
            found.push(*record);
        }
    }
    Ok(found)
}
