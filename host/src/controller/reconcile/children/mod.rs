//! What the host does to a plugin's desired children before any of them reaches the cluster,
//! and what it decides about the children it observes. Everything here is pure: it decides,
//! the reconciler acts.
//!
//! | file | decides |
//! |---|---|
//! | `validate` | whether the answer is allowed at all; stamps and fingerprints the valid children |
//! | `stamp` | ownership: the controller reference and labels the host sets, and whose child an object is |
//! | `converge` | whether an observed child already is as desired, and where it differs |
//! | `order` | which children wait for which, and which must outlive which |
//! | `prune` | which observed children are no longer desired |
//! | `readiness` | whether an observed child is ready, from its own status |

mod converge;
pub(crate) mod order;
mod prune;
pub(crate) mod readiness;
mod stamp;
mod validate;

pub(crate) use converge::{differences, is_converged, is_subset};
pub(crate) use prune::{GroupResource, to_prune};
pub(crate) use stamp::foreign_controller;
pub(crate) use validate::{AllowedKind, DesiredChild, InvalidChild, prepare};
