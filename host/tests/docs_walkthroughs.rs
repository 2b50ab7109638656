//! The docs' walk-throughs, run as written: each page's setup block by bash, then every
//! `$ command` of its console blocks, each output compared by shape with the page's (see
//! `support/walkthrough.rs`). Each runs against a control plane of its own: the example
//! policy claims its kind in every namespace, which the shared test cluster's tests must keep.
//!
//! The only changes are a reader's own values — where the session's files go, the host's
//! port — and what the test provides itself: the control plane (`cargo xtask cluster up`) and
//! the plugin builds (`cargo xtask build-plugins`; the tests build every plugin), and a
//! registry (`docker run … registry`).

mod support;
#[path = "support/walkthrough.rs"]
mod walkthrough;

use std::path::{Path, PathBuf};
use std::time::Duration;

use wasmctrl_testenv::cluster::{Binaries, ControlPlane, Lifetime};
use wasmctrl_testenv::plugins::{guest, plugin_dir};
use wasmctrl_testenv::registry::Registry;
use wasmctrl_testenv::repo_root;

use walkthrough::{Session, blocks};

/// How long a step may take to show what the page shows (a rollout, a reconcile): 90 s, or
/// `WASMCTRL_WALKTHROUGH_PATIENCE_SECS` (a few seconds shows every difference quickly while
/// editing a page).
fn patience() -> Duration {
    let seconds = std::env::var("WASMCTRL_WALKTHROUGH_PATIENCE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(90);
    Duration::from_secs(seconds)
}

/// The directory of the `wasmctrl` binary under test, and of the control plane's `kubectl`,
/// first on `PATH`.
fn path_with(dirs: &[&Path]) -> String {
    let inherited = std::env::var_os("PATH").unwrap_or_default();
    let dirs = dirs
        .iter()
        .map(|d| d.to_path_buf())
        .chain(std::env::split_paths(&inherited));
    std::env::join_paths(dirs)
        .expect("PATH")
        .to_string_lossy()
        .into_owned()
}

fn wasmctrl_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_wasmctrl"))
        .parent()
        .expect("the binary's directory")
        .to_owned()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A setup block as the test runs it: without the lines the test does itself (`cargo
/// xtask …`, `docker run` of a registry), and with a host started in the background (`… &`) leaving its pid in
/// `host.pid` and its output in `host.log`, so the test stops it and shows what it said.
fn setup_script(block: &str) -> String {
    block
        .lines()
        .filter(|line| !line.starts_with("cargo xtask ") && !line.starts_with("docker run "))
        .map(|line| match line.strip_suffix(" &") {
            Some(background) => format!("{background} > host.log 2>&1 & echo $! > host.pid"),
            None => line.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Stops the background host when the walk-through ends, passed or not.
struct BackgroundHost(PathBuf);

impl BackgroundHost {
    fn log(&self) -> String {
        std::fs::read_to_string(self.0.join("host.log")).unwrap_or_default()
    }
}

impl Drop for BackgroundHost {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.0.join("host.pid")) {
            let _ = std::process::Command::new("kill").arg(pid.trim()).status();
        }
    }
}

/// A walk-through: its page, the section whose `sh` block sets it up, the sections whose
/// console blocks it plays, and the directory its session works in.
struct Walk {
    page: &'static str,
    setup: &'static str,
    sections: &'static [&'static str],
    work_dir: &'static str,
}

impl Walk {
    /// Play the page against a control plane of its own, with `more_values` for whatever
    /// else the test provides (a registry's address).
    async fn play(&self, more_values: Vec<(String, String)>) {
        let page = std::fs::read_to_string(repo_root().join(self.page)).expect("the page");
        let binaries = tokio::task::spawn_blocking(|| Binaries::build(&repo_root()))
            .await
            .expect("a task")
            .expect("the control plane's binaries");
        let state = tempfile::Builder::new()
            .prefix("walkthrough-cluster-")
            .tempdir_in(repo_root().join("target"))
            .expect("a state directory");
        let cluster = ControlPlane::start(state.path(), &binaries, Lifetime::TiedToStarter)
            .await
            .expect("a control plane");
        let work = tempfile::tempdir().expect("a directory");
        let work_dir = work.path().join("work");
        let env = vec![
            (
                "PATH".to_owned(),
                path_with(&[&wasmctrl_dir(), binaries.dir()]),
            ),
            (
                "KUBECONFIG".to_owned(),
                cluster.kubeconfig.display().to_string(),
            ),
            ("WASMCTRL_LOG".to_owned(), "info".to_owned()),
        ];
        let mut values = vec![
            (self.work_dir.to_owned(), work_dir.display().to_string()),
            (
                "127.0.0.1:8080".to_owned(),
                format!("127.0.0.1:{}", free_port()),
            ),
            (
                "target/wasm32-wasip2/plugin/".to_owned(),
                format!("{}/", plugin_dir().display()),
            ),
        ];
        values.extend(more_values);
        let mut session = Session::new(&repo_root(), env, values);

        let setup = blocks(&page, self.setup, "sh");
        assert_eq!(setup.len(), 1, "one setup block under {}", self.setup);
        let host = BackgroundHost(work_dir.clone());
        session.set_up(&setup_script(&setup[0]));

        let mut failures = Vec::new();
        for heading in self.sections {
            let section = blocks(&page, heading, "console");
            assert!(!section.is_empty(), "{heading} shows what to run");
            for block in section {
                failures.extend(
                    session
                        .play(&block, patience())
                        .into_iter()
                        .map(|failure| format!("{heading}:\n{failure}")),
                );
            }
        }
        assert!(
            failures.is_empty(),
            "{}\n\nthe host printed:\n{}",
            failures.join("\n\n"),
            host.log()
        );
        drop(host);
        cluster.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_debugging_walkthrough_runs_as_written() {
    guest("myapp_before_plugin");
    Walk {
        page: "docs/debugging.md",
        setup: "## 0. Set up",
        sections: &[
            "## 1. Something is wrong",
            "## 2. Explain",
            "## 3. Save the case",
            "## 4. Fix the plugin, replay",
            "## 5. Shadow, then promote",
            "## 6. The user's fix, explained",
        ],
        work_dir: "/tmp/walk",
    }
    .play(Vec::new())
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipping_a_new_plugin_runs_as_written() {
    guest("myapp_v2_plugin");
    let registry = tokio::task::spawn_blocking(Registry::start)
        .await
        .expect("a task")
        .expect("a registry");
    Walk {
        page: "docs/operating.md",
        setup: "## Shipping a new plugin",
        sections: &["## Shipping a new plugin"],
        work_dir: "/tmp/ship",
    }
    .play(vec![(
        "127.0.0.1:5000".to_owned(),
        registry.address.clone(),
    )])
    .await;
}

/// The README's quickstart: `cargo xtask up` in the background (with a cluster directory of
/// its own, so it starts a control plane beside the suite's), the second block played in
/// another shell, then Ctrl-C, after which the host and the control plane it started are gone.
/// The reader's `kubectl edit` is an editor that changes one value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_quickstart_runs_as_written() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("the README");
    let up = blocks(&readme, "## Quickstart", "sh");
    assert_eq!(up.first().map(String::as_str), Some("cargo xtask up"));
    let binaries = tokio::task::spawn_blocking(|| Binaries::build(&repo_root()))
        .await
        .expect("a task")
        .expect("the control plane's binaries");
    // A fixed place, so that a run killed half-way (its control plane is detached, as
    // `up`'s is) is cleaned up by the next.
    let work = repo_root().join("target/quickstart-test");
    let cluster_dir = work.join("cluster");
    if let Ok(Some(left)) = ControlPlane::load(&cluster_dir) {
        left.stop();
    }
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).expect("a directory");
    let log = std::fs::File::create(work.join("up.log")).expect("a log");
    let mut running = std::process::Command::new("bash");
    wasmctrl_testenv::runner::without_cargos_package_variables(&mut running);
    let running = running
        .args(["-c", &up[0]])
        .current_dir(repo_root())
        .env("WASMCTRL_CLUSTER_DIR", &cluster_dir)
        .stdout(log.try_clone().expect("the log"))
        .stderr(log)
        .spawn()
        .expect("cargo xtask up");
    let mut job = Job {
        shell: running,
        cluster_dir: cluster_dir.clone(),
    };
    let said = || std::fs::read_to_string(work.join("up.log")).unwrap_or_default();
    let started = std::time::Instant::now();
    while !said().contains("wasmctrl is starting") {
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "cargo xtask up did not start the host:\n{}",
            said()
        );
        assert!(
            job.shell.try_wait().expect("its status").is_none(),
            "cargo xtask up stopped:\n{}",
            said()
        );
        std::thread::sleep(Duration::from_secs(1));
    }

    let editor = work.join("edit");
    std::fs::write(
        &editor,
        "#!/bin/sh\nsed -i 's/LOG_LEVEL: info/LOG_LEVEL: debug/' \"$1\"\n",
    )
    .expect("an editor");
    std::fs::set_permissions(&editor, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("an executable editor");
    let env = vec![("KUBE_EDITOR".to_owned(), editor.display().to_string())];
    let values = vec![
        (
            "$PWD/target/cluster/kubeconfig".to_owned(),
            cluster_dir.join("kubeconfig").display().to_string(),
        ),
        (
            "~/.cache/wasmctrl/cluster/<hash>/bin".to_owned(),
            binaries.dir().display().to_string(),
        ),
    ];
    let mut session = Session::new(&repo_root(), env, values);
    let steps = blocks(&readme, "## Quickstart", "console");
    assert_eq!(steps.len(), 1, "one block to run beside the host");
    let failures = session.play(&steps[0], patience());

    // Ctrl-C, which a terminal sends to every process of the job: the host stops, then the
    // control plane `up` started. (The job stays in the test's process group, so that the
    // runner's kill of a test that hangs reaches it too.)
    job.signal("-INT");
    let stopping = std::time::Instant::now();
    let status = loop {
        if let Some(status) = job.shell.try_wait().expect("its status") {
            break Some(status);
        }
        if stopping.elapsed() > Duration::from_secs(60) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        failures.is_empty(),
        "{}\n\ncargo xtask up printed:\n{}",
        failures.join("\n\n"),
        said()
    );
    assert!(
        status.is_some(),
        "cargo xtask up did not stop within 60 s of Ctrl-C:\n{}",
        said()
    );
    assert!(said().contains("xtask: cluster stopped"), "{}", said());
    let plane = ControlPlane::load(&cluster_dir).expect("the cluster's state");
    assert!(
        plane.is_none_or(|plane| !plane.all_alive()),
        "the control plane outlived Ctrl-C"
    );
}

/// `cargo xtask up` run as a terminal's job: the shell and what it started in its process
/// group (not the control plane, which `up` detaches into groups of its own). Dropped, it
/// kills what is left and stops the control plane, so a test that fails half-way leaves no
/// host on the quickstart's port.
struct Job {
    shell: std::process::Child,
    cluster_dir: PathBuf,
}

impl Job {
    /// Send `signal` (`-INT`, as Ctrl-C) to every process of the job, while its shell runs
    /// (after that its pid may be another process's).
    fn signal(&mut self, signal: &str) {
        if !matches!(self.shell.try_wait(), Ok(None)) {
            return;
        }
        let mut members = in_group_below(self.shell.id());
        members.push(self.shell.id());
        let _ = std::process::Command::new("kill")
            .arg(signal)
            .args(members.iter().map(u32::to_string))
            .stderr(std::process::Stdio::null())
            .status();
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.signal("-KILL");
        if let Ok(Some(plane)) = ControlPlane::load(&self.cluster_dir) {
            plane.stop();
        }
    }
}

/// The processes below `pid` in its process group, from /proc.
fn in_group_below(pid: u32) -> Vec<u32> {
    // (pid, parent, process group) of every process.
    let processes: Vec<(u32, u32, u32)> = std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|entry| {
            let child: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).ok()?;
            // "PID (COMM) STATE PPID PGRP …": the command may hold spaces and parentheses.
            let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(1);
            let parent = fields.next()?.parse().ok()?;
            let group = fields.next()?.parse().ok()?;
            Some((child, parent, group))
        })
        .collect();
    let Some(&(_, _, group)) = processes.iter().find(|(p, _, _)| *p == pid) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        for (child, _, child_group) in processes.iter().filter(|(_, p, _)| *p == parent) {
            if *child_group == group {
                found.push(*child);
            }
            frontier.push(*child);
        }
    }
    found
}
