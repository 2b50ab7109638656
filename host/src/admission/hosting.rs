//! What a host that serves webhooks hands its policies: the listener's registry of answerers,
//! where the API server reaches the listener, the CA bundle it must trust (kept current as
//! the pair is renewed), and whose writes the webhooks never judge.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::watch;

use super::certs::{Certificates, Issued};
use super::configurations::{Configurations, Endpoint};
use super::server::{Answerers, ServingCertificate};

/// How often a host checks its serving pair for a renewal (its own or another replica's,
/// or a new one cert-manager mounted).
pub const CERTIFICATE_CHECK: Duration = Duration::from_secs(10 * 60);

/// A host's webhook serving, as its policies see it.
pub struct Hosting {
    /// Who answers each policy's reviews on this replica.
    pub answerers: Arc<Answerers>,
    /// Where the API server reaches the hosts' listeners.
    pub endpoint: Endpoint,
    /// The name of the validating and the mutating webhook configuration policies' entries
    /// go in (see [`super::configurations`]).
    pub configuration: String,
    /// The CA bundle the webhook configurations carry: the CA of the pair the listeners
    /// present.
    pub ca_bundle: watch::Receiver<String>,
    /// Users whose writes the webhooks do not judge: the host's own (finalizers), so that a
    /// plugin that cannot answer never keeps the host from letting a parent go.
    pub exempt_users: Vec<String>,
}

impl Hosting {
    /// The configurations, written through `client`.
    pub fn configurations(&self, client: &kube::Client) -> Configurations {
        Configurations::new(client.clone(), &self.configuration)
    }
}

/// Where the listener's pair comes from.
pub enum PairSource {
    /// Made and renewed by the hosts, in a Secret ([`Certificates`]).
    Secret(Box<Certificates>),
    /// Files someone else keeps current (cert-manager's Secret, mounted): `tls.crt`,
    /// `tls.key` and `ca.crt` in one directory.
    Files(PathBuf),
}

impl PairSource {
    /// The pair to present now.
    pub async fn current(&self) -> anyhow::Result<Issued> {
        match self {
            Self::Secret(certificates) => certificates.ensure().await,
            Self::Files(dir) => {
                let read = |name: &str| {
                    let path = dir.join(name);
                    std::fs::read_to_string(&path)
                        .with_context(|| format!("reading {}", path.display()))
                };
                Issued::from_pem(read("ca.crt")?, read("tls.crt")?, read("tls.key")?)
                    .with_context(|| format!("the webhook pair in {}", dir.display()))
            }
        }
    }
}

/// Every [`CERTIFICATE_CHECK`] until `stop`, present the newest pair of `source` and publish
/// its CA bundle. A check that fails keeps the pair presented (it stays valid for weeks) and
/// is logged.
pub async fn keep_pair_current(
    source: PairSource,
    presented: Arc<ServingCertificate>,
    mut last: Issued,
    ca_bundle: watch::Sender<String>,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(CERTIFICATE_CHECK) => {}
            () = stop.cancelled() => return,
        }
        match source.current().await {
            Ok(issued) if issued != last => {
                if let Err(error) = presented.replace(&issued) {
                    tracing::warn!(error = %format!("{error:#}"), "cannot present the renewed webhook certificate; keeping the one presented");
                    continue;
                }
                tracing::info!(not_after = ?issued.not_after, "presenting a renewed webhook certificate");
                ca_bundle.send_if_modified(|bundle| {
                    let changed = *bundle != issued.ca_bundle;
                    bundle.clone_from(&issued.ca_bundle);
                    changed
                });
                last = issued;
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(error = %format!("{error:#}"), "cannot check the webhook certificate; keeping the one presented");
            }
        }
    }
}

/// The user the API server knows `client` as.
pub async fn own_user(client: &kube::Client) -> anyhow::Result<String> {
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let reviews: kube::Api<SelfSubjectReview> = kube::Api::all(client.clone());
    let review = reviews
        .create(
            &kube::api::PostParams::default(),
            &SelfSubjectReview::default(),
        )
        .await
        .context("asking the API server who this host is (SelfSubjectReview)")?;
    review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username)
        .context("the API server did not say who this host is")
}
