//! Ordered children against a real API server, with the controller manager, the scheduler
//! and kwok making StatefulSets, Jobs and Deployments progress: the Stack example plugin's
//! database comes first, its migration Job only once the database is ready, the app only
//! once the Job has completed; the Stack says what it waits for; deleting a Stack deletes
//! the app, then the Job, then the database — also when the plugin has since been replaced
//! by one that traps. An order that goes in a circle is refused, naming the circle.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use kube::api::{Api, DeleteParams, DynamicObject};
use kube::runtime::watcher;
use serde_json::{Value, json};
use wasmctrl_e2e::*;
use wasmctrl_testenv::cluster::eventually;

/// How long a Stack takes to come up: a StatefulSet's pod scheduled and made ready by kwok,
/// a Job's pod run to completion, each seen by its controller.
const COME_UP: Duration = Duration::from_secs(90);

fn stack(name: &str) -> Value {
    json!({
        "apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Stack", "metadata": {"name": name},
        "spec": {"app": {"image": "shop:1"}, "database": {"image": "postgres:17"},
                 "migration": {"image": "shop-migrate:1"}},
    })
}

fn stack_policy(plugin: Value) -> Value {
    json!({
        "parent": {"apiVersion": format!("{TEST_GROUP}/v1"), "kind": "Stack"},
        "children": [
            {"apiVersion": "apps/v1", "kind": "StatefulSet"},
            {"apiVersion": "v1", "kind": "Service"},
            {"apiVersion": "batch/v1", "kind": "Job"},
            {"apiVersion": "apps/v1", "kind": "Deployment"},
        ],
        "plugin": plugin,
    })
}

/// The APIs of a Stack's children: database (StatefulSet and Service), migration, app.
struct Parts {
    database: Api<DynamicObject>,
    service: Api<DynamicObject>,
    migration: Api<DynamicObject>,
    app: Api<DynamicObject>,
}

impl Parts {
    fn new(client: &kube::Client, ns: &str) -> Self {
        Self {
            database: api(client, &resource("apps", "v1", "StatefulSet"), ns),
            service: api(client, &resource("", "v1", "Service"), ns),
            migration: api(client, &resource("batch", "v1", "Job"), ns),
            app: api(client, &resource("apps", "v1", "Deployment"), ns),
        }
    }

    /// The four children of Stack `name`, with their APIs, in the order they come up.
    fn of<'a>(&'a self, name: &str) -> [(&'a Api<DynamicObject>, String); 4] {
        [
            (&self.database, format!("{name}-db")),
            (&self.service, format!("{name}-db")),
            (&self.migration, format!("{name}-migrate")),
            (&self.app, format!("{name}-app")),
        ]
    }
}

/// RFC 3339 seconds, as Kubernetes writes timestamps, for comparing them.
fn seconds(value: &Value) -> anyhow::Result<i64> {
    let text = value.as_str().context("a timestamp")?;
    Ok(text.parse::<jiff::Timestamp>()?.as_second())
}

/// Bring Stack `name` up and check that each part came only after what it depends on was
/// ready; returns the Progressing messages seen on the way.
async fn come_up(
    client: &kube::Client,
    ns: &str,
    parts: &Parts,
    name: &str,
) -> anyhow::Result<Vec<String>> {
    let stacks = api(client, &resource(TEST_GROUP, "v1", "Stack"), ns);
    apply(&stacks, stack(name)).await?;
    let waits = std::sync::Mutex::new(Vec::<String>::new());
    eventually(
        &format!("Stack {name} applied in full"),
        COME_UP,
        || async {
            let Some(stack) = get(&stacks, name).await? else {
                return Ok(false);
            };
            let Some(progressing) = condition(&stack, "Progressing") else {
                return Ok(false);
            };
            let message = progressing["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            if progressing["reason"] == "WaitingFor" {
                let mut waits = waits.lock().expect("not poisoned");
                if waits.last() != Some(&message) {
                    waits.push(message);
                }
            }
            // The host judges the Stack's Ready (its plugin sets none) by the children's
            // own status: True only once the app is available.
            let ready = condition(&stack, "Ready")
                .is_some_and(|c| c["status"] == "True" && c["reason"] == "ChildrenReady");
            Ok(progressing["status"] == "False" && progressing["reason"] == "Applied" && ready)
        },
    )
    .await?;
    let [(_, database), _, (_, migration), (_, app)] = parts.of(name);
    // The database's pod was ready before the migration Job was created...
    let pods = api(client, &resource("", "v1", "Pod"), ns);
    let pod = get(&pods, &format!("{database}-0"))
        .await?
        .context("the database's pod")?;
    let ready = condition(&pod, "Ready").context("the pod's Ready condition")?;
    let job = get(&parts.migration, &migration)
        .await?
        .context("the Job")?;
    assert!(
        seconds(&ready["lastTransitionTime"])? <= seconds(&job["metadata"]["creationTimestamp"])?,
        "the migration came before the database was ready: {ready} vs {job}"
    );
    // ...and the Job had completed before the app was created, which was available when
    // the Stack said Ready.
    let deployment = get(&parts.app, &app).await?.context("the Deployment")?;
    assert!(
        deployment["status"]["availableReplicas"].as_u64() >= Some(1),
        "{deployment}"
    );
    assert!(
        seconds(&job["status"]["completionTime"])?
            <= seconds(&deployment["metadata"]["creationTimestamp"])?,
        "the app came before the migration completed: {job} vs {deployment}"
    );
    Ok(waits.into_inner().expect("not poisoned"))
}

/// Delete Stack `name` and return the etcd revision at which each of its children was
/// deleted (the resourceVersion of its watch's DELETED event), by child name and kind.
async fn go_down(
    client: &kube::Client,
    ns: &str,
    parts: &Parts,
    name: &str,
) -> anyhow::Result<HashMap<String, u64>> {
    let children = parts.of(name);
    // One watch per child, started (listed) before the deletion: each says when it is
    // listening, then the revision of its child's deletion.
    let mut events = futures::stream::select_all(children.iter().map(|(api, child)| {
        let config = watcher::Config::default().fields(&format!("metadata.name={child}"));
        let kind = api
            .resource_url()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        let key = format!("{kind}/{child}");
        watcher(Api::clone(api), config)
            .filter_map(move |event| {
                let seen = match event {
                    Ok(watcher::Event::InitDone) => Some((key.clone(), None)),
                    Ok(watcher::Event::Delete(object)) => object
                        .metadata
                        .resource_version
                        .and_then(|rv| rv.parse::<u64>().ok())
                        .map(|rv| (key.clone(), Some(rv))),
                    _ => None,
                };
                async move { seen }
            })
            .boxed()
    }));
    let (sender, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let watching = tokio::spawn(async move {
        while let Some(event) = events.next().await {
            if sender.send(event).is_err() {
                return;
            }
        }
    });
    let mut listening = 0;
    let mut revisions = HashMap::new();
    let outcome = tokio::time::timeout(COME_UP, async {
        while listening < children.len() {
            match seen.recv().await {
                Some((_, None)) => listening += 1,
                Some((key, Some(revision))) => {
                    anyhow::bail!("{key} was deleted early, at {revision}")
                }
                None => anyhow::bail!("the watches ended"),
            }
        }
        let stacks = api(client, &resource(TEST_GROUP, "v1", "Stack"), ns);
        stacks.delete(name, &DeleteParams::default()).await?;
        while revisions.len() < children.len() {
            match seen.recv().await {
                Some((key, Some(revision))) => {
                    revisions.insert(key, revision);
                }
                Some((_, None)) => {}
                None => anyhow::bail!("the watches ended"),
            }
        }
        Ok(())
    })
    .await;
    watching.abort();
    outcome
        .with_context(|| format!("Stack {name}'s children deleted; saw only {revisions:?}"))??;
    Ok(revisions)
}

fn assert_reverse_order(revisions: &HashMap<String, u64>, name: &str) {
    let at = |kind: &str, child: String| revisions[&format!("{kind}/{child}")];
    let app = at("deployments", format!("{name}-app"));
    let migration = at("jobs", format!("{name}-migrate"));
    let database = at("statefulsets", format!("{name}-db"));
    let service = at("services", format!("{name}-db"));
    assert!(
        app < migration && migration < database && migration < service,
        "Stack {name} went down out of order (etcd revisions of the deletions): {revisions:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stack_comes_up_in_order_and_goes_down_in_reverse_even_under_a_trapping_plugin()
-> anyhow::Result<()> {
    const TEST: &str = "ordered-stack";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    install_crd(&client, &test_crd(TEST_GROUP, "Stack")).await?;
    apply_policy(
        &client,
        TEST,
        TEST,
        stack_policy(json!({"source": file_source("stack_plugin")})),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let parts = Parts::new(&client, &ns);

    let (shop, kept) = tokio::try_join!(
        come_up(&client, &ns, &parts, "shop"),
        come_up(&client, &ns, &parts, "kept"),
    )?;
    // The Stack said what it waited for on the way.
    for waits in [&shop, &kept] {
        assert!(
            waits
                .iter()
                .any(|w| w.contains("waits for Job") && w.contains("-migrate: not complete")),
            "the Stack showed no wait for its migration: {waits:?}"
        );
    }
    // Every child that others depend on is held for them; the app, which nothing needs, is not.
    for (api, child) in parts.of("shop") {
        let object = get(api, &child).await?.context("a child")?;
        let held = object["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| f.iter().any(|f| f == "wasmctrl.dev/teardown-order"));
        assert_eq!(held, !child.ends_with("-app"), "{child}: {object}");
    }

    assert_reverse_order(&go_down(&client, &ns, &parts, "shop").await?, "shop");

    // The plugin replaced by one that traps: the order is on the children, not in the plugin.
    apply_policy(
        &client,
        TEST,
        TEST,
        stack_policy(
            json!({"source": file_source("misbehave_plugin"), "config": {"behavior": "panic"}}),
        ),
    )
    .await?;
    let stacks = api(&client, &resource(TEST_GROUP, "v1", "Stack"), &ns);
    wait_for_object(
        &stacks,
        "kept",
        "the trapping plugin serves the Stack",
        |s| condition(s, "Reconciled").is_some_and(|c| c["status"] == "False"),
    )
    .await?;
    assert_reverse_order(&go_down(&client, &ns, &parts, "kept").await?, "kept");

    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_in_a_circle_is_refused_naming_the_circle_and_nothing_is_applied()
-> anyhow::Result<()> {
    const TEST: &str = "ordered-cycle";
    let after = |name: &str, dependency: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name,
            "annotations": {"wasmctrl.dev/depends-on": format!("ConfigMap/{dependency}")}}})
    };
    let (client, ns) = widget_test(
        TEST,
        json!({"children": [after("first", "second"), after("second", "third"), after("third", "first")]}),
    )
    .await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w", None)).await?;
    let refused = wait_for_object(&widgets, "w", "the answer refused", |w| {
        condition(w, "Reconciled").is_some_and(|c| c["reason"] == "InvalidChildren")
    })
    .await?;
    let message = condition_message(&refused, "Reconciled");
    assert!(
        message.contains(
            "the children's order has a cycle: ConfigMap/first → ConfigMap/second → ConfigMap/third → ConfigMap/first"
        ),
        "{message}"
    );
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    for name in ["first", "second", "third"] {
        assert!(
            get(&config_maps, name).await?.is_none(),
            "{name} was applied"
        );
    }
    host.stop().await?;
    delete_namespace(&client, &ns).await?;
    policies(&client).delete(TEST, &Default::default()).await?;
    Ok(())
}
