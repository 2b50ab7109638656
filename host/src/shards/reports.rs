//! What each shard's holder counted of every policy's parents, so that the holder of shard 0,
//! which writes each policy's status, reports on every shard's parents and not only on its
//! own.
//!
//! The counts travel on the shard Leases, which each holder writes every retry period
//! anyway: a renewal carries the holder's latest counts for that shard in
//! [`COUNTS_ANNOTATION`], and every replica reads them back from the list each round makes.
//! So they cost no request of their own, and they are as fresh as the last renewal (a retry
//! period) plus the holder's last count (a status interval). A shard that nobody holds, or
//! whose holder has not counted a policy yet, is reported as not counted rather than as
//! empty.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::lock;

/// The annotation on a shard Lease holding its holder's counts, per policy, as JSON.
pub const COUNTS_ANNOTATION: &str = "wasmctrl.dev/parent-counts";

/// Largest reports annotation written: a Lease's annotations must stay within the API
/// server's 256 KiB. Counts take about 40 bytes per policy; a policy's rollout figures a
/// few hundred while it has a candidate.
const MAX_ANNOTATION_BYTES: usize = 128 << 10;

/// How one policy's parents in one shard stand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardCounts {
    /// Parents whose last reconcile succeeded.
    #[serde(rename = "r")]
    pub reconciled: u64,
    /// Parents whose last reconcile failed.
    #[serde(rename = "f")]
    pub failing: u64,
    /// Parents whose last successful reconcile the active plugin decided.
    #[serde(rename = "a")]
    pub on_active: u64,
}

impl std::ops::AddAssign for ShardCounts {
    fn add_assign(&mut self, other: Self) {
        self.reconciled += other.reconciled;
        self.failing += other.failing;
        self.on_active += other.on_active;
    }
}

/// What a shard's holder reports of one policy's parents in the shard.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyReport {
    /// How they stand.
    #[serde(flatten)]
    pub counts: ShardCounts,
    /// What they say of the policy's rollout candidate, while it has one: its gates'
    /// figures, which the holder of shard 0 sums to decide the rollout for every shard.
    #[serde(rename = "m", default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutReport>,
    /// The holder's prune guard window for the policy, while one is open (the same on
    /// every shard it holds): the holder of shard 0 shows them all in the policy's status.
    #[serde(rename = "p", default, skip_serializing_if = "Option::is_none")]
    pub prune: Option<serde_json::Value>,
    /// The holder's tally of the candidate's shadow verdicts for the policy, while it has a
    /// candidate (the same on every shard it holds).
    #[serde(rename = "c", default, skip_serializing_if = "Option::is_none")]
    pub candidate: Option<serde_json::Value>,
}

/// A rollout's gate figures over one shard's parents, measured for one candidate.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutReport {
    /// The candidate measured (its digest and config): figures of another candidate are
    /// not summed.
    #[serde(rename = "d")]
    pub candidate: String,
    /// The share of the parents it served when measured (`None`: stopped): figures of
    /// another stage are not summed either.
    #[serde(rename = "s", default)]
    pub share: Option<u8>,
    /// The figures, as the rollout's gates take them.
    #[serde(rename = "g")]
    pub gates: serde_json::Value,
}

/// One shard, as [`ShardReports::across_shards`] found it for a policy.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardReport {
    /// The shard's number.
    pub shard: u32,
    /// Its holder, as the last round saw its Lease (`None`: free, or expired).
    pub holder: Option<String>,
    /// What its holder reported of the policy's parents in the shard, once it did.
    pub report: Option<PolicyReport>,
}

/// A shard's Lease as the last list showed it.
#[derive(Debug, Default)]
struct Seen {
    holder: Option<String>,
    reports: BTreeMap<String, PolicyReport>,
}

/// The counts this replica made for the shards it holds, and those the shard Leases carry.
#[derive(Debug, Default)]
pub struct ShardReports {
    /// Per shard, per policy: what this replica counted.
    own: Mutex<BTreeMap<u32, BTreeMap<String, PolicyReport>>>,
    /// Per shard: what its Lease said when last listed.
    seen: Mutex<BTreeMap<u32, Seen>>,
    /// This replica's identity in the Leases, once its coordinator started.
    me: std::sync::OnceLock<String>,
}

impl ShardReports {
    /// This replica's identity in the Leases (its coordinator's), once known: a Lease that
    /// names it still is one it just gave back, not another replica's report.
    pub fn me(&self) -> Option<&str> {
        self.me.get().map(String::as_str)
    }

    /// Name this replica (its coordinator does, once).
    pub(super) fn identify(&self, me: &str) {
        let _ = self.me.set(me.to_owned());
    }

    /// `policy`'s parents in each shard this replica holds now, replacing what it counted
    /// before (for shards it no longer holds too).
    pub fn count(&self, policy: &str, per_shard: BTreeMap<u32, PolicyReport>) {
        let mut own = lock(&self.own);
        for counts in own.values_mut() {
            counts.remove(policy);
        }
        for (shard, counts) in per_shard {
            own.entry(shard)
                .or_default()
                .insert(policy.to_owned(), counts);
        }
        own.retain(|_, counts| !counts.is_empty());
    }

    /// `policy` stopped on this replica: it counts nothing for it any more.
    pub fn forget(&self, policy: &str) {
        self.count(policy, BTreeMap::new());
    }

    /// The annotation value to renew `shard`'s Lease with: this replica's reports for it.
    /// Past [`MAX_ANNOTATION_BYTES`] the prune guard windows and candidate tallies are left
    /// out first (the counts and rollout figures matter more), then everything.
    pub(super) fn annotation(&self, shard: u32) -> String {
        let own = lock(&self.own);
        let empty = BTreeMap::new();
        let reports = own.get(&shard).unwrap_or(&empty);
        let text = serde_json::to_string(reports).unwrap_or_else(|_| "{}".to_owned());
        if text.len() <= MAX_ANNOTATION_BYTES {
            return text;
        }
        let lean: BTreeMap<&String, PolicyReport> = reports
            .iter()
            .map(|(policy, report)| {
                let lean = PolicyReport {
                    prune: None,
                    candidate: None,
                    ..report.clone()
                };
                (policy, lean)
            })
            .collect();
        let text = serde_json::to_string(&lean).unwrap_or_else(|_| "{}".to_owned());
        if text.len() <= MAX_ANNOTATION_BYTES {
            tracing::warn!(
                shard,
                policies = reports.len(),
                "too many policies to carry their prune guard windows and candidate tallies on a shard lease; the policies' status leaves this replica's out"
            );
            return text;
        }
        tracing::warn!(
            shard,
            policies = reports.len(),
            "too many policies to carry their counts on a shard lease; the policies' status counts leave this shard out"
        );
        "{}".to_owned()
    }

    /// `shard`'s Lease as a list showed it: held by `holder`, with `annotation`.
    pub(super) fn saw(&self, shard: u32, holder: Option<&str>, annotation: Option<&str>) {
        let reports = annotation
            .and_then(|text| serde_json::from_str(text).ok())
            .unwrap_or_default();
        lock(&self.seen).insert(
            shard,
            Seen {
                holder: holder.filter(|h| !h.is_empty()).map(str::to_owned),
                reports,
            },
        );
    }

    /// `policy`'s parents in every one of `count` shards, each with its holder as the last
    /// round saw it: from this replica's own counts for the shards `holds` says it holds,
    /// else from the shard's Lease.
    pub fn across_shards(
        &self,
        policy: &str,
        count: u32,
        holds: impl Fn(u32) -> bool,
    ) -> Vec<ShardReport> {
        let own = lock(&self.own);
        let seen = lock(&self.seen);
        (0..count)
            .map(|shard| {
                let lease = seen.get(&shard);
                let holder = lease.and_then(|l| l.holder.clone());
                let report = if holds(shard) {
                    own.get(&shard).and_then(|c| c.get(policy)).cloned()
                } else {
                    lease
                        .filter(|l| l.holder.is_some())
                        .and_then(|l| l.reports.get(policy))
                        .cloned()
                };
                ShardReport {
                    shard,
                    holder,
                    report,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(reconciled: u64, failing: u64) -> PolicyReport {
        PolicyReport {
            counts: ShardCounts {
                reconciled,
                failing,
                on_active: reconciled,
            },
            rollout: None,
            prune: None,
            candidate: None,
        }
    }

    /// Its own shards from what it counted, the others from their Leases; a shard nobody
    /// holds, or whose holder did not count the policy, is not counted (not zero).
    #[test]
    fn the_counts_of_every_shard_come_from_their_holders() {
        let reports = ShardReports::default();
        reports.count("p", BTreeMap::from([(0, counts(5, 1))]));
        reports.count("q", BTreeMap::from([(0, counts(2, 0))]));
        // What the other replicas' renewals of shards 1 and 2 carried; shard 3 is free.
        let other = serde_json::to_string(&BTreeMap::from([("p", counts(7, 0))])).expect("json");
        reports.saw(1, Some("b"), Some(&other));
        reports.saw(2, Some("c"), Some("{}"));
        reports.saw(3, None, Some(&other));
        reports.saw(0, Some("a"), Some("{}"));

        let across = reports.across_shards("p", 4, |shard| shard == 0);
        assert_eq!(
            across,
            [
                ShardReport {
                    shard: 0,
                    holder: Some("a".into()),
                    report: Some(counts(5, 1))
                },
                ShardReport {
                    shard: 1,
                    holder: Some("b".into()),
                    report: Some(counts(7, 0))
                },
                ShardReport {
                    shard: 2,
                    holder: Some("c".into()),
                    report: None
                },
                ShardReport {
                    shard: 3,
                    holder: None,
                    report: None
                },
            ]
        );
        // Each renewal carries this replica's counts for that shard only.
        let carried: BTreeMap<String, PolicyReport> =
            serde_json::from_str(&reports.annotation(0)).expect("json");
        assert_eq!(
            carried,
            BTreeMap::from([("p".into(), counts(5, 1)), ("q".into(), counts(2, 0))])
        );
        assert_eq!(reports.annotation(1), "{}");

        // A count replaces the last, shards let go included; a stopped policy is dropped.
        reports.count("p", BTreeMap::from([(2, counts(1, 0))]));
        let carried: BTreeMap<String, PolicyReport> =
            serde_json::from_str(&reports.annotation(0)).expect("json");
        assert_eq!(carried.keys().collect::<Vec<_>>(), ["q"]);
        reports.forget("q");
        assert_eq!(reports.annotation(0), "{}");
    }

    /// A Lease whose annotation is not what a replica writes counts as no report.
    #[test]
    fn an_unreadable_annotation_is_no_report() {
        let reports = ShardReports::default();
        reports.saw(0, Some("b"), Some("not json"));
        let across = reports.across_shards("p", 1, |_| false);
        assert_eq!(across[0].report, None);
        assert_eq!(across[0].holder.as_deref(), Some("b"));
    }
}
