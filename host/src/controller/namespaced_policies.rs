//! NamespacedReconcilePolicies become ReconcilePolicies (see [`crate::policy::namespaced`]).
//!
//! For each NamespacedReconcilePolicy `<name>` in `<namespace>`, the host applies a
//! ReconcilePolicy `<namespace>.<name>` with the same spec, confined to the namespace and
//! acting as one of its accounts, labelled as the source is (so `--policy-selector` splits
//! them as it splits any policy) and marked with the source's uid. The ReconcilePolicy's
//! status is copied back, so the team sees its policy's state where it made it. A
//! finalizer on the source lets the ReconcilePolicy — and the parents it releases — go first
//! when the source is deleted. Only the leader writes.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::ApiResource;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, ResourceExt as _};
use serde_json::{Value, json};

use crate::controller::policy_run::release;
use crate::leader::Leadership;
use crate::policy::namespaced::{self, Refusal};
use crate::policy::{ReconcilePolicy, ReconcilePolicySpec};

/// On each NamespacedReconcilePolicy: its ReconcilePolicy goes before it does.
pub const FINALIZER: &str = "wasmctrl.dev/namespaced-policy";
/// On each ReconcilePolicy made from one: the source's uid.
pub const SOURCE_UID_LABEL: &str = "wasmctrl.dev/namespaced-policy-uid";
/// On each ReconcilePolicy made from one: the source, as `namespace/name`.
pub const SOURCE_ANNOTATION: &str = "wasmctrl.dev/namespaced-policy";
const FIELD_MANAGER: &str = "wasmctrl-namespaced-policies";

struct Context {
    client: Client,
    resource: ApiResource,
    leadership: Arc<Leadership>,
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("{0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Serde(#[from] serde_json::Error),
    #[error("NamespacedReconcilePolicy {0} has no namespace")]
    NoNamespace(String),
}

/// Run until `stop`: turn every NamespacedReconcilePolicy the host watches (in `namespace`,
/// or all; matching `selector`, if any) into its ReconcilePolicy.
pub(crate) async fn run(
    client: Client,
    leadership: Arc<Leadership>,
    namespace: Option<String>,
    selector: Option<String>,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let resource = namespaced::api_resource();
    let sources: Api<DynamicObject> = match &namespace {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    let mut config = watcher::Config::default();
    if let Some(selector) = &selector {
        config = config.labels(selector);
    }
    let made = watcher::Config::default().labels(SOURCE_UID_LABEL);
    let mapped = resource.clone();
    let ctx = Arc::new(Context {
        client: client.clone(),
        resource: resource.clone(),
        leadership,
    });
    let controller = Controller::new_with(sources, config, resource)
        .watches(
            Api::<ReconcilePolicy>::all(client),
            made,
            move |policy: ReconcilePolicy| {
                source_of(&policy).map(|(namespace, name)| {
                    ObjectRef::new_with(name, mapped.clone()).within(namespace)
                })
            },
        )
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "namespaced policy");
            }
        });
    // Stopped at once, not drained: each write is whole and repeated on the next start, and a
    // watch that cannot list (a host without rights to the kind) must not hold a shutdown.
    tokio::select! {
        () = controller => {}
        () = stop => {}
    }
}

/// The source a ReconcilePolicy was made from, by its annotation.
fn source_of(policy: &ReconcilePolicy) -> Option<(&str, &str)> {
    policy.annotations().get(SOURCE_ANNOTATION)?.split_once('/')
}

fn error_policy(source: Arc<DynamicObject>, error: &Error, _: Arc<Context>) -> Action {
    tracing::warn!(namespace = ?source.namespace(), name = %source.name_any(), error = %error, "could not run a NamespacedReconcilePolicy");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(source: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    if !ctx.leadership.is_leader() {
        // A takeover re-lists; until then a standby writes nothing.
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    let name = source.name_any();
    let namespace = source
        .namespace()
        .ok_or_else(|| Error::NoNamespace(name.clone()))?;
    let uid = source.metadata.uid.clone().unwrap_or_default();
    let policies: Api<ReconcilePolicy> = Api::all(ctx.client.clone());
    let made_name = namespaced::cluster_name(&namespace, &name);
    let made = policies.get_opt(&made_name).await?;
    let ours = made
        .as_ref()
        .is_some_and(|p| p.labels().get(SOURCE_UID_LABEL) == Some(&uid));
    let sources: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &namespace, &ctx.resource);

    if source.metadata.deletion_timestamp.is_some() {
        if ours && let Some(made) = &made {
            // Its own finalizer releases its parents first; wait for it to be gone.
            if made.metadata.deletion_timestamp.is_none() {
                policies.delete(&made_name, &Default::default()).await?;
            }
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        set_finalizer(&sources, &source, false).await?;
        return Ok(Action::await_change());
    }
    set_finalizer(&sources, &source, true).await?;

    let confined = serde_json::from_value::<ReconcilePolicySpec>(source.data["spec"].clone())
        .map_err(|error| Refusal {
            reason: "InvalidSpec",
            message: format!("spec: {error}"),
        })
        .and_then(|spec| namespaced::confine(&namespace, spec));
    let spec = match confined {
        Ok(spec) if made.is_none() || ours => spec,
        Ok(_) => {
            let refusal = Refusal {
                reason: "NameTaken",
                message: format!(
                    "a ReconcilePolicy {made_name} that was not made from this one exists; rename this policy"
                ),
            };
            refuse(&sources, &source, &refusal).await?;
            return Ok(Action::await_change());
        }
        Err(refusal) => {
            refuse(&sources, &source, &refusal).await?;
            return Ok(Action::await_change());
        }
    };
    let mut labels = source.labels().clone();
    labels.insert(SOURCE_UID_LABEL.to_owned(), uid);
    let policy = json!({
        "apiVersion": "wasmctrl.dev/v1alpha1", "kind": "ReconcilePolicy",
        "metadata": {
            "name": made_name,
            "labels": labels,
            "annotations": {SOURCE_ANNOTATION: format!("{namespace}/{name}")},
        },
        "spec": spec,
    });
    let applied = policies
        .patch(
            &made_name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&policy),
        )
        .await?;
    mirror_status(&sources, &source, &applied).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Add or remove [`FINALIZER`] on `source`, bound to the resourceVersion read.
async fn set_finalizer(
    sources: &Api<DynamicObject>,
    source: &DynamicObject,
    present: bool,
) -> Result<(), Error> {
    let Some(ops) = release::finalizer_patch(&source.metadata, FINALIZER, present) else {
        return Ok(());
    };
    let patch: json_patch::Patch = serde_json::from_value(ops)?;
    let patched = sources
        .patch(
            &source.name_any(),
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await;
    gone_is_done(patched)
}

/// Say on `source` why it does not run.
async fn refuse(
    sources: &Api<DynamicObject>,
    source: &DynamicObject,
    refusal: &Refusal,
) -> Result<(), Error> {
    tracing::info!(namespace = ?source.namespace(), name = %source.name_any(), reason = refusal.reason, message = %refusal.message, "NamespacedReconcilePolicy refused");
    let condition = json!({
        "type": "Ready", "status": "False", "reason": refusal.reason, "message": refusal.message,
        "observedGeneration": source.metadata.generation,
        "lastTransitionTime": crate::controller::reconcile::status::now(),
    });
    write_status(
        sources,
        source,
        json!({"observedGeneration": source.metadata.generation, "conditions": [condition]}),
    )
    .await
}

/// Copy the ReconcilePolicy's status to its source. The generation it observed is the
/// source's when the ReconcilePolicy has acted on the spec last applied.
async fn mirror_status(
    sources: &Api<DynamicObject>,
    source: &DynamicObject,
    made: &ReconcilePolicy,
) -> Result<(), Error> {
    let Some(status) = &made.status else {
        return Ok(());
    };
    let mut status = serde_json::to_value(status)?;
    let current = status["observedGeneration"].as_i64() == made.metadata.generation;
    let generation = source.metadata.generation.filter(|_| current);
    let observed = |object: &mut Value| {
        if let Some(object) = object.as_object_mut() {
            match generation {
                Some(generation) => object.insert("observedGeneration".into(), json!(generation)),
                None => object.remove("observedGeneration"),
            };
        }
    };
    if let Some(conditions) = status["conditions"].as_array_mut() {
        conditions.iter_mut().for_each(observed);
    }
    observed(&mut status);
    write_status(sources, source, status).await
}

/// Replace `source`'s status when it differs.
async fn write_status(
    sources: &Api<DynamicObject>,
    source: &DynamicObject,
    status: Value,
) -> Result<(), Error> {
    if source.data.get("status") == Some(&status) {
        return Ok(());
    }
    // The whole status, so nothing the ReconcilePolicy dropped lingers here.
    let patch: json_patch::Patch =
        serde_json::from_value(json!([{"op": "add", "path": "/status", "value": status}]))?;
    let patched = sources
        .patch_status(
            &source.name_any(),
            &PatchParams::default(),
            &Patch::<()>::Json(patch),
        )
        .await;
    gone_is_done(patched)
}

/// A write to a source deleted meanwhile has nothing left to do.
fn gone_is_done(result: Result<DynamicObject, kube::Error>) -> Result<(), Error> {
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(error) => Err(error.into()),
    }
}
