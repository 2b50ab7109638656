//! The recommended Kubernetes labels, so children are selectable and recognisable.
//!
//! The host adds `app.kubernetes.io/managed-by` and its policy label itself; these helpers
//! cover what only the plugin knows: which app and which instance a child belongs to.

use std::collections::BTreeMap;

/// `app.kubernetes.io/name`
pub const NAME: &str = "app.kubernetes.io/name";
/// `app.kubernetes.io/instance`
pub const INSTANCE: &str = "app.kubernetes.io/instance";
/// `app.kubernetes.io/component`
pub const COMPONENT: &str = "app.kubernetes.io/component";

/// Labels that identify the children of one parent instance. Stable for the parent's
/// lifetime, so they are safe to use as a Deployment selector (which is immutable).
pub fn selector(app: &str, instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (NAME.to_owned(), app.to_owned()),
        (INSTANCE.to_owned(), instance.to_owned()),
    ])
}

/// Merge `extra` into `labels`, keeping values already present in `labels`.
pub fn merge_missing(labels: &mut BTreeMap<String, String>, extra: &BTreeMap<String, String>) {
    for (key, value) in extra {
        labels.entry(key.clone()).or_insert_with(|| value.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_keeps_existing_values() {
        let mut labels = BTreeMap::from([(NAME.to_owned(), "mine".to_owned())]);
        merge_missing(&mut labels, &selector("theirs", "x"));
        assert_eq!(labels[NAME], "mine");
        assert_eq!(labels[INSTANCE], "x");
    }
}
