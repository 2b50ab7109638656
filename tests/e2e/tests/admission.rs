//! The webhooks against a real API server: the hosts make one CA and serving pair in a
//! Secret and every replica serves the same (a pair that is due is renewed from the same CA,
//! so the CA bundle the API server holds stays valid); the API server calls the listener
//! over HTTPS as the webhook configurations say, and its client sees the plugin's answers.

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, ResourceExt as _};
use wasmctrl::admission::certs::Certificates;
use wasmctrl_e2e::*;

const SECRET: &str = "wasmctrl-webhooks";

fn names(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_one_ca_and_renew_the_serving_pair_from_it() -> anyhow::Result<()> {
    const TEST: &str = "webhook-certificates";
    let (client, ns) = test_namespace(TEST).await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let served = names(&["wasmctrl-webhooks.wasmctrl.svc", "127.0.0.1"]);
    let replica = |names: Vec<String>| Certificates::new(secrets.clone(), SECRET, names);

    // Two replicas start together on no Secret: one makes it, both serve its pair.
    let first = replica(served.clone());
    let second = replica(served.clone());
    let (a, b) = tokio::join!(first.ensure(), second.ensure());
    let (a, b) = (a?, b?);
    assert_eq!(a.ca_bundle, b.ca_bundle);
    assert_eq!(a.certificate, b.certificate);
    let stored = secrets.get(SECRET).await?;
    assert_eq!(stored.type_.as_deref(), Some("kubernetes.io/tls"));
    let keys: Vec<&String> = stored.data.as_ref().expect("data").keys().collect();
    assert_eq!(keys, ["ca.crt", "ca.key", "tls.crt", "tls.key"]);

    // Not due: read as it is, by any replica.
    assert_eq!(second.ensure().await?.certificate, a.certificate);

    // Due (here: a replica that renews anything with less than 100 days left, more than a
    // pair is valid), the pair is renewed from the same CA, once: the next replica reads the
    // renewed one. Labels others put on the Secret stay.
    let mut labelled = secrets.get(SECRET).await?;
    labelled
        .metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("team".to_owned(), "platform".to_owned());
    labelled.metadata.managed_fields = None;
    secrets
        .replace(SECRET, &Default::default(), &labelled)
        .await?;
    let renewed = replica(served.clone())
        .renew_within(Duration::from_secs(100 * 24 * 3600))
        .ensure()
        .await?;
    assert_ne!(renewed.certificate, a.certificate);
    assert_eq!(renewed.ca_bundle, a.ca_bundle, "the CA stays");
    let again = replica(served.clone()).ensure().await?;
    assert_eq!(again.certificate, renewed.certificate);
    let kept = secrets.get(SECRET).await?;
    assert_eq!(
        kept.labels().get("team").map(String::as_str),
        Some("platform")
    );

    // A host that serves under another name gets a pair that covers it, from the same CA.
    let mut more = served.clone();
    more.push("wasmctrl-webhooks.wasmctrl.svc.cluster.local".to_owned());
    let widened = replica(more).ensure().await?;
    assert_ne!(widened.certificate, renewed.certificate);
    assert_eq!(widened.ca_bundle, a.ca_bundle);

    // A Secret of that name that holds something else is reported, and left alone.
    secrets.delete(SECRET, &Default::default()).await?;
    let foreign: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": SECRET},
        "stringData": {"token": "not a CA"},
    }))?;
    secrets.create(&Default::default(), &foreign).await?;
    let err = second.ensure().await.expect_err("not a webhook pair");
    assert!(format!("{err:#}").contains(SECRET), "{err:#}");
    let kept = secrets.get(SECRET).await?;
    assert!(kept.data.expect("data").contains_key("token"));

    delete_namespace(&client, &ns).await?;
    Ok(())
}

mod served {
    use std::sync::Arc;
    use std::time::Duration;

    use anyhow::Context as _;
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::{DynamicObject, PostParams};
    use kube::{Api, Client};
    use serde_json::{Value, json};
    use wasmctrl::admission::certs::Certificates;
    use wasmctrl::admission::configurations::{Configurations, Endpoint, Scope};
    use wasmctrl::admission::review::{Answerer, FailurePolicy};
    use wasmctrl::plugin::{EngineOptions, Limits, PluginEngine};
    use wasmctrl_e2e::*;

    /// What a Service does for the replicas behind it: each connection goes to the first
    /// replica listed that takes it. TLS passes through untouched.
    struct Front {
        url: String,
        backends: Arc<std::sync::Mutex<Vec<std::net::SocketAddr>>>,
        open: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
    }

    impl Front {
        async fn start(backends: Vec<std::net::SocketAddr>) -> anyhow::Result<Self> {
            let front = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let url = format!("https://{}", front.local_addr()?);
            let backends = Arc::new(std::sync::Mutex::new(backends));
            let open = Arc::new(std::sync::Mutex::new(Vec::new()));
            let (routes, connections) = (backends.clone(), open.clone());
            tokio::spawn(async move {
                while let Ok((mut inbound, _)) = front.accept().await {
                    let order = routes.lock().expect("not poisoned").clone();
                    let task = tokio::spawn(async move {
                        for backend in order {
                            if let Ok(mut outbound) = tokio::net::TcpStream::connect(backend).await
                            {
                                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound)
                                    .await;
                                return;
                            }
                        }
                    });
                    connections
                        .lock()
                        .expect("not poisoned")
                        .push(task.abort_handle());
                }
            });
            Ok(Self {
                url,
                backends,
                open,
            })
        }

        /// New connections go to `backends`.
        fn route(&self, backends: Vec<std::net::SocketAddr>) {
            *self.backends.lock().expect("not poisoned") = backends;
        }

        /// The connections open break, as when the replica behind them goes (a write the
        /// API server sends on one just then fails, as it would).
        fn drop_connections(&self) {
            for connection in self.open.lock().expect("not poisoned").drain(..) {
                connection.abort();
            }
        }
    }

    /// The certificate `address` presents to a client that trusts `ca_bundle` for
    /// 127.0.0.1, DER.
    async fn presented(address: std::net::SocketAddr, ca_bundle: &str) -> anyhow::Result<Vec<u8>> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(ca_bundle.as_bytes())?)
            .tls_info(true)
            .build()?;
        let response = client
            .post(format!("https://{address}/validate/nobody"))
            .send()
            .await?;
        let info = response
            .extensions()
            .get::<reqwest::tls::TlsInfo>()
            .context("no TLS info")?;
        Ok(info.peer_certificate().context("no certificate")?.to_vec())
    }

    fn der(pem: &str) -> anyhow::Result<Vec<u8>> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject as _;
        Ok(CertificateDer::from_pem_slice(pem.as_bytes())?.to_vec())
    }

    async fn create_apps(
        myapps: &Api<DynamicObject>,
        prefix: &str,
        n: usize,
    ) -> anyhow::Result<()> {
        for i in 0..n {
            let created = myapps
                .create(
                    &PostParams::default(),
                    &app(&format!("{prefix}-{i}"), 1, "nginx:1.27")?,
                )
                .await
                .with_context(|| format!("creating {prefix}-{i}"))?;
            assert_eq!(created.data["spec"]["port"], 80, "defaulted");
        }
        Ok(())
    }

    fn answerer(
        plugin: &str,
        config: Value,
        failure_policy: FailurePolicy,
    ) -> anyhow::Result<Answerer> {
        let plugin = PluginEngine::new(EngineOptions::default())?.load(
            &wasmctrl_testenv::plugins::guest_bytes(plugin),
            None,
            Limits::default(),
        )?;
        Ok(Answerer::with_plugin(
            "ReconcilePolicy/myapp-webhooks",
            plugin,
            Some(config.to_string()),
            "policy/myapp-webhooks",
            failure_policy,
        ))
    }

    fn app(name: &str, replicas: i64, image: &str) -> anyhow::Result<DynamicObject> {
        Ok(serde_json::from_value(myapp(name, replicas, image, None))?)
    }

    /// Create `object` until the API server's answer satisfies `done` (the webhook
    /// configurations take a moment to reach it); the last answer.
    async fn create_until(
        myapps: &Api<DynamicObject>,
        object: &DynamicObject,
        what: &str,
        done: impl Fn(&Result<DynamicObject, kube::Error>) -> bool,
    ) -> anyhow::Result<Result<DynamicObject, kube::Error>> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let answer = myapps.create(&PostParams::default(), object).await;
            if done(&answer) {
                return Ok(answer);
            }
            if let Ok(created) = &answer {
                myapps
                    .delete(&created.name_any(), &Default::default())
                    .await?;
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{what}: the API server kept answering {answer:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Create a MyApp of 80 replicas named `name` until the plugin's rule refuses it (`422`,
    /// its message); the refusal.
    async fn refused_too_big(
        myapps: &Api<DynamicObject>,
        name: &str,
    ) -> anyhow::Result<kube::core::Status> {
        let refused = create_until(myapps, &app(name, 80, "nginx:1.27")?, "the denial", |a| {
            denied(a).is_some_and(|status| status.code == 422)
        })
        .await?;
        let status = denied(&refused).expect("denied").clone();
        assert!(
            status
                .message
                .contains("spec.replicas: must be between 1 and 50, got 80"),
            "{status:?}"
        );
        Ok(status)
    }

    use kube::ResourceExt as _;

    fn denied(answer: &Result<DynamicObject, kube::Error>) -> Option<&kube::core::Status> {
        match answer {
            Err(kube::Error::Api(status)) => Some(&**status),
            _ => None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_api_server_asks_the_plugin_over_https_and_the_client_sees_its_answer()
    -> anyhow::Result<()> {
        const TEST: &str = "webhooks-served";
        let (client, ns) = test_namespace(TEST).await?;
        install_repo_crds(&client).await?;
        let (url, ca_bundle, answerers) = listener(&client, &ns, super::SECRET).await?;
        let policy = format!("{ns}/myapp-webhooks");
        answerers.serve(
            &policy,
            answerer("myapp_plugin", json!({}), FailurePolicy::Fail)?,
        );
        let scope = Scope {
            policy: policy.clone(),
            group: "example.com".to_owned(),
            version: "v1".to_owned(),
            plural: "myapps".to_owned(),
            namespace: Some(ns.clone()),
            operations: vec!["CREATE".to_owned(), "UPDATE".to_owned()],
            failure_policy: FailurePolicy::Fail,
            timeout_seconds: 5,
            // The test's own writes (as the cluster admin) are the ones judged here.
            exempt_users: vec!["system:serviceaccount:wasmctrl:wasmctrl".to_owned()],
        };
        let endpoint = Endpoint::Url(url);
        let configurations = Configurations::new(client.clone(), &format!("wasmctrl-{ns}"));
        configurations
            .reconcile(&scope, &endpoint, &ca_bundle, true, true)
            .await?;
        let myapps = myapps(&client, &ns);

        // A MyApp that breaks the plugin's rules is refused at create, with the plugin's
        // message and each field as a cause.
        let status = refused_too_big(&myapps, "too-big").await?;
        let causes = &status.details.as_ref().expect("details").causes;
        assert_eq!(causes[0].field, "spec.replicas", "{status:?}");

        // A MyApp without a port gets the plugin's default as it is stored (the mutating
        // configuration may reach the API server a moment after the validating one).
        create_until(&myapps, &app("web", 2, "nginx:1.27")?, "the default", |a| {
            a.as_ref()
                .is_ok_and(|created| created.data["spec"]["port"] == 80)
        })
        .await??;

        // A warning reaches the client (an image with no tag), the write goes through.
        let request =
            kube::core::Request::new(format!("/apis/example.com/v1/namespaces/{ns}/myapps"))
                .create(
                    &PostParams::default(),
                    serde_json::to_vec(&myapp("unpinned", 1, "nginx", None))?,
                )?;
        let response = client.send(request.map(kube::client::Body::from)).await?;
        assert!(response.status().is_success(), "{response:?}");
        let warnings: Vec<String> = response
            .headers()
            .get_all("warning")
            .iter()
            .filter_map(|v| v.to_str().ok().map(str::to_owned))
            .collect();
        assert!(
            warnings.iter().any(|w| w.contains("has no tag or digest")),
            "{warnings:?}"
        );

        // A plugin that traps, under Fail: refused with the reason, well within the timeout.
        answerers.serve(
            &policy,
            answerer(
                "misbehave_plugin",
                json!({"behavior": "panic"}),
                FailurePolicy::Fail,
            )?,
        );
        let started = std::time::Instant::now();
        let trapped = myapps
            .create(&PostParams::default(), &app("trapped", 1, "nginx:1.27")?)
            .await;
        assert!(started.elapsed() < Duration::from_secs(5));
        let status = denied(&trapped).expect("refused under Fail");
        assert!(
            status.message.contains("could not") && status.message.contains("panic"),
            "{status:?}"
        );
        // ...and under Ignore, admitted.
        answerers.serve(
            &policy,
            answerer(
                "misbehave_plugin",
                json!({"behavior": "panic"}),
                FailurePolicy::Ignore,
            )?,
        );
        myapps
            .create(&PostParams::default(), &app("admitted", 1, "nginx:1.27")?)
            .await?;

        // The configurations removed, writes no longer reach the plugin.
        answerers.serve(
            &policy,
            answerer("myapp_plugin", json!({}), FailurePolicy::Fail)?,
        );
        configurations.remove(&policy).await?;
        create_until(
            &myapps,
            &app("unjudged", 80, "nginx:1.27")?,
            "no webhook",
            |a| a.is_ok(),
        )
        .await??;

        delete_configurations(&client, &format!("wasmctrl-{ns}")).await?;
        delete_namespace(&client, &ns).await?;
        Ok(())
    }

    /// The failure policy of the policy's validating webhook (in the test's configuration,
    /// `wasmctrl-<namespace>`), once it exists.
    async fn validating_failure_policy(
        client: &Client,
        policy: &str,
    ) -> anyhow::Result<Option<String>> {
        use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
        let configurations: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        let entry = format!("validate.{policy}.webhooks.wasmctrl.dev");
        Ok(configurations
            .get_opt(&format!("wasmctrl-{policy}"))
            .await?
            .and_then(|c| c.webhooks)
            .and_then(|w| w.into_iter().find(|w| w.name == entry))
            .and_then(|w| w.failure_policy))
    }

    /// Delete the test's configurations (cluster-scoped: the namespace does not take them).
    async fn delete_configurations(client: &Client, name: &str) -> anyhow::Result<()> {
        use k8s_openapi::api::admissionregistration::v1::{
            MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
        };
        Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .delete(name, &Default::default())
            .await?;
        Api::<MutatingWebhookConfiguration>::all(client.clone())
            .delete(name, &Default::default())
            .await?;
        Ok(())
    }

    async fn wait_for_failure_policy(
        client: &Client,
        policy: &str,
        expected: Option<&str>,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let now = validating_failure_policy(client, policy).await?;
            if now.as_deref() == expected {
                return Ok(());
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the validating webhook's failure policy stayed {now:?}, not {expected:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_policy_asks_and_the_host_serves_its_plugins_webhooks() -> anyhow::Result<()> {
        const TEST: &str = "webhooks-policy";
        let (client, ns) = test_namespace(TEST).await?;
        install_repo_crds(&client).await?;
        let (url, ca_bundle, answerers) = listener(&client, &ns, super::SECRET).await?;
        let host = HostUnderTest::builder(TEST, &ns)
            .webhooks(hosting(&ns, &url, &answerers, &ca_bundle))
            .start()
            .await?;
        let name = ns.clone();
        let mut spec = myapp_policy_spec(file_source("myapp_plugin"), json!({}));
        spec["admission"] = json!({"validate": true, "default": true});
        apply_policy(&client, TEST, &name, spec.clone()).await?;
        let myapps = myapps(&client, &ns);

        // The plugin's rule refuses a MyApp at create, with its message and field.
        refused_too_big(&myapps, "too-big").await?;
        // Its default is filled in.
        create_until(&myapps, &app("web", 2, "nginx:1.27")?, "the default", |a| {
            a.as_ref()
                .is_ok_and(|created| created.data["spec"]["port"] == 80)
        })
        .await??;
        // Each answer is on record for `wasmctrl explain`, beside the object's reconciles:
        // what the plugin said, never a value of the object.
        let denial = webhook_records(&host, "MyApp", &ns, "too-big")?
            .into_iter()
            .find(|r| r.outcome == "denied")
            .context("no record of the denial")?;
        assert_eq!(denial.webhook, "validate");
        assert_eq!(denial.operation, "CREATE");
        assert!(
            denial.violations[0].starts_with("spec.replicas: must be between 1 and 50"),
            "{denial:?}"
        );
        assert!(denial.plugin.is_some_and(|p| p.starts_with("sha256:")));
        let defaults = webhook_records(&host, "MyApp", &ns, "web")?
            .into_iter()
            .find(|r| r.outcome == "patched")
            .context("no record of the defaults")?;
        assert_eq!(defaults.defaulted, ["/spec/port"]);

        // The policy says what it serves, and since when.
        let served = wait_for_object(&policies(&client), &name, "webhooks in the status", |p| {
            p["status"]["webhooks"]
                .as_array()
                .is_some_and(|w| w.len() == 2)
                && condition(p, "WebhooksServed").is_some_and(|c| c["status"] == "True")
        })
        .await?;
        let webhooks = &served["status"]["webhooks"];
        assert_eq!(webhooks[0]["webhook"], "validate", "{webhooks}");
        assert_eq!(webhooks[0]["configuration"], format!("wasmctrl-{name}"));
        assert_eq!(webhooks[0]["failurePolicy"], "Fail");
        assert!(webhooks[0]["since"].is_string(), "{webhooks}");

        // A candidate that would refuse what the active plugin admits is counted before it
        // serves anything.
        spec["plugin"]["candidate"] = json!({
            "source": file_source("misbehave_plugin"), "config": {"behavior": "deny"},
        });
        apply_policy(&client, TEST, &name, spec.clone()).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        for i in 0.. {
            myapps
                .create(
                    &PostParams::default(),
                    &app(&format!("shadowed-{i}"), 1, "nginx:1.27")?,
                )
                .await?;
            let policy = policies(&client).get(&name).await?;
            let counted = &policy.data["status"]["candidate"]["webhooks"];
            if counted["wouldDeny"].as_u64().is_some_and(|n| n >= 1) {
                let example = counted["examples"][0].as_str().unwrap_or_default();
                assert!(example.contains("x is never allowed"), "{counted}");
                break;
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the candidate's denials were never counted: {}",
                policy.data["status"]
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }

        // The host stops: nothing answers, so the webhook no longer refuses every write…
        host.stop().await?;
        wait_for_failure_policy(&client, &name, Some("Ignore")).await?;
        // …and a host that starts again serves it as before, with the same CA.
        let host = HostUnderTest::builder(TEST, &ns)
            .webhooks(hosting(&ns, &url, &answerers, &ca_bundle))
            .start()
            .await?;
        wait_for_failure_policy(&client, &name, Some("Fail")).await?;
        refused_too_big(&myapps, "too-big-again").await?;

        // The policy goes, and its webhooks with it.
        policies(&client).delete(&name, &Default::default()).await?;
        wait_for_failure_policy(&client, &name, None).await?;
        create_until(
            &myapps,
            &app("unjudged", 80, "nginx:1.27")?,
            "no webhook",
            |a| a.is_ok(),
        )
        .await??;
        host.stop().await?;
        delete_configurations(&client, &format!("wasmctrl-{ns}")).await?;
        delete_namespace(&client, &ns).await?;
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_replica_answers_one_going_and_a_renewed_pair_fail_no_write() -> anyhow::Result<()>
    {
        const TEST: &str = "webhooks-replicas";
        let (client, ns) = test_namespace(TEST).await?;
        install_repo_crds(&client).await?;
        let (a, b) = (
            Listener::start(&client, &ns, super::SECRET).await?,
            Listener::start(&client, &ns, super::SECRET).await?,
        );
        assert_eq!(a.ca_bundle, b.ca_bundle, "one CA for every replica");
        let front = Front::start(vec![a.address]).await?;
        let leader = HostUnderTest::builder(TEST, &ns)
            .webhooks(hosting(&ns, &front.url, &a.answerers, &a.ca_bundle))
            .start()
            .await?;
        let standby = HostUnderTest::builder(TEST, &ns)
            .standby()
            .webhooks(hosting(&ns, &front.url, &b.answerers, &b.ca_bundle))
            .start()
            .await?;
        let name = ns.clone();
        let mut spec = myapp_policy_spec(file_source("myapp_plugin"), json!({}));
        spec["admission"] = json!({"validate": true, "default": true});
        apply_policy(&client, TEST, &name, spec).await?;
        let myapps = myapps(&client, &ns);
        refused_too_big(&myapps, "too-big").await?;
        create_apps(&myapps, "on-the-leader", 3).await?;
        assert!(a.answered() >= 4.0 && b.answered() == 0.0);

        // The standby answers as the leader does (once its controller runs: the standby
        // writes nothing, so the policy's status cannot say when).
        front.route(vec![b.address]);
        front.drop_connections();
        refused_too_big(&myapps, "too-big-standby").await?;
        create_apps(&myapps, "on-the-standby", 3).await?;
        assert!(b.answered() >= 4.0, "{}", b.answered());

        // The pair is renewed from the same CA under the writes: none fails (connections open
        // keep their session), and new connections get the renewed pair.
        let renewed = Certificates::new(
            Api::<Secret>::namespaced(client.clone(), &ns),
            super::SECRET,
            vec!["127.0.0.1".to_owned()],
        )
        .renew_within(Duration::from_secs(100 * 24 * 3600))
        .ensure()
        .await?;
        assert_eq!(renewed.ca_bundle, a.ca_bundle, "the CA stays");
        assert_eq!(presented(a.address, &a.ca_bundle).await?, der(&a.pem)?);
        assert_ne!(renewed.certificate, a.pem);
        b.certificate.replace(&renewed)?;
        a.certificate.replace(&renewed)?;
        front.route(vec![a.address, b.address]);
        create_apps(&myapps, "renewed", 3).await?;
        assert_eq!(
            presented(b.address, &b.ca_bundle).await?,
            der(&renewed.certificate)?
        );
        assert_eq!(
            presented(a.address, &a.ca_bundle).await?,
            der(&renewed.certificate)?
        );

        // The leader goes (its host, its listener, its connections): the standby answers
        // every write.
        leader.stop().await?;
        a.task.abort();
        front.drop_connections();
        let before = b.answered();
        refused_too_big(&myapps, "too-big-after").await?;
        create_apps(&myapps, "after", 3).await?;
        assert!(b.answered() >= before + 4.0, "{before} {}", b.answered());

        // Every host stops, then the policy is deleted: its (relaxed) entries outlive it
        // until a host starts and finds no policy of theirs.
        standby.stop().await?;
        assert_eq!(
            validating_failure_policy(&client, &name).await?.as_deref(),
            Some("Ignore")
        );
        policies(&client).delete(&name, &Default::default()).await?;
        let next = HostUnderTest::builder(TEST, &ns)
            .webhooks(hosting(&ns, &front.url, &b.answerers, &b.ca_bundle))
            .start()
            .await?;
        wait_for_failure_policy(&client, &name, None).await?;
        next.stop().await?;
        delete_configurations(&client, &format!("wasmctrl-{ns}")).await?;
        delete_namespace(&client, &ns).await?;
        Ok(())
    }
}
