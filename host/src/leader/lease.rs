//! How a Lease is held: its name, namespace, holder and durations, shared by the leader
//! election and the shard Leases (which import only this of the leader module).

use std::time::Duration;

use tokio::time::Instant;

/// Where the Lease is and how it is held; the durations are controller-runtime's defaults.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// Name of the Lease.
    pub name: String,
    /// Namespace of the Lease (the host's own).
    pub namespace: String,
    /// This replica's identity in the Lease (the pod name, where there is one).
    pub identity: String,
    /// How long a standby waits after the Lease last changed before it takes over.
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up leading.
    pub renew_deadline: Duration,
    /// How often the leader renews and a standby checks.
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// Check that the durations allow a safe election, as client-go does.
    pub fn validate(&self) -> Result<(), String> {
        if self.lease_duration <= self.renew_deadline {
            return Err(format!(
                "the lease duration ({:?}) must be longer than the renew deadline ({:?})",
                self.lease_duration, self.renew_deadline
            ));
        }
        if self.renew_deadline <= self.retry_period {
            return Err(format!(
                "the renew deadline ({:?}) must be longer than the retry period ({:?})",
                self.renew_deadline, self.retry_period
            ));
        }
        if self.identity.is_empty() {
            return Err("the leader election identity is empty".into());
        }
        Ok(())
    }
}

/// `period` stretched by up to a fifth, so that standbys do not all ask at once.
pub(crate) fn jittered(period: Duration) -> Duration {
    use std::hash::{BuildHasher as _, RandomState};
    let random = RandomState::new().hash_one(Instant::now());
    period + period.mul_f64((random % 1000) as f64 / 5000.0)
}
