//! Starting a cluster where one already runs, and stopping one whose API server was killed,
//! both leave a working state: a crashed run never breaks the next one.

use std::time::Duration;

use wasmctrl_testenv::cluster::{Binaries, ControlPlane, Lifetime, is_alive};
use wasmctrl_testenv::repo_root;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(unsafe_code)] // see the SAFETY comment inside
async fn start_twice_and_stop_after_apiserver_was_killed() -> anyhow::Result<()> {
    let binaries = tokio::task::spawn_blocking(|| Binaries::build(&repo_root())).await??;
    let dir = tempfile::Builder::new()
        .prefix("lifecycle-")
        .tempdir_in(repo_root().join("target"))?;

    let first = ControlPlane::start(dir.path(), &binaries, Lifetime::TiedToStarter).await?;
    assert!(first.all_alive());
    // Starting again on the same directory replaces the first cluster cleanly.
    let second = ControlPlane::start(dir.path(), &binaries, Lifetime::TiedToStarter).await?;
    for c in &first.components {
        assert!(
            !is_alive(c.pid),
            "{} of the first cluster still runs",
            c.name
        );
    }
    second.client().await?.apiserver_version().await?;

    let apiserver = second
        .components
        .iter()
        .find(|c| c.name == "kube-apiserver")
        .expect("an API server");
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(apiserver.pid as i32, libc::SIGKILL) };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let recorded = ControlPlane::load(dir.path())?.expect("state survives the crash");
    assert!(!recorded.all_alive(), "the killed API server is noticed");

    recorded.stop();
    for c in &recorded.components {
        assert!(!is_alive(c.pid), "{} survived stop", c.name);
    }
    assert!(!dir.path().exists(), "state removed");

    // And the next start works.
    let third = ControlPlane::start(dir.path(), &binaries, Lifetime::TiedToStarter).await?;
    third.client().await?.apiserver_version().await?;
    third.stop();
    Ok(())
}
