//! Which shards a replica claims and gives back, from what it saw of the shard and
//! membership Leases. Pure, so every rule is tested without a cluster; the
//! [`coordinator`](super::coordinator) acts on the plan and the Leases settle the races
//! (two replicas claiming one shard: the second write conflicts).
//!
//! Every replica computes the same fair share for each live member: of `count` shards and
//! `m` members sorted by identity, the first `count % m` take one more than the rest. So
//! twelve shards over three replicas are four each, over five are 3, 3, 2, 2, 2.
//! A replica above its share gives back at most `max_releases` shards per round, so a
//! replica joining moves shards a few at a time rather than all at once; one below takes
//! shards nobody holds (or whose holder stopped renewing), in an order of its own so that
//! replicas starting together mostly ask for different shards.

use std::collections::BTreeSet;
use std::hash::{BuildHasher as _, Hasher as _};

/// One shard's Lease as a replica saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardView {
    /// Who holds it; `None` when nobody does (never taken, or given back).
    pub holder: Option<String>,
    /// Whether its holder stopped renewing it for longer than its lease duration, as this
    /// replica measures it: it may be taken over.
    pub expired: bool,
}

impl ShardView {
    fn claimable(&self) -> bool {
        self.holder.is_none() || self.expired
    }
}

/// What a replica does this round.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Shards to take, in the order to try them.
    pub claim: Vec<u32>,
    /// Shards to give back (after the reconciles running for them end).
    pub release: Vec<u32>,
}

/// The shards `me` holds at most, of `count` among `members` (none if it is not one).
pub fn fair_share(me: &str, members: &BTreeSet<String>, count: u32) -> u32 {
    let Some(rank) = members.iter().position(|member| member == me) else {
        return 0;
    };
    let m = u32::try_from(members.len()).unwrap_or(u32::MAX);
    let rank = u32::try_from(rank).unwrap_or(u32::MAX);
    count / m + u32::from(rank < count % m)
}

/// What `me` does with `shards` (indexed by shard), held as it saw them, among the live
/// `members`: claim up to its fair share, or give back what is over it (at most
/// `max_releases`).
pub fn plan(
    me: &str,
    members: &BTreeSet<String>,
    shards: &[ShardView],
    max_releases: usize,
) -> Plan {
    let count = u32::try_from(shards.len()).unwrap_or(u32::MAX);
    let share = fair_share(me, members, count) as usize;
    let held: Vec<u32> = (0..count)
        .filter(|&i| shards[i as usize].holder.as_deref() == Some(me))
        .collect();
    let mut plan = Plan::default();
    if held.len() > share {
        // The shards this replica prefers least go first.
        let mut given = held;
        given.sort_by_key(|&i| std::cmp::Reverse(preference(me, i)));
        given.truncate((given.len() - share).min(max_releases));
        plan.release = given;
    } else if held.len() < share {
        let mut free: Vec<u32> = (0..count)
            .filter(|&i| shards[i as usize].claimable())
            .collect();
        free.sort_by_key(|&i| preference(me, i));
        free.truncate(share - held.len());
        plan.claim = free;
    }
    plan
}

/// How much `me` wants `shard`, lower first: a hash of both, the same in every round and in
/// every replica that computes it, different from one replica to the next.
fn preference(me: &str, shard: u32) -> u64 {
    let mut hasher = std::hash::BuildHasherDefault::<fnv::FnvHasher>::default().build_hasher();
    hasher.write(me.as_bytes());
    hasher.write(&shard.to_le_bytes());
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|name| (*name).to_owned()).collect()
    }

    fn held_by(holders: &[Option<&str>]) -> Vec<ShardView> {
        holders
            .iter()
            .map(|holder| ShardView {
                holder: holder.map(str::to_owned),
                expired: false,
            })
            .collect()
    }

    /// Play rounds of every member in turn, each acting on its plan at once (claims of a
    /// held shard lose), until nothing changes: the shards each ends with.
    fn settle(all: &BTreeSet<String>, shards: &mut [ShardView], max_releases: usize) -> usize {
        let mut moves = 0;
        for _ in 0..100 {
            let mut changed = false;
            for me in all {
                let plan = plan(me, all, shards, max_releases);
                for i in plan.release {
                    shards[i as usize].holder = None;
                    changed = true;
                }
                for i in plan.claim {
                    let shard = &mut shards[i as usize];
                    if shard.claimable() {
                        if shard.holder.is_some() {
                            moves += 1;
                        }
                        shard.holder = Some(me.clone());
                        shard.expired = false;
                        changed = true;
                    }
                }
            }
            if !changed {
                return moves;
            }
        }
        panic!("the plans never settled: {shards:?}");
    }

    fn holding(shards: &[ShardView], me: &str) -> usize {
        shards
            .iter()
            .filter(|s| s.holder.as_deref() == Some(me))
            .count()
    }

    #[test]
    fn every_member_takes_its_fair_share() {
        assert_eq!(fair_share("a", &members(&["a", "b", "c"]), 12), 4);
        let five = members(&["a", "b", "c", "d", "e"]);
        let shares: Vec<u32> = five.iter().map(|m| fair_share(m, &five, 12)).collect();
        assert_eq!(shares, [3, 3, 2, 2, 2]);
        assert_eq!(fair_share("z", &members(&["a"]), 12), 0, "not a member");
        assert_eq!(fair_share("a", &BTreeSet::new(), 4), 0);
    }

    #[test]
    fn three_replicas_starting_together_hold_four_shards_each() {
        let all = members(&["host-a", "host-b", "host-c"]);
        let mut shards = held_by(&[None; 12]);
        settle(&all, &mut shards, 1);
        for me in &all {
            assert_eq!(holding(&shards, me), 4, "{me}: {shards:?}");
        }
    }

    #[test]
    fn a_joining_replica_gets_shards_given_back_a_few_per_round() {
        let three = members(&["host-a", "host-b", "host-c"]);
        let mut shards = held_by(&[None; 12]);
        settle(&three, &mut shards, 1);
        let four = members(&["host-a", "host-b", "host-c", "host-d"]);
        // One round of the three: each gives back one shard, no more.
        for me in ["host-a", "host-b", "host-c"] {
            let plan = plan(me, &four, &shards, 1);
            assert!(plan.claim.is_empty());
            assert_eq!(plan.release.len(), 1, "{me}: {plan:?}");
        }
        settle(&four, &mut shards, 1);
        for me in &four {
            assert_eq!(holding(&shards, me), 3, "{me}: {shards:?}");
        }
    }

    #[test]
    fn the_shards_of_a_replica_that_stopped_are_taken_once_expired_not_before() {
        let three = members(&["host-a", "host-b", "host-c"]);
        let mut shards = held_by(&[None; 12]);
        settle(&three, &mut shards, 1);
        // host-c stopped renewing: the others see two members, but its Leases still hold.
        let two = members(&["host-a", "host-b"]);
        let plan_a = plan("host-a", &two, &shards, 1);
        assert!(plan_a.claim.is_empty(), "taken before expiry: {plan_a:?}");
        for shard in shards.iter_mut() {
            if shard.holder.as_deref() == Some("host-c") {
                shard.expired = true;
            }
        }
        let moves = settle(&two, &mut shards, 1);
        assert_eq!(moves, 4, "host-c's four shards, each taken once");
        assert_eq!(holding(&shards, "host-a"), 6);
        assert_eq!(holding(&shards, "host-b"), 6);
    }

    #[test]
    fn a_replica_at_its_share_does_nothing() {
        let two = members(&["a", "b"]);
        let shards = held_by(&[Some("a"), Some("b"), None, Some("a")]);
        assert_eq!(plan("a", &two, &shards, 1), Plan::default());
        let plan_b = plan("b", &two, &shards, 1);
        assert_eq!(plan_b.claim, vec![2]);
        assert!(plan_b.release.is_empty());
    }

    #[test]
    fn replicas_prefer_different_shards() {
        let firsts: BTreeSet<u32> = ["host-a", "host-b", "host-c", "host-d"]
            .iter()
            .map(|me| (0..12).min_by_key(|&i| preference(me, i)).unwrap_or(0))
            .collect();
        assert!(firsts.len() >= 3, "{firsts:?}");
    }
}
