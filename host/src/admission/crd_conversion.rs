//! A parent CustomResourceDefinition's `spec.conversion`, pointed at the hosts' listener
//! while a policy converts its kind, and put back as it was when the policy stops.
//!
//! - **Pointing it at the hosts** writes `strategy: Webhook` with the listener's
//!   `/convert/<policy>` path and CA bundle, and keeps what was there before in an
//!   annotation of the CRD ([`PREVIOUS_ANNOTATION`]), beside the policy that owns the stanza
//!   now ([`POLICY_ANNOTATION`]). Every write tests the CRD's resourceVersion: one that
//!   changed since it was read is read again, never overwritten.
//! - **Putting it back** is refused while an object is stored at a version other than the
//!   storage version (the CRD's `status.storedVersions`): without the webhook the API server
//!   could not read it at the version it is asked for. `wasmctrl migrate` rewrites those
//!   objects; then the stanza goes back.
//! - Who may do it: the host, with `patch` on the CRDs its chart names
//!   (`conversion.crds`), for a cluster policy whose parent is that CRD's kind; a
//!   NamespacedReconcilePolicy may not ask.

use anyhow::Context as _;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceConversion, CustomResourceDefinition, WebhookClientConfig, WebhookConversion,
};
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt as _};

use super::configurations::Endpoint;

/// On a CRD whose conversion a policy's plugin serves: the policy.
pub const POLICY_ANNOTATION: &str = "conversion.wasmctrl.dev/policy";
/// On a CRD whose conversion a policy's plugin serves: its `spec.conversion` before, as
/// JSON, put back when the policy stops.
pub const PREVIOUS_ANNOTATION: &str = "conversion.wasmctrl.dev/previous";
/// The field manager of the host's writes to CRDs.
const FIELD_MANAGER: &str = "wasmctrl-conversion";

/// Why the CRD's conversion cannot be as asked.
#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    /// Not the host's to change, as things stand: the reason (a condition's) and what to do.
    #[error("{message}")]
    Refused {
        /// The condition's reason.
        reason: &'static str,
        /// What is wrong and what to do.
        message: String,
    },
    /// The API server did not let it read or write the CRD.
    #[error(transparent)]
    Api(#[from] anyhow::Error),
    /// The CRD changed between the read and the write (the write tests its
    /// resourceVersion): read it again.
    #[error("CRD {0} changed while it was written")]
    Changed(String),
}

/// Reads and writes of one change tried before a CRD that keeps changing is reported.
const ATTEMPTS: usize = 3;

impl CrdError {
    fn refused(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Refused {
            reason,
            message: message.into(),
        }
    }
}

/// What a conversion is served for: the policy and where the API server reaches it.
#[derive(Debug, Clone, PartialEq)]
pub struct Served<'a> {
    /// The policy (cluster-scoped; the listener's path).
    pub policy: &'a str,
    /// The versions it converts between.
    pub versions: &'a [String],
    /// Where the API server reaches the listeners.
    pub endpoint: &'a Endpoint,
    /// The CA bundle they present a certificate of.
    pub ca_bundle: &'a str,
}

/// How the CRD stands after [`CrdConversion::ensure`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Standing {
    /// Whether this call changed it.
    pub written: bool,
    /// Its `status.storedVersions`.
    pub stored_versions: Vec<String>,
}

/// How a stop ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restored {
    /// The stanza is as it was before the policy.
    Restored,
    /// The stanza is not the policy's (never was, or someone took it over): left alone.
    NotOurs,
    /// There is no such CRD (any more).
    Gone,
}

/// One CRD's conversion stanza.
pub struct CrdConversion {
    crds: Api<CustomResourceDefinition>,
    name: String,
}

impl CrdConversion {
    /// CRD `name`, read and written through `client`.
    pub fn new(client: &kube::Client, name: &str) -> Self {
        Self {
            crds: Api::all(client.clone()),
            name: name.to_owned(),
        }
    }

    /// The CRD's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Point the CRD's conversion at the hosts for `served` (a write only when it does not
    /// already say so).
    pub async fn ensure(&self, served: &Served<'_>) -> Result<Standing, CrdError> {
        retried(|| self.ensure_once(served)).await
    }

    async fn ensure_once(&self, served: &Served<'_>) -> Result<Standing, CrdError> {
        let crd = self.read().await?.ok_or_else(|| {
            CrdError::refused(
                "NotACustomResource",
                format!(
                    "the parent kind has no CustomResourceDefinition {}: only a custom resource's versions can be converted",
                    self.name
                ),
            )
        })?;
        let known: Vec<&str> = crd.spec.versions.iter().map(|v| v.name.as_str()).collect();
        let missing: Vec<&str> = served
            .versions
            .iter()
            .map(String::as_str)
            .filter(|v| !known.contains(v))
            .collect();
        if !missing.is_empty() {
            return Err(CrdError::refused(
                "VersionNotInCrd",
                format!(
                    "spec.conversion.versions names {} that CRD {} does not have (it has {})",
                    missing.join(", "),
                    self.name,
                    known.join(", ")
                ),
            ));
        }
        let annotations = crd.metadata.annotations.clone().unwrap_or_default();
        let owner = annotations.get(POLICY_ANNOTATION);
        if let Some(other) = owner.filter(|o| *o != served.policy) {
            return Err(CrdError::refused(
                "ConversionTaken",
                format!(
                    "CRD {}'s conversion is served for policy {other}: it converts the kind until it stops",
                    self.name
                ),
            ));
        }
        if owner.is_none()
            && crd
                .spec
                .conversion
                .as_ref()
                .is_some_and(|c| c.strategy == "Webhook")
        {
            return Err(CrdError::refused(
                "ConversionTaken",
                format!(
                    "CRD {} already sends its conversions to a webhook that is not wasmctrl's: remove it from the CRD first",
                    self.name
                ),
            ));
        }
        let stored_versions = stored_versions(&crd);
        let wanted = wanted(served)?;
        if owner.is_some() && crd.spec.conversion.as_ref() == Some(&wanted) {
            return Ok(Standing {
                written: false,
                stored_versions,
            });
        }
        let mut patch = vec![test_version(&crd)];
        if crd.metadata.annotations.is_none() {
            patch.push(
                serde_json::json!({"op": "add", "path": "/metadata/annotations", "value": {}}),
            );
        }
        if owner.is_none() {
            let previous = serde_json::to_string(&crd.spec.conversion)
                .context("the CRD's conversion stanza as JSON")?;
            patch.push(add_annotation(PREVIOUS_ANNOTATION, &previous));
            patch.push(add_annotation(POLICY_ANNOTATION, served.policy));
        }
        patch.push(serde_json::json!({"op": "add", "path": "/spec/conversion", "value": wanted}));
        self.patch(patch).await?;
        Ok(Standing {
            written: true,
            stored_versions,
        })
    }

    /// Put the CRD's conversion back as it was before `policy` served it, unless an object
    /// is stored at a version only the webhook can read it from (then refused, with what to
    /// do: `StillNeeded`).
    ///
    /// `reconciled_at`: the version a running controller of the policy reads and writes
    /// parents at; refused unless it is the storage version (through strategy `None`, an
    /// object read at another version would be written back pruned to its schema).
    pub async fn restore(
        &self,
        policy: &str,
        reconciled_at: Option<&str>,
    ) -> Result<Restored, CrdError> {
        retried(|| self.restore_once(policy, reconciled_at)).await
    }

    async fn restore_once(
        &self,
        policy: &str,
        reconciled_at: Option<&str>,
    ) -> Result<Restored, CrdError> {
        let Some(crd) = self.read().await? else {
            return Ok(Restored::Gone);
        };
        let annotations = crd.metadata.annotations.clone().unwrap_or_default();
        if annotations.get(POLICY_ANNOTATION).map(String::as_str) != Some(policy) {
            return Ok(Restored::NotOurs);
        }
        let storage = crd
            .spec
            .versions
            .iter()
            .find(|v| v.storage)
            .map(|v| v.name.clone())
            .unwrap_or_default();
        let stored = stored_versions(&crd);
        let needing: Vec<&str> = stored
            .iter()
            .map(String::as_str)
            .filter(|v| *v != storage)
            .collect();
        if !needing.is_empty() {
            return Err(CrdError::refused(
                "StillNeeded",
                format!(
                    "objects of CRD {} are stored at {} (its storage version is {storage}): the conversion webhook stays until they are rewritten (wasmctrl migrate {})",
                    self.name,
                    needing.join(", "),
                    self.name
                ),
            ));
        }
        if let Some(version) = reconciled_at.filter(|v| *v != storage) {
            return Err(CrdError::refused(
                "StillNeeded",
                format!(
                    "the policy reconciles at {version}, and CRD {} stores {storage}: without the webhook its writes would lose what {version} cannot hold; make {version} the policy's parent version, or delete the policy",
                    self.name
                ),
            ));
        }
        let previous: Option<CustomResourceConversion> = match annotations.get(PREVIOUS_ANNOTATION) {
            Some(json) => serde_json::from_str(json).map_err(|error| {
                CrdError::refused(
                    "PreviousUnreadable",
                    format!(
                        "CRD {}'s {PREVIOUS_ANNOTATION} annotation is not a conversion stanza ({error}): set spec.conversion by hand and remove the annotation and {POLICY_ANNOTATION}",
                        self.name
                    ),
                )
            })?,
            None => None,
        };
        let previous = previous.unwrap_or_else(|| CustomResourceConversion {
            strategy: "None".to_owned(),
            webhook: None,
        });
        let patch = vec![
            test_version(&crd),
            serde_json::json!({"op": "add", "path": "/spec/conversion", "value": previous}),
            serde_json::json!({"op": "remove", "path": annotation_path(POLICY_ANNOTATION)}),
        ]
        .into_iter()
        .chain(annotations.contains_key(PREVIOUS_ANNOTATION).then(
            || serde_json::json!({"op": "remove", "path": annotation_path(PREVIOUS_ANNOTATION)}),
        ))
        .collect();
        self.patch(patch).await?;
        Ok(Restored::Restored)
    }

    /// The policy whose plugin the CRD's conversion is served by, if any.
    pub async fn owner(&self) -> anyhow::Result<Option<String>> {
        let crd = self.read().await.map_err(anyhow::Error::new)?;
        Ok(crd.and_then(|crd| crd.annotations().get(POLICY_ANNOTATION).cloned()))
    }

    async fn read(&self) -> Result<Option<CustomResourceDefinition>, CrdError> {
        self.crds
            .get_opt(&self.name)
            .await
            .map_err(|error| self.failed(error, "reading"))
    }

    /// `error` from `doing` something to the CRD: a refusal the admin can act on when the
    /// host may not.
    fn failed(&self, error: kube::Error, doing: &str) -> CrdError {
        match error {
            kube::Error::Api(status) if status.code == 403 => CrdError::refused(
                "CrdForbidden",
                format!(
                    "the host may not read and patch CRD {}: list it in the chart's webhooks.conversionCrds ({})",
                    self.name, status.message
                ),
            ),
            error => CrdError::Api(
                anyhow::Error::new(error).context(format!("{doing} CRD {}", self.name)),
            ),
        }
    }

    async fn patch(&self, operations: Vec<serde_json::Value>) -> Result<(), CrdError> {
        let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(operations))
            .context("the CRD patch")?;
        self.crds
            .patch(
                &self.name,
                &PatchParams {
                    field_manager: Some(FIELD_MANAGER.to_owned()),
                    ..PatchParams::default()
                },
                &Patch::<()>::Json(patch),
            )
            .await
            .map_err(|error| match error {
                // A failed `test` of the resourceVersion, or a conflict.
                kube::Error::Api(status) if status.code == 409 || status.code == 422 => {
                    CrdError::Changed(self.name.clone())
                }
                error => self.failed(error, "writing the conversion of"),
            })?;
        Ok(())
    }
}

/// `once`, tried again (up to [`ATTEMPTS`] in all) while the CRD changes between its read
/// and its write.
async fn retried<T, Attempt>(mut once: impl FnMut() -> Attempt) -> Result<T, CrdError>
where
    Attempt: Future<Output = Result<T, CrdError>>,
{
    let mut attempt = 1;
    loop {
        match once().await {
            Err(CrdError::Changed(_)) if attempt < ATTEMPTS => attempt += 1,
            other => return other,
        }
    }
}

/// The name of the CRD of `plural` in `group`.
pub fn crd_name(plural: &str, group: &str) -> String {
    format!("{plural}.{group}")
}

/// The stanza that sends the API server's conversions of the kind to `served`'s listener.
fn wanted(served: &Served<'_>) -> anyhow::Result<CustomResourceConversion> {
    // The same client config as an admission webhook's, in apiextensions' own type.
    let client_config = super::configurations::client_config(
        served.endpoint,
        format!("/convert/{}", served.policy),
        served.ca_bundle,
    );
    let client_config: WebhookClientConfig =
        serde_json::from_value(serde_json::to_value(client_config)?)
            .context("the conversion webhook's client config")?;
    Ok(CustomResourceConversion {
        strategy: "Webhook".to_owned(),
        webhook: Some(WebhookConversion {
            client_config: Some(client_config),
            conversion_review_versions: vec!["v1".to_owned()],
        }),
    })
}

fn stored_versions(crd: &CustomResourceDefinition) -> Vec<String> {
    crd.status
        .as_ref()
        .and_then(|s| s.stored_versions.clone())
        .unwrap_or_default()
}

fn test_version(crd: &CustomResourceDefinition) -> serde_json::Value {
    serde_json::json!({
        "op": "test",
        "path": "/metadata/resourceVersion",
        "value": crd.metadata.resource_version,
    })
}

fn annotation_path(key: &str) -> String {
    format!(
        "/metadata/annotations/{}",
        key.replace('~', "~0").replace('/', "~1")
    )
}

fn add_annotation(key: &str, value: &str) -> serde_json::Value {
    serde_json::json!({"op": "add", "path": annotation_path(key), "value": value})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stanza_names_the_policys_path_on_the_service_and_the_ca() {
        let endpoint = Endpoint::Service {
            namespace: "wasmctrl".into(),
            name: "wasmctrl-webhooks".into(),
            port: 443,
        };
        let versions = ["v1alpha1".to_owned(), "v1".to_owned()];
        let stanza = wanted(&Served {
            policy: "widgets",
            versions: &versions,
            endpoint: &endpoint,
            ca_bundle: "PEM",
        })
        .expect("a stanza");
        let json = serde_json::to_value(&stanza).expect("json");
        assert_eq!(json["strategy"], "Webhook");
        let config = &json["webhook"]["clientConfig"];
        assert_eq!(config["service"]["path"], "/convert/widgets");
        assert_eq!(config["service"]["port"], 443);
        assert_eq!(config["caBundle"], "UEVN");
        assert_eq!(
            json["webhook"]["conversionReviewVersions"],
            serde_json::json!(["v1"])
        );
        let url = wanted(&Served {
            endpoint: &Endpoint::Url("https://10.0.0.1:9443/".into()),
            ..Served {
                policy: "widgets",
                versions: &versions,
                endpoint: &endpoint,
                ca_bundle: "PEM",
            }
        })
        .expect("a stanza");
        let json = serde_json::to_value(&url).expect("json");
        assert_eq!(
            json["webhook"]["clientConfig"]["url"],
            "https://10.0.0.1:9443/convert/widgets"
        );
    }

    #[test]
    fn annotation_keys_are_escaped_in_patch_paths() {
        assert_eq!(
            annotation_path(POLICY_ANNOTATION),
            "/metadata/annotations/conversion.wasmctrl.dev~1policy"
        );
    }
}
