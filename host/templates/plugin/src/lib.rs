//! The {{kind}} plugin for wasmctrl: a {{kind}} (`{{group}}/{{version}}`) becomes a Deployment
//! running `spec.image` with `spec.replicas` pods, and its status reports how many are ready
//! with a `Ready` condition. The host does the rest: it watches {{kind}}s, calls this function
//! in a sandbox, applies the Deployment, prunes what the answer leaves out and writes the
//! status (adding `observedGeneration` and a `Reconciled` condition).
//!
//! Start here: change the spec, the children and the status to what your operator needs, then
//! `UPDATE_CRD=1 cargo test` rewrites `deploy/crd.yaml` and `wasmctrl plugin test … --update`
//! the golden cases (review both diffs).

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use wasmctrl_plugin_sdk::{
    Condition, ConditionStatus, Error, Reconciler, Request, Response, labels, set_condition,
};

#[cfg(test)]
mod tests;
{{webhooks_module}}
/// What to run: `replicas` copies of `image`.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "{{group}}",
    version = "{{version}}",
    kind = "{{kind}}",
    plural = "{{plural}}",
    namespaced,
    status = "{{kind}}Status",
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct {{kind}}Spec {
    /// The container image to run.
    #[schemars(length(min = 1))]
    pub image: String,
    /// How many pods to run.
    #[schemars(range(min = 0))]
    pub replicas: i32,
}

/// What the plugin observed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct {{kind}}Status {
    /// Pods the Deployment reports ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// The generation the host last reconciled (written by the host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` (from the plugin) and `Reconciled` (from the host).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The policy's `spec.plugin.config`. Add fields here to make the plugin configurable per
/// policy; `Default` is used when the policy sets none.
#[derive(Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {}

/// The app name in the recommended labels of every child.
const APP: &str = "{{singular}}";

/// Turns a {{kind}} into a Deployment.
pub struct {{kind}}Reconciler;

impl Reconciler for {{kind}}Reconciler {
    type Parent = {{kind}};
    type Config = Config;

    fn reconcile(request: &Request<{{kind}}, Config>) -> Result<Response, Error> {
        let parent = &request.parent;
        let mut response = Response::new();
        if request.finalizing {
            // Nothing outside the cluster to clean up: owned children are garbage-collected.
            response.set_finalized();
            return Ok(response);
        }
        // The host sends only parents that have a name (and, this kind being namespaced, a
        // namespace: `request.namespace()`), so neither needs checking.
        let name = request.name();
        let selector = labels::selector(APP, name);
        response.add_child(&deployment(name, &parent.spec, &selector))?;

        let ready_replicas = request
            .children
            .get::<Deployment>(name)?
            .and_then(|d| d.status)
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0);
        response.set_status(&status(parent, ready_replicas))?;
        Ok(response)
    }
}

{{export}}

fn deployment(name: &str, spec: &{{kind}}Spec, selector: &BTreeMap<String, String>) -> Deployment {
    Deployment {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(selector.clone()),
            ..ObjectMeta::default()
        },
        spec: DeploymentSpec {
            replicas: Some(spec.replicas),
            selector: LabelSelector {
                match_labels: Some(selector.clone()),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(selector.clone()),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![Container {
                        name: "app".to_owned(),
                        image: Some(spec.image.clone()),
                        ..Container::default()
                    }],
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        },
        status: None,
    }
}

fn status(parent: &{{kind}}, ready_replicas: i32) -> {{kind}}Status {
    // Keep the conditions already there: `set_condition` keeps an unchanged condition's
    // `lastTransitionTime`, and the host's `Reconciled` condition stays the host's.
    let mut conditions = parent
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let replicas = parent.spec.replicas;
    let all_ready = ready_replicas >= replicas;
    set_condition(
        &mut conditions,
        Condition::new(
            "Ready",
            ConditionStatus::from_bool(all_ready),
            if all_ready {
                "AllReplicasReady"
            } else {
                "ReplicasNotReady"
            },
            format!("{ready_replicas}/{replicas} replicas ready"),
        ),
    );
    {{kind}}Status {
        ready_replicas,
        observed_generation: None,
        conditions,
    }
}
