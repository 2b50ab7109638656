//! A plugin that misbehaves on demand, to prove the sandbox and the host hold. The policy
//! config picks the behaviour: `{"behavior": "loop"}`. Without one it behaves: it desires the
//! objects listed in `children` verbatim (so a test can ask for anything, allowed or not) and
//! echoes what it saw as the status. When finalizing it records a `Finalizing` event and
//! reports `finalized`, unless the behaviour is `hold-finalizer`.

use std::sync::atomic::{AtomicU32, Ordering};

use serde::Deserialize;
use serde_json::{Value, json};
use wasmctrl_plugin_sdk::webhooks::{
    Admission, Converter, Defaulter, Defaults, Validator, Verdict,
};
use wasmctrl_plugin_sdk::{Error, Reconciler, Request, Response};

#[derive(Deserialize, Default)]
struct Config {
    #[serde(default)]
    behavior: String,
    /// Desired children, returned as given.
    #[serde(default)]
    children: Vec<Value>,
    /// Ask to be called again after this many milliseconds (0 asks for a hot loop).
    #[serde(default, rename = "requeueAfterMs")]
    requeue_after_ms: Option<u64>,
    /// Record this many Events, each with its own reason.
    #[serde(default)]
    events: u32,
    /// With `behavior: spin`, busy-loop this many iterations before answering, so a test can
    /// hold a reconcile open for a while.
    #[serde(default)]
    spins: u64,
    /// Also desire a ConfigMap of the parent's own, `<parent>-own`, holding the parent's
    /// `spec` as its data (so many parents can each have a child).
    #[serde(default, rename = "ownChild")]
    own_child: bool,
    /// Also desire a ConfigMap `<parent>-<item>` for each name in the parent's `spec.items`,
    /// so a parent's own spec says how many children it has (and shrinking it prunes).
    #[serde(default, rename = "specChildren")]
    spec_children: bool,
    /// Fail (a transient error) for every parent whose `spec.fail` is true, so a test can
    /// have a plugin fail for a known share of its parents.
    #[serde(default, rename = "failMarked")]
    fail_marked: bool,
    /// With `ownChild`, leave the own child out for a parent labelled `drop: "true"`, so a
    /// test can have the plugin turn on children it made, with no change to the plugin.
    #[serde(default, rename = "dropLabelled")]
    drop_labelled: bool,
    /// Also desire a Deployment `<parent>-app` of one replica running this image.
    #[serde(default)]
    deployment: Option<String>,
    /// With `deployment`, give its pods a node selector no node matches: they never run, so
    /// the Deployment never becomes available.
    #[serde(default)]
    unschedulable: bool,
    /// Claim the parent is ready: a `Ready=True` condition in the status it writes.
    #[serde(default, rename = "claimReady")]
    claim_ready: bool,
    /// Touch this many MiB of memory (every page written) before answering, so a test can
    /// make each call hold that much resident.
    #[serde(default, rename = "touchMib")]
    touch_mib: usize,
}

/// Calls seen by this instance. A fresh sandbox per call means it is always 1.
static CALLS: AtomicU32 = AtomicU32::new(0);

struct Misbehave;

impl Reconciler for Misbehave {
    type Parent = Value;
    type Config = Config;

    fn reconcile(request: &Request<Value, Config>) -> Result<Response, Error> {
        let calls = CALLS.fetch_add(1, Ordering::SeqCst) + 1;
        let name = request.name();
        let mut response = Response::new();
        if request.finalizing {
            if request.config.behavior == "panic-finalizing" {
                panic!("deliberate panic while finalizing {name}");
            }
            response.add_event(
                wasmctrl_plugin_sdk::EventType::Normal,
                "Finalizing",
                format!("cleaning up after {name}"),
            );
            if request.config.behavior != "hold-finalizer" {
                response.set_finalized();
            }
            return Ok(response);
        }
        let touched = vec![1u8; request.config.touch_mib << 20];
        std::hint::black_box(&touched);
        if request.config.fail_marked && request.parent["spec"]["fail"] == true {
            return Err(Error::transient(format!("{name} is marked to fail")));
        }
        for child in &request.config.children {
            response.add_child(child)?;
        }
        let dropped =
            request.config.drop_labelled && request.parent["metadata"]["labels"]["drop"] == "true";
        if request.config.own_child && !dropped {
            let data: serde_json::Map<String, Value> = request.parent["spec"]
                .as_object()
                .map(|spec| {
                    spec.iter()
                        .map(|(k, v)| (k.clone(), Value::String(v.to_string())))
                        .collect()
                })
                .unwrap_or_default();
            response.add_child(&json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": format!("{name}-own")},
                "data": data,
            }))?;
        }
        if let Some(image) = &request.config.deployment {
            let app = format!("{name}-app");
            let mut pod = json!({"containers": [{"name": "app", "image": image}]});
            if request.config.unschedulable {
                pod["nodeSelector"] = json!({"wasmctrl.test/nowhere": "true"});
            }
            response.add_child(&json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": app},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": {"app": app}},
                    "template": {
                        "metadata": {"labels": {"app": app}},
                        "spec": pod,
                    },
                },
            }))?;
        }
        if request.config.spec_children {
            let items = request.parent["spec"]["items"].as_array().cloned();
            for item in items.unwrap_or_default().iter().filter_map(Value::as_str) {
                response.add_child(&json!({
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": format!("{name}-{item}")},
                }))?;
            }
        }
        if let Some(ms) = request.config.requeue_after_ms {
            response.set_requeue_after(std::time::Duration::from_millis(ms));
        }
        for i in 0..request.config.events {
            response.add_event(
                wasmctrl_plugin_sdk::EventType::Normal,
                format!("Flood{i}"),
                format!("event {i} for {name}"),
            );
        }
        match request.config.behavior.as_str() {
            "loop" => {
                let mut n = 0u64;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            "grow-memory" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            "panic" => panic!("deliberate panic while reconciling {name}"),
            "noisy-panic" => {
                eprintln!("about to fail");
                panic!("deliberate panic while reconciling {name}")
            }
            "exit" => std::process::exit(3),
            "sleep" => std::thread::sleep(std::time::Duration::from_secs(3600)),
            "big-output" => {
                let filler = "x".repeat(100 << 20);
                response.add_child(&json!({
                    "apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": name}, "data": {"big": filler},
                }))?;
            }
            "invalid-json" => {
                response.add_child_json("{\"apiVersion\": \"v1\", \"kind\": ".to_owned());
            }
            "spin" => {
                let mut n = 0u64;
                for _ in 0..request.config.spins {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            "error" => return Err(Error::transient(format!("backend for {name} unavailable"))),
            "permanent" => return Err(Error::permanent(format!("{name} can never work"))),
            "invalid-parent" => {
                return Err(Error::invalid_parent(format!("{name} has no usable spec")));
            }
            "log-flood" => {
                for i in 0..100_000 {
                    wasmctrl_plugin_sdk::info!("flood message {i} for {name}");
                }
            }
            "escape" => {
                response.set_status(&json!({
                    "file": attempt(std::fs::read_to_string("/etc/passwd")),
                    "dir": attempt(std::fs::read_dir(".").map(|d| d.count())),
                    "env": attempt(std::env::var("HOME")),
                    "envCount": std::env::vars().count(),
                    "args": std::env::args().count(),
                    "socket": attempt(std::net::TcpStream::connect("127.0.0.1:6443")),
                    "stdin": attempt(std::io::read_to_string(std::io::stdin())),
                    "wallClock": std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_secs())
                        .unwrap_or(u64::MAX),
                }))?;
                return Ok(response);
            }
            "stderr" => eprintln!("misbehave reconciled {name}"),
            _ => {}
        }
        let mut status = json!({
            "parent": name,
            "calls": calls,
            "children": request.children.len(),
            "related": request.related.len(),
        });
        if request.config.claim_ready {
            status["conditions"] = json!([{
                "type": "Ready", "status": "True", "reason": "Claimed",
                "message": "the plugin says so", "lastTransitionTime": "2026-01-01T00:00:00Z",
            }]);
        }
        response.set_status(&status)?;
        Ok(response)
    }
}

/// `"ok: …"` if the attempt worked (a sandbox hole), else `"denied: <error>"`.
fn attempt<T: std::fmt::Debug, E: std::fmt::Display>(result: Result<T, E>) -> String {
    match result {
        Ok(value) => format!("ok: {value:?}"),
        Err(error) => format!("denied: {error}"),
    }
}

/// Its webhooks misbehave the same way, picked by the same config: `panic`, `loop`, `error`,
/// `grow-memory`; `deny` refuses every write (on `spec.x`), `warn-flood` allows it with 100
/// warnings, and its defaulter's `rename` renames the object (which the host must refuse).
/// Otherwise validate allows and default sets `spec.defaulted: true`. Its converter, between
/// `example.com/v1` and `example.com/v2`, misbehaves on the object's own `spec.behavior`
/// (`panic`, `loop`), and upgrading loses `spec.lost`, which v2 has no field for: a
/// conversion that does not come back.
struct MisbehaveVersions;

impl Converter for MisbehaveVersions {
    type Older = Value;
    type Newer = Value;
    const OLDER: &'static str = "example.com/v1";
    const NEWER: &'static str = "example.com/v2";

    fn upgrade(mut older: Value) -> Result<Value, Error> {
        MisbehaveWebhooks::misbehave(older["spec"]["behavior"].as_str().unwrap_or_default())?;
        if let Some(spec) = older["spec"].as_object_mut() {
            spec.remove("lost");
        }
        Ok(older)
    }

    fn downgrade(newer: Value) -> Result<Value, Error> {
        MisbehaveWebhooks::misbehave(newer["spec"]["behavior"].as_str().unwrap_or_default())?;
        Ok(newer)
    }
}

struct MisbehaveWebhooks;

impl MisbehaveWebhooks {
    fn misbehave(behavior: &str) -> Result<(), Error> {
        match behavior {
            "panic" => panic!("deliberate panic in a webhook"),
            "loop" =>
            {
                #[allow(clippy::empty_loop)]
                loop {}
            }
            "grow-memory" => {
                let mut hog: Vec<Vec<u8>> = Vec::new();
                loop {
                    hog.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hog);
                }
            }
            "error" => Err(Error::permanent("the webhook cannot decide")),
            _ => Ok(()),
        }
    }
}

impl Validator for MisbehaveWebhooks {
    type Parent = Value;
    type Config = Config;

    fn validate(request: &Admission<Value, Config>) -> Result<Verdict, Error> {
        Self::misbehave(&request.config.behavior)?;
        let mut verdict = Verdict::allow();
        match request.config.behavior.as_str() {
            "deny" => {
                verdict.deny("spec.x", "x is never allowed");
            }
            "warn-flood" => {
                for i in 0..100 {
                    verdict.warn(format!("warning {i}"));
                }
            }
            _ => {}
        }
        Ok(verdict)
    }
}

impl Defaulter for MisbehaveWebhooks {
    type Parent = Value;
    type Config = Config;

    fn apply_defaults(
        request: &Admission<Value, Config>,
        defaults: &mut Defaults,
    ) -> Result<(), Error> {
        Self::misbehave(&request.config.behavior)?;
        if request.config.behavior == "rename" {
            defaults.set("metadata.name", "renamed")?;
        } else {
            defaults.set("spec.defaulted", true)?;
        }
        Ok(())
    }
}

wasmctrl_plugin_sdk::export_plugin!(
    reconciler: Misbehave,
    validator: MisbehaveWebhooks,
    defaulter: MisbehaveWebhooks,
    converter: MisbehaveVersions,
);
