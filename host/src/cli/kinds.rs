//! Kinds the offline commands know without a cluster: the built-in kinds a policy commonly
//! names, and those of the CustomResourceDefinitions given. `wasmctrl rbac` needs their
//! resources, `plugin run --policy` their scope.

use std::any::TypeId;
use std::collections::BTreeMap;

use anyhow::Context as _;
use k8s_openapi::{NamespaceResourceScope, Resource};
use serde_json::Value;

use crate::policy::permissions::KindScope;

/// Kinds by (apiVersion, kind): the built-in ones a policy commonly names, and those of the
/// CRDs given.
pub(super) struct KindTable(BTreeMap<(String, String), KindScope>);

macro_rules! builtin_kinds {
    ($($kind:ty),* $(,)?) => {
        [$((
            <$kind as Resource>::API_VERSION,
            <$kind as Resource>::KIND,
            <$kind as Resource>::GROUP,
            <$kind as Resource>::URL_PATH_SEGMENT,
            TypeId::of::<<$kind as Resource>::Scope>() == TypeId::of::<NamespaceResourceScope>(),
        )),*]
    };
}

impl KindTable {
    pub(super) fn builtin() -> Self {
        use k8s_openapi::api::{apps, autoscaling, batch, core, networking, policy, rbac};
        let known = builtin_kinds![
            core::v1::ConfigMap,
            core::v1::Secret,
            core::v1::Service,
            core::v1::ServiceAccount,
            core::v1::Pod,
            core::v1::PersistentVolumeClaim,
            core::v1::Namespace,
            core::v1::Endpoints,
            apps::v1::Deployment,
            apps::v1::StatefulSet,
            apps::v1::DaemonSet,
            apps::v1::ReplicaSet,
            batch::v1::Job,
            batch::v1::CronJob,
            networking::v1::Ingress,
            networking::v1::NetworkPolicy,
            policy::v1::PodDisruptionBudget,
            autoscaling::v2::HorizontalPodAutoscaler,
            rbac::v1::Role,
            rbac::v1::RoleBinding,
        ];
        let mut table = Self(BTreeMap::new());
        for (api_version, kind, group, resource, namespaced) in known {
            table.insert(
                api_version,
                kind,
                KindScope {
                    group: group.to_owned(),
                    resource: resource.to_owned(),
                    namespaced,
                },
            );
        }
        table
    }

    pub(super) fn insert(&mut self, api_version: &str, kind: &str, scope: KindScope) {
        self.0
            .insert((api_version.to_owned(), kind.to_owned()), scope);
    }

    pub(super) fn get(&self, api_version: &str, kind: &str) -> Option<&KindScope> {
        self.0.get(&(api_version.to_owned(), kind.to_owned()))
    }

    /// Every served version of the CRD's kind.
    pub(super) fn add_crd(&mut self, crd: &Value) -> anyhow::Result<()> {
        let spec = &crd["spec"];
        let group = spec["group"].as_str().context("spec.group")?;
        let kind = spec["names"]["kind"].as_str().context("spec.names.kind")?;
        let plural = spec["names"]["plural"]
            .as_str()
            .context("spec.names.plural")?;
        let namespaced = spec["scope"].as_str() != Some("Cluster");
        for version in spec["versions"].as_array().context("spec.versions")? {
            let version = version["name"].as_str().context("spec.versions[].name")?;
            self.insert(
                &format!("{group}/{version}"),
                kind,
                KindScope {
                    group: group.to_owned(),
                    resource: plural.to_owned(),
                    namespaced,
                },
            );
        }
        Ok(())
    }
}
