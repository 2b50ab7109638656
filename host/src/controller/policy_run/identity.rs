//! Who the host is when it acts for a policy.
//!
//! A policy that names a ServiceAccount (`spec.serviceAccount`) is served through a client
//! that impersonates that account: its watches, its reads of related objects, its child
//! writes, its parents' status and finalizers and its Events. The API server then grants the
//! policy exactly what RBAC grants the account, and the host's own role needs no rule on any
//! parent, child or related kind: only `impersonate` on the accounts it may act as.
//!
//! What stays the host's own business is done as the host: reading and reporting on
//! ReconcilePolicies, fetching plugins (and their registry credentials), leader election.

use std::sync::Arc;

use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt as _};

use crate::controller::policy_run::status::State;
use crate::leader::Leadership;
use crate::policy::{ReconcilePolicy, ServiceAccountRef};

/// Makes the client each policy acts through.
pub(crate) struct Identities {
    /// The host's own client: for policies without an identity, when the host allows them.
    host: Client,
    /// The host's connection settings, to impersonate from; `None` when the host was given a
    /// client only (then it can act as no one else).
    config: Option<kube::Config>,
    /// Writes through an impersonating client are gated on leadership like the host's own.
    leadership: Arc<Leadership>,
    /// Refuse a policy without `spec.serviceAccount` instead of acting as the host for it.
    require: bool,
}

/// The client a policy acts through, and who it acts as.
#[derive(Clone)]
pub(crate) struct Acting {
    pub client: Client,
    /// `None`: the host itself.
    pub account: Option<ServiceAccountRef>,
}

impl Acting {
    /// Who is acting, for messages: "ServiceAccount team-a/app" or "the host".
    pub fn who(&self) -> String {
        match &self.account {
            Some(account) => format!("ServiceAccount {account}"),
            None => "the host".to_owned(),
        }
    }
}

impl Identities {
    /// Act as the host (`host`) for policies without an account, unless `require`d.
    pub fn new(host: Client, leadership: Arc<Leadership>, require: bool) -> Self {
        Self {
            host,
            config: None,
            leadership,
            require,
        }
    }

    /// Impersonate policies' accounts with the credentials in `config`.
    pub fn impersonating_from(&mut self, config: kube::Config) {
        self.config = Some(config);
    }

    /// The client `policy` acts through, or the `Ready=False` state saying why it has none.
    pub fn acting_for(&self, policy: &ReconcilePolicy) -> Result<Acting, State> {
        let Some(account) = &policy.spec.service_account else {
            if self.require {
                return Err(State::failed(
                    "IdentityRequired",
                    "this host runs only policies that name the ServiceAccount they act as: set spec.serviceAccount (see `wasmctrl rbac`)",
                ));
            }
            return Ok(Acting {
                client: self.host.clone(),
                account: None,
            });
        };
        let Some(config) = &self.config else {
            return Err(State::failed(
                "IdentityUnavailable",
                format!(
                    "this host was given a client without its connection settings, so it cannot act as ServiceAccount {account}"
                ),
            ));
        };
        let client = impersonating(config, account, &self.leadership).map_err(|error| {
            tracing::warn!(policy = %policy.name_any(), %account, error = %format!("{error:#}"), "could not build an impersonating client");
            State::failed(
                "IdentityUnavailable",
                format!("building a client that acts as ServiceAccount {account}: {error:#}"),
            )
        })?;
        Ok(Acting {
            client,
            account: Some(account.clone()),
        })
    }
}

/// A client that makes every request as `account`, with the host's credentials, gated on
/// leadership.
fn impersonating(
    config: &kube::Config,
    account: &ServiceAccountRef,
    leadership: &Arc<Leadership>,
) -> anyhow::Result<Client> {
    let mut config = config.clone();
    // The API server adds the account's groups itself; naming none also means the host
    // needs no right to impersonate groups.
    config.auth_info.impersonate = Some(account.user_name());
    config.auth_info.impersonate_groups = None;
    config.auth_info.impersonate_uid = None;
    config.auth_info.impersonate_user_extra = None;
    Ok(crate::leader::gated_client(config, leadership)?)
}

/// Whether the API server lets the host act as `acting`'s account: a `SelfSubjectReview`
/// made through the impersonating client is refused when the host may not impersonate it.
/// Any other failure is left to the checks after this one, which say the same thing better.
pub(crate) async fn verify(acting: &Acting) -> Result<(), State> {
    let Some(account) = &acting.account else {
        return Ok(());
    };
    let api: Api<SelfSubjectReview> = Api::all(acting.client.clone());
    match api
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
    {
        Ok(review) => {
            let user = review
                .status
                .and_then(|status| status.user_info)
                .and_then(|info| info.username);
            match user {
                Some(user) if user != account.user_name() => Err(State::failed(
                    "IdentityUnavailable",
                    format!(
                        "acting as ServiceAccount {account}, the API server saw {user}; check the host's credentials"
                    ),
                )),
                _ => Ok(()),
            }
        }
        Err(kube::Error::Api(status)) if status.code == 403 => Err(State::failed(
            "ImpersonationForbidden",
            format!(
                "the host may not act as ServiceAccount {account}: grant its ServiceAccount `impersonate` on serviceaccounts/{} in namespace {} (see `wasmctrl rbac`): {}",
                account.name, account.namespace, status.message
            ),
        )),
        Err(error) => {
            tracing::debug!(%account, %error, "could not review the policy's identity");
            Ok(())
        }
    }
}
