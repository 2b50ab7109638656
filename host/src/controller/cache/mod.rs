//! What reconciles read, and what the host's own writes have not shown yet.

pub(crate) mod cached;
pub(crate) mod field_ownership;
pub(crate) mod named_objects;
pub(crate) mod pending_writes;
pub(crate) mod per_shard;
pub(crate) mod read_cache;
pub(crate) mod related;
pub(crate) mod removals;
pub(crate) mod store_index;
pub(crate) mod stores;
