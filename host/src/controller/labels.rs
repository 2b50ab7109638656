//! The names the host writes on the objects it manages: the labels and annotation on every
//! child, and the finalizers on parents and policies. Every room reads them; they import
//! nothing.

use sha2::{Digest as _, Sha256};

/// Label every child carries: who manages it.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of [`MANAGED_BY_LABEL`].
pub const MANAGED_BY: &str = "wasmctrl";
/// Label every child carries: the policy whose plugin desired it. The host's child watches
/// select on it, so they cache only wasmctrl's children.
pub const POLICY_LABEL: &str = "wasmctrl.dev/policy";
/// Label every child of a sharded host carries: its parent's shard, as `<shard>-of-<count>`
/// ([`shard_label_value`]). A host that watches per shard selects its shards' children by
/// it: the API server cannot select a child by its owner's uid.
pub const SHARD_LABEL: &str = "wasmctrl.dev/shard";
/// Label a sharded policy's parent carries where the API server cannot narrow watches by
/// uid: the shard of its own uid, as `<shard>-of-<count>` ([`shard_label_value`]), which
/// the replicas watch their parents by. Not [`SHARD_LABEL`]: a parent of one policy may be
/// a child of another, labelled there with its own parent's shard.
pub const UID_SHARD_LABEL: &str = "wasmctrl.dev/uid-shard";
/// Annotation holding the fingerprint of the desired object last applied.
pub const DESIRED_HASH_ANNOTATION: &str = "wasmctrl.dev/desired-hash";

/// Annotation by which a plugin's child names the other children of the same answer it
/// depends on (`Kind/name, Kind/name`): the host applies it only once they exist and are
/// ready, and deletes it before them. It stays on the child, so teardown keeps the order
/// without the plugin.
pub const DEPENDS_ON_ANNOTATION: &str = "wasmctrl.dev/depends-on";
/// Annotation holding a CEL expression over the child as stored (`self`) that says when it
/// is ready, in place of the host's rule for its kind.
pub const READY_WHEN_ANNOTATION: &str = "wasmctrl.dev/ready-when";
/// The finalizer on a child that another child of the same parent depends on: the host
/// removes it once no child that depends on it is left, so deletion goes in reverse order
/// whoever deletes (the garbage collector after the parent, or the host's prune).
pub const TEARDOWN_FINALIZER: &str = "wasmctrl.dev/teardown-order";

/// The finalizer on a ReconcilePolicy whose parents hold finalizers of its own.
pub const POLICY_FINALIZER: &str = "wasmctrl.dev/release-parents";

/// The finalizer on a ReconcilePolicy whose plugin its parent CRD's conversion was pointed
/// at: the policy stays until the stanza is back as it was.
pub const CONVERSION_FINALIZER: &str = "wasmctrl.dev/put-back-conversion";

/// The value of [`SHARD_LABEL`] for `shard` of `count`. The count is in it, so that children
/// labelled under another count are no shard's under this one (their next apply labels
/// them anew).
pub fn shard_label_value(shard: u32, count: u32) -> String {
    format!("{shard}-of-{count}")
}

/// The shard of `count` a [`SHARD_LABEL`] value names; `None` for another count's or a
/// malformed one.
pub fn shard_of_label(value: &str, count: u32) -> Option<u32> {
    let (shard, of) = value.split_once("-of-")?;
    let shard: u32 = shard.parse().ok()?;
    (of.parse() == Ok(count) && shard < count).then_some(shard)
}

/// The finalizer a policy named `policy_label` holds on its parents.
pub(crate) fn parent_finalizer(policy_label: &str) -> String {
    format!("wasmctrl.dev/{policy_label}")
}

/// The value of [`POLICY_LABEL`] for a policy: its name when that fits a label value,
/// otherwise a prefix plus a hash, so long names still get a unique, valid label.
pub fn policy_label_value(policy: &str) -> String {
    if policy.len() <= 63 {
        return policy.to_owned();
    }
    let hash = hex::encode(&Sha256::digest(policy.as_bytes())[..5]);
    let prefix = policy[..52].trim_end_matches(['-', '.']);
    format!("{prefix}-{hash}")
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn long_policy_names_get_unique_valid_labels() {
        let long = "a".repeat(80);
        let label = policy_label_value(&long);
        assert!(label.len() <= 63, "{label}");
        assert_ne!(label, policy_label_value(&"a".repeat(81)));
        assert_eq!(policy_label_value("myapp"), "myapp");
    }
}
