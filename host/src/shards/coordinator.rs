//! The Leases behind sharding: each round (every retry period) a replica renews its
//! membership Lease and the shard Leases it holds, reads every Lease of its shard set in one
//! list, and claims or gives back shards as [`assignment::plan`] says.
//!
//! The Leases of a set named `wasmctrl` in the host's namespace:
//!
//! - `wasmctrl-shard-<i>`, one per shard, held by the replica that reconciles its parents;
//!   annotated with the set's shard count, so replicas configured with another count (a
//!   rollout changing `--shards`) claim nothing until the old count's holders are gone;
//! - `wasmctrl-member-<hash of the identity>`, one per replica, held by it while it runs,
//!   so every replica knows how many share the work; annotated with the count too, and a
//!   member of another count is not counted (the old replicas of such a rollout keep their
//!   shards, rather than give them to new ones that may not take them yet).
//!
//! Expiry follows client-go's rule, as the leader election does: a Lease held by another
//! counts as expired only a lease duration after *this* replica last saw it change, so no
//! clocks are compared across machines. Two replicas claiming one shard race on the Lease's
//! resource version; the second write conflicts and it tries another shard next round.
//!
//! A shard is given back in order: this replica stops holding it (no reconcile starts and
//! no write for it is sent from then on), waits for the reconciles running for it to end (at
//! most a renew deadline, after which they are refused at their next write; the rounds go
//! on meanwhile), and only then clears the Lease's holder, so the replica that takes it
//! never overlaps the one that gave it. A renewal is not sent once the shard's deadline has passed: another replica
//! may hold it by then.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams, Preconditions};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::assignment::{self, ShardView};
use super::ownership::ShardOwnership;
use super::reports::COUNTS_ANNOTATION;
use crate::leader::lease::{LeaseConfig, jittered};

/// The label naming the shard set a Lease belongs to.
pub const SET_LABEL: &str = "wasmctrl.dev/shard-set";
/// The annotation on a shard Lease naming how many shards its set has.
pub const COUNT_ANNOTATION: &str = "wasmctrl.dev/shard-count";
/// At most this many shards: a round renews its shards one after another, and must finish
/// well within the renew deadline.
pub const MAX_SHARDS: u32 = 64;
/// Shards a replica gives back per round when another needs them.
const RELEASES_PER_ROUND: usize = 1;
/// A membership Lease left by a replica that stopped without deleting it is deleted once
/// it has been expired for this many lease durations.
const FORGET_MEMBERS_AFTER: u32 = 10;

/// Where a replica's shard Leases are and how they are held.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// The set's name (the Leases' prefix and [`SET_LABEL`]), namespace, this replica's
    /// identity and the durations, as for leader election.
    pub lease: LeaseConfig,
    /// How many shards the parents are cut into.
    pub count: u32,
}

impl ShardConfig {
    /// Check the durations (as leader election does) and the count.
    pub fn validate(&self) -> Result<(), String> {
        self.lease.validate()?;
        // A Lease carries its duration in whole seconds; others measure expiry by it.
        if self.lease.lease_duration.subsec_nanos() != 0 {
            return Err(format!(
                "the lease duration must be whole seconds, not {:?}",
                self.lease.lease_duration
            ));
        }
        if self.count == 0 || self.count > MAX_SHARDS {
            return Err(format!(
                "the shard count must be between 1 and {MAX_SHARDS}, not {}",
                self.count
            ));
        }
        Ok(())
    }

    fn shard_name(&self, shard: u32) -> String {
        format!("{}-shard-{shard}", self.lease.name)
    }

    fn member_name(&self) -> String {
        use std::hash::Hasher as _;
        let mut hasher = fnv::FnvHasher::default();
        hasher.write(self.lease.identity.as_bytes());
        format!("{}-member-{:016x}", self.lease.name, hasher.finish())
    }
}

/// Claims, renews and gives back this replica's shards, and tells its [`ShardOwnership`].
pub struct ShardCoordinator {
    api: Api<Lease>,
    config: ShardConfig,
    ownership: Arc<ShardOwnership>,
    /// Each Lease of the set as last seen (its spec), and when it was first seen so.
    observed: HashMap<String, (LeaseSpec, Instant)>,
    /// The shards held, and the start of the write that last renewed each.
    renewed: BTreeMap<u32, Instant>,
    /// Shards being given back: no longer held, their Leases not yet cleared (until their
    /// reconciles end, or until the instant named).
    draining: BTreeMap<u32, Instant>,
}

/// A Lease of the set, as one round read it.
struct Listed {
    leases: HashMap<String, Lease>,
}

impl ShardCoordinator {
    /// A coordinator for `config`'s set, writing its Leases through `client` (not
    /// write-gated: a replica writes to take a shard it does not hold yet).
    pub fn new(client: kube::Client, config: ShardConfig, ownership: Arc<ShardOwnership>) -> Self {
        ownership.reports().identify(&config.lease.identity);
        Self {
            api: Api::namespaced(client, &config.lease.namespace),
            config,
            ownership,
            observed: HashMap::new(),
            renewed: BTreeMap::new(),
            draining: BTreeMap::new(),
        }
    }

    /// The shards this coordinator holds, shared with the controllers.
    pub fn ownership(&self) -> &Arc<ShardOwnership> {
        &self.ownership
    }

    /// Take part until `stop`; returns the coordinator, for [`release`](Self::release).
    pub async fn run(mut self, stop: CancellationToken) -> Self {
        let retry = self.config.lease.retry_period;
        loop {
            if let Err(error) = self.round().await {
                tracing::warn!(set = %self.config.lease.name, identity = %self.config.lease.identity, error = %format!("{error:#}"), "shard round failed; retrying");
            }
            tokio::select! {
                () = stop.cancelled() => return self,
                () = tokio::time::sleep(jittered(retry)) => {}
            }
        }
    }

    /// Give every shard back and leave the set, so the other replicas take the shards within
    /// a retry period instead of a lease. Call it after the host's last write, with its write
    /// gate closed ([`crate::leader::Leadership::stop_leading`]): a reconcile the host
    /// abandoned on its way out is not waited for, and its shard is left to expire (a write
    /// it had under way may still be on its way).
    pub async fn release(&mut self) -> anyhow::Result<()> {
        let held: Vec<u32> = self.renewed.keys().copied().collect();
        for shard in held {
            self.start_giving_back(shard);
        }
        let shards: Vec<u32> = self.draining.keys().copied().collect();
        let listed = self.list().await?;
        for shard in shards {
            self.hand_over(shard, &listed).await?;
        }
        let member = self.config.member_name();
        match self.api.delete(&member, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(error) => Err(error).context("deleting this replica's membership lease"),
        }
    }

    /// One round: read the set, renew what is held, then claim or give back.
    async fn round(&mut self) -> anyhow::Result<()> {
        let mut listed = self.list().await?;
        // The shards first: their deadlines are what a failing round costs.
        self.renew_shards(&mut listed).await;
        if let Err(error) = self.renew_membership(&listed).await {
            // Others may count this replica out meanwhile and claim more; its shards stay
            // held by their own Leases.
            tracing::warn!(set = %self.config.lease.name, error = %format!("{error:#}"), "could not renew the membership lease; retrying");
        }
        let members = self.members(&listed);
        let Some(views) = self.views(&listed) else {
            return Ok(());
        };
        let plan = assignment::plan(
            &self.config.lease.identity,
            &members,
            &views,
            RELEASES_PER_ROUND,
        );
        for shard in plan.release {
            self.start_giving_back(shard);
        }
        for shard in plan.claim {
            if let Err(error) = self.claim(shard, &listed).await {
                tracing::warn!(set = %self.config.lease.name, shard, error = %format!("{error:#}"), "could not claim a shard; trying again next round");
            }
        }
        self.finish_giving_back(&listed).await?;
        self.report_seen(&listed);
        self.forget_departed(&listed).await;
        Ok(())
    }

    /// Every Lease of the set, noting when each was last seen to change.
    async fn list(&mut self) -> anyhow::Result<Listed> {
        let selector = format!("{SET_LABEL}={}", self.config.lease.name);
        let list = self
            .api
            .list(&ListParams::default().labels(&selector))
            .await
            .context("listing the shard leases")?;
        let now = Instant::now();
        let mut leases = HashMap::new();
        for lease in list.items {
            let name = lease.name_any();
            let spec = lease.spec.clone().unwrap_or_default();
            if self
                .observed
                .get(&name)
                .is_none_or(|(seen, _)| *seen != spec)
            {
                self.observed.insert(name.clone(), (spec, now));
            }
            leases.insert(name, lease);
        }
        self.observed.retain(|name, _| leases.contains_key(name));
        Ok(Listed { leases })
    }

    /// Tell the reports who holds each shard and what its holder counted, as this round saw
    /// it: an expired holder holds nothing.
    fn report_seen(&self, listed: &Listed) {
        for shard in 0..self.config.count {
            let name = self.config.shard_name(shard);
            let lease = listed.leases.get(&name);
            let holder = lease
                .and_then(|lease| lease.spec.as_ref()?.holder_identity.as_deref())
                .filter(|_| !self.expired(&name, 1));
            let counts = lease
                .and_then(|lease| lease.metadata.annotations.as_ref()?.get(COUNTS_ANNOTATION))
                .map(String::as_str);
            self.ownership.reports().saw(shard, holder, counts);
        }
    }

    /// Whether the Lease `name` as last seen expired: held by someone who has not renewed it
    /// for its lease duration, by this replica's clock.
    fn expired(&self, name: &str, after: u32) -> bool {
        let Some((spec, seen)) = self.observed.get(name) else {
            return true;
        };
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(self.config.lease.lease_duration, Duration::from_secs);
        Instant::now() >= *seen + duration * after
    }

    /// The live members of the set: this replica and every other of the same shard count
    /// whose membership Lease has not expired.
    fn members(&self, listed: &Listed) -> BTreeSet<String> {
        let prefix = format!("{}-member-", self.config.lease.name);
        let count = self.config.count.to_string();
        let mut members: BTreeSet<String> = listed
            .leases
            .iter()
            .filter(|(name, _)| name.starts_with(&prefix) && !self.expired(name, 1))
            // A replica of another shard count (a rollout changing it) shares nothing with
            // this one: counting it would give shards back that it will not take.
            .filter(|(_, lease)| {
                lease
                    .annotations()
                    .get(COUNT_ANNOTATION)
                    .is_none_or(|theirs| *theirs == count)
            })
            .filter_map(|(_, lease)| lease.spec.as_ref()?.holder_identity.clone())
            .collect();
        members.insert(self.config.lease.identity.clone());
        members
    }

    /// Each shard as this round saw it, or `None` while a Lease of another shard count is
    /// still held (a rollout changing the count: the old replicas must go first).
    fn views(&self, listed: &Listed) -> Option<Vec<ShardView>> {
        let shard_prefix = format!("{}-shard-", self.config.lease.name);
        let count = self.config.count.to_string();
        for (name, lease) in &listed.leases {
            let other_count = lease
                .annotations()
                .get(COUNT_ANNOTATION)
                .is_some_and(|c| *c != count);
            let held = lease
                .spec
                .as_ref()
                .and_then(|s| s.holder_identity.as_deref())
                .is_some_and(|holder| !holder.is_empty());
            if name.starts_with(&shard_prefix) && other_count && held && !self.expired(name, 1) {
                tracing::warn!(set = %self.config.lease.name, lease = %name, count = %count, "a shard lease of another shard count is still held; claiming nothing until it is given back or expires");
                return None;
            }
        }
        let views = (0..self.config.count)
            .map(|shard| {
                let name = self.config.shard_name(shard);
                let me = &self.config.lease.identity;
                let holder = listed
                    .leases
                    .get(&name)
                    .and_then(|lease| lease.spec.as_ref()?.holder_identity.clone())
                    .filter(|holder| !holder.is_empty())
                    // A shard this replica is giving back counts as nobody's: it is not
                    // given back twice, and may be taken back.
                    .filter(|_| !self.draining.contains_key(&shard))
                    // A Lease naming this replica that it does not renew (lost past its
                    // deadline, a claim whose answer was lost, an earlier process under the
                    // same identity, a drain abandoned) is held by no one alive: anyone may
                    // take it once it expires, as if another replica had left it.
                    .map(|holder| {
                        if holder == *me && !self.renewed.contains_key(&shard) {
                            format!("{holder} (no longer renewed)")
                        } else {
                            holder
                        }
                    });
                ShardView {
                    expired: holder.is_some() && self.expired(&name, 1),
                    holder,
                }
            })
            .collect();
        Some(views)
    }

    async fn renew_membership(&mut self, listed: &Listed) -> anyhow::Result<()> {
        let name = self.config.member_name();
        let lease = self.lease(&name, listed.leases.get(&name), None);
        self.write(&name, listed.leases.contains_key(&name), lease)
            .await
            .map(|_| ())
            .context("renewing this replica's membership lease")
    }

    /// Renew every shard held; one whose deadline passed, or that another replica took, is
    /// let go.
    async fn renew_shards(&mut self, listed: &mut Listed) {
        let held: Vec<(u32, Instant)> = self.renewed.iter().map(|(s, at)| (*s, *at)).collect();
        for (shard, renewed_at) in held {
            let name = self.config.shard_name(shard);
            let deadline = renewed_at + self.config.lease.renew_deadline;
            let current = listed.leases.get(&name);
            let ours = current
                .and_then(|lease| lease.spec.as_ref()?.holder_identity.as_deref())
                .is_some_and(|holder| holder == self.config.lease.identity);
            let why = if !ours {
                "another replica holds its lease"
            } else if Instant::now() >= deadline {
                "its renew deadline passed"
            } else {
                let started = Instant::now();
                let lease = self.lease(&name, current, Some(shard));
                match self.write(&name, true, lease).await {
                    Ok(Some(written)) if Instant::now() < deadline => {
                        self.renewed.insert(shard, started);
                        self.ownership
                            .hold_until(shard, started + self.config.lease.renew_deadline);
                        listed.leases.insert(name, written);
                        continue;
                    }
                    Ok(Some(_)) => "it was renewed only after its renew deadline",
                    Ok(None) => "another replica wrote its lease first",
                    Err(error) if Instant::now() < deadline => {
                        tracing::warn!(shard, error = %format!("{error:#}"), "could not renew a shard lease; retrying");
                        continue;
                    }
                    Err(_) => "renewing it failed until its renew deadline",
                }
            };
            tracing::warn!(set = %self.config.lease.name, shard, why, "lost a shard");
            self.renewed.remove(&shard);
            self.ownership.let_go(shard);
        }
    }

    /// Take `shard`, nobody's or expired as this round saw it.
    async fn claim(&mut self, shard: u32, listed: &Listed) -> anyhow::Result<()> {
        let name = self.config.shard_name(shard);
        let current = listed.leases.get(&name);
        let started = Instant::now();
        let lease = self.lease(&name, current, Some(shard));
        if self
            .write(&name, current.is_some(), lease)
            .await
            .with_context(|| format!("claiming shard {shard}"))?
            .is_some()
        {
            self.draining.remove(&shard);
            self.renewed.insert(shard, started);
            self.ownership
                .hold_until(shard, started + self.config.lease.renew_deadline);
            tracing::info!(set = %self.config.lease.name, identity = %self.config.lease.identity, shard, "took a shard");
        }
        Ok(())
    }

    /// Stop holding `shard` now; its Lease is cleared once its reconciles ended (see
    /// [`finish_giving_back`](Self::finish_giving_back)).
    fn start_giving_back(&mut self, shard: u32) {
        self.ownership.let_go(shard);
        self.renewed.remove(&shard);
        let until = Instant::now() + self.config.lease.renew_deadline;
        self.draining.insert(shard, until);
    }

    /// Clear the holder of each shard being given back whose reconciles ended, or that
    /// waited a renew deadline for them (their writes are refused by then). Other rounds
    /// go on meanwhile, so the shards still held are renewed while one drains.
    async fn finish_giving_back(&mut self, listed: &Listed) -> anyhow::Result<()> {
        let now = Instant::now();
        let done: Vec<u32> = self
            .draining
            .iter()
            .filter(|&(&shard, &until)| self.ownership.writing(shard) == 0 || now >= until)
            .map(|(&shard, _)| shard)
            .collect();
        for shard in done {
            self.hand_over(shard, listed).await?;
        }
        Ok(())
    }

    /// End the drain of `shard`: clear its Lease's holder if none of its reconciles runs
    /// any more. One still running after the wait may have a write on its way: the Lease is
    /// then left to expire, a lease duration after its last renewal, rather than handed
    /// over now (its writes are refused from the let-go on).
    async fn hand_over(&mut self, shard: u32, listed: &Listed) -> anyhow::Result<()> {
        self.draining.remove(&shard);
        if self.ownership.writing(shard) > 0 {
            tracing::warn!(
                shard,
                "reconciles of a shard given back still run after a renew deadline; their writes are refused, and its lease is left to expire"
            );
            return Ok(());
        }
        self.clear_holder(shard, listed)
            .await
            .with_context(|| format!("giving back shard {shard}"))
    }

    /// Clear the holder of `shard`'s Lease, if it is this replica (as `listed` shows it).
    async fn clear_holder(&self, shard: u32, listed: &Listed) -> anyhow::Result<()> {
        let name = self.config.shard_name(shard);
        let Some(current) = listed.leases.get(&name) else {
            return Ok(());
        };
        let mut lease = current.clone();
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(self.config.lease.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(jiff::Timestamp::now()));
        self.write(&name, true, lease).await?;
        tracing::info!(set = %self.config.lease.name, identity = %self.config.lease.identity, shard, "gave back a shard");
        Ok(())
    }

    /// Delete the membership Leases of replicas gone for long (a pod's name is not reused).
    async fn forget_departed(&self, listed: &Listed) {
        let prefix = format!("{}-member-", self.config.lease.name);
        for (name, lease) in &listed.leases {
            if !name.starts_with(&prefix) || !self.expired(name, FORGET_MEMBERS_AFTER) {
                continue;
            }
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: lease.resource_version(),
                    uid: lease.uid(),
                }),
                ..DeleteParams::default()
            };
            if let Err(error) = self.api.delete(name, &params).await {
                tracing::debug!(lease = %name, error = %format!("{error:#}"), "could not delete a departed member's lease");
            }
        }
    }

    /// The Lease `name` held by this replica now: `current` renewed (or taken over, counting
    /// a transition), or a new one. Every Lease carries the set's count, and a shard's the
    /// counts of its parents this replica made (see [`super::reports`]).
    fn lease(&self, name: &str, current: Option<&Lease>, shard: Option<u32>) -> Lease {
        let now = MicroTime(jiff::Timestamp::now());
        let identity = &self.config.lease.identity;
        let duration =
            i32::try_from(self.config.lease.lease_duration.as_secs()).unwrap_or(i32::MAX);
        let mut lease = current.cloned().unwrap_or_else(|| Lease {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            spec: None,
        });
        lease
            .labels_mut()
            .insert(SET_LABEL.into(), self.config.lease.name.clone());
        lease
            .annotations_mut()
            .insert(COUNT_ANNOTATION.into(), self.config.count.to_string());
        if let Some(shard) = shard {
            lease.annotations_mut().insert(
                COUNTS_ANNOTATION.into(),
                self.ownership.reports().annotation(shard),
            );
        }
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(identity.as_str()) {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(identity.clone());
        spec.lease_duration_seconds = Some(duration);
        spec.renew_time = Some(now);
        lease
    }

    /// Create (`exists` false) or replace the Lease: the written Lease, or `None` when
    /// another replica wrote it first (a conflict).
    async fn write(&self, name: &str, exists: bool, lease: Lease) -> anyhow::Result<Option<Lease>> {
        let written = if exists {
            self.api.replace(name, &PostParams::default(), &lease).await
        } else {
            self.api.create(&PostParams::default(), &lease).await
        };
        match written {
            Ok(lease) => Ok(Some(lease)),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(None),
            Err(error) => Err(error).with_context(|| format!("writing lease {name}")),
        }
    }
}
