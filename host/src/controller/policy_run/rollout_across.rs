//! A rollout over sharded hosts: one decision, every shard measured.
//!
//! The holder of shard 0 decides, as the leader does (see [`super::rollout`]). Each replica
//! measures the candidate's gates over the parents of the shards it holds and reports the
//! figures with its counts on those shards' Leases (see [`crate::shards::reports`]). The
//! decider sums them with its own. It moves on only once every shard has reported for the
//! candidate at the share it serves now, so a stage never passes on figures left from the
//! stage before; what has been reported is enough to roll back. The other replicas follow the decision: they serve the candidate to the
//! share `status.rollout` says, and stop it when it says rolled back, so every shard's
//! parents are served alike.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::controller::reconcile::serving::Candidate;
use crate::shards::{RolloutReport, ShardOwnership};

/// What names `candidate` in a report: its digest and a hash of its config. The rollout is
/// the digest's, but a config change is a new candidate (its verdicts start over), so
/// figures of the old config are not summed with the new.
fn key(candidate: &Candidate) -> String {
    use std::hash::{Hash as _, Hasher as _};
    let mut hasher = fnv::FnvHasher::default();
    candidate.serving.config.hash(&mut hasher);
    format!(
        "{}+{:016x}",
        candidate.serving.plugin.digest(),
        hasher.finish()
    )
}

/// The share of the parents `candidate` serves now, as reported with its figures: 0 to
/// 100, or `None` once stopped.
fn share(candidate: &Candidate) -> Option<u8> {
    (!candidate.stopped.load(Ordering::Relaxed)).then(|| candidate.percent.load(Ordering::Relaxed))
}

/// The reports of `candidate`'s gate `figures` for each of `held` (this replica's shards;
/// one without figures has no parents), for their Leases to carry.
pub(crate) fn reports<F: Serialize + Default>(
    candidate: &Candidate,
    held: &BTreeSet<u32>,
    mut figures: BTreeMap<u32, F>,
) -> BTreeMap<u32, RolloutReport> {
    let digest = key(candidate);
    let share = share(candidate);
    held.iter()
        .map(|&shard| {
            let figures = figures.remove(&shard).unwrap_or_default();
            let report = RolloutReport {
                candidate: digest.clone(),
                share,
                gates: serde_json::to_value(figures).unwrap_or_default(),
            };
            (shard, report)
        })
        .collect()
}

/// The gate figures the holders of the shards other than `held` last reported for
/// `candidate` at the share it serves now, and which shards have not reported so (in
/// words), if any.
pub(crate) fn reported<F: DeserializeOwned>(
    policy: &str,
    candidate: &Candidate,
    shards: &ShardOwnership,
    held: &BTreeSet<u32>,
) -> (Vec<F>, Option<String>) {
    let digest = key(candidate);
    let share = share(candidate);
    let mut figures = Vec::new();
    let mut missing = Vec::new();
    let across = shards
        .reports()
        .across_shards(policy, shards.count(), |shard| held.contains(&shard));
    for report in across.into_iter().filter(|r| !held.contains(&r.shard)) {
        let reported = report
            .report
            .and_then(|r| r.rollout)
            .filter(|r| r.candidate == digest && r.share == share)
            .and_then(|r| serde_json::from_value::<F>(r.gates).ok());
        match reported {
            Some(reported) => figures.push(reported),
            None => missing.push(report.shard.to_string()),
        }
    }
    let waiting = (!missing.is_empty()).then(|| {
        format!(
            "waiting for the holders of shard(s) {} to measure candidate {} at its share",
            missing.join(", "),
            candidate.serving.plugin.digest().short()
        )
    });
    (figures, waiting)
}
