//! The resync: every parent reconciled again once per resync period, from one timer per
//! policy instead of one requeue per parent.
//!
//! kube-runtime keeps each requeue as an entry of its scheduler (a hash-map slot and a
//! delay-queue slot) until it comes due. A resync asked for by every reconcile therefore holds
//! one entry per parent for as long as the host runs: some 7 MiB at 10,000 parents, and twice
//! that for the moments the table doubles. Here each parent has a fixed point in the period,
//! a hash of its uid, and one timer per policy walks the parents cache and enqueues those
//! whose point it passed since its last tick. That keeps nothing per parent, and spreads the
//! resyncs evenly over the period, as timers started at each parent's reconcile did.
//!
//! Left out:
//! - a parent younger than half the period: its create reconciled it, and a burst of creates
//!   would otherwise come back within the period, the plugin asked again about each parent
//!   it has just decided (a timer per parent first fired a whole period after the create).
//!   So a new parent's first resync comes between half a period and one and a half after its
//!   create. A creation time ahead of this host's clock counts as old, so a skewed clock
//!   cannot hold a parent back;
//! - a parent whose last failure awaits a change (a permanent error, an invalid parent), as
//!   its status says; a change, or a takeover, tries it again;
//! - parents this replica does not write for. While it may not write (a standby, a stalled
//!   process), the timer keeps the points it passes, and enqueues them once it may.
//!
//! What differs from a timer per parent: a parent's resync does not move when a change
//! reconciles it. A resync that comes soon after such a reconcile finds its decision standing
//! (see `reconcile::decisions`) and asks the plugin nothing; one that comes later reaches the
//! plugin. A settled parent is reconciled once per period (a new one within one and a half).
//! A requeue the plugin asked for, a failure's retry and the wait for the children a decision
//! created stay timers of their parent: they are few and short.

use std::hash::Hasher as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt as _};
use kube::runtime::reflector::{ObjectRef, Store};

use crate::controller::cache::cached::CachedObject;
use crate::controller::reconcile::context::PolicyContext;
use crate::controller::reconcile::parent::parent_key;
use crate::lock;

/// How often a policy's timer looks for the parents come due: a hundredth of the period, so a
/// tick enqueues about one percent of the parents, within these bounds.
const TICK_AT_LEAST: Duration = Duration::from_millis(250);
const TICK_AT_MOST: Duration = Duration::from_secs(5);

/// Where in a period of `period_ms` the parent with this uid comes due.
fn point_of(uid: &str, period_ms: u64) -> u64 {
    let mut hasher = fnv::FnvHasher::default();
    hasher.write(uid.as_bytes());
    // Another stream of the hash than the shard's (`shards::map`), which cuts it by range.
    hasher.write_u8(0x5f);
    hasher.finish() % period_ms.max(1)
}

/// Whether a point of the period was passed between `from` and `to` (milliseconds since the
/// timer started, `from < to`): the points in `(from, to]` taken modulo the period.
fn passed(point: u64, from: u64, to: u64, period_ms: u64) -> bool {
    let period_ms = period_ms.max(1);
    if to.saturating_sub(from) >= period_ms {
        return true;
    }
    let (start, end) = (from % period_ms, to % period_ms);
    if start <= end {
        start < point && point <= end
    } else {
        point > start || point <= end
    }
}

/// Whether `parent` was created before `born_before`, or after `now` (a clock skewed against
/// the API server's). One the API server gave no creation time counts as old.
fn old_enough(parent: &CachedObject, born_before: jiff::Timestamp, now: jiff::Timestamp) -> bool {
    parent
        .metadata
        .creation_timestamp
        .as_ref()
        .is_none_or(|created| created.0 <= born_before || created.0 > now)
}

/// The timer's tick for a period.
fn tick_for(period: Duration) -> Duration {
    (period / 100).clamp(TICK_AT_LEAST, TICK_AT_MOST)
}

/// The parents whose resync came due, tick by tick, for the controller's `reconcile_on`.
/// Only parents this replica writes for are enqueued: none on a standby, and on a sharded
/// host only those of the shards it holds (the others would start and end at once).
pub(super) fn parents_due(
    parents: Store<CachedObject>,
    ctx: Arc<PolicyContext>,
) -> impl Stream<Item = ObjectRef<CachedObject>> + Send + use<> {
    let period_ms = u64::try_from(ctx.resync.as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    let started = Instant::now();
    let mut interval = tokio::time::interval(tick_for(ctx.resync));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    futures::stream::unfold((interval, 0_u64), move |(mut interval, from)| {
        let parents = parents.clone();
        let ctx = ctx.clone();
        async move {
            interval.tick().await;
            let to = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            if !ctx.leadership.may_write() || to <= from {
                // The points passed meanwhile stay due until this replica may write.
                return Some((futures::stream::iter(Vec::new()), (interval, from)));
            }
            let due = due_between(&parents, &ctx, (from, to), period_ms);
            if !due.is_empty() {
                ctx.queue.added(
                    due.iter()
                        .map(|parent| (parent.namespace.clone(), parent.name.clone())),
                );
                // One deleted since the walk is dropped by the controller without starting:
                // it leaves the queue's count here.
                for gone in due.iter().filter(|parent| parents.get(parent).is_none()) {
                    ctx.queue
                        .started(&(gone.namespace.clone(), gone.name.clone()));
                }
            }
            Some((futures::stream::iter(due), (interval, to)))
        }
    })
    .flatten()
}

/// The parents whose points fall in `(from, to]` and that the resync may reconcile now.
fn due_between(
    parents: &Store<CachedObject>,
    ctx: &PolicyContext,
    (from, to): (u64, u64),
    period_ms: u64,
) -> Vec<ObjectRef<CachedObject>> {
    let shards = ctx.leadership.shards();
    let now = jiff::Timestamp::now();
    let born_before = now
        .checked_sub(jiff::SignedDuration::try_from(ctx.resync / 2).unwrap_or_default())
        .unwrap_or(jiff::Timestamp::MIN);
    let awaiting_change = lock(&ctx.outcomes.awaiting_change);
    parents
        .state()
        .iter()
        .filter(|parent| {
            let uid = parent.metadata.uid.as_deref().unwrap_or_default();
            passed(point_of(uid, period_ms), from, to, period_ms)
        })
        .filter(|parent| shards.is_none_or(|shards| shards.holds_parent(&***parent)))
        .filter(|parent| old_enough(parent, born_before, now))
        .map(|parent| parent_key(&**parent, &ctx.parent))
        .filter(|key| !awaiting_change.contains(key))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_point_is_passed_once_per_period_whatever_the_ticks() {
        let period = 1_000;
        // Uneven ticks, none a period apart.
        let ticks = [
            0, 7, 250, 251, 600, 999, 1_000, 1_013, 1_700, 2_000, 2_999, 3_000,
        ];
        for point in [0, 1, 6, 7, 8, 250, 500, 999] {
            let passes = ticks
                .windows(2)
                .filter(|tick| passed(point, tick[0], tick[1], period))
                .count();
            // The moments the point stands for after the timer started, up to the last tick.
            let moments = (0..=3)
                .map(|k| k * period + point)
                .filter(|moment| (1..=3_000).contains(moment))
                .count();
            assert_eq!(passes, moments, "point {point}");
        }
    }

    #[test]
    fn a_tick_later_than_a_period_passes_every_point() {
        for point in [0, 1, 500, 999] {
            assert!(passed(point, 10, 1_010, 1_000));
            assert!(passed(point, 10, 5_000, 1_000));
        }
        assert!(!passed(500, 10, 20, 1_000));
        assert!(passed(15, 10, 20, 1_000));
        assert!(
            !passed(10, 10, 20, 1_000),
            "the start of a window was the last one's end"
        );
    }

    #[test]
    fn points_spread_over_the_period() {
        let period = 300_000;
        let mut buckets = [0_u32; 10];
        for i in 0..10_000 {
            let uid = format!("0c6a1f2e-{i:04x}-4d3b-9b8e-5f2a7c1d{i:04x}");
            let point = point_of(&uid, period);
            assert!(point < period);
            buckets[usize::try_from(point * 10 / period).unwrap_or(9)] += 1;
        }
        // 1,000 expected per tenth; a hash that clustered would leave some near empty.
        assert!(
            buckets.iter().all(|n| (850..=1_150).contains(n)),
            "{buckets:?}"
        );
    }

    #[test]
    fn a_parent_younger_than_half_the_period_is_left_out_unless_the_clock_is_behind() {
        let parent = |created: Option<&str>| {
            let mut metadata = serde_json::json!({"name": "p", "uid": "u"});
            if let Some(created) = created {
                metadata["creationTimestamp"] = created.into();
            }
            CachedObject::from_value(
                serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}),
            )
            .expect("a cached object")
        };
        let at = |t: &str| t.parse().unwrap_or(jiff::Timestamp::MIN);
        let (cut, now) = (at("2026-12-07T10:00:00Z"), at("2026-12-07T10:02:30Z"));
        assert!(old_enough(&parent(Some("2026-12-07T09:59:59Z")), cut, now));
        assert!(old_enough(&parent(Some("2026-12-07T10:00:00Z")), cut, now));
        assert!(!old_enough(&parent(Some("2026-12-07T10:00:01Z")), cut, now));
        assert!(!old_enough(&parent(Some("2026-12-07T10:02:30Z")), cut, now));
        assert!(
            old_enough(&parent(Some("2026-12-07T10:02:31Z")), cut, now),
            "a creation time ahead of this clock is skew, not youth"
        );
        assert!(old_enough(&parent(None), cut, now));
    }

    #[test]
    fn the_tick_is_a_hundredth_of_the_period_within_bounds() {
        assert_eq!(tick_for(Duration::from_secs(300)), Duration::from_secs(3));
        assert_eq!(tick_for(Duration::from_secs(2)), TICK_AT_LEAST);
        assert_eq!(tick_for(Duration::from_secs(3_600)), TICK_AT_MOST);
    }
}
