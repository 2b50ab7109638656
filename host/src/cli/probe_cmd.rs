//! `wasmctrl probe URL`: ask a host's health endpoint the way the kubelet does, from a
//! container that has no shell and no curl (the image holds only `wasmctrl`). The chart's
//! `helm test` runs it against the release's Service.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};

/// Ask one URL; done when it answers 2xx.
#[derive(Debug, clap::Args)]
pub struct ProbeCommand {
    /// What to ask, e.g. `https://wasmctrl-metrics.wasmctrl.svc:8443/readyz`.
    url: url::Url,
    /// Trust these certificate authorities (PEM), besides the system's: the issuer of a
    /// `metrics.tlsSecretName` certificate.
    #[arg(long, value_name = "PEM", conflicts_with = "insecure_skip_tls_verify")]
    ca_file: Option<PathBuf>,
    /// Accept any certificate: the host's self-signed one. The answer's status is all that
    /// is read, as the kubelet's HTTPS probes do.
    #[arg(long)]
    insecure_skip_tls_verify: bool,
    /// How long to wait for the answer, in seconds.
    #[arg(long, default_value_t = 10)]
    timeout_seconds: u64,
}

impl ProbeCommand {
    /// GET the URL; print its status and body; an error unless the status is 2xx.
    pub async fn run(self) -> anyhow::Result<()> {
        crate::ensure_crypto_provider();
        let builder = reqwest::Client::builder()
            .timeout(Duration::from_secs(self.timeout_seconds.max(1)))
            .danger_accept_invalid_certs(self.insecure_skip_tls_verify)
            .user_agent(concat!("wasmctrl-probe/", env!("CARGO_PKG_VERSION")));
        let client = super::plugin_oci::trusting_ca_file(builder, self.ca_file.as_deref())?
            .build()
            .context("building the HTTP client")?;
        let response = client
            .get(self.url.clone())
            .send()
            .await
            .with_context(|| format!("asking {}", self.url))?;
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        let body = body.trim();
        if !status.is_success() {
            bail!("{} answered {status}: {body}", self.url);
        }
        println!("{} answered {status}: {body}", self.url);
        Ok(())
    }
}
