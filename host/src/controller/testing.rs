//! What the controller's unit tests share: kube-runtime stores filled directly (as
//! kube-runtime's own tests fill them, no API server), objects, and a loaded plugin.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use kube::core::{ApiResource, DynamicObject};
use kube::runtime::reflector::Store;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher;
use serde_json::json;

use crate::controller::cache::cached::CachedObject;
use crate::controller::cache::store_index::StoreIndex;
use crate::controller::reconcile::serving::ActivePlugin;
use crate::plugin::{EngineOptions, Limits, Plugin, PluginEngine};

/// A client that reaches no API server (a test's reads fail, as when it is unreachable).
/// Needs a Tokio runtime.
pub fn offline_client() -> kube::Client {
    crate::ensure_crypto_provider();
    let config = kube::Config::new("http://127.0.0.1:9".parse().expect("a URI"));
    kube::Client::try_from(config).expect("a client needs no server")
}

/// The ConfigMap kind.
pub fn config_maps() -> ApiResource {
    ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&())
}

/// The MyApp parent kind.
pub fn myapps() -> ApiResource {
    ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
        "example.com",
        "v1",
        "MyApp",
    ))
}

/// A synced store of `resource` holding `objects`, cached as the watches cache them.
pub fn store(resource: ApiResource, objects: Vec<DynamicObject>) -> Store<CachedObject> {
    let objects = objects
        .into_iter()
        .map(|object| {
            serde_json::to_value(object)
                .and_then(CachedObject::from_value)
                .unwrap_or_else(|e| panic!("{e}"))
        })
        .collect();
    indexed_store(Arc::new(resource), objects, |_| None).0
}

/// A synced store of `resource` holding `objects`, and its index under `key`, fed the same
/// events as a watch would feed them.
pub fn indexed_store<K>(
    resource: K::DynamicType,
    objects: Vec<K>,
    key: fn(&K) -> Option<String>,
) -> (Store<K>, Arc<StoreIndex<K>>)
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash,
{
    let index = Arc::new(StoreIndex::new(resource.clone(), key));
    let mut writer = Writer::new(resource);
    let mut feed = |event: watcher::Event<K>| {
        index.observe(&event);
        writer.apply_watcher_event(&event);
    };
    feed(watcher::Event::Init);
    for object in objects {
        feed(watcher::Event::InitApply(object));
    }
    feed(watcher::Event::InitDone);
    (writer.as_reader(), index)
}

/// A MyApp parent in `namespace` with `labels`.
pub fn parent(namespace: &str, name: &str, labels: &[(&str, &str)]) -> DynamicObject {
    let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
    serde_json::from_value(json!({
        "apiVersion": "example.com/v1", "kind": "MyApp",
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}"), "labels": labels},
    }))
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The selector `key=value`.
pub fn label_selector(key: &str, value: &str) -> kube::core::Selector {
    kube::core::Expression::Equal(key.into(), value.into()).into()
}

/// The MyApp plugin, loaded once per test process.
pub fn plugin() -> Plugin {
    static PLUGIN: OnceLock<Plugin> = OnceLock::new();
    PLUGIN
        .get_or_init(|| {
            let engine = PluginEngine::new(EngineOptions {
                cache_dir: Some(std::env::temp_dir().join("wasmctrl-unit-artifacts")),
                max_concurrent_calls: 2,
                ..EngineOptions::default()
            })
            .unwrap_or_else(|e| panic!("engine: {e:#}"));
            let bytes = wasmctrl_testenv::plugins::guest_bytes("myapp_plugin");
            engine
                .load(&bytes, None, Limits::default())
                .unwrap_or_else(|e| panic!("load: {e}"))
        })
        .clone()
}

/// The MyApp plugin called with `config`: two of these with different configs are two
/// different serving plugins as far as selection is concerned.
pub fn serving(config: &str) -> Arc<ActivePlugin> {
    Arc::new(ActivePlugin {
        plugin: plugin(),
        config: Some(config.to_owned()),
    })
}

/// The child kinds of the validation tests: a namespaced Deployment, a cluster-scoped Namespace.
pub fn allowed_kinds() -> Vec<crate::controller::reconcile::children::AllowedKind> {
    use crate::controller::reconcile::children::AllowedKind;
    vec![
        AllowedKind {
            api_version: "apps/v1".into(),
            kind: "Deployment".into(),
            namespaced: true,
        },
        AllowedKind {
            api_version: "v1".into(),
            kind: "Namespace".into(),
            namespaced: false,
        },
    ]
}

/// A MyApp parent `web` in namespace `team-a`.
pub fn team_a_parent() -> crate::controller::reconcile::parent::ParentIdentity {
    crate::controller::reconcile::parent::ParentIdentity {
        api_version: "example.com/v1".into(),
        kind: "MyApp".into(),
        name: "web".into(),
        namespace: Some("team-a".into()),
        uid: "uid-1".into(),
        shard: None,
    }
}

/// `value`, which must be a JSON object, as one.
pub fn object(value: serde_json::Value) -> crate::plugin::JsonObject {
    match value {
        serde_json::Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

/// A desired Deployment `name` with three replicas.
pub fn deployment(name: &str) -> crate::plugin::JsonObject {
    object(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"replicas": 3},
    }))
}

/// A validated child of kind `kind_index` named `name` in namespace `a`, depending on the
/// children at `depends_on`, with an empty object: for what decides on names and order.
pub fn desired_child(
    kind_index: usize,
    name: &str,
    depends_on: Vec<usize>,
) -> crate::controller::reconcile::children::DesiredChild {
    crate::controller::reconcile::children::DesiredChild {
        kind_index,
        name: name.to_owned(),
        namespace: Some("a".into()),
        object: serde_json::json!({}),
        hash: String::new(),
        depends_on,
    }
}
