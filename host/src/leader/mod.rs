//! Leader election: of several replicas of the host, exactly one writes to the cluster.
//!
//! Every replica runs its watches and loads its plugins, so a standby's caches are warm and
//! a takeover costs one pass over the parents it already holds. Only the holder of a
//! `coordination.k8s.io/v1` Lease writes. Two mechanisms keep a standby from writing:
//!
//! - the controllers ask [`Leadership::may_write`] before a reconcile, and
//!   [`Leadership::is_leader`] before a status flush or a finalizer change, and do nothing
//!   as a standby;
//! - every request that is not a read goes through [`gated_client`]: a layer that refuses it
//!   outright while this replica does not lead, over connections of its own that are cut
//!   the moment the lead runs out (see [`write_gate`]). A leader that loses the lease
//!   therefore stops writing at once, even in the middle of a reconcile.
//!
//! Leading is not only a flag the elector sets: it is bounded by a clock. Each successful
//! renewal lets this replica lead until the renewal's start plus `renew_deadline`, and
//! [`Leadership::may_write`] (so the gate, at every write) answers no once that instant has
//! passed, whether or not the elector has run since. That matters when the whole process
//! stops — a SIGSTOP, a VM pause, a long stall — for longer than the lease: a standby takes
//! over, and when the old leader resumes its reconciles, and the connection tasks holding
//! their requests, may be woken before its elector. The clock is monotonic
//! (`CLOCK_MONOTONIC` keeps counting while a process is stopped), so the gate is already
//! closed when anything of the resumed process tries to write: a write still inside the
//! client, or handed to its connection but not yet written, is dropped on resume. What
//! remains is what the kernel already held when the process stopped, which reaches the API
//! server while the old lead still holds; only a fencing token checked by the API server
//! could do better, and Kubernetes has none.
//!
//! The election follows client-go's `leaderelection` package, so it behaves as Go operators
//! do with controller-runtime's defaults (15 s lease, 10 s renew deadline, 2 s retry):
//!
//! - a Lease held by someone else counts as expired only `lease_duration` after *this*
//!   replica last saw it change, so no clocks are compared across machines;
//! - the leader renews every `retry_period` and gives up once `renew_deadline` has passed
//!   since the start of its last successful renewal — well before the others may take over;
//!   a renewal is a write of the lead like any other, so it goes through the gate and its
//!   fenced connections, and one the process stopped before sending is never sent late;
//! - a leader that shuts down clears the holder, and a standby checking every
//!   `retry_period` takes over within about that time instead of a whole lease.
//!
//! Why not a crate: `kube-leader-election` targets kube 4, and `kube-lease-manager` (kube 5)
//! sleeps a standby until the lease expires, so a released lease is only taken a whole lease
//! duration later, and a leader whose renewals fail keeps reporting itself the leader.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

mod leadership;
pub mod lease;
pub mod write_gate;

pub use leadership::Leadership;
pub use lease::LeaseConfig;
use lease::jittered;
pub use write_gate::{GatedService, NotLeader, WriteGate, gated_client};

/// This replica stopped leading while it was running: another took the Lease, or renewing
/// failed for longer than the renew deadline.
#[derive(Debug, thiserror::Error)]
#[error("lost the leader lease {namespace}/{name}: {why}")]
pub struct LeadershipLost {
    namespace: String,
    name: String,
    why: String,
}

/// Takes part in the election for one Lease and reports the outcome to a [`Leadership`].
pub struct LeaderElector {
    api: Api<Lease>,
    /// The same Lease through the write-gated client: a renewal is sent while this replica
    /// leads, so it is dropped with the other writes if the lead runs out before its bytes
    /// left (a process stopped between the deadline check and the wire). The Lease is
    /// watched through it too, as its reads start watches with a consistent read.
    renewals: Api<Lease>,
    config: LeaseConfig,
    leadership: Arc<Leadership>,
    /// The holder's part of the Lease as last seen, and when it was first seen so.
    observed: Option<(LeaseSpec, Instant)>,
}

/// One attempt to take or renew the Lease.
enum Attempt {
    Held,
    HeldByOther(String),
}

impl LeaderElector {
    /// An elector for the Lease in `config`. It takes and releases the Lease through
    /// `client`, which must *not* be write-gated (a standby writes to take over), and
    /// renews it through `gated`, the client gated on `leadership` (see [`gated_client`]).
    pub fn new(
        client: kube::Client,
        gated: kube::Client,
        config: LeaseConfig,
        leadership: Arc<Leadership>,
    ) -> Self {
        Self {
            api: Api::namespaced(client, &config.namespace),
            renewals: Api::namespaced(gated, &config.namespace),
            config,
            leadership,
            observed: None,
        }
    }

    /// Campaign until `stop`, leading whenever the Lease is ours. Returns the elector (for
    /// [`release`](Self::release)) when stopped, or why leadership was lost.
    pub async fn run(mut self, stop: CancellationToken) -> Result<Self, LeadershipLost> {
        let Some(mut renewed) = self.acquire(&stop).await else {
            return Ok(self);
        };
        let retry = self.config.retry_period;
        self.leadership
            .lead_until(renewed + self.config.renew_deadline);
        tracing::info!(lease = %self.config.name, identity = %self.config.identity, "became the leader");
        loop {
            tokio::select! {
                () = stop.cancelled() => return Ok(self),
                () = tokio::time::sleep(retry) => {}
            }
            let started = Instant::now();
            let deadline = renewed + self.config.renew_deadline;
            let renewal = self.try_acquire_or_renew(Some(deadline));
            let why = match tokio::time::timeout_at(deadline, renewal).await {
                // Renewed, but answered only after the deadline: the lead had run out
                // meanwhile (writes were refused), so it is not taken up again, as client-go
                // does: the gate's refusals always mean the lead is gone for good.
                Ok(Ok(Attempt::Held)) if Instant::now() < deadline => {
                    renewed = started;
                    self.leadership
                        .lead_until(renewed + self.config.renew_deadline);
                    continue;
                }
                Ok(Ok(Attempt::Held)) => "renewed only after the renew deadline".to_owned(),
                Ok(Ok(Attempt::HeldByOther(holder))) => format!("{holder} holds it now"),
                Ok(Err(error)) if Instant::now() < deadline => {
                    tracing::warn!(lease = %self.config.name, error = %format!("{error:#}"), "could not renew the leader lease; retrying");
                    continue;
                }
                Ok(Err(error)) => format!("renewing failed until the deadline: {error:#}"),
                Err(_) => format!(
                    "not renewed within the renew deadline ({:?})",
                    self.config.renew_deadline
                ),
            };
            self.leadership.stop_leading();
            return Err(LeadershipLost {
                namespace: self.config.namespace.clone(),
                name: self.config.name.clone(),
                why,
            });
        }
    }

    /// Give the Lease up, if this replica holds it, so a standby takes over within its
    /// retry period. Call it after the last write: the gate must already be closed.
    pub async fn release(&mut self) -> anyhow::Result<()> {
        use anyhow::Context as _;
        self.leadership.stop_leading();
        let Some(mut lease) = self
            .api
            .get_opt(&self.config.name)
            .await
            .context("reading the leader lease")?
        else {
            return Ok(());
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
        self.api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
            .context("releasing the leader lease")?;
        tracing::info!(lease = %self.config.name, "released the leader lease");
        Ok(())
    }

    /// Wait until the Lease is ours, or `stop` (`None`). The Lease is ours from the start of
    /// the attempt that took it: leading is measured from there.
    async fn acquire(&mut self, stop: &CancellationToken) -> Option<Instant> {
        use futures::StreamExt as _;
        use kube::runtime::{WatchStreamExt as _, watcher};
        let retry = self.config.retry_period;
        // Watching the Lease shows a standby each renewal (and a release) as it happens, so
        // it measures expiry from the leader's last renewal rather than from its own last
        // look; polling every retry period stays as the fallback.
        // Through the gated client, whose reads (never gated) ask for a consistent start.
        let only_the_lease = format!("metadata.name={}", self.config.name);
        let lease_events = crate::watch_lists::watcher(
            self.renewals.clone(),
            watcher::Config::default().fields(&only_the_lease),
        )
        .default_backoff()
        .applied_objects();
        let mut lease_events = std::pin::pin!(lease_events);
        loop {
            let started = Instant::now();
            let next_try = started + jittered(retry);
            let wake = match self.try_acquire_or_renew(None).await {
                Ok(Attempt::Held) => return Some(started),
                Ok(Attempt::HeldByOther(_)) => self
                    .observed_expiry()
                    .map_or(next_try, |expiry| expiry.min(next_try)),
                Err(error) => {
                    tracing::warn!(lease = %self.config.name, error = %format!("{error:#}"), "could not take part in the leader election");
                    next_try
                }
            };
            tokio::select! {
                () = stop.cancelled() => return None,
                () = tokio::time::sleep_until(wake) => {}
                Some(Ok(_)) = lease_events.next() => {}
            }
        }
    }

    /// When the Lease as last seen expires, if someone else holds it.
    fn observed_expiry(&self) -> Option<Instant> {
        let (spec, seen) = self.observed.as_ref()?;
        let held_for = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(self.config.lease_duration, Duration::from_secs);
        Some(*seen + held_for)
    }

    /// client-go's `tryAcquireOrRenew`: create the Lease, renew it, or take it over once it
    /// expired; an optimistic-concurrency conflict means someone else won. A leader renewing
    /// passes its `deadline`: once it has passed (the process may have been stopped between
    /// the read and the write), the renewal is not sent, since a standby may lead by now.
    /// A renewal goes through the gated client, whose fence drops it if the process stopped
    /// after that check with the request not yet written.
    async fn try_acquire_or_renew(&mut self, deadline: Option<Instant>) -> anyhow::Result<Attempt> {
        use anyhow::Context as _;
        let writes = if deadline.is_some() {
            &self.renewals
        } else {
            &self.api
        };
        let now = MicroTime(jiff::Timestamp::now());
        let duration = i32::try_from(self.config.lease_duration.as_secs()).unwrap_or(i32::MAX);
        let Some(mut lease) = self
            .api
            .get_opt(&self.config.name)
            .await
            .context("reading the leader lease")?
        else {
            let spec = LeaseSpec {
                holder_identity: Some(self.config.identity.clone()),
                lease_duration_seconds: Some(duration),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            };
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.config.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(spec.clone()),
            };
            ensure_before(deadline)?;
            let written = writes.create(&PostParams::default(), &lease).await;
            return self.settle(written, spec, "creating the leader lease");
        };
        let current = lease.spec.clone().unwrap_or_default();
        if self
            .observed
            .as_ref()
            .is_none_or(|(seen, _)| *seen != current)
        {
            self.observed = Some((current.clone(), Instant::now()));
        }
        let holder = current.holder_identity.clone().unwrap_or_default();
        let ours = holder == self.config.identity;
        if !holder.is_empty()
            && !ours
            && self
                .observed_expiry()
                .is_some_and(|expiry| expiry > Instant::now())
        {
            return Ok(Attempt::HeldByOther(holder));
        }
        let mut spec = current;
        if !ours {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(self.config.identity.clone());
        spec.lease_duration_seconds = Some(duration);
        spec.renew_time = Some(now);
        lease.spec = Some(spec.clone());
        ensure_before(deadline)?;
        let written = writes
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await;
        self.settle(written, spec, "updating the leader lease")
    }

    /// The outcome of writing the Lease with `spec`: held once written (and seen so), held by
    /// another when someone wrote first (a conflict), else the error.
    fn settle(
        &mut self,
        written: Result<Lease, kube::Error>,
        spec: LeaseSpec,
        doing: &'static str,
    ) -> anyhow::Result<Attempt> {
        use anyhow::Context as _;
        match written {
            Ok(_) => {
                self.observed = Some((spec, Instant::now()));
                Ok(Attempt::Held)
            }
            Err(kube::Error::Api(status)) if status.code == 409 => {
                Ok(Attempt::HeldByOther("another replica".into()))
            }
            Err(error) => Err(error).context(doing),
        }
    }
}

/// A renewal is sent only before its deadline (none when acquiring).
fn ensure_before(deadline: Option<Instant>) -> anyhow::Result<()> {
    match deadline {
        Some(deadline) if Instant::now() >= deadline => {
            anyhow::bail!("the renew deadline passed before the renewal could be sent")
        }
        _ => Ok(()),
    }
}

/// A default identity for this replica: the pod name where there is one (so the Lease
/// names the pod), else the host name, with a random suffix so two processes never match.
pub fn default_identity() -> String {
    use std::hash::{BuildHasher as _, RandomState};
    if let Ok(pod) = std::env::var("POD_NAME")
        && !pod.is_empty()
    {
        return pod;
    }
    let host = host_name().unwrap_or_else(|| "wasmctrl".into());
    let random = RandomState::new().hash_one(std::process::id());
    format!("{host}_{random:016x}")
}

/// This machine's name, as the kernel knows it.
#[cfg(target_os = "linux")]
fn host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    Some(name.trim().to_owned()).filter(|name| !name.is_empty())
}

/// Outside Linux (a workstation; pods have `POD_NAME`) there is no `/proc`: the shell's
/// `HOSTNAME` if exported, else none, and the identity is `wasmctrl_<random>`.
#[cfg(not(target_os = "linux"))]
fn host_name() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|name| !name.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_renewal_is_not_sent_after_its_deadline() {
        let deadline = Instant::now() + Duration::from_secs(10);
        assert!(ensure_before(Some(deadline)).is_ok());
        assert!(ensure_before(None).is_ok());
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(ensure_before(Some(deadline)).is_err());
        assert!(ensure_before(None).is_ok(), "acquiring has no deadline");
    }

    /// Lease `n/l` for `me`, held as controller-runtime holds its leases.
    fn controller_runtime_defaults() -> LeaseConfig {
        LeaseConfig {
            name: "l".into(),
            namespace: "n".into(),
            identity: "me".into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    /// An API server that holds the Lease for `me` and answers a write only once `release`d,
    /// counting the writes it was sent.
    #[derive(Clone, Default)]
    struct HeldLease {
        write_arrived: Arc<tokio::sync::Notify>,
        release: Arc<tokio::sync::Notify>,
        written: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl HeldLease {
        fn client(&self, gate: Option<&Arc<Leadership>>) -> kube::Client {
            use tower::Layer as _;
            let server = self.clone();
            let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
                let server = server.clone();
                async move {
                    if request.method() != http::Method::GET {
                        server.write_arrived.notify_one();
                        server.release.notified().await;
                        server
                            .written
                            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    let lease = serde_json::json!({
                        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": "l", "namespace": "n", "resourceVersion": "1"},
                        "spec": {"holderIdentity": "me", "leaseDurationSeconds": 15},
                    });
                    Ok::<_, std::convert::Infallible>(http::Response::new(
                        kube::client::Body::from(lease.to_string().into_bytes()),
                    ))
                }
            });
            match gate {
                Some(leadership) => {
                    kube::Client::new(WriteGate::new(leadership.clone()).layer(service), "n")
                }
                None => kube::Client::new(service, "n"),
            }
        }
    }

    /// The process stops after the renewal passed its deadline check, with the write not
    /// yet sent, and resumes past the deadline: the write is dropped, as every other write
    /// of the lead is, instead of renewing a lease a standby may hold by now.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_held_up_past_its_deadline_is_dropped_not_sent() {
        let config = controller_runtime_defaults();
        let leadership = Leadership::standby();
        let deadline = Instant::now() + config.renew_deadline;
        leadership.lead_until(deadline);
        let server = HeldLease::default();
        let mut elector = LeaderElector::new(
            server.client(None),
            server.client(Some(&leadership)),
            config,
            leadership.clone(),
        );
        let mut renewal = std::pin::pin!(elector.try_acquire_or_renew(Some(deadline)));
        tokio::select! {
            () = server.write_arrived.notified() => {}
            outcome = &mut renewal => panic!("renewed without waiting: {:?}", outcome.is_ok()),
        }
        tokio::time::advance(Duration::from_secs(11)).await;
        server.release.notify_one();
        let refused = renewal
            .await
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        assert!(refused.contains("not the leader"), "{refused}");
        assert_eq!(
            server.written.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "the renewal was not sent after the deadline"
        );
    }

    #[test]
    fn unsafe_durations_are_refused() {
        let config = controller_runtime_defaults();
        assert!(config.validate().is_ok());
        let longer_renew = LeaseConfig {
            renew_deadline: Duration::from_secs(20),
            ..config.clone()
        };
        assert!(longer_renew.validate().is_err());
        let slow_retry = LeaseConfig {
            retry_period: Duration::from_secs(10),
            ..config
        };
        assert!(slow_retry.validate().is_err());
    }
}
