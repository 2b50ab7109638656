//! The moments a watch's cache may have lost objects: a deletion, or a re-list (which drops
//! what the list no longer shows without a deletion for each). Bookkeeping kept per cached
//! object is swept against the cache when one happened, instead of every object being
//! looked up on a timer: at 10,000 parents those timed sweeps were 7 % of the host's CPU
//! with nothing ever deleted.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counts removals from one cache, for one sweeper.
#[derive(Debug, Default)]
pub(crate) struct Removals {
    happened: AtomicU64,
    swept: AtomicU64,
}

impl Removals {
    /// The cache may have lost objects. Call it after the store took the event, so that a
    /// sweep it starts reads the store without them.
    pub fn happened(&self) {
        self.happened.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether objects may have gone since this last answered yes: the caller sweeps now.
    /// A removal while the sweep runs is answered yes the next time, so none is missed.
    pub fn sweep_due(&self) -> bool {
        let happened = self.happened.load(Ordering::Acquire);
        self.swept.swap(happened, Ordering::AcqRel) != happened
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_is_due_once_after_each_batch_of_removals() {
        let removals = Removals::default();
        assert!(!removals.sweep_due(), "nothing went yet");
        removals.happened();
        removals.happened();
        assert!(removals.sweep_due());
        assert!(!removals.sweep_due(), "swept already");
        removals.happened();
        assert!(removals.sweep_due());
    }
}
