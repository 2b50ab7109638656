//! Sharding: every replica of the host reconciles a share of the parents, instead of one
//! leader doing all the work while the others stand by.
//!
//! The parents are cut into a fixed number of shards by their uid ([`shard_of`]); children
//! follow their parent. Each shard is a `coordination.k8s.io/v1` Lease, and a replica writes
//! for a parent only while it holds that parent's shard's Lease, by the same clock rule as
//! the leader's write gate: holding counts until the start of the last successful renewal
//! plus the renew deadline, well before another replica may take the Lease over
//! ([`ShardOwnership`]). Each replica also keeps a membership Lease, so every replica knows
//! how many are alive and takes its fair share of the shards ([`assignment`]); a replica
//! that joins gets shards given back to it, a bounded number per retry period, and the
//! shards of a replica that stopped renewing are taken once their Leases expire
//! ([`coordinator`]).
//!
//! Why the uid and not the namespace and name: a parent's uid is fixed for its life, every
//! child carries it in its controller reference (so a child's shard is known without its
//! parent), and it is what Kubernetes' server-side sharded list and watch hashes
//! (`shardRange(object.metadata.uid, start, end)`, KEP-5866): the same FNV-1a hash and the
//! same equal ranges of the hash space, so a replica's share can be asked of the API server
//! as it is computed here. A parent deleted and created again under the same name may land
//! in another shard; nothing is kept per parent across that.

pub mod assignment;
pub mod coordinator;
mod map;
pub mod ownership;
pub mod reports;
pub mod selector;

pub use coordinator::{ShardConfig, ShardCoordinator};
pub use map::{shard_of, shard_of_hash, shard_range, uid_hash};
pub use ownership::{ShardOwnership, Writing, gained, write_for, writes_allowed};
pub use reports::{PolicyReport, RolloutReport, ShardCounts, ShardReport, ShardReports};
