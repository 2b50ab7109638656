//! No team, plugin or registry can exhaust the memory of a host that many teams share: what
//! a registry sends is read through a cap, whatever it says about its size.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use serde_json::{Value, json};
use wasmctrl_e2e::*;
use wasmctrl_testenv::crds::{install_crd, install_repo_crds};

/// The API group of this file's kinds.
const GROUP: &str = "limits.e2e.wasmctrl.dev";
/// How much a hostile server sends of a body it calls endless: far past every cap, and
/// finite, so that a host without caps fails the test by its memory rather than hanging it.
const ENDLESS: usize = 512 << 20;

/// The peak resident memory of this process (where the host under test runs), in bytes.
fn peak_rss() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM in /proc/self/status"))?;
    Ok(kib << 10)
}

fn sha256(bytes: &[u8]) -> String {
    wasmctrl::plugin::Digest::of(bytes).to_string()
}

/// A registry that answers in three hostile ways, one per repository:
/// - `endless-manifest`: every manifest is a body without end;
/// - `endless-token`: every request is challenged, and the token service's answer has no
///   end;
/// - `lying-signature`: a proper Wasm artifact whose signature layer claims 300 bytes and
///   then sends without end.
struct HostileRegistry {
    address: SocketAddr,
}

/// The artifact `lying-signature` serves: its manifest, and the component's bytes.
struct Artifact {
    manifest: Vec<u8>,
    component: Vec<u8>,
}

fn hostile_registry(component: Vec<u8>) -> anyhow::Result<HostileRegistry> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let config = b"{}".to_vec();
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": wasmctrl::registry::WASM_CONFIG_MEDIA_TYPE, "digest": sha256(&config), "size": config.len()},
        "layers": [{"mediaType": wasmctrl::registry::WASM_LAYER_MEDIA_TYPE, "digest": sha256(&component), "size": component.len()}],
    }))?;
    let artifact = std::sync::Arc::new(Artifact {
        manifest,
        component,
    });
    // Ends with the test's process (each test runs in a process of its own).
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let artifact = artifact.clone();
            std::thread::spawn(move || serve(stream, address, &artifact));
        }
    });
    Ok(HostileRegistry { address })
}

fn serve(stream: TcpStream, address: SocketAddr, artifact: &Artifact) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let mut reader = BufReader::new(&stream);
    let mut request_line = String::new();
    let _ = reader.read_line(&mut request_line);
    let mut authorized = false;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        authorized |= line.to_ascii_lowercase().starts_with("authorization:");
    }
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    let mut out = &stream;
    let signature_manifest = || {
        serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha256(b"{}"), "size": 2},
            "layers": [{
                "mediaType": "application/vnd.dev.cosign.simplesigning.v1+json",
                "digest": sha256(b"a signature"),
                "size": 300,
                "annotations": {"dev.cosignproject.cosign/signature": "c2lnbmF0dXJl"},
            }],
        }))
        .unwrap_or_default()
    };
    if path.starts_with("/token") {
        endless(out, "application/json");
    } else if path.starts_with("/v2/endless-token/") && !authorized {
        let _ = write!(
            out,
            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer realm=\"http://{address}/token\",service=\"hostile\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
    } else if path.starts_with("/v2/endless-manifest/") && path.contains("/manifests/") {
        endless(out, "application/vnd.oci.image.manifest.v1+json");
    } else if path.starts_with("/v2/lying-signature/") && path.contains("/manifests/sha256-") {
        respond(
            out,
            "application/vnd.oci.image.manifest.v1+json",
            &signature_manifest(),
        );
    } else if path.starts_with("/v2/lying-signature/") && path.contains("/manifests/") {
        respond(
            out,
            "application/vnd.oci.image.manifest.v1+json",
            &artifact.manifest,
        );
    } else if path.starts_with("/v2/lying-signature/")
        && path.ends_with(&sha256(&artifact.component))
    {
        respond(out, "application/octet-stream", &artifact.component);
    } else if path.starts_with("/v2/lying-signature/") && path.contains("/blobs/") {
        endless(out, "application/octet-stream");
    } else {
        let _ = write!(
            out,
            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
    }
    let _ = out.flush();
}

fn respond(mut out: &TcpStream, content_type: &str, body: &[u8]) {
    let _ = write!(
        out,
        "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = out.write_all(body);
}

/// A chunked body of [`ENDLESS`] bytes, or until the reader goes away.
fn endless(mut out: &TcpStream, content_type: &str) {
    let _ = write!(
        out,
        "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    );
    let chunk = vec![b' '; 64 << 10];
    let mut sent = 0;
    while sent < ENDLESS {
        let written = write!(out, "{:x}\r\n", chunk.len())
            .and_then(|()| out.write_all(&chunk))
            .and_then(|()| out.write_all(b"\r\n"));
        if written.is_err() {
            return;
        }
        sent += chunk.len();
    }
    let _ = out.write_all(b"0\r\n\r\n");
}

fn policy_for(kind: &str, reference: &str, digest: &str, verify: Option<Value>) -> Value {
    let mut plugin = json!({
        "source": {"oci": {"reference": reference, "insecure": true}},
        "digest": digest,
    });
    if let Some(verify) = verify {
        plugin["verify"] = verify;
    }
    json!({
        "parent": {"apiVersion": format!("{GROUP}/v1"), "kind": kind},
        "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
        "plugin": plugin,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_that_sends_without_end_costs_the_host_no_more_than_its_caps()
-> anyhow::Result<()> {
    const TEST: &str = "limits-registry";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    for kind in ["Manifested", "Tokened", "Signed"] {
        install_crd(&client, &test_crd(GROUP, kind)).await?;
    }
    let component = std::fs::read(wasmctrl_testenv::plugins::guest("myapp_plugin"))?;
    let digest = sha256(&component);
    let registry = hostile_registry(component)?;
    let at = registry.address;
    let key = wasmctrl::signing::sign::SigningKey::generate()?.public_pem()?;
    let cases = [
        (
            "limits-manifest",
            "Manifested",
            format!("{at}/endless-manifest/p:1"),
            None,
            "is more than 4194304 bytes",
        ),
        (
            "limits-token",
            "Tokened",
            format!("{at}/endless-token/p:1"),
            None,
            "is more than 65536 bytes",
        ),
        (
            "limits-signature",
            "Signed",
            format!("{at}/lying-signature/p:1"),
            Some(json!({"keys": [key]})),
            "sent more than the 300 bytes its descriptor claims",
        ),
    ];
    let host = HostUnderTest::builder(TEST, &ns)
        .without_disk_cache()
        .start()
        .await?;
    let before = peak_rss()?;
    let policy_api = policies(&client);
    for (name, kind, reference, verify, says) in &cases {
        apply_policy(
            &client,
            TEST,
            name,
            policy_for(kind, reference, &digest, verify.clone()),
        )
        .await?;
        let refused = wait_for_object(&policy_api, name, &format!("{name} refused"), |p| {
            condition(p, "PluginLoaded").is_some_and(|c| c["status"] == "False")
        })
        .await?;
        let message = condition_message(&refused, "PluginLoaded");
        assert!(message.contains(says), "{name}: {message}");
    }
    let grew = peak_rss()?.saturating_sub(before);
    eprintln!(
        "limits: the host's peak RSS grew by {} MiB under three hostile registries",
        grew >> 20
    );
    // The caps add up to a little over 4 MiB; the rest is the slack of a busy process.
    assert!(
        grew < 64 << 20,
        "the host's peak RSS grew by {} MiB",
        grew >> 20
    );

    host.stop().await?;
    for (name, ..) in &cases {
        policy_api.delete(name, &Default::default()).await?;
    }
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_calls_that_touch_their_whole_allowance_stay_within_the_hosts_budget()
-> anyhow::Result<()> {
    const TEST: &str = "limits-call-memory";
    const PARENTS: usize = 32;
    const BUDGET_MIB: usize = 1024;
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    for kind in ["Glutton", "Giant"] {
        install_crd(&client, &test_crd(GROUP, kind)).await?;
    }
    let host = HostUnderTest::builder(TEST, &ns)
        .max_concurrent_calls(64)
        .call_memory(1536, BUDGET_MIB)
        .start()
        .await?;
    let policy_api = policies(&client);
    let hungry = |kind: &str, memory_mib: u32| {
        json!({
            "parent": {"apiVersion": format!("{GROUP}/v1"), "kind": kind},
            "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
            "plugin": {"source": file_source("misbehave_plugin"), "config": {"touchMib": 200, "ownChild": true}},
            "limits": {"memoryMib": memory_mib, "timeoutMs": 60000},
            "maxConcurrentReconciles": PARENTS,
        })
    };

    // A plugin whose limit is above the whole budget could never run: refused, saying so.
    apply_policy(&client, TEST, "limits-greedy", hungry("Giant", 1200)).await?;
    let refused = wait_for_object(&policy_api, "limits-greedy", "refused", |p| {
        condition(p, "PluginLoaded").is_some_and(|c| c["status"] == "False")
    })
    .await?;
    let message = condition_message(&refused, "PluginLoaded");
    assert!(
        message.contains("budget") && message.contains("plugin-memory-budget-mib"),
        "{message}"
    );

    apply_policy(&client, TEST, "limits-hungry", hungry("Glutton", 256)).await?;
    wait_for_object(&policy_api, "limits-hungry", "loaded", |p| {
        condition(p, "PluginLoaded").is_some_and(|c| c["status"] == "True")
    })
    .await?;
    let before = peak_rss()?;
    let parents = api(&client, &resource(GROUP, "v1", "Glutton"), &ns);
    for i in 0..PARENTS {
        apply(
            &parents,
            json!({"apiVersion": format!("{GROUP}/v1"), "kind": "Glutton", "metadata": {"name": format!("h{i}")}, "spec": {}}),
        )
        .await?;
    }
    let config_maps = api(&client, &resource("", "v1", "ConfigMap"), &ns);
    let most_reserved = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampling = {
        let most_reserved = most_reserved.clone();
        let metrics = host.metrics.clone();
        tokio::spawn(async move {
            loop {
                let reserved = metrics
                    .encode()
                    .lines()
                    .find_map(|l| l.strip_prefix("wasmctrl_plugin_call_memory_reserved_bytes "))
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .unwrap_or(0.0);
                most_reserved.fetch_max(reserved as u64, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    for i in 0..PARENTS {
        wait_for_object(&config_maps, &format!("h{i}-own"), "converged", |_| true).await?;
    }
    sampling.abort();
    let grew = peak_rss()?.saturating_sub(before);
    let reserved = most_reserved.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!(
        "limits: {PARENTS} calls touching 200 MiB each grew the host's peak RSS by {} MiB; at most {} MiB reserved (budget {BUDGET_MIB} MiB)",
        grew >> 20,
        reserved >> 20
    );
    assert_eq!(
        host.metric("wasmctrl_plugin_call_memory_budget_bytes"),
        (BUDGET_MIB << 20) as f64
    );
    assert!(
        reserved > 0 && reserved <= (BUDGET_MIB as u64) << 20,
        "{reserved}"
    );
    // Without the budget all 32 calls run at once: 6 GiB and more.
    assert!(
        grew < ((BUDGET_MIB as u64) + 256) << 20,
        "the host's peak RSS grew by {} MiB, past the budget of {BUDGET_MIB} MiB",
        grew >> 20
    );

    host.stop().await?;
    for name in ["limits-greedy", "limits-hungry"] {
        policy_api.delete(name, &Default::default()).await?;
    }
    delete_namespace(&client, &ns).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_drips_does_not_hold_up_another_policys_swap() -> anyhow::Result<()> {
    const TEST: &str = "limits-drip";
    let (client, ns) = test_namespace(TEST).await?;
    install_repo_crds(&client).await?;
    install_crd(&client, &test_crd(GROUP, "Dripper")).await?;
    // One compile at a time, as the chart has it, and every plugin compiled afresh.
    let host = HostUnderTest::builder(TEST, &ns)
        .without_disk_cache()
        .max_concurrent_loads(1)
        .start()
        .await?;
    let policy_api = policies(&client);
    let digest = |plugin: &str| {
        std::fs::read(wasmctrl_testenv::plugins::guest(plugin)).map(|bytes| sha256(&bytes))
    };
    let (v1, v2) = (digest("myapp_plugin")?, digest("myapp_v2_plugin")?);
    let myapps = |plugin: &str, digest: &str| {
        let mut spec = myapp_policy_in(&ns, file_source(plugin));
        spec["plugin"]["digest"] = json!(digest);
        spec
    };
    apply_policy(
        &client,
        TEST,
        "limits-swapping",
        myapps("myapp_plugin", &v1),
    )
    .await?;
    wait_for_object(&policy_api, "limits-swapping", "v1 serving", |p| {
        p["status"]["activeDigest"] == v1.as_str()
    })
    .await?;

    // A source that sends a byte a second: slow enough to hold a fetch for minutes.
    let drip = dripping_server(Some(Duration::from_secs(1)))?;
    apply_policy(
        &client,
        TEST,
        "limits-dripping",
        json!({
            "parent": {"apiVersion": format!("{GROUP}/v1"), "kind": "Dripper"},
            "children": [{"apiVersion": "v1", "kind": "ConfigMap"}],
            // A digest the host holds nowhere, so it must fetch.
            "plugin": {"source": {"http": {"url": format!("http://{}/plugin.wasm", drip.address)}}, "digest": sha256(b"dripped")},
        }),
    )
    .await?;
    wasmctrl_testenv::cluster::eventually(
        "the dripping fetch under way",
        Duration::from_secs(30),
        || async { Ok(drip.connections.load(std::sync::atomic::Ordering::SeqCst) > 0) },
    )
    .await?;

    // While it drips, the other policy swaps to v2: fetched and compiled at once.
    let started = std::time::Instant::now();
    apply_policy(
        &client,
        TEST,
        "limits-swapping",
        myapps("myapp_v2_plugin", &v2),
    )
    .await?;
    wait_for_object(&policy_api, "limits-swapping", "v2 serving", |p| {
        p["status"]["activeDigest"] == v2.as_str()
    })
    .await?;
    let took = started.elapsed();
    eprintln!("limits: a swap took {took:?} while another policy's source dripped");
    assert!(
        took < Duration::from_secs(10),
        "the swap waited {took:?} behind a dripping source"
    );

    // The drip itself is given up as too slow, saying so.
    let given_up = wait_for_object(&policy_api, "limits-dripping", "the drip given up", |p| {
        condition(p, "PluginLoaded").is_some_and(|c| c["status"] == "False")
    })
    .await?;
    let message = condition_message(&given_up, "PluginLoaded");
    assert!(message.contains("too slowly"), "{message}");

    host.stop().await?;
    for name in ["limits-swapping", "limits-dripping"] {
        policy_api.delete(name, &Default::default()).await?;
    }
    delete_namespace(&client, &ns).await
}

/// A TCP proxy to `upstream` that delivers what a client sends `delay` after it arrives: an
/// API server that answers slowly, as a loaded one does.
async fn slow_proxy(upstream: SocketAddr, delay: Duration) -> anyhow::Result<SocketAddr> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(outbound) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                let (mut from_client, mut to_client) = inbound.into_split();
                let (mut from_server, mut to_server) = outbound.into_split();
                let (send, mut due) =
                    tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
                tokio::spawn(async move {
                    let mut buffer = vec![0u8; 64 << 10];
                    while let Ok(read) = from_client.read(&mut buffer).await {
                        if read == 0
                            || send
                                .send((
                                    tokio::time::Instant::now() + delay,
                                    buffer[..read].to_vec(),
                                ))
                                .is_err()
                        {
                            break;
                        }
                    }
                });
                tokio::spawn(async move {
                    while let Some((at, bytes)) = due.recv().await {
                        tokio::time::sleep_until(at).await;
                        if to_server.write_all(&bytes).await.is_err() {
                            break;
                        }
                    }
                });
                let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
            });
        }
    });
    Ok(address)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_tokens_from_one_client_do_not_keep_a_real_caller_from_the_metrics()
-> anyhow::Result<()> {
    const TEST: &str = "limits-tokens";
    const FLOOD: usize = 96;
    let (client, ns) = test_namespace(TEST).await?;
    service_account(&client, &ns, "scraper").await?;
    may_read_metrics(&client, &ns, "scraper").await?;
    let scraper = service_account_token(&ns, "scraper").await?;
    let host = HostUnderTest::builder(TEST, &ns).start().await?;

    // The host reviews tokens through an API server that takes most of a second to answer.
    let env = wasmctrl_testenv::TestEnv::get();
    let kubeconfig = kube::config::Kubeconfig::read_from(env.kubeconfig())?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    let upstream: SocketAddr = format!(
        "{}:{}",
        config.cluster_url.host().unwrap_or("127.0.0.1"),
        config.cluster_url.port_u16().unwrap_or(443)
    )
    .parse()?;
    let proxy = slow_proxy(upstream, Duration::from_millis(600)).await?;
    config.cluster_url = format!("https://{proxy}").parse()?;
    let access = wasmctrl::server::Access::Reviewed {
        reviewer: std::sync::Arc::new(wasmctrl::server::access::Reviewer::new(
            kube::Client::try_from(config)?,
        )),
        tls: wasmctrl::server::tls::server_config(None, &["localhost".to_owned()])?,
    };
    let (address, stop_serving) = host.serve(access).await?;

    // A client at another loopback address sends made-up tokens as fast as it is answered.
    let flooding = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let answers = std::sync::Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::<
        u16,
        usize,
    >::new()));
    let mut flood = Vec::new();
    for task in 0..FLOOD {
        let (flooding, answers) = (flooding.clone(), answers.clone());
        flood.push(tokio::spawn(async move {
            let Ok(http) = reqwest::Client::builder()
                .danger_accept_invalid_certs(true)
                .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
                .build()
            else {
                return;
            };
            let mut n = 0;
            while flooding.load(std::sync::atomic::Ordering::SeqCst) {
                n += 1;
                let sent = http
                    .get(format!("https://{address}/metrics"))
                    .bearer_auth(format!("made-up-{task}-{n}"))
                    .send()
                    .await;
                let status = sent.map_or(0, |r| r.status().as_u16());
                *answers
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .entry(status)
                    .or_default() += 1;
                if status == 0 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;

    // The scraper, from another address, is answered while the flood goes on.
    let started = std::time::Instant::now();
    let (status, body) = https_get(address, "/metrics", Some(&scraper)).await?;
    let took = started.elapsed();
    flooding.store(false, std::sync::atomic::Ordering::SeqCst);
    for task in flood {
        let _ = task.await;
    }
    let answers = answers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    eprintln!("limits: the scraper got {status} in {took:?} during a flood answered {answers:?}");
    assert_eq!(status, 200, "{body}");
    assert!(
        answers.get(&429).copied().unwrap_or(0) > 0,
        "the flooding client was told to slow down: {answers:?}"
    );

    let _ = stop_serving.send(());
    host.stop().await?;
    delete_namespace(&client, &ns).await
}
