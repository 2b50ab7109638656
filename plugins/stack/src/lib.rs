//! The Stack example plugin: children that must come up in order.
//!
//! A Stack is an app with its own database:
//!
//! ```yaml
//! apiVersion: example.com/v1
//! kind: Stack
//! metadata: {name: shop}
//! spec: {app: {image: shop:1.4}, database: {image: postgres:17}, migration: {image: shop-migrate:1.4}}
//! ```
//!
//! It becomes four children, in this order:
//!
//! 1. the database: a StatefulSet `shop-db` and its headless Service `shop-db`;
//! 2. the migration: a Job `shop-migrate`, applied once the database is ready;
//! 3. the app: a Deployment `shop-app`, applied once the migration has completed.
//!
//! The plugin only says the order ([`Child::after`]); the host applies each child once what
//! it comes after is ready, shows what the Stack waits for in its `Progressing` condition,
//! and deletes in reverse: the app, then the migration, then the database.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, StatefulSet, StatefulSetSpec};
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec, Service, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use serde::{Deserialize, Serialize};
use wasmctrl_plugin_sdk::{Child, Error, Reconciler, Request, Response, labels, serde_json};

/// A Stack at `example.com/v1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stack {
    /// The object's metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// What the user asks for.
    pub spec: StackSpec,
}

/// The images of the three parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StackSpec {
    /// The app.
    pub app: Part,
    /// The database.
    pub database: Part,
    /// The schema migration, run once the database is ready and before the app starts.
    pub migration: Part,
}

/// One part of a Stack.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    /// Its container image.
    pub image: String,
}

/// Reconciles Stacks.
pub struct StackReconciler;

impl Reconciler for StackReconciler {
    type Parent = Stack;
    type Config = serde_json::Value;

    fn reconcile(request: &Request<Stack, serde_json::Value>) -> Result<Response, Error> {
        let name = request.name();
        let spec = &request.parent.spec;
        let database = format!("{name}-db");
        let db = Child::new(&StatefulSet {
            metadata: meta(&database),
            spec: StatefulSetSpec {
                service_name: Some(database.clone()),
                replicas: Some(1),
                selector: selector(name, "database"),
                template: pod(name, "database", &spec.database.image, None),
                ..StatefulSetSpec::default()
            },
            ..StatefulSet::default()
        })?;
        let service = Child::new(&Service {
            metadata: meta(&database),
            spec: Some(ServiceSpec {
                cluster_ip: Some("None".to_owned()),
                selector: selector(name, "database").match_labels,
                ..ServiceSpec::default()
            }),
            ..Service::default()
        })?;
        let migrate = Child::new(&Job {
            metadata: meta(&format!("{name}-migrate")),
            spec: Some(JobSpec {
                backoff_limit: Some(2),
                template: pod(name, "migration", &spec.migration.image, Some("Never")),
                ..JobSpec::default()
            }),
            ..Job::default()
        })?
        .after(&db)
        .after(&service);
        let app = Child::new(&Deployment {
            metadata: meta(&format!("{name}-app")),
            spec: DeploymentSpec {
                replicas: Some(1),
                selector: selector(name, "app"),
                template: pod(name, "app", &spec.app.image, None),
                ..DeploymentSpec::default()
            },
            ..Deployment::default()
        })?
        .after(&migrate);
        let mut response = Response::new();
        response
            .add_child(&db)?
            .add_child(&service)?
            .add_child(&migrate)?
            .add_child(&app)?;
        Ok(response)
    }
}

fn meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        ..ObjectMeta::default()
    }
}

/// The labels of one part of one Stack.
fn part_labels(stack: &str, part: &str) -> BTreeMap<String, String> {
    let mut labels = labels::selector("stack", stack);
    labels.insert(labels::COMPONENT.to_owned(), part.to_owned());
    labels
}

fn selector(stack: &str, part: &str) -> LabelSelector {
    LabelSelector {
        match_labels: Some(part_labels(stack, part)),
        ..LabelSelector::default()
    }
}

fn pod(stack: &str, part: &str, image: &str, restart: Option<&str>) -> PodTemplateSpec {
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(part_labels(stack, part)),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            containers: vec![Container {
                name: part.to_owned(),
                image: Some(image.to_owned()),
                ..Container::default()
            }],
            restart_policy: restart.map(str::to_owned),
            ..PodSpec::default()
        }),
    }
}

wasmctrl_plugin_sdk::export_reconciler!(StackReconciler);

#[cfg(test)]
mod tests {
    use serde_json::json;
    use wasmctrl_plugin_sdk::testing::TestRequest;

    use super::*;

    #[test]
    fn the_database_comes_first_then_the_migration_then_the_app() {
        let stack = json!({
            "apiVersion": "example.com/v1", "kind": "Stack",
            "metadata": {"name": "shop", "namespace": "default"},
            "spec": {"app": {"image": "shop:1"}, "database": {"image": "postgres:17"},
                     "migration": {"image": "shop-migrate:1"}},
        });
        let response = TestRequest::new(&stack)
            .reconcile::<StackReconciler>()
            .expect("a decision");
        let depends = |meta: ObjectMeta| {
            meta.annotations.unwrap_or_default()[wasmctrl_plugin_sdk::child::DEPENDS_ON].clone()
        };
        let app: Deployment = response.child("shop-app").expect("app");
        assert_eq!(depends(app.metadata), "Job/shop-migrate");
        let migrate: Job = response.child("shop-migrate").expect("migration");
        assert_eq!(
            depends(migrate.metadata),
            "StatefulSet/shop-db, Service/shop-db"
        );
        let db: StatefulSet = response.child("shop-db").expect("database");
        assert_eq!(db.metadata.annotations, None, "the database comes first");
        assert_eq!(response.children_json().len(), 4);
    }
}
