//! `wasmctrl explain`, record and replay against a real control plane: what each reconcile did
//! to each child (created, changed with the fields, unchanged, pruned), a failing reconcile's
//! reason and the plugin's message, Secret values kept out of records, a saved case and a
//! recorded directory replaying to the same answer on the same plugin and to a would-change
//! on `myapp-v2`, and the deployed path through the API server's pod proxy.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser as _;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use wasmctrl::cli::{CasesDiffer, Cli, Command};
use wasmctrl::explain::{
    Bounds, ChildAction, Explain, ExplainOptions, Record, RecordOptions, RecordResult,
};
use wasmctrl::server::Access;
use wasmctrl::server::access::Reviewer;
use wasmctrl_e2e::*;
use wasmctrl_testenv::TestEnv;

/// Serve the host's endpoints to anyone over plain HTTP (`--insecure-listen`), on all
/// interfaces, until the returned sender fires.
async fn serve(
    host: &HostUnderTest,
) -> anyhow::Result<(SocketAddr, tokio::sync::oneshot::Sender<()>)> {
    host.serve(Access::Open).await
}

/// Serve the host's endpoints as `wasmctrl run` does by default: over TLS with a self-signed
/// certificate, `/metrics` and `/explain` to callers the API server vouches for.
async fn serve_checked(
    host: &HostUnderTest,
) -> anyhow::Result<(SocketAddr, tokio::sync::oneshot::Sender<()>)> {
    let access = Access::Reviewed {
        reviewer: Arc::new(Reviewer::new(TestEnv::get().client().await?)),
        tls: wasmctrl::server::tls::server_config(None, &["localhost".to_owned()])?,
    };
    host.serve(access).await
}

/// `wasmctrl ARGS…` for `explain`: what it prints.
async fn explain(args: &[&str]) -> anyhow::Result<String> {
    let mut all = vec!["wasmctrl", "explain"];
    all.extend_from_slice(args);
    match Cli::try_parse_from(all)?.command {
        Command::Explain(command) => command.render().await,
        _ => anyhow::bail!("not the explain command"),
    }
}

/// The records `explain` shows for `parent`, newest first.
async fn records(url: &str, ns: &str, parent: &str, history: usize) -> anyhow::Result<Vec<Record>> {
    let history = history.to_string();
    let text = explain(&[
        parent,
        "-n",
        ns,
        "--host",
        url,
        "--history",
        &history,
        "-o",
        "json",
    ])
    .await?;
    Ok(serde_json::from_str(&text)?)
}

/// Wait until one of the parent's records satisfies `check`; that record.
async fn wait_for_record(
    url: &str,
    ns: &str,
    parent: &str,
    what: &str,
    check: impl Fn(&Record) -> bool,
) -> anyhow::Result<Record> {
    let started = Instant::now();
    loop {
        if let Ok(found) = records(url, ns, parent, 50).await
            && let Some(record) = found.into_iter().find(&check)
        {
            return Ok(record);
        }
        anyhow::ensure!(started.elapsed() < ACT * 2, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn action(record: &Record, kind: &str) -> Option<(ChildAction, Vec<String>)> {
    record
        .children
        .iter()
        .find(|c| c.kind == kind)
        .map(|c| (c.action, c.changed.clone()))
}

/// `wasmctrl plugin replay ARGS…`: whether every case was unchanged.
async fn replay(args: &[&str]) -> anyhow::Result<bool> {
    let mut all = vec!["wasmctrl", "plugin", "replay"];
    all.extend_from_slice(args);
    match Cli::try_parse_from(all)?.run().await {
        Ok(()) => Ok(true),
        Err(error) if error.is::<CasesDiffer>() => Ok(false),
        Err(error) => Err(error),
    }
}

fn plugin(name: &str) -> String {
    wasmctrl_testenv::plugins::guest(name)
        .to_string_lossy()
        .into_owned()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_each_step_and_a_saved_or_recorded_case_replays() -> anyhow::Result<()> {
    const TEST: &str = "explain-myapp";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    let mut spec = myapp_policy_spec(file_source("myapp_plugin"), json!({"service": true}));
    spec["related"]
        .as_array_mut()
        .context("related")?
        .push(json!({"apiVersion": "v1", "kind": "Secret",
                     "selector": {"matchLabels": {"example.com/myapp-config": "true"}}}));
    apply_policy(&client, TEST, TEST, spec.clone()).await?;
    let record_dir = tempfile::tempdir()?;
    let explain_store = Arc::new(Explain::new(&ExplainOptions {
        bounds: Bounds {
            max_bytes: 8 << 20,
            per_parent: 50,
        },
        record: Some(RecordOptions {
            dir: record_dir.path().to_owned(),
            max_files: 500,
            one_in: 1,
        }),
        secret_data: false,
    })?);
    let host = HostUnderTest::builder(TEST, &ns)
        .explained(explain_store)
        .start()
        .await?;
    let (address, _stop) = serve(&host).await?;
    let url = format!("http://127.0.0.1:{}", address.port());

    // A Secret the policy relates: its value must never show.
    let secrets = api(&client, &resource("", "v1", "Secret"), &ns);
    apply(
        &secrets,
        json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "db", "labels": {"example.com/myapp-config": "true"}},
        "data": {"password": "c2VjcmV0LWh1bnRlcjI="}}),
    )
    .await?;

    // Created: both children, with the plugin's Warning about the missing ConfigMap (no
    // web-config exists).
    let myapps = myapps(&client, &ns);
    apply(&myapps, myapp("web", 2, "nginx:1.25", Some("web-config"))).await?;
    let created = wait_for_record(&url, &ns, "myapp/web", "a record of the creation", |r| {
        action(r, "Deployment").is_some_and(|(a, _)| a == ChildAction::Created)
    })
    .await?;
    assert_eq!(created.result, RecordResult::Reconciled);
    assert_eq!(
        action(&created, "Service").map(|a| a.0),
        Some(ChildAction::Created)
    );
    assert!(
        created
            .events
            .iter()
            .any(|e| e.reason == "ConfigMapMissing" && e.type_ == "Warning")
    );
    assert!(created.status.as_ref().is_some_and(|s| s.written));
    let steps: Vec<_> = created.steps.iter().map(|s| s.step.as_str()).collect();
    for step in [
        "caches", "request", "plugin", "validate", "apply", "prune", "status", "events",
    ] {
        assert!(steps.contains(&step), "step {step} missing from {steps:?}");
    }
    assert!(
        created
            .plugin
            .as_deref()
            .is_some_and(|p| p.starts_with("sha256:"))
    );

    // Unchanged: a reconcile with nothing to do writes nothing, and says so. A change the
    // decision does not depend on (an annotation) brings one; the host's own writes coming
    // back do not. Touched again until one finds the status settled too (the
    // controller-manager moves the Deployment's ready count meanwhile).
    let idle = |r: &Record| {
        r.children.len() == 2
            && r.children
                .iter()
                .all(|c| c.action == ChildAction::Unchanged)
            && r.status.as_ref().is_some_and(|s| !s.written)
    };
    let started = Instant::now();
    let quiet = loop {
        let touch = json!({"metadata": {"annotations": {"example.com/touched": started.elapsed().as_millis().to_string()}}});
        myapps
            .patch("web", &PatchParams::default(), &Patch::Merge(touch))
            .await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        if let Ok(found) = records(&url, &ns, "myapps.example.com/web", 50).await
            && let Some(record) = found.into_iter().find(idle)
        {
            break record;
        }
        anyhow::ensure!(
            started.elapsed() < ACT * 2,
            "timed out waiting for an idle reconcile"
        );
    };
    assert!(quiet.error.is_none());

    // Changed: the Deployment, naming the field that differed.
    apply(&myapps, myapp("web", 3, "nginx:1.25", Some("web-config"))).await?;
    let changed = wait_for_record(&url, &ns, "MyApp/web", "a record of the scale-up", |r| {
        action(r, "Deployment").is_some_and(|(a, _)| a == ChildAction::Changed)
    })
    .await?;
    let (_, fields) = action(&changed, "Deployment").context("deployment")?;
    assert!(fields.iter().any(|f| f == ".spec.replicas"), "{fields:?}");
    assert_eq!(
        action(&changed, "Service").map(|a| a.0),
        Some(ChildAction::Unchanged)
    );

    // The text form says the same for people.
    let text = explain(&["myapp/web", "-n", &ns, "--host", &url, "--history", "50"]).await?;
    assert!(
        text.contains("changed    Deployment web: .spec.replicas"),
        "{text}"
    );

    // Secret values are redacted in every record and recorded case.
    let json_text = explain(&["myapp/web", "-n", &ns, "--host", &url, "-o", "json"]).await?;
    assert!(
        json_text.contains("\"kind\": \"Secret\""),
        "the Secret is among the related objects"
    );
    assert!(json_text.contains("<redacted>"));
    assert!(
        !json_text.contains("c2VjcmV0LWh1bnRlcjI="),
        "Secret data in explain output"
    );

    // A saved case replays to the same answer on the same plugin, and v2 would change it.
    let case = record_dir.path().join("saved.yaml");
    explain(&[
        "myapp/web",
        "-n",
        &ns,
        "--host",
        &url,
        "--save",
        path(&case),
    ])
    .await?;
    let saved = std::fs::read_to_string(&case)?;
    assert!(!saved.contains("c2VjcmV0LWh1bnRlcjI="));
    assert!(replay(&[&plugin("myapp_plugin"), path(&case), "--expect"]).await?);
    assert!(!replay(&[&plugin("myapp_v2_plugin"), path(&case), "--expect"]).await?);

    // Pruned: the Service goes once the config no longer asks for it.
    spec["plugin"]["config"] = json!({"service": false});
    apply_policy(&client, TEST, TEST, spec).await?;
    wait_for_record(&url, &ns, "myapp/web", "a record of the prune", |r| {
        action(r, "Service").is_some_and(|(a, _)| a == ChildAction::Pruned)
    })
    .await?;

    // Every recorded reconcile replays unchanged on the plugin that answered it.
    let recorded = record_dir.path().join(TEST);
    let files = std::fs::read_dir(&recorded)?.count();
    assert!(files >= 4, "{files} recorded cases");
    let all = std::fs::read_to_string(recorded.read_dir()?.next().context("a case")??.path())?;
    assert!(all.contains("recorded:"), "{all}");
    assert!(replay(&[&plugin("myapp_plugin"), path(&recorded), "--expect"]).await?);

    // A parent the host never reconciled: a clear answer, not an empty list.
    let missing = explain(&["myapp/nope", "-n", &ns, "--host", &url]).await;
    let message = format!("{:#}", missing.expect_err("no record"));
    assert!(message.contains("no record of myapp"), "{message}");
    host.stop().await
}

/// This machine's address on its first non-loopback interface, which the API server can
/// dial (it refuses to proxy to loopback).
fn routable_address() -> anyhow::Result<std::net::IpAddr> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0")?;
    socket
        .connect("203.0.113.1:9")
        .context("no route off this machine: the pod proxy test needs a non-loopback address")?;
    Ok(socket.local_addr()?.ip())
}

/// A pod that stands for a deployed host replica: on a node no kubelet (or kwok) manages, with
/// its status saying it runs at `address`, behind a Service as the chart makes one.
async fn stand_in_replica(
    client: &kube::Client,
    ns: &str,
    address: SocketAddr,
) -> anyhow::Result<()> {
    let node_name = format!("explain-{ns}");
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({"metadata": {"name": node_name}}))?;
    nodes.create(&PostParams::default(), &node).await?;
    let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "wasmctrl-0", "labels": {"app.kubernetes.io/name": "wasmctrl"}},
        "spec": {"nodeName": node_name,
                 "tolerations": [{"operator": "Exists"}],
                 "containers": [{"name": "wasmctrl", "image": "wasmctrl",
                                 "ports": [{"name": "https", "containerPort": address.port()}]}]},
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    let ip = address.ip().to_string();
    pods.patch_status(
        "wasmctrl-0",
        &PatchParams::default(),
        &Patch::Merge(
            json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True"}]}}),
        ),
    )
    .await?;
    let services: kube::Api<Service> = kube::Api::namespaced(client.clone(), ns);
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": "wasmctrl-metrics"},
        "spec": {"selector": {"app.kubernetes.io/name": "wasmctrl"},
                 "ports": [{"name": "https", "port": 8443, "targetPort": "https"}]},
    }))?;
    services.create(&PostParams::default(), &service).await?;
    Ok(())
}

/// Let ServiceAccount `account` of `ns` get the widgets there.
async fn may_get_widgets(client: &kube::Client, ns: &str, account: &str) -> anyhow::Result<()> {
    bind_role(
        client,
        ns,
        "read-widgets",
        json!([{"apiGroups": ["e2e.wasmctrl.dev"], "resources": ["widgets"], "verbs": ["get"]}]),
        account_subject(ns, account),
    )
    .await
}

/// `wasmctrl explain` as `kubeconfig`'s user, through the API server's pod proxy.
async fn explain_through_api_server(
    parent: &str,
    ns: &str,
    kubeconfig: &Path,
    extra: &[&str],
) -> anyhow::Result<String> {
    let service = format!("{ns}/wasmctrl-metrics");
    let mut args = vec![
        parent,
        "-n",
        ns,
        "--service",
        &service,
        "--kubeconfig",
        path(kubeconfig),
    ];
    args.extend_from_slice(extra);
    explain(&args).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_reconcile_is_explained_through_the_api_server() -> anyhow::Result<()> {
    const TEST: &str = "explain-failure";
    let (client, ns) = widget_test(TEST, json!({"behavior": "permanent"})).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let (address, _stop) = serve_checked(&host).await?;
    apply(&widgets(&client, &ns), widget("broken", None)).await?;

    let replica = SocketAddr::new(routable_address()?, address.port());
    stand_in_replica(&client, &ns, replica).await?;
    // Two people who hold the chart's explain-reader role; only one may read widgets.
    let dir = tempfile::tempdir()?;
    let admin = TestEnv::get().kubeconfig().to_path_buf();
    let mut kubeconfigs = Vec::new();
    for person in ["reader", "stranger"] {
        service_account(&client, &ns, person).await?;
        install_explain_reader(&client, "wasmctrl", &ns, &account_subject(&ns, person)).await?;
        let token = service_account_token(&ns, person).await?;
        kubeconfigs.push(token_kubeconfig(&admin, &token, person, dir.path())?);
    }
    may_get_widgets(&client, &ns, "reader").await?;
    let (reader, stranger) = (&kubeconfigs[0], &kubeconfigs[1]);

    let started = Instant::now();
    let text = loop {
        match explain_through_api_server("widget/broken", &ns, reader, &[]).await {
            Ok(text) if text.contains("Failed") => break text,
            other => {
                anyhow::ensure!(
                    started.elapsed() < ACT,
                    "no failed record through the API server: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    };
    assert!(text.contains("error:   PluginReportedError"), "{text}");
    assert!(
        text.contains("broken can never work"),
        "the plugin's message: {text}"
    );
    assert!(
        text.contains("Warning PluginReportedError"),
        "the Event: {text}"
    );

    let yaml = explain_through_api_server(
        "widgets.e2e.wasmctrl.dev/broken",
        &ns,
        reader,
        &["-o", "yaml"],
    )
    .await?;
    let records: Vec<Value> = serde_yaml_ng::from_str(&yaml)?;
    assert_eq!(records[0]["result"], "Failed");
    assert_eq!(
        records[0]["case"]["recorded"]["error"]["outcome"],
        "reported_error"
    );

    // Reaching the host is not enough: the host asks whether the caller may get the parent.
    let refused = explain_through_api_server("widget/broken", &ns, stranger, &[]).await;
    let message = format!("{:#}", refused.expect_err("refused"));
    assert!(
        message.contains(&format!(
            "system:serviceaccount:{ns}:stranger may not get widgets.e2e.wasmctrl.dev broken in namespace {ns}"
        )),
        "{message}"
    );
    assert!(!message.contains("can never work"), "{message}");
    // A user who signs in with a client certificate has no token the host could review.
    let refused = explain_through_api_server("widget/broken", &ns, &admin, &[]).await;
    let message = format!("{:#}", refused.expect_err("refused"));
    assert!(message.contains("client certificate"), "{message}");

    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    nodes
        .delete(&format!("explain-{ns}"), &Default::default())
        .await?;
    host.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_answers_only_callers_the_api_server_vouches_for() -> anyhow::Result<()> {
    const TEST: &str = "explain-access";
    let (client, ns) = widget_test(TEST, json!({"behavior": "permanent"})).await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;
    let (address, _stop) = serve_checked(&host).await?;
    apply(&widgets(&client, &ns), widget("broken", None)).await?;
    for account in ["reader", "stranger", "scraper"] {
        service_account(&client, &ns, account).await?;
    }
    may_get_widgets(&client, &ns, "reader").await?;
    may_read_metrics(&client, &ns, "scraper").await?;
    let reader = service_account_token(&ns, "reader").await?;
    let stranger = service_account_token(&ns, "stranger").await?;
    let scraper = service_account_token(&ns, "scraper").await?;

    let query = format!("/explain?kind=widget&namespace={ns}&name=broken");
    let started = Instant::now();
    let records = loop {
        let (status, body) = https_get(address, &query, Some(&reader)).await?;
        if status == 200 {
            break body;
        }
        anyhow::ensure!(
            started.elapsed() < ACT,
            "no record for the reader: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(records.contains("broken can never work"), "{records}");

    for token in [None, Some("not-a-token")] {
        let (status, body) = https_get(address, &query, token).await?;
        assert_eq!(status, 401, "{token:?}: {body}");
        assert_eq!(https_get(address, "/metrics", token).await?.0, 401);
    }
    let (status, body) = https_get(address, &query, Some(&stranger)).await?;
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains(&format!(
            "may not get widgets.e2e.wasmctrl.dev broken in namespace {ns}"
        )),
        "{body}"
    );
    assert!(
        !body.contains("can never work") && !body.contains("records"),
        "nothing of the record in a refusal: {body}"
    );
    // Nor does a refusal tell whether the host holds a record at all: a parent it has never
    // seen is refused the same way, and only a caller who may get it learns there is none.
    let ghost = format!("/explain?kind=widget&namespace={ns}&name=ghost");
    let (status, ghost_body) = https_get(address, &ghost, Some(&stranger)).await?;
    assert_eq!(status, 403, "{ghost_body}");
    assert_eq!(ghost_body, body.replace(" broken ", " ghost "));
    let (status, body) = https_get(address, &ghost, Some(&reader)).await?;
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("no record of widget"), "{body}");

    let (status, body) = https_get(address, "/metrics", Some(&reader)).await?;
    assert_eq!(
        status, 403,
        "reading a parent is not reading metrics: {body}"
    );
    let (status, metrics) = https_get(address, "/metrics", Some(&scraper)).await?;
    assert_eq!(status, 200, "{metrics}");
    assert!(
        metrics.contains("controller_runtime_reconcile_total"),
        "{metrics}"
    );
    let (status, body) = https_get(address, &query, Some(&scraper)).await?;
    assert_eq!(
        status, 403,
        "reading metrics is not reading parents: {body}"
    );

    // The kubelet's probes need no token.
    assert_eq!(https_get(address, "/healthz", None).await?.0, 200);
    assert_eq!(https_get(address, "/readyz", None).await?.0, 200);
    // And nothing is served in clear text on the secure port.
    let local = SocketAddr::from(([127, 0, 0, 1], address.port()));
    assert!(
        !matches!(http_get(local, "/metrics").await, Ok((200, _))),
        "plain HTTP answered"
    );
    host.stop().await
}

/// Env var that turns this test binary into a host process: its `wasmctrl` arguments, JSON.
const HOST_ARGS: &str = "WASMCTRL_E2E_EXPLAIN_HOST";

/// Not a test: the body of the host process of the trace test (does nothing when run alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs only as the host of the trace test"]
async fn host_process() -> anyhow::Result<()> {
    let Ok(args) = std::env::var(HOST_ARGS) else {
        return Ok(());
    };
    let args: Vec<String> = serde_json::from_str(&args)?;
    let telemetry = wasmctrl::telemetry::init(wasmctrl::telemetry::LogFormat::Text)?;
    let result = Cli::parse_from(args).run().await;
    tokio::task::spawn_blocking(move || telemetry.shutdown()).await?;
    result
}

/// A stand-in OTLP/HTTP collector: answers every request 200 and keeps the bodies of the
/// ones posted to `/v1/traces`.
async fn collector() -> anyhow::Result<(SocketAddr, Arc<std::sync::Mutex<Vec<Vec<u8>>>>)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = bodies.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 8192];
                // Headers, then as many body bytes as content-length says.
                loop {
                    let Ok(n) = stream.read(&mut buffer).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..n]);
                    let text = String::from_utf8_lossy(&request);
                    let Some(end) = text.find("\r\n\r\n") else {
                        continue;
                    };
                    let length = text[..end]
                        .lines()
                        .find_map(|l| {
                            let (name, value) = l.split_once(':')?;
                            name.eq_ignore_ascii_case("content-length")
                                .then(|| value.trim().parse::<usize>().ok())?
                        })
                        .unwrap_or(0);
                    if request.len() >= end + 4 + length {
                        if text.starts_with("POST /v1/traces") {
                            kept.lock()
                                .expect("not poisoned")
                                .push(request[end + 4..end + 4 + length].to_vec());
                        }
                        let _ = stream
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                            .await;
                        return;
                    }
                }
            });
        }
    });
    Ok((address, bodies))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciles_are_exported_as_traces_with_their_steps() -> anyhow::Result<()> {
    const TEST: &str = "explain-traces";
    let (client, ns) = widget_test(TEST, json!({})).await?;
    let (collector, bodies) = collector().await?;
    let kubeconfig = TestEnv::get().kubeconfig().to_string_lossy().into_owned();
    let selector = format!("{TEST_LABEL}={TEST}");
    let plugins = wasmctrl_testenv::plugins::plugin_dir();
    let args = [
        "wasmctrl",
        "run",
        "--kubeconfig",
        &kubeconfig,
        "--plugin-dir",
        &plugins.to_string_lossy(),
        "--namespace",
        &ns,
        "--policy-selector",
        &selector,
        "--listen",
        "off",
    ];
    let (command_line, endpoint) = (serde_json::to_string(&args)?, format!("http://{collector}"));
    let mut host = spawn_self(
        "host_process",
        &[
            (HOST_ARGS, command_line.as_str()),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "200"),
            ("WASMCTRL_LOG", "warn"),
        ],
    )?;
    apply(&widgets(&client, &ns), widget("traced", None)).await?;

    let started = Instant::now();
    let exported = loop {
        let all: Vec<u8> = bodies.lock().expect("not poisoned").concat();
        let has = |name: &str| all.windows(name.len()).any(|w| w == name.as_bytes());
        if has("reconcile") && has("validate") && has("status") && has("traced") {
            break all;
        }
        if started.elapsed() > ACT * 2 || host.try_wait()?.is_some() {
            anyhow::bail!(
                "no reconcile trace reached the collector ({} bytes)",
                all.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    drop(host);
    for step in [
        "caches",
        "finalizer",
        "request",
        "plugin",
        "apply",
        "prune",
        "events",
        "wasmctrl",
    ] {
        assert!(
            exported.windows(step.len()).any(|w| w == step.as_bytes()),
            "{step} missing from the exported spans"
        );
    }
    Ok(())
}
