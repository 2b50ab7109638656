//! Objects of any kind, as JSON: their APIs, applying and reading them, and waiting for them.

use std::time::Duration;

use anyhow::Context as _;
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::Value;
use wasmctrl_testenv::cluster::eventually;

use crate::ACT;

/// The API resource of `kind` in `group`/`version` (`""` for the core group).
pub fn resource(group: &str, version: &str, kind: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind))
}

/// An API for `resource` in `namespace`.
pub fn api(client: &Client, resource: &ApiResource, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), namespace, resource)
}

/// Server-side apply `object` (a JSON manifest) as the test's own field manager.
pub async fn apply(api: &Api<DynamicObject>, object: Value) -> anyhow::Result<DynamicObject> {
    let name = object["metadata"]["name"]
        .as_str()
        .context("object without a name")?
        .to_owned();
    api.patch(
        &name,
        &PatchParams::apply("wasmctrl-e2e").force(),
        &Patch::Apply(&object),
    )
    .await
    .with_context(|| format!("applying {name}"))
}

/// The object as JSON, or `None` if it does not exist.
pub async fn get(api: &Api<DynamicObject>, name: &str) -> anyhow::Result<Option<Value>> {
    Ok(api
        .get_opt(name)
        .await?
        .map(|o| serde_json::to_value(o).unwrap_or_default()))
}

/// The condition `type_` of `object`'s status.
pub fn condition<'a>(object: &'a Value, type_: &str) -> Option<&'a Value> {
    object["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// The message of the condition `type_` of `object`'s status, or empty.
pub fn condition_message(object: &Value, type_: &str) -> String {
    condition(object, type_)
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_owned()
}

/// Wait until `check` accepts the object (which must exist).
pub async fn wait_for_object(
    api: &Api<DynamicObject>,
    name: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    wait_for_object_within(api, name, what, ACT, check).await
}

/// [`wait_for_object`] with a window of its own, for a step whose cost is not the host's
/// reaction: compiling a large plugin, say.
pub async fn wait_for_object_within(
    api: &Api<DynamicObject>,
    name: &str,
    what: &str,
    timeout: Duration,
    check: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    let found = std::sync::Mutex::new(Value::Null);
    eventually(what, timeout, || {
        let fetched = get(api, name);
        let check = &check;
        let found = &found;
        async move {
            Ok(match fetched.await? {
                Some(object) if check(&object) => {
                    *found.lock().expect("not poisoned") = object;
                    true
                }
                _ => false,
            })
        }
    })
    .await?;
    Ok(found.into_inner().expect("not poisoned"))
}

/// Wait until the object is gone.
pub async fn wait_gone(api: &Api<DynamicObject>, name: &str, what: &str) -> anyhow::Result<()> {
    eventually(
        what,
        ACT,
        || async move { Ok(get(api, name).await?.is_none()) },
    )
    .await
}

/// How long garbage collection may take. It is kube-controller-manager's work, not the
/// host's, and for a kind whose CRD was installed moments ago its collector first has to
/// notice the kind (its discovery resyncs every 30 s).
pub const COLLECT: Duration = Duration::from_secs(90);

/// Wait until garbage collection has removed the object.
pub async fn wait_collected(
    api: &Api<DynamicObject>,
    name: &str,
    what: &str,
) -> anyhow::Result<()> {
    eventually(what, COLLECT, || async move {
        Ok(get(api, name).await?.is_none())
    })
    .await
}

/// Event reasons recorded on objects named `name` in `namespace`.
pub async fn event_reasons(
    client: &Client,
    namespace: &str,
    name: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), namespace);
    Ok(events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.type_.unwrap_or_default(), e.reason.unwrap_or_default()))
        .collect())
}
