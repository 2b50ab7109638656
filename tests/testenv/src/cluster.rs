//! Starting, finding and stopping a local control plane: etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler and kwok (a simulated node), on loopback, on free
//! ports, from binaries built by `tools/cluster/build.sh`.
//!
//! A cluster lives in a state directory holding its certificates, data, logs, kubeconfig and a
//! `state.json` naming every process by pid. `stop` kills those pids and removes the directory;
//! `start` on a directory whose cluster is half dead (say, the API server was killed) stops
//! the rest first, so a crashed run never breaks the next one.

use std::fs::File;
use std::net::TcpListener;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use kube::api::{Api, PostParams};
use serde::{Deserialize, Serialize};

use crate::pki;

/// The annotation kwok uses to pick the nodes it simulates.
const KWOK_NODE_ANNOTATION: &str = "kwok.x-k8s.io/node";
/// The simulated node's name.
pub const NODE_NAME: &str = "kwok-node-0";

/// Where the control plane binaries are.
#[derive(Debug, Clone)]
pub struct Binaries {
    dir: PathBuf,
}

impl Binaries {
    /// Build (or find in the cache) the binaries pinned in `tools/cluster/`. The first build
    /// takes several minutes; progress goes to stderr.
    pub fn build(repo_root: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            dir: crate::tools::build_in(repo_root, "cluster")?,
        })
    }

    /// The path of one binary.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The directory holding them (to put on `PATH` for `kubectl`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// One running component.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Component {
    /// `etcd`, `kube-apiserver`, …
    pub name: String,
    /// Its process id.
    pub pid: u32,
    /// The port it serves on.
    pub port: u16,
    /// Its log file.
    pub log: PathBuf,
    /// The arguments it was started with, so a fault test can start it again.
    #[serde(default)]
    pub args: Vec<String>,
}

/// A started control plane, as recorded in `state.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ControlPlane {
    /// The state directory.
    pub dir: PathBuf,
    /// The admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    /// Where the binaries are (for `kubectl`).
    pub bin_dir: PathBuf,
    /// The API server's audit log (writes only, unless started with [`Audit::Everything`]).
    pub audit_log: PathBuf,
    /// Every process, in start order.
    pub components: Vec<Component>,
}

/// How the processes relate to the one starting them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// They keep running after the starter exits (`cargo xtask cluster up`).
    Detached,
    /// The kernel kills them when the starting thread exits (test runs). Start from a thread
    /// that lives as long as the cluster should.
    TiedToStarter,
}

impl ControlPlane {
    /// The cluster recorded in `dir`, if any.
    pub fn load(dir: &Path) -> anyhow::Result<Option<Self>> {
        let path = dir.join("state.json");
        match std::fs::read(&path) {
            Ok(bytes) => Ok(Some(
                serde_json::from_slice(&bytes)
                    .with_context(|| format!("reading {}", path.display()))?,
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    /// Whether every recorded process is still alive.
    pub fn all_alive(&self) -> bool {
        self.components.iter().all(|c| is_alive(c.pid))
    }

    /// Start a control plane in `dir`, replacing whatever was recorded there, and wait until
    /// it is ready: `/readyz` ok, the simulated node Ready, and the `default` service account
    /// present.
    pub async fn start(
        dir: &Path,
        binaries: &Binaries,
        lifetime: Lifetime,
    ) -> anyhow::Result<Self> {
        Self::start_auditing(dir, binaries, lifetime, Audit::Writes).await
    }

    /// [`ControlPlane::start`], with its audit log holding `audit`.
    pub async fn start_auditing(
        dir: &Path,
        binaries: &Binaries,
        lifetime: Lifetime,
        audit: Audit,
    ) -> anyhow::Result<Self> {
        if let Some(old) = Self::load(dir)? {
            old.stop();
        }
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir.join("logs"))?;
        let dir = dir.canonicalize()?;
        let pki_dir = dir.join("pki");
        pki::generate(&pki_dir)?;
        let pki = |name: &str| pki_dir.join(name).display().to_string();

        let etcd_port = free_port()?;
        let etcd_peer_port = free_port()?;
        let api_port = free_port()?;
        let server = format!("https://127.0.0.1:{api_port}");
        let kubeconfig = dir.join("kubeconfig");
        write_kubeconfig(&kubeconfig, &server, &pki_dir)?;
        let audit_policy = dir.join("audit-policy.yaml");
        let policy = match audit {
            Audit::Writes => AUDIT_POLICY,
            Audit::Everything => AUDIT_EVERY_REQUEST,
        };
        std::fs::write(&audit_policy, policy)?;
        let audit_log = dir.join("logs/audit.log");

        let mut plane = Self {
            dir: dir.clone(),
            kubeconfig: kubeconfig.clone(),
            server: server.clone(),
            bin_dir: binaries.dir().to_path_buf(),
            audit_log: audit_log.clone(),
            components: Vec::new(),
        };
        let result = async {
            let etcd_url = format!("http://127.0.0.1:{etcd_port}");
            let peer_url = format!("http://127.0.0.1:{etcd_peer_port}");
            plane.spawn(
                binaries,
                lifetime,
                "etcd",
                etcd_port,
                &[
                    "--name=default".into(),
                    format!("--data-dir={}", dir.join("etcd").display()),
                    format!("--listen-client-urls={etcd_url}"),
                    format!("--advertise-client-urls={etcd_url}"),
                    format!("--listen-peer-urls={peer_url}"),
                    format!("--initial-advertise-peer-urls={peer_url}"),
                    format!("--initial-cluster=default={peer_url}"),
                    "--unsafe-no-fsync=true".into(),
                    "--log-level=warn".into(),
                ],
            )?;
            wait_for_port(etcd_port, Duration::from_secs(30))
                .await
                .context("etcd did not start")?;

            let kubeconfig_arg = format!("--kubeconfig={}", kubeconfig.display());
            plane.spawn(
                binaries,
                lifetime,
                "kube-apiserver",
                api_port,
                &[
                    format!("--etcd-servers={etcd_url}"),
                    "--bind-address=127.0.0.1".into(),
                    "--advertise-address=127.0.0.1".into(),
                    // Loopback may not appear in the kubernetes Service endpoints; nothing here
                    // reaches the API server through that Service anyway.
                    "--endpoint-reconciler-type=none".into(),
                    format!("--secure-port={api_port}"),
                    format!("--tls-cert-file={}", pki(pki::SERVING_CERT)),
                    format!("--tls-private-key-file={}", pki(pki::SERVING_KEY)),
                    format!("--client-ca-file={}", pki(pki::CA_CERT)),
                    "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                    format!(
                        "--service-account-key-file={}",
                        pki(pki::SERVICE_ACCOUNT_PUB)
                    ),
                    format!(
                        "--service-account-signing-key-file={}",
                        pki(pki::SERVICE_ACCOUNT_KEY)
                    ),
                    "--authorization-mode=Node,RBAC".into(),
                    "--enable-admission-plugins=NodeRestriction".into(),
                    "--service-cluster-ip-range=10.96.0.0/16".into(),
                    "--allow-privileged=true".into(),
                    // Lists and watches narrowed to a shard's uids (alpha): what a sharded
                    // host's per-shard caches ask for.
                    "--feature-gates=ShardedListAndWatch=true".into(),
                    format!("--audit-policy-file={}", audit_policy.display()),
                    format!("--audit-log-path={}", audit_log.display()),
                    // Never rotate (the default rotates at 100 MB): write counts read the
                    // whole log, and a rotation mid-run would cut them short.
                    "--audit-log-maxsize=1000000".into(),
                    format!("--cert-dir={}", dir.join("apiserver-certs").display()),
                ],
            )?;
            wait_until_api_server_ready(
                "the API server to be ready",
                Duration::from_secs(90),
                &kubeconfig,
                &plane.components,
            )
            .await?;
            let client = admin_client(&kubeconfig).await?;

            let cm_port = free_port()?;
            plane.spawn(
                binaries,
                lifetime,
                "kube-controller-manager",
                cm_port,
                &[
                    kubeconfig_arg.clone(),
                    format!("--authentication-kubeconfig={}", kubeconfig.display()),
                    format!("--authorization-kubeconfig={}", kubeconfig.display()),
                    "--bind-address=127.0.0.1".into(),
                    format!("--secure-port={cm_port}"),
                    format!(
                        "--cert-dir={}",
                        dir.join("controller-manager-certs").display()
                    ),
                    format!(
                        "--service-account-private-key-file={}",
                        pki(pki::SERVICE_ACCOUNT_KEY)
                    ),
                    format!("--root-ca-file={}", pki(pki::CA_CERT)),
                    format!("--cluster-signing-cert-file={}", pki(pki::CA_CERT)),
                    format!("--cluster-signing-key-file={}", pki(pki::CA_KEY)),
                    "--use-service-account-credentials=true".into(),
                    "--leader-elect=false".into(),
                ],
            )?;
            let scheduler_port = free_port()?;
            plane.spawn(
                binaries,
                lifetime,
                "kube-scheduler",
                scheduler_port,
                &[
                    kubeconfig_arg.clone(),
                    format!("--authentication-kubeconfig={}", kubeconfig.display()),
                    format!("--authorization-kubeconfig={}", kubeconfig.display()),
                    "--bind-address=127.0.0.1".into(),
                    format!("--secure-port={scheduler_port}"),
                    format!("--cert-dir={}", dir.join("scheduler-certs").display()),
                    "--leader-elect=false".into(),
                ],
            )?;
            let kwok_port = free_port()?;
            plane.spawn(
                binaries,
                lifetime,
                "kwok",
                kwok_port,
                &[
                    kubeconfig_arg,
                    format!("--config={}", binaries.path("kwok-stages.yaml").display()),
                    format!("--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake"),
                    format!("--server-address=127.0.0.1:{kwok_port}"),
                    "--cidr=10.244.0.0/16".into(),
                    "--node-ip=10.0.0.1".into(),
                ],
            )?;
            plane.save()?;

            create_fake_node(&client).await?;
            let components = plane.components.clone();
            wait_until(
                "the simulated node to be Ready",
                Duration::from_secs(60),
                &components,
                || async {
                    let node = Api::<Node>::all(client.clone()).get(NODE_NAME).await?;
                    Ok(node
                        .status
                        .and_then(|s| s.conditions)
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True"))
                },
            )
            .await?;
            wait_until(
                "the default service account",
                Duration::from_secs(60),
                &components,
                || async {
                    Ok(Api::<ServiceAccount>::namespaced(client.clone(), "default")
                        .get_opt("default")
                        .await?
                        .is_some())
                },
            )
            .await?;
            anyhow::Ok(())
        }
        .await;
        match result {
            Ok(()) => Ok(plane),
            Err(e) => {
                let logs = plane.dir.join("logs");
                plane.stop_processes();
                Err(e.context(format!(
                    "starting the local control plane failed; component logs are in {}",
                    logs.display()
                )))
            }
        }
    }

    #[allow(unsafe_code)] // see the SAFETY comment inside
    fn spawn(
        &mut self,
        binaries: &Binaries,
        lifetime: Lifetime,
        name: &str,
        port: u16,
        args: &[String],
    ) -> anyhow::Result<()> {
        let log = self.dir.join("logs").join(format!("{name}.log"));
        let out = File::options().create(true).append(true).open(&log)?;
        let mut command = Command::new(binaries.path(name));
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            // Own process group: a Ctrl-C meant for the starter does not reach them.
            .process_group(0);
        if lifetime == Lifetime::TiedToStarter {
            // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
            unsafe {
                command.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {name} ({})", binaries.path(name).display()))?;
        let component = Component {
            name: name.to_owned(),
            pid: child.id(),
            port,
            log,
            args: args.to_vec(),
        };
        match self.components.iter_mut().find(|c| c.name == name) {
            Some(existing) => *existing = component,
            None => self.components.push(component),
        }
        // The child is reaped by `stop` (or by init once the starter exits).
        std::mem::forget(child);
        self.save()
    }

    fn save(&self) -> anyhow::Result<()> {
        let path = self.dir.join("state.json");
        std::fs::write(&path, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// Kill one component with SIGKILL, as a crash would, and wait until it is gone. For
    /// fault tests; [`ControlPlane::start_component`] brings it back.
    pub async fn kill_component(&self, name: &str) -> anyhow::Result<()> {
        let component = self
            .components
            .iter()
            .find(|c| c.name == name)
            .with_context(|| format!("no component {name}"))?;
        signal(component.pid, libc::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(10);
        while is_alive(component.pid) {
            if Instant::now() > deadline {
                bail!("{name} (pid {}) survived SIGKILL", component.pid);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Start a killed component again with its original arguments and port, and wait until
    /// it listens.
    pub async fn start_component(
        &mut self,
        name: &str,
        binaries: &Binaries,
        lifetime: Lifetime,
    ) -> anyhow::Result<()> {
        self.start_component_with(name, binaries, lifetime, &[])
            .await
    }

    /// [`ControlPlane::start_component`], with `extra` arguments after the original ones
    /// (for this start only: a later start uses the originals).
    pub async fn start_component_with(
        &mut self,
        name: &str,
        binaries: &Binaries,
        lifetime: Lifetime,
        extra: &[String],
    ) -> anyhow::Result<()> {
        let component = self
            .components
            .iter()
            .find(|c| c.name == name)
            .with_context(|| format!("no component {name}"))?
            .clone();
        if is_alive(component.pid) {
            bail!("{name} is still running");
        }
        let mut args = component.args.clone();
        args.extend_from_slice(extra);
        // Connections the killed process left half-closed keep its port until the kernel
        // lets them go; a start before that fails to listen.
        wait_until_bindable(component.port, Duration::from_secs(90))
            .await
            .with_context(|| format!("{name}'s port stays taken"))?;
        self.spawn(binaries, lifetime, name, component.port, &args)?;
        if let Some(started) = self.components.iter_mut().find(|c| c.name == name) {
            started.args.clone_from(&component.args);
        }
        self.save()?;
        wait_for_port(component.port, Duration::from_secs(60))
            .await
            .with_context(|| format!("{name} did not come back"))?;
        if name == "kube-apiserver" {
            // It listens before it serves: until `/readyz` says so, a request may be reset.
            wait_until_api_server_ready(
                "the restarted API server to be ready",
                Duration::from_secs(60),
                &self.kubeconfig,
                &self.components,
            )
            .await?;
        }
        Ok(())
    }

    /// Compact etcd's history up to its current revision, so watches that resume from an
    /// older resourceVersion get `410 Gone` and must relist. Returns the revision compacted.
    pub fn compact_etcd(&self) -> anyhow::Result<i64> {
        let etcd = self
            .components
            .iter()
            .find(|c| c.name == "etcd")
            .context("no etcd")?;
        // etcd's JSON gateway: a range over one key reports the store's revision.
        let range = etcd_post(etcd.port, "/v3/kv/range", r#"{"key":"Lw=="}"#)?;
        let revision: i64 = range["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .or_else(|| range["header"]["revision"].as_i64())
            .with_context(|| format!("no revision in {range}"))?;
        etcd_post(
            etcd.port,
            "/v3/kv/compaction",
            &format!(r#"{{"revision":"{revision}","physical":true}}"#),
        )?;
        Ok(revision)
    }

    /// Kill every process (TERM, then KILL after a grace period) and remove the state.
    pub fn stop(&self) {
        self.stop_processes();
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    fn stop_processes(&self) {
        for component in self.components.iter().rev() {
            signal(component.pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && self.components.iter().any(|c| is_alive(c.pid)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        for component in &self.components {
            if is_alive(component.pid) {
                signal(component.pid, libc::SIGKILL);
            }
        }
    }

    /// A `kube::Client` with admin rights.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        admin_client(&self.kubeconfig).await
    }
}

/// Log every write (not reads) at metadata level, so tests can count what a controller wrote.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  verbs: [create, update, patch, delete, deletecollection]
- level: None
";

/// What a control plane's audit log holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audit {
    /// Every write, at metadata level: what tests count. Small enough to read whole.
    Writes,
    /// Every request, reads too: for a bench that counts all of a client's requests.
    Everything,
}

/// Log every request at metadata level.
const AUDIT_EVERY_REQUEST: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
";

fn write_kubeconfig(path: &Path, server: &str, pki_dir: &Path) -> anyhow::Result<()> {
    let file = |name: &str| pki_dir.join(name).display().to_string();
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "wasmctrl-local", "cluster": {
            "server": server, "certificate-authority": file(pki::CA_CERT)}}],
        "users": [{"name": "admin", "user": {
            "client-certificate": file(pki::ADMIN_CERT), "client-key": file(pki::ADMIN_KEY)}}],
        "contexts": [{"name": "wasmctrl-local", "context": {"cluster": "wasmctrl-local", "user": "admin"}}],
        "current-context": "wasmctrl-local",
    });
    std::fs::write(path, serde_yaml_ng::to_string(&config)?)?;
    Ok(())
}

/// A client for the admin kubeconfig at `path`.
pub async fn admin_client(path: &Path) -> anyhow::Result<kube::Client> {
    Ok(kube::Client::try_from(admin_config(path).await?)?)
}

/// The connection settings of [`admin_client`], for a client built differently.
pub async fn admin_config(path: &Path) -> anyhow::Result<kube::Config> {
    ensure_crypto_provider();
    let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
    Ok(kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?)
}

fn http_get(path: &str) -> anyhow::Result<http::Request<Vec<u8>>> {
    Ok(http::Request::get(path).body(Vec::new())?)
}

async fn create_fake_node(client: &kube::Client) -> anyhow::Result<()> {
    let node: Node = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": NODE_NAME,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux",
                       "kubernetes.io/arch": "amd64", "type": "kwok"},
        },
        "status": {
            "allocatable": {"cpu": "1000", "memory": "4Ti", "pods": "50000"},
            "capacity": {"cpu": "1000", "memory": "4Ti", "pods": "50000"},
        },
    }))?;
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .context("creating the simulated node")?;
    Ok(())
}

/// A port nothing listens on, for a component to listen on in a moment. Taken below the
/// kernel's ephemeral range (32768 and up by default): a port the kernel hands out for `:0`
/// may be handed out again, between this check and the component's bind, as the source
/// port of any outgoing connection, and the component then fails with "address already in
/// use". Ports are tried from a point that differs per process and call, so planes started
/// side by side do not try the same ones.
fn free_port() -> anyhow::Result<u16> {
    use std::hash::{BuildHasher as _, RandomState};
    const PORTS: std::ops::Range<u16> = 20_000..32_000;
    let span = PORTS.end - PORTS.start;
    let start = u16::try_from(RandomState::new().hash_one(std::process::id()) % u64::from(span))?;
    for offset in 0..span {
        let port = PORTS.start + (start + offset) % span;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

async fn wait_until_bindable(port: u16, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while let Err(e) = TcpListener::bind(("127.0.0.1", port)) {
        if Instant::now() > deadline {
            bail!("port {port} cannot be bound after {timeout:?}: {e}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

async fn wait_for_port(port: u16, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            bail!("nothing listens on port {port} after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Poll `check` until it returns true, or fail naming `what` and the last error.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    wait_until(what, timeout, &[], check).await
}

/// Wait until the API server of `kubeconfig` answers `/readyz` with `ok` (naming `what` if
/// it does not within `timeout`), failing at once if one of `components` dies.
async fn wait_until_api_server_ready(
    what: &str,
    timeout: Duration,
    kubeconfig: &Path,
    components: &[Component],
) -> anyhow::Result<()> {
    let client = admin_client(kubeconfig).await?;
    wait_until(what, timeout, components, || async {
        client
            .request_text(http_get("/readyz")?)
            .await
            .map(|body| body.trim() == "ok")
            .map_err(anyhow::Error::from)
    })
    .await
}

/// [`eventually`], failing at once, with the end of its log, if one of `components` dies.
async fn wait_until<F, Fut>(
    what: &str,
    timeout: Duration,
    components: &[Component],
    mut check: F,
) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(dead) = components.iter().find(|c| !is_alive(c.pid)) {
            let log = std::fs::read_to_string(&dead.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            bail!(
                "{} exited while waiting for {what}; the end of {}:\n{}",
                dead.name,
                dead.log.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        let last = match check().await {
            Ok(true) => return Ok(()),
            Ok(false) => "not yet".to_owned(),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what} (last: {last})");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// POST a JSON body to etcd's gRPC gateway on loopback and parse the answer.
fn etcd_post(port: u16, path: &str, body: &str) -> anyhow::Result<serde_json::Value> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, payload) = response
        .split_once("\r\n\r\n")
        .context("no HTTP body from etcd")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("etcd {path}: {head}");
    }
    // The gateway may answer chunked; the JSON object is what lies between the braces.
    let start = payload.find('{').context("no JSON from etcd")?;
    let end = payload.rfind('}').context("no JSON from etcd")?;
    Ok(serde_json::from_str(&payload[start..=end])?)
}

#[allow(unsafe_code)] // see the SAFETY comment inside
fn signal(pid: u32, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// A memory figure of a process from `/proc/<pid>/status`, in MiB: `field` is e.g. `VmRSS`
/// (resident now) or `VmHWM` (peak resident).
pub fn memory_mib(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// Alive and not a zombie.
pub fn is_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Pick rustls' ring provider, as the host does: both ring and aws-lc-rs are in the
/// dependency graph, and rustls refuses to guess between them.
pub fn ensure_crypto_provider() {
    // An error means another provider was installed first, which works just as well.
    let _ = rustls::crypto::ring::default_provider().install_default();
}
