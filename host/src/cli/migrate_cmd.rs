//! `wasmctrl migrate KIND`: rewrite every stored object of a custom resource at its CRD's
//! storage version, then drop the other versions from the CRD's `status.storedVersions`:
//! the documented way to retire an API version (after which no stored object needs the
//! conversion webhook, and the version can be removed from the CRD).
//!
//! Each object is rewritten by an update that changes nothing (the API server reads it,
//! converting it through the webhook where it is stored at another version, and stores it
//! at the storage version). An object that changed meanwhile was stored at the storage
//! version by that change; one deleted meanwhile needs nothing. The run is idempotent: run
//! again, it rewrites what is left (an object already at the storage version is not
//! written again by the API server), so an interrupted migration resumes by running it
//! again. A list whose continue token expired starts over, skipping what was done.
//!
//! Who may run it: whoever may list and update the kind's objects and patch
//! `customresourcedefinitions/status` (an admin).

use std::collections::HashSet;

use anyhow::{Context as _, bail};
use clap::Args;
use futures::StreamExt as _;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Api, ResourceExt as _};

/// Objects read per page.
const PAGE: u32 = 500;
/// Objects rewritten at once.
const WRITES_AT_ONCE: usize = 8;

/// Rewrite every stored object of a custom resource at its storage version, then record that
/// only the storage version is stored (`status.storedVersions`), so that older versions can
/// be removed from the CRD.
#[derive(Debug, Args)]
pub struct MigrateCommand {
    /// The custom resource: its CRD's name (`widgets.example.com`), or its plural or kind
    /// when one CRD has it.
    kind: String,
    /// Rewrite, but leave `status.storedVersions` as it is.
    #[arg(long)]
    keep_stored_versions: bool,
    /// Rewrite even though the CRD converts without a webhook (strategy `None`): only when
    /// its versions have the same fields, or what the storage version lacks is lost.
    #[arg(long)]
    without_webhook: bool,
}

/// What a migration did.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Migrated {
    /// The CRD.
    pub crd: String,
    /// Its storage version.
    pub storage_version: String,
    /// Objects the API server stored again (they were stored at another version).
    pub rewritten: u64,
    /// Objects already stored at the storage version (the update changed nothing).
    pub already_current: u64,
    /// Objects changed by someone else meanwhile (stored at the storage version by that).
    pub changed_meanwhile: u64,
    /// Objects deleted meanwhile.
    pub gone: u64,
    /// Objects the API server refused to store (a schema, a validation, a webhook), as
    /// `namespace/name: why`; while any is left, `storedVersions` is left as it is.
    pub failed: Vec<String>,
    /// `status.storedVersions` after the run.
    pub stored_versions: Vec<String>,
}

impl MigrateCommand {
    /// Migrate, and say what was done.
    pub async fn run(self) -> anyhow::Result<()> {
        let client = kube::Client::try_default()
            .await
            .context("connecting to the cluster")?;
        let migrated = self.run_with(&client).await?;
        println!(
            "{}: {} rewritten at {}, {} already there, {} changed meanwhile, {} gone; storedVersions {}",
            migrated.crd,
            migrated.rewritten,
            migrated.storage_version,
            migrated.already_current,
            migrated.changed_meanwhile,
            migrated.gone,
            migrated.stored_versions.join(", ")
        );
        if !migrated.failed.is_empty() {
            for failure in &migrated.failed {
                eprintln!("not rewritten: {failure}");
            }
            bail!(
                "{} object(s) could not be rewritten: fix them and run again (storedVersions left as it was)",
                migrated.failed.len()
            );
        }
        Ok(())
    }

    /// [`Self::run`] through `client`: what was done (objects that failed are listed in it,
    /// not an error).
    pub async fn run_with(&self, client: &kube::Client) -> anyhow::Result<Migrated> {
        let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
        let crd = find_crd(&crds, &self.kind).await?;
        let name = crd.name_any();
        let Some(storage) = crd.spec.versions.iter().find(|v| v.storage) else {
            bail!("CRD {name} has no storage version");
        };
        let stored = crd
            .status
            .as_ref()
            .and_then(|s| s.stored_versions.clone())
            .unwrap_or_default();
        let webhook = crd
            .spec
            .conversion
            .as_ref()
            .is_some_and(|c| c.strategy == "Webhook");
        if !webhook && !self.without_webhook && stored.iter().any(|v| *v != storage.name) {
            bail!(
                "CRD {name} stores objects at {} and converts without a webhook: rewriting them at {} would keep only the fields {} has. Serve the conversion first (a policy's spec.conversion), or pass --without-webhook when the versions have the same fields",
                stored.join(", "),
                storage.name,
                storage.name
            );
        }
        let gvk = GroupVersionKind::gvk(&crd.spec.group, &storage.name, &crd.spec.names.kind);
        let resource = ApiResource::from_gvk_with_plural(&gvk, &crd.spec.names.plural);
        let mut migrated = Migrated {
            crd: name.clone(),
            storage_version: storage.name.clone(),
            stored_versions: stored.clone(),
            ..Migrated::default()
        };
        rewrite_all(
            client,
            &resource,
            crd.spec.scope == "Namespaced",
            &mut migrated,
        )
        .await?;
        if migrated.failed.is_empty()
            && !self.keep_stored_versions
            && stored != [storage.name.clone()]
        {
            let patch = serde_json::json!({"status": {"storedVersions": [storage.name]}});
            crds.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .with_context(|| {
                    format!("recording that {name} is stored at {} only", storage.name)
                })?;
            migrated.stored_versions = vec![storage.name.clone()];
        }
        Ok(migrated)
    }
}

/// Update every object of `resource` with itself, page by page, counting into `migrated`.
async fn rewrite_all(
    client: &kube::Client,
    resource: &ApiResource,
    namespaced: bool,
    migrated: &mut Migrated,
) -> anyhow::Result<()> {
    let objects: Api<DynamicObject> = Api::all_with(client.clone(), resource);
    let mut done: HashSet<String> = HashSet::new();
    let mut token: Option<String> = None;
    loop {
        let mut params = ListParams::default().limit(PAGE);
        if let Some(token) = &token {
            params = params.continue_token(token);
        }
        let page = match objects.list(&params).await {
            Ok(page) => page,
            Err(kube::Error::Api(status)) if status.code == 410 && token.is_some() => {
                tracing::info!(
                    "the list's continue token expired; listing again from the start, skipping what was done"
                );
                token = None;
                continue;
            }
            Err(error) => {
                return Err(error).with_context(|| format!("listing {}", migrated.crd));
            }
        };
        let todo: Vec<DynamicObject> = page
            .items
            .into_iter()
            .filter(|o| {
                o.metadata
                    .uid
                    .as_ref()
                    .is_none_or(|uid| !done.contains(uid))
            })
            .collect();
        let writes = futures::stream::iter(todo)
            .map(|mut object| {
                let api = match (namespaced, object.namespace()) {
                    (true, Some(namespace)) => {
                        Api::namespaced_with(client.clone(), &namespace, resource)
                    }
                    _ => objects.clone(),
                };
                // Items of a list may leave out what they are; a write must say it.
                object.types = Some(kube::core::TypeMeta {
                    api_version: resource.api_version.clone(),
                    kind: resource.kind.clone(),
                });
                async move {
                    let uid = object.metadata.uid.clone().unwrap_or_default();
                    let sent = object.metadata.resource_version.clone();
                    let named = match object.namespace() {
                        Some(namespace) => format!("{namespace}/{}", object.name_any()),
                        None => object.name_any(),
                    };
                    let written = api
                        .replace(&object.name_any(), &PostParams::default(), &object)
                        .await
                        .map(|stored| stored.metadata.resource_version != sent);
                    (uid, named, written)
                }
            })
            .buffer_unordered(WRITES_AT_ONCE)
            .collect::<Vec<_>>()
            .await;
        for (uid, named, written) in writes {
            match written {
                Ok(true) => migrated.rewritten += 1,
                Ok(false) => migrated.already_current += 1,
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    migrated.changed_meanwhile += 1;
                }
                Err(kube::Error::Api(status)) if status.code == 404 => migrated.gone += 1,
                Err(kube::Error::Api(status)) => {
                    migrated.failed.push(format!("{named}: {}", status.message));
                }
                Err(error) => {
                    return Err(error).with_context(|| {
                        format!(
                            "rewriting {} {named} (after {} rewritten; run again to go on)",
                            migrated.crd, migrated.rewritten
                        )
                    });
                }
            }
            done.insert(uid);
        }
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            return Ok(());
        }
    }
}

/// The CRD `kind` names: by its name, or by the plural, singular or kind of exactly one.
async fn find_crd(
    crds: &Api<CustomResourceDefinition>,
    kind: &str,
) -> anyhow::Result<CustomResourceDefinition> {
    if kind.contains('.') {
        return crds
            .get_opt(kind)
            .await
            .with_context(|| format!("reading CRD {kind}"))?
            .with_context(|| format!("there is no CRD {kind}"));
    }
    let all = crds
        .list(&ListParams::default())
        .await
        .context("listing CRDs")?;
    let matching: Vec<CustomResourceDefinition> = all
        .items
        .into_iter()
        .filter(|crd| {
            let names = &crd.spec.names;
            names.plural.eq_ignore_ascii_case(kind)
                || names.kind.eq_ignore_ascii_case(kind)
                || names
                    .singular
                    .as_deref()
                    .is_some_and(|s| s.eq_ignore_ascii_case(kind))
        })
        .collect();
    match matching.len() {
        1 => Ok(matching.into_iter().next().context("one CRD")?),
        0 => bail!("no CRD has the kind or plural {kind}"),
        _ => bail!(
            "{kind} is the kind or plural of several CRDs ({}): name one",
            matching
                .iter()
                .map(kube::ResourceExt::name_any)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}
