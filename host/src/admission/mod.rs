//! The webhooks a policy's plugin serves to the API server for its parent kind: what each
//! AdmissionReview is answered ([`review`]) and kept on record for `explain`, the listener
//! ([`server`]), the certificate it presents, which the hosts make and renew themselves
//! ([`certs`]), the policy's entries in the webhook configurations that send the API server
//! to it ([`configurations`]), the conversions of a policy's parent CRD ([`conversion`]) and
//! its conversion stanza pointed at the hosts ([`crd_conversion`]), and what `wasmctrl run`
//! hands the host to serve them ([`hosting`]).
//!
//! A validating and a mutating webhook are answered the same way on every replica, leader or
//! standby: by the policy's plugins (a rollout's candidate for its share), in their sandbox,
//! under the policy's failure policy. A conversion is answered by the active plugin alone.

pub mod certs;
pub mod configurations;
pub mod conversion;
pub mod crd_conversion;
mod explained;
pub mod hosting;
pub mod review;
pub mod server;
