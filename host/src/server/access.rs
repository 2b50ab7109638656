//! Who may read what the listener serves. A caller shows a bearer token; the API server says
//! who it belongs to (TokenReview) and whether that identity may do what the endpoint needs
//! (SubjectAccessReview): `get` on the non-resource URL `/metrics`, or `get` on the very
//! parent an `/explain` answer is about. The host's own rights never stand in for the
//! caller's. This is controller-runtime's secure metrics serving, extended to records.
//!
//! Answers are kept for [`REVIEW_TTL`], so a scraper every few seconds costs the API server
//! two reviews (its token, its access) a half-minute; a token revoked or a binding removed
//! takes effect within it; a token refused is refused from memory as long. At most
//! [`MAX_REVIEWS`] reviews are in flight at once, each within [`REVIEW_TIMEOUT`], so callers
//! with made-up tokens cannot turn the host into a flood of requests on the API server
//! (which would count against the host's own fair share); and at most
//! [`MAX_REVIEWS_PER_CLIENT`] of those are one client address's token reviews, so a client
//! sending made-up tokens as fast as it can fills no more than its share, and a real caller
//! from elsewhere is answered: the flooding client is told to slow down (429).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use sha2::{Digest as _, Sha256};

/// How long a review's answer is reused.
pub const REVIEW_TTL: Duration = Duration::from_secs(30);
/// Answers kept at most, per kind of review; the oldest half goes when it is full.
const MAX_CACHED: usize = 4096;
/// Reviews in flight at once; more wait.
pub const MAX_REVIEWS: usize = 8;
/// Token reviews in flight for one client address; more are refused at once.
pub const MAX_REVIEWS_PER_CLIENT: usize = 2;
/// The longest one review may take.
pub const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a caller could not be reviewed.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// The API server answered with an error.
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// The API server did not answer in time, or too many reviews were waiting.
    #[error("the API server did not answer the review within {0:?}")]
    TimedOut(Duration),
    /// The client already has [`MAX_REVIEWS_PER_CLIENT`] token reviews in flight.
    #[error("{0} has {MAX_REVIEWS_PER_CLIENT} tokens under review already")]
    ClientBusy(std::net::IpAddr),
}

/// An identity the API server vouched for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Caller {
    /// e.g. `system:serviceaccount:monitoring:prometheus`.
    pub username: String,
    /// The identity's UID, when it has one.
    pub uid: Option<String>,
    /// Its groups.
    pub groups: Vec<String>,
    /// Extra attributes (scopes and the like), passed on to authorization as they came.
    pub extra: BTreeMap<String, Vec<String>>,
}

/// What a request needs the caller to be allowed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Needs {
    /// `get` on a non-resource URL such as `/metrics`.
    Path(&'static str),
    /// `get` on one object.
    Get {
        /// The API group; empty for the core group.
        group: String,
        /// The resource, plural (`myapps`).
        resource: String,
        /// Its namespace, for a namespaced object.
        namespace: Option<String>,
        /// Its name.
        name: String,
    },
}

impl std::fmt::Display for Needs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Path(path) => write!(f, "get {path}"),
            Self::Get {
                group,
                resource,
                namespace,
                name,
            } => {
                let resource = match group.as_str() {
                    "" => resource.clone(),
                    group => format!("{resource}.{group}"),
                };
                match namespace {
                    Some(namespace) => write!(f, "get {resource} {name} in namespace {namespace}"),
                    None => write!(f, "get {resource} {name}"),
                }
            }
        }
    }
}

/// Asks the API server about callers, through the host's own client (which needs `create`
/// on `tokenreviews` and `subjectaccessreviews`, and nothing about the callers).
pub struct Reviewer {
    client: kube::Client,
    in_flight: tokio::sync::Semaphore,
    /// Token reviews in flight per client address.
    per_client: Mutex<HashMap<std::net::IpAddr, usize>>,
    tokens: Mutex<Cache<[u8; 32], Option<Caller>>>,
    decisions: Mutex<Cache<(Caller, Needs), bool>>,
}

impl Reviewer {
    /// A reviewer asking through `client`.
    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            in_flight: tokio::sync::Semaphore::new(MAX_REVIEWS),
            per_client: Mutex::default(),
            tokens: Mutex::new(Cache::default()),
            decisions: Mutex::new(Cache::default()),
        }
    }

    /// Who `token`, shown by a client at address `client`, belongs to; `None` when the API
    /// server does not accept it.
    pub async fn caller(
        &self,
        token: &str,
        client: std::net::IpAddr,
    ) -> Result<Option<Caller>, ReviewError> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(known) = crate::lock(&self.tokens).get(&key) {
            return Ok(known);
        }
        let _turn = ClientTurn::take(&self.per_client, client)?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let api = Api::<TokenReview>::all(self.client.clone());
        let answer = self
            .bounded(async move { api.create(&PostParams::default(), &review).await })
            .await?;
        let status = answer.status.unwrap_or_default();
        let caller = match (status.authenticated, status.user) {
            (Some(true), Some(user)) => user.username.map(|username| Caller {
                username,
                uid: user.uid,
                groups: user.groups.unwrap_or_default(),
                extra: user.extra.unwrap_or_default(),
            }),
            _ => None,
        };
        crate::lock(&self.tokens).put(key, caller.clone());
        Ok(caller)
    }

    /// Whether `caller` may do what `needs` names.
    pub async fn allows(&self, caller: &Caller, needs: &Needs) -> Result<bool, ReviewError> {
        let key = (caller.clone(), needs.clone());
        if let Some(known) = crate::lock(&self.decisions).get(&key) {
            return Ok(known);
        }
        let mut spec = SubjectAccessReviewSpec {
            user: Some(caller.username.clone()),
            uid: caller.uid.clone(),
            groups: Some(caller.groups.clone()),
            extra: Some(caller.extra.clone()),
            ..SubjectAccessReviewSpec::default()
        };
        match needs {
            Needs::Path(path) => {
                spec.non_resource_attributes = Some(NonResourceAttributes {
                    path: Some((*path).to_owned()),
                    verb: Some("get".to_owned()),
                });
            }
            Needs::Get {
                group,
                resource,
                namespace,
                name,
            } => {
                spec.resource_attributes = Some(ResourceAttributes {
                    group: Some(group.clone()),
                    resource: Some(resource.clone()),
                    namespace: namespace.clone(),
                    name: Some(name.clone()),
                    verb: Some("get".to_owned()),
                    ..ResourceAttributes::default()
                });
            }
        }
        let review = SubjectAccessReview {
            spec,
            ..SubjectAccessReview::default()
        };
        let api = Api::<SubjectAccessReview>::all(self.client.clone());
        let answer = self
            .bounded(async move { api.create(&PostParams::default(), &review).await })
            .await?;
        let allowed = answer.status.is_some_and(|status| status.allowed);
        crate::lock(&self.decisions).put(key, allowed);
        Ok(allowed)
    }

    /// Run `review` within the in-flight bound and the deadline (waiting counts).
    async fn bounded<T>(
        &self,
        review: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, ReviewError> {
        tokio::time::timeout(REVIEW_TIMEOUT, async {
            let _slot = self.in_flight.acquire().await;
            review.await
        })
        .await
        .map_err(|_| ReviewError::TimedOut(REVIEW_TIMEOUT))?
        .map_err(ReviewError::Api)
    }
}

/// One of a client's [`MAX_REVIEWS_PER_CLIENT`] token reviews in flight; given back on drop.
struct ClientTurn<'a> {
    clients: &'a Mutex<HashMap<std::net::IpAddr, usize>>,
    client: std::net::IpAddr,
}

impl<'a> ClientTurn<'a> {
    fn take(
        clients: &'a Mutex<HashMap<std::net::IpAddr, usize>>,
        client: std::net::IpAddr,
    ) -> Result<Self, ReviewError> {
        let mut in_flight = crate::lock(clients);
        let held = in_flight.entry(client).or_insert(0);
        if *held >= MAX_REVIEWS_PER_CLIENT {
            return Err(ReviewError::ClientBusy(client));
        }
        *held += 1;
        Ok(Self { clients, client })
    }
}

impl Drop for ClientTurn<'_> {
    fn drop(&mut self) {
        let mut in_flight = crate::lock(self.clients);
        if let Some(held) = in_flight.get_mut(&self.client) {
            *held -= 1;
            if *held == 0 {
                in_flight.remove(&self.client);
            }
        }
    }
}

/// Answers kept for [`REVIEW_TTL`], at most [`MAX_CACHED`].
struct Cache<K, V> {
    entries: HashMap<K, (Instant, V)>,
}

impl<K, V> Default for Cache<K, V> {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
        }
    }
}

impl<K: std::hash::Hash + Eq, V: Clone> Cache<K, V> {
    fn get(&self, key: &K) -> Option<V> {
        self.entries
            .get(key)
            .filter(|(at, _)| at.elapsed() < REVIEW_TTL)
            .map(|(_, value)| value.clone())
    }

    fn put(&mut self, key: K, value: V) {
        if self.entries.len() >= MAX_CACHED {
            self.entries.retain(|_, (at, _)| at.elapsed() < REVIEW_TTL);
        }
        if self.entries.len() >= MAX_CACHED {
            // Still full of live answers (many callers at once): forget the older half.
            let mut ages: Vec<Instant> = self.entries.values().map(|(at, _)| *at).collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 2];
            self.entries.retain(|_, (at, _)| *at > cut);
        }
        self.entries.insert(key, (Instant::now(), value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_request_needs_reads_as_rbac_would_say_it() {
        let needs = Needs::Get {
            group: "example.com".into(),
            resource: "myapps".into(),
            namespace: Some("team-a".into()),
            name: "web".into(),
        };
        assert_eq!(
            needs.to_string(),
            "get myapps.example.com web in namespace team-a"
        );
        assert_eq!(Needs::Path("/metrics").to_string(), "get /metrics");
    }

    #[test]
    fn a_client_has_at_most_its_share_of_token_reviews_in_flight() {
        let clients = Mutex::default();
        let flood: std::net::IpAddr = "127.0.0.2".parse().expect("an address");
        let real: std::net::IpAddr = "127.0.0.1".parse().expect("an address");
        let first = ClientTurn::take(&clients, flood).expect("a turn");
        let _second = ClientTurn::take(&clients, flood).expect("a turn");
        assert!(matches!(
            ClientTurn::take(&clients, flood),
            Err(ReviewError::ClientBusy(_))
        ));
        let _other = ClientTurn::take(&clients, real).expect("another client is not held back");
        drop(first);
        let _again = ClientTurn::take(&clients, flood).expect("a turn given back");
    }

    #[test]
    fn the_cache_forgets_when_full_and_keeps_the_newest() {
        let mut cache = Cache::default();
        for key in 0..MAX_CACHED + 10 {
            cache.put(key, key);
        }
        assert!(cache.entries.len() <= MAX_CACHED);
        assert_eq!(cache.get(&(MAX_CACHED + 9)), Some(MAX_CACHED + 9));
    }
}
