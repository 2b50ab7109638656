//! The host's HTTP listener as a kubelet and Prometheus see it: `/healthz` always, `/readyz`
//! only once the policies are listed and their caches synced, `/metrics` with
//! controller-runtime's series after real reconciles.

use std::sync::Arc;

use serde_json::json;
use wasmctrl::health::Readiness;
use wasmctrl::metrics::Metrics;
use wasmctrl_e2e::*;

/// Serve the host's endpoints on an ephemeral loopback port until the returned sender fires.
async fn serve(
    readiness: Arc<Readiness>,
    metrics: Arc<Metrics>,
) -> anyhow::Result<(std::net::SocketAddr, tokio::sync::oneshot::Sender<()>)> {
    let listener = wasmctrl::server::bind("127.0.0.1:0".parse()?).await?;
    let address = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let endpoints = wasmctrl::server::Endpoints {
        readiness,
        metrics,
        explain: Arc::new(wasmctrl::explain::Explain::in_memory(
            wasmctrl::explain::ExplainOptions::default().bounds,
        )),
        access: wasmctrl::server::Access::Open,
    };
    tokio::spawn(wasmctrl::server::serve(listener, endpoints, async move {
        let _ = stopped.await;
    }));
    Ok((address, stop))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_has_not_listed_its_policies_is_alive_but_not_ready() -> anyhow::Result<()> {
    let (address, _stop) = serve(Arc::default(), Arc::default()).await?;
    assert_eq!(http_get(address, "/healthz").await?, (200, "ok".into()));
    let (status, body) = http_get(address, "/readyz").await?;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("ReconcilePolicies not listed yet"), "{body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_host_is_ready_and_its_metrics_count_reconciles() -> anyhow::Result<()> {
    const TEST: &str = "server-metrics";
    let (client, ns) = widget_test(TEST, json!({"ownChild": true})).await?;
    // No precompiled artifact: the plugin takes a while to compile, and the host must not
    // say ready before it is loaded and the policy's caches are synced.
    let host = HostUnderTest::builder(TEST, &ns)
        .without_disk_cache()
        .start()
        .await?;
    let (address, stop) = serve(host.readiness.clone(), host.metrics.clone()).await?;
    let deadline = tokio::time::Instant::now() + ACT;
    while http_get(address, "/readyz").await? != (200, "ok".into()) {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "/readyz never said ok"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let (_, text) = http_get(address, "/metrics").await?;
    assert!(
        text.contains(&format!(
            r#"wasmctrl_plugin_active_info{{controller="{TEST}",digest="sha256:"#
        )),
        "ready before the policy's controller started:\n{text}"
    );

    let widgets = widgets(&client, &ns);
    apply(&widgets, widget("w", Some(1))).await?;
    wait_for_object(&widgets, "w", "w reconciled", |w| {
        condition(w, "Reconciled").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    // The status write that makes w Reconciled happens inside the reconcile; its counts go up
    // when the reconcile returns, a moment later.
    let success =
        format!(r#"controller_runtime_reconcile_total{{controller="{TEST}",result="success"}} "#);
    let counted = |text: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(&success))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .is_some_and(|n| n >= 1)
    };
    wasmctrl_testenv::cluster::eventually("a successful reconcile counted", ACT, || async {
        let (status, text) = http_get(address, "/metrics").await?;
        Ok(status == 200 && counted(&text))
    })
    .await?;
    let (status, text) = http_get(address, "/metrics").await?;
    assert_eq!(status, 200);
    assert!(
        !text.contains(&format!(
            r#"controller_runtime_reconcile_errors_total{{controller="{TEST}"}}"#
        )),
        "a clean run counts no error:\n{text}"
    );
    assert!(
        text.trim_end().ends_with("# EOF"),
        "OpenMetrics text ends with # EOF"
    );
    let value = |text: &str, series: &str| -> Option<f64> {
        text.lines()
            .find_map(|line| line.strip_prefix(series))
            .and_then(|n| n.trim().parse().ok())
    };
    let at_least_one = [
        format!(r#"controller_runtime_reconcile_time_seconds_count{{controller="{TEST}"}} "#),
        format!(r#"workqueue_adds_total{{name="{TEST}"}} "#),
        format!(r#"wasmctrl_plugin_calls_total{{controller="{TEST}",outcome="ok"}} "#),
        format!(r#"wasmctrl_plugin_call_duration_seconds_count{{controller="{TEST}"}} "#),
        format!(r#"wasmctrl_plugin_loads_total{{controller="{TEST}",result="ok"}} "#),
        format!(
            r#"wasmctrl_child_operations_total{{controller="{TEST}",kind="ConfigMap",operation="applied"}} "#
        ),
    ];
    for series in &at_least_one {
        assert!(
            value(&text, series).is_some_and(|n| n >= 1.0),
            "{series}missing or zero:\n{text}"
        );
    }
    assert!(
        text.contains(&format!(
            r#"wasmctrl_plugin_active_info{{controller="{TEST}",digest="sha256:"#
        )),
        "the active digest is reported:\n{text}"
    );
    // Once converged, nothing waits and no worker is busy.
    wasmctrl_testenv::cluster::eventually("an idle queue", ACT, || async {
        let (_, text) = http_get(address, "/metrics").await?;
        Ok(
            value(&text, &format!(r#"workqueue_depth{{name="{TEST}"}} "#)) == Some(0.0)
                && value(
                    &text,
                    &format!(r#"controller_runtime_active_workers{{controller="{TEST}"}} "#),
                ) == Some(0.0),
        )
    })
    .await?;

    // A deleted policy leaves no series behind.
    policies(&client).delete(TEST, &Default::default()).await?;
    let labelled = [
        format!(r#"controller="{TEST}""#),
        format!(r#"name="{TEST}""#),
    ];
    wasmctrl_testenv::cluster::eventually("the deleted policy's series removed", ACT, || async {
        let (_, text) = http_get(address, "/metrics").await?;
        Ok(!labelled.iter().any(|label| text.contains(label.as_str())))
    })
    .await?;

    let _ = stop.send(());
    host.stop().await?;
    delete_namespace(&client, &ns).await
}
