//! The webhooks a policy's plugin serves to the API server for its parent kind: what each
//! AdmissionReview is answered ([`review`]), and the certificate the listener presents,
//! which the hosts make and renew themselves ([`certs`]), and the webhook configurations
//! that send the API server to it ([`configurations`]).
//!
//! A validating and a mutating webhook are answered the same way on every replica, leader or
//! standby: by the policy's active plugin, in its sandbox, under the policy's failure policy.

pub mod certs;
pub mod configurations;
mod explained;
pub mod hosting;
pub mod review;
pub mod server;
