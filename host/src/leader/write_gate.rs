//! The write gate: a replica writes to the cluster only while it leads, down to the moment a
//! request's bytes are handed to the kernel.
//!
//! Two checks stand between a controller and the wire:
//!
//! - [`WriteGate`], a layer of the client, refuses a write outright while this replica does
//!   not lead, and asks again each time a write under way is polled, so one still waiting
//!   inside the client stack (for a connection, a token, the pool) when the lead runs out is
//!   dropped instead of sent;
//! - past that layer, hyper hands the request to the connection's own task, which writes it
//!   whenever that task next runs. For a process that stopped in between (a SIGSTOP, a VM
//!   pause), that is on resume, possibly before anything else of it runs. So
//!   [`gated_client`] gives writes connections of their own, whose tasks are fenced too:
//!   each time one is polled it asks [`Leadership::may_write`], and once the lead has run
//!   out it ends, dropping whatever it had not yet written.
//!
//! What still goes out after the deadline is only what the kernel already held when the
//! process stopped: it travels while the process stands still, so it reaches the API server
//! while the lead it was sent under still holds. Reads keep their own connections, so a
//! standby's and a fenced leader's watches are never cut by the fence.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;

use super::leadership::Leadership;

/// A Kubernetes client whose writes go out only while `leadership` leads: reads over one
/// connection pool, writes through [`WriteGate`] over another whose connection tasks are
/// fenced on the lead (see the module docs). Every write of the controllers goes through one.
pub fn gated_client(
    config: kube::Config,
    leadership: &Arc<Leadership>,
) -> Result<kube::Client, kube::Error> {
    let default_namespace = config.default_namespace.clone();
    let reads = kube::Client::try_from(config.clone())?;
    let valid_until = *reads.valid_until();
    let fenced = FencedExecutor {
        leadership: leadership.clone(),
    };
    let writes = kube::client::ClientBuilder::try_from((config, fenced))?
        .with_layer(&WriteGate::new(leadership.clone()))
        .build();
    Ok(
        kube::Client::new(SplitWrites { reads, writes }, default_namespace)
            .with_valid_until(valid_until),
    )
}

/// Whether `request` changes something: everything but a read or a self-review.
fn is_write<B>(request: &http::Request<B>) -> bool {
    !(matches!(*request.method(), http::Method::GET | http::Method::HEAD)
        || is_review(request.uri().path()))
}

/// Sends each request over the client for its kind: reads and self-reviews over `reads`,
/// anything else over the gated, fenced `writes`.
#[derive(Clone)]
struct SplitWrites {
    reads: kube::Client,
    writes: kube::Client,
}

impl tower::Service<http::Request<kube::client::Body>> for SplitWrites {
    type Response = http::Response<kube::client::Body>;
    type Error = kube::Error;
    type Future = BoxFuture<'static, Result<Self::Response, kube::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Each client waits for its own stack to be ready in `send`.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<kube::client::Body>) -> Self::Future {
        let client = if is_write(&request) {
            self.writes.clone()
        } else {
            crate::watch_lists::consistent_initial_events(&mut request);
            self.reads.clone()
        };
        Box::pin(async move { client.send(request).await })
    }
}

/// Runs the background tasks of the write pool's connections (and only those), each fenced
/// on the lead.
#[derive(Clone)]
struct FencedExecutor {
    leadership: Arc<Leadership>,
}

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

impl hyper::rt::Executor<Task> for FencedExecutor {
    fn execute(&self, task: Task) {
        tokio::spawn(Fenced {
            task,
            leadership: self.leadership.clone(),
        });
    }
}

/// A connection's task that ends, closing the connection and dropping what it had not yet
/// written, the first time it is polled after the lead ran out.
struct Fenced {
    task: Task,
    leadership: Arc<Leadership>,
}

impl Future for Fenced {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if !self.leadership.may_write() {
            return Poll::Ready(());
        }
        self.task.as_mut().poll(cx)
    }
}

/// The error a standby's client gives instead of sending a write, or for a write whose lead
/// ran out while it was under way.
#[derive(Debug, thiserror::Error)]
#[error("not the leader: {}", self.said())]
pub struct NotLeader {
    method: http::Method,
    path: String,
    under_way: bool,
    /// The shard of the parent written for, when this replica no longer holds it.
    shard: Option<u32>,
}

impl NotLeader {
    fn said(&self) -> String {
        let (method, path) = (&self.method, &self.path);
        if let Some(shard) = self.shard {
            format!(
                "this replica no longer holds shard {shard}: {method} {path} was stopped where it stood (it may have been sent)"
            )
        } else if self.under_way {
            format!("the lead ran out while {method} {path} was under way (it may have been sent)")
        } else {
            format!("this replica is a standby and sends no {method} {path}")
        }
    }
}

/// A layer for the host's Kubernetes client that refuses every request but reads while
/// this replica does not lead (see the module docs).
#[derive(Debug, Clone)]
pub struct WriteGate {
    leadership: Arc<Leadership>,
}

impl WriteGate {
    /// Gate writes on `leadership`.
    pub fn new(leadership: Arc<Leadership>) -> Self {
        Self { leadership }
    }
}

impl<S> tower::Layer<S> for WriteGate {
    type Service = GatedService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GatedService {
            inner,
            leadership: self.leadership.clone(),
        }
    }
}

/// The service [`WriteGate`] wraps around the client's stack.
#[derive(Debug, Clone)]
pub struct GatedService<S> {
    inner: S,
    leadership: Arc<Leadership>,
}

impl<S, B> tower::Service<http::Request<B>> for GatedService<S>
where
    S: tower::Service<http::Request<B>>,
    S::Response: Send + 'static,
    S::Error: Into<tower::BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = tower::BoxError;
    type Future = BoxFuture<'static, Result<S::Response, tower::BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if !is_write(&request) {
            let response = self.inner.call(request);
            return Box::pin(async move { response.await.map_err(Into::into) });
        }
        let mut refused = NotLeader {
            method: request.method().clone(),
            path: request.uri().path().to_owned(),
            under_way: false,
            shard: None,
        };
        // Asked here too where the caller's task calls the gate itself (a buffered client
        // calls it from its own task: there the poll below is the check).
        refused.shard = crate::shards::writes_allowed().err();
        if !self.leadership.may_write() || refused.shard.is_some() {
            return Box::pin(std::future::ready(Err(refused.into())));
        }
        refused.under_way = true;
        let response = self.inner.call(request);
        Box::pin(GatedWrite {
            response: Box::pin(response),
            leadership: self.leadership.clone(),
            refused: Some(refused),
        })
    }
}

/// A write under way, refused the moment the lead it started under runs out: each poll asks
/// [`Leadership::may_write`] before it lets the request go further. A process stopped with
/// writes inside its client stack (waiting for a connection, a token, the pool) drops them on
/// resume instead of sending them. Only what the connection already holds can still go out.
struct GatedWrite<F> {
    response: std::pin::Pin<Box<F>>,
    leadership: Arc<Leadership>,
    refused: Option<NotLeader>,
}

impl<F, R, E> std::future::Future for GatedWrite<F>
where
    F: std::future::Future<Output = Result<R, E>>,
    E: Into<tower::BoxError>,
{
    type Output = Result<R, tower::BoxError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // A write of a reconcile is polled on the reconcile's task, which names its shard.
        let shard = crate::shards::writes_allowed().err();
        if !self.leadership.may_write() || shard.is_some() {
            let refused = self.refused.take().map_or_else(
                || "not the leader".into(),
                |mut refused| -> tower::BoxError {
                    refused.shard = shard;
                    refused.into()
                },
            );
            return Poll::Ready(Err(refused));
        }
        self.response.as_mut().poll(cx).map_err(Into::into)
    }
}

/// A self-review (`POST …/selfsubjectaccessreviews`, `…/selfsubjectreviews`) asks a question
/// and changes nothing, so a standby may make it: it checks its permissions, and who it acts
/// as, before it leads.
fn is_review(path: &str) -> bool {
    (path.starts_with("/apis/authorization.k8s.io/")
        && (path.ends_with("/selfsubjectaccessreviews")
            || path.ends_with("/selfsubjectrulesreviews")))
        || (path.starts_with("/apis/authentication.k8s.io/")
            && path.ends_with("/selfsubjectreviews"))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use tokio::time::Instant;

    use super::*;

    /// A write gate on `leadership` around a service that counts the requests it is sent.
    fn counting_gate(
        leadership: &Arc<Leadership>,
    ) -> (
        impl tower::Service<http::Request<()>, Response = (), Error = tower::BoxError>,
        Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use tower::Layer as _;
        let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let inner = {
            let sent = sent.clone();
            tower::service_fn(move |_: http::Request<()>| {
                sent.fetch_add(1, Ordering::SeqCst);
                std::future::ready(Ok::<_, std::convert::Infallible>(()))
            })
        };
        (WriteGate::new(leadership.clone()).layer(inner), sent)
    }

    fn request(method: http::Method, uri: &str) -> http::Request<()> {
        http::Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .unwrap_or_default()
    }

    #[test]
    fn a_standby_learns_of_leadership_and_the_gate_follows() {
        let leadership = Leadership::standby();
        let mut changes = leadership.subscribe();
        assert!(!leadership.is_leader());
        leadership.lead_until(Instant::now() + Duration::from_secs(60));
        assert!(leadership.is_leader());
        assert!(changes.has_changed().unwrap_or(false));
        assert!(*changes.borrow_and_update());
        assert!(Leadership::always().is_leader());
    }

    /// A sharded host's reconcile writes for its parent's shard: from the moment the shard
    /// is let go, its writes are refused (reads and other tasks' writes are not), and a
    /// shard held past its deadline stops every write of the process.
    #[tokio::test(start_paused = true)]
    async fn a_reconcile_writes_only_while_its_parents_shard_is_held() {
        use tower::Service as _;
        let leadership = Leadership::always();
        let shards = crate::shards::ShardOwnership::new(2);
        leadership.shard_by(shards.clone());
        let (mut gated, sent) = counting_gate(&leadership);
        let path = "/api/v1/namespaces/a/configmaps";
        shards.hold_until(1, Instant::now() + Duration::from_secs(10));
        let writing = shards.start_writing(1).expect("held");
        let outcomes = crate::shards::write_for(writing, async {
            let first = gated.call(request(http::Method::POST, path)).await.is_ok();
            shards.let_go(1);
            let after = gated
                .call(request(http::Method::POST, path))
                .await
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            let read = gated.call(request(http::Method::GET, path)).await.is_ok();
            (first, after, read)
        })
        .await;
        assert!(outcomes.0, "written while held");
        assert!(
            outcomes.1.contains("no longer holds shard 1"),
            "{}",
            outcomes.1
        );
        assert!(outcomes.2, "reads go on");
        assert_eq!(
            sent.load(Ordering::SeqCst),
            2,
            "the write after letting go was not sent"
        );
        // A write of the host's own (outside any reconcile) is not a shard's.
        assert!(gated.call(request(http::Method::POST, path)).await.is_ok());
        // A shard held past its deadline (the process stood still): nothing is written.
        shards.hold_until(0, Instant::now() + Duration::from_secs(10));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(!leadership.may_write());
        assert!(gated.call(request(http::Method::POST, path)).await.is_err());
        assert_eq!(sent.load(Ordering::SeqCst), 3);
    }

    /// A sharded host leads its policies (status, rollout, finalizers) only while it holds
    /// shard 0, by the same clock, and its subscribers see shard 0 come and go; it writes for
    /// the parents of its other shards all the while.
    #[tokio::test(start_paused = true)]
    async fn a_sharded_host_leads_the_policies_while_it_holds_shard_0() {
        let leadership = Leadership::always();
        let shards = crate::shards::ShardOwnership::new(3);
        shards.hold_until(2, Instant::now() + Duration::from_secs(60));
        leadership.shard_by(shards.clone());
        let mut leading = leadership.subscribe();
        assert!(!*leading.borrow_and_update(), "shard 0 is not held");
        assert!(!leadership.is_leader());
        assert!(leadership.may_write(), "shard 2's parents are written");

        shards.hold_until(0, Instant::now() + Duration::from_secs(10));
        tokio::time::timeout(Duration::from_secs(1), leading.changed())
            .await
            .expect("shard 0's gain is seen")
            .expect("open");
        assert!(*leading.borrow_and_update());
        assert!(leadership.is_leader());
        leadership.until_leader().await;

        // Past shard 0's deadline nothing is written, as for a leader whose lease ran out.
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(!leadership.is_leader() && !leadership.may_write());
        shards.let_go(0);
        tokio::time::timeout(Duration::from_secs(1), leading.changed())
            .await
            .expect("shard 0's loss is seen")
            .expect("open");
        assert!(!*leading.borrow_and_update());
        assert!(leadership.may_write() && !leadership.is_leader());
    }

    /// kube's client calls the gate from a task of its own (a buffer), and hands the write
    /// under way back to the reconcile's task: the shard is asked when that task polls it,
    /// before the request goes any further.
    #[tokio::test]
    async fn a_write_called_elsewhere_is_refused_when_its_reconcile_polls_it() {
        use tower::{Layer as _, Service as _};
        let leadership = Leadership::always();
        let shards = crate::shards::ShardOwnership::new(1);
        leadership.shard_by(shards.clone());
        let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        // Sends when polled, as a connection pool's checkout does.
        let inner = {
            let sent = sent.clone();
            tower::service_fn(move |_: http::Request<()>| {
                let sent = sent.clone();
                async move {
                    sent.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::convert::Infallible>(())
                }
            })
        };
        let mut gated = WriteGate::new(leadership.clone()).layer(inner);
        shards.hold_until(0, Instant::now() + Duration::from_secs(60));
        let writing = shards.start_writing(0).expect("held");
        let refused = crate::shards::write_for(writing, async {
            let request = request(http::Method::POST, "/api/v1/namespaces/a/configmaps");
            let (under_way, _gated) = tokio::spawn(async move { (gated.call(request), gated) })
                .await
                .expect("the calling task ran");
            shards.let_go(0);
            under_way
                .await
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        })
        .await;
        assert!(refused.contains("no longer holds shard 0"), "{refused}");
        assert_eq!(sent.load(Ordering::SeqCst), 0, "nothing was sent");
    }

    #[tokio::test]
    async fn the_gate_refuses_writes_but_not_reads_while_standing_by() {
        use tower::Service as _;
        let leadership = Leadership::standby();
        let (mut gated, sent) = counting_gate(&leadership);
        let request = |method| request(method, "/api/v1/namespaces/a/configmaps");
        assert!(gated.call(request(http::Method::GET)).await.is_ok());
        for method in [
            http::Method::POST,
            http::Method::PATCH,
            http::Method::DELETE,
        ] {
            let refused = gated.call(request(method.clone())).await;
            let message = refused.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(message.starts_with("not the leader"), "{method}: {message}");
        }
        assert_eq!(sent.load(Ordering::SeqCst), 1, "only the read went through");
        let review = http::Request::builder()
            .method(http::Method::POST)
            .uri("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews")
            .body(())
            .unwrap_or_default();
        assert!(
            gated.call(review).await.is_ok(),
            "a self-review changes nothing"
        );
        assert_eq!(sent.load(Ordering::SeqCst), 2);
        leadership.lead_until(Instant::now() + Duration::from_secs(60));
        assert!(gated.call(request(http::Method::PATCH)).await.is_ok());
        assert_eq!(sent.load(Ordering::SeqCst), 3);
    }

    /// A leader whose process stood still past its renew deadline (nothing ran: no elector,
    /// no renewal) finds its gate closed when it resumes, before any task of it runs.
    #[tokio::test(start_paused = true)]
    async fn the_gate_closes_at_the_renew_deadline_without_the_elector() {
        use tower::Service as _;
        let renew_deadline = Duration::from_secs(10);
        let leadership = Leadership::standby();
        let (mut gated, sent) = counting_gate(&leadership);
        let request = |method| request(method, "/api/v1/namespaces/a/configmaps/c");
        let renewed = Instant::now();
        leadership.lead_until(renewed + renew_deadline);
        assert!(gated.call(request(http::Method::PATCH)).await.is_ok());

        tokio::time::advance(renew_deadline - Duration::from_millis(1)).await;
        assert!(leadership.is_leader(), "still within the deadline");
        assert!(gated.call(request(http::Method::PATCH)).await.is_ok());
        assert_eq!(sent.load(Ordering::SeqCst), 2);

        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(
            !leadership.is_leader(),
            "closed at renewal + renew deadline"
        );
        for method in [
            http::Method::POST,
            http::Method::PATCH,
            http::Method::PUT,
            http::Method::DELETE,
        ] {
            let refused = gated.call(request(method.clone())).await;
            let message = refused.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(message.starts_with("not the leader"), "{method}: {message}");
        }
        assert!(
            gated.call(request(http::Method::GET)).await.is_ok(),
            "reads go on"
        );
        assert_eq!(
            sent.load(Ordering::SeqCst),
            3,
            "no write after the deadline"
        );
        // Nothing told the subscribers: the clock alone closed the gate.
        assert!(*leadership.subscribe().borrow());

        // A renewal (as the elector makes it) opens it again until the next deadline.
        leadership.lead_until(Instant::now() + renew_deadline);
        assert!(gated.call(request(http::Method::PATCH)).await.is_ok());
        assert!(Leadership::always().is_leader(), "no election, no clock");
    }

    /// A write that passed the gate and then waited (for a connection, say) while the
    /// process stood still past the deadline is dropped when it resumes, not sent.
    #[tokio::test(start_paused = true)]
    async fn a_write_under_way_past_the_deadline_is_dropped_not_sent() {
        use tower::{Layer as _, Service as _};
        let renew_deadline = Duration::from_secs(10);
        let leadership = Leadership::standby();
        leadership.lead_until(Instant::now() + renew_deadline);
        let connection = Arc::new(tokio::sync::Notify::new());
        let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let inner = {
            let (connection, sent) = (connection.clone(), sent.clone());
            tower::service_fn(move |_: http::Request<()>| {
                let (connection, sent) = (connection.clone(), sent.clone());
                async move {
                    connection.notified().await;
                    sent.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::convert::Infallible>(())
                }
            })
        };
        let mut gated = WriteGate::new(leadership.clone()).layer(inner);
        let mut write = gated.call(request(
            http::Method::PATCH,
            "/api/v1/namespaces/a/configmaps/c",
        ));
        // Under way: polled once, waiting for its connection.
        assert!(futures::poll!(&mut write).is_pending());
        tokio::time::advance(renew_deadline + Duration::from_secs(1)).await;
        connection.notify_waiters();
        let refused = write.await.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.starts_with("not the leader"), "{refused}");
        assert_eq!(
            sent.load(Ordering::SeqCst),
            0,
            "nothing sent after the deadline"
        );

        // Within the lead, the same wait ends in the write.
        leadership.lead_until(Instant::now() + renew_deadline);
        let mut write = gated.call(request(
            http::Method::PATCH,
            "/api/v1/namespaces/a/configmaps/c",
        ));
        assert!(futures::poll!(&mut write).is_pending());
        connection.notify_waiters();
        assert!(write.await.is_ok());
        assert_eq!(sent.load(Ordering::SeqCst), 1);
    }

    /// A connection's task that was handed a request while leading but runs again only after
    /// the lead ran out (the process stood still in between) writes nothing: it ends,
    /// closing the connection, instead.
    #[tokio::test(flavor = "current_thread")]
    async fn a_connection_woken_after_the_deadline_writes_nothing() {
        let leadership = Leadership::standby();
        leadership.lead_until(Instant::now() + Duration::from_secs(60));
        let (requests, mut connection) = tokio::sync::mpsc::unbounded_channel::<&str>();
        let written = Arc::new(std::sync::Mutex::new(Vec::new()));
        let executor = FencedExecutor {
            leadership: leadership.clone(),
        };
        {
            let written = written.clone();
            hyper::rt::Executor::execute(
                &executor,
                Box::pin(async move {
                    while let Some(request) = connection.recv().await {
                        crate::lock(&written).push(request);
                    }
                }),
            );
        }
        let settle = || async {
            for _ in 0..8 {
                tokio::task::yield_now().await;
            }
        };
        assert!(requests.send("PATCH within the lead").is_ok());
        settle().await;
        assert_eq!(*crate::lock(&written), ["PATCH within the lead"]);

        // Handed over, and the lead runs out before the task runs again.
        assert!(requests.send("PATCH handed over before the stop").is_ok());
        leadership.lead_until(Instant::now());
        settle().await;
        assert_eq!(
            *crate::lock(&written),
            ["PATCH within the lead"],
            "nothing written after the deadline"
        );
        assert!(requests.is_closed(), "the connection ended");
    }
}
