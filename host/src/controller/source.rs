//! Fetching a policy's plugin bytes. The plugin module never sees a Kubernetes client, so
//! sources that live in the cluster are read here and handed over as bytes.

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{Api, Client};

use crate::policy::PluginSource;

/// Largest component the host will read from any source.
pub const MAX_PLUGIN_BYTES: usize = 64 << 20;

/// Read the component `source` points at.
pub async fn fetch(client: &Client, source: &PluginSource) -> anyhow::Result<Vec<u8>> {
    match (&source.file, &source.config_map) {
        (Some(file), None) => {
            let bytes = tokio::fs::read(&file.path)
                .await
                .with_context(|| format!("reading plugin file {}", file.path))?;
            check_size(bytes.len(), &file.path)?;
            Ok(bytes)
        }
        (None, Some(cm)) => {
            let where_ = format!("ConfigMap {}/{} key {}", cm.namespace, cm.name, cm.key);
            let config_map = Api::<ConfigMap>::namespaced(client.clone(), &cm.namespace)
                .get(&cm.name)
                .await
                .with_context(|| format!("reading plugin from {where_}"))?;
            let bytes = config_map
                .binary_data
                .and_then(|mut data| data.remove(&cm.key))
                .with_context(|| format!("{where_}: no such binaryData key"))?
                .0;
            check_size(bytes.len(), &where_)?;
            Ok(bytes)
        }
        _ => bail!("the plugin source must name exactly one of file or configMap"),
    }
}

fn check_size(len: usize, what: &str) -> anyhow::Result<()> {
    if len > MAX_PLUGIN_BYTES {
        bail!("{what} is {len} bytes, above the {MAX_PLUGIN_BYTES}-byte plugin limit");
    }
    Ok(())
}
