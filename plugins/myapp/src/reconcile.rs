use std::collections::BTreeMap;

use serde::Deserialize;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, PodSpec, PodTemplateSpec, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use wasmctrl_plugin_sdk::{
    Condition, ConditionStatus, Error, EventType, Reconciler, Request, Response, labels,
    set_condition,
};

use crate::types::{DEFAULT_PORT, MyApp, MyAppStatus};

/// The one thing the status needs from the observed Deployment. Decoding just this, instead
/// of a whole `Deployment`, is most of what keeps a reconcile call cheap.
#[derive(Deserialize)]
struct ObservedReadiness {
    status: Option<ReadinessStatus>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReadinessStatus {
    ready_replicas: Option<i32>,
}

/// The app name used in the recommended labels of every child.
const APP: &str = "myapp";

/// Turns a MyApp into a Deployment and a Service.
pub struct MyAppReconciler;

impl Reconciler for MyAppReconciler {
    type Parent = MyApp;
    type Config = serde_json::Value;

    fn reconcile(request: &Request<MyApp, serde_json::Value>) -> Result<Response, Error> {
        let app = &request.parent;
        let mut response = Response::new();
        if request.finalizing {
            // Nothing outside the cluster to clean up; owned children are garbage-collected.
            response.finalized();
            return Ok(response);
        }
        let name = app
            .metadata
            .name
            .as_deref()
            .ok_or_else(|| Error::invalid_parent("metadata.name is missing"))?;
        if app.spec.replicas < 1 {
            return Err(Error::invalid_parent(format!(
                "spec.replicas must be at least 1, got {}",
                app.spec.replicas
            )));
        }
        let port = app.spec.port.unwrap_or(DEFAULT_PORT);
        let selector = labels::selector(APP, name);

        response.add_child(&deployment(
            name,
            &app.spec.image,
            app.spec.replicas,
            port,
            &selector,
        ))?;
        response.add_child(&service(name, port, &selector))?;

        let observed = request
            .children
            .get_part::<Deployment, ObservedReadiness>(name)?;
        if observed.is_none() {
            response.event(
                EventType::Normal,
                "Creating",
                format!("creating Deployment and Service {name}"),
            );
        }
        let ready_replicas = observed
            .and_then(|d| d.status)
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0);
        response.set_status(&status(app, ready_replicas))?;
        Ok(response)
    }
}

fn deployment(
    name: &str,
    image: &str,
    replicas: i32,
    port: i32,
    selector: &BTreeMap<String, String>,
) -> Deployment {
    Deployment {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(selector.clone()),
            ..ObjectMeta::default()
        },
        spec: DeploymentSpec {
            replicas: Some(replicas),
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
                        image: Some(image.to_owned()),
                        ports: Some(vec![ContainerPort {
                            name: Some("http".to_owned()),
                            container_port: port,
                            ..ContainerPort::default()
                        }]),
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

fn service(name: &str, port: i32, selector: &BTreeMap<String, String>) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(selector.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            selector: Some(selector.clone()),
            ports: Some(vec![ServicePort {
                name: Some("http".to_owned()),
                port,
                target_port: Some(IntOrString::String("http".to_owned())),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

fn status(app: &MyApp, ready_replicas: i32) -> MyAppStatus {
    let replicas = app.spec.replicas;
    let mut conditions = app
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let all_ready = ready_replicas == replicas;
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
    MyAppStatus {
        replicas,
        ready_replicas,
        ready: format!("{ready_replicas}/{replicas}"),
        observed_generation: None,
        conditions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MyAppSpec;
    use k8s_openapi::api::apps::v1::DeploymentStatus;
    use wasmctrl_plugin_sdk::testing::TestRequest;

    fn my_app(replicas: i32, port: Option<i32>) -> MyApp {
        let mut app = MyApp::new(
            "web",
            MyAppSpec {
                replicas,
                image: "nginx:1.25".into(),
                port,
            },
        );
        app.metadata.namespace = Some("default".into());
        app
    }

    fn observed_deployment(ready: Option<i32>) -> Deployment {
        let mut d = deployment("web", "nginx:1.25", 3, 80, &labels::selector(APP, "web"));
        d.status = Some(DeploymentStatus {
            ready_replicas: ready,
            ..DeploymentStatus::default()
        });
        d
    }

    #[test]
    fn new_app_gets_deployment_and_service() {
        let response = TestRequest::new(&my_app(3, Some(8080)))
            .reconcile::<MyAppReconciler>()
            .expect("reconcile");
        let deployment: Deployment = response.child("web").expect("deployment");
        let spec = deployment.spec;
        assert_eq!(spec.replicas, Some(3));
        let container = &spec.template.spec.expect("pod spec").containers[0];
        assert_eq!(container.image.as_deref(), Some("nginx:1.25"));
        assert_eq!(
            container.ports.as_ref().expect("ports")[0].container_port,
            8080
        );
        let service: Service = response.child("web").expect("service");
        assert_eq!(
            service.spec.expect("spec").ports.expect("ports")[0].port,
            8080
        );
        assert_eq!(response.events()[0].reason, "Creating");
    }

    #[test]
    fn port_defaults_to_80() {
        let response = TestRequest::new(&my_app(1, None))
            .reconcile::<MyAppReconciler>()
            .expect("reconcile");
        let service: Service = response.child("web").expect("service");
        assert_eq!(
            service.spec.expect("spec").ports.expect("ports")[0].port,
            80
        );
    }

    #[test]
    fn ready_follows_observed_deployment() {
        let partly = TestRequest::new(&my_app(3, None))
            .child(&observed_deployment(Some(2)))
            .reconcile::<MyAppReconciler>()
            .expect("reconcile");
        let status: MyAppStatus = partly.status().expect("status");
        assert_eq!((status.replicas, status.ready_replicas), (3, 2));
        assert_eq!(status.conditions[0].status, ConditionStatus::False);
        assert!(partly.events().is_empty());

        let fully = TestRequest::new(&my_app(3, None))
            .child(&observed_deployment(Some(3)))
            .reconcile::<MyAppReconciler>()
            .expect("reconcile");
        let status: MyAppStatus = fully.status().expect("status");
        assert_eq!(status.ready, "3/3");
        assert_eq!(status.conditions[0].status, ConditionStatus::True);
    }

    #[test]
    fn zero_replicas_is_an_invalid_parent() {
        let err = TestRequest::new(&my_app(0, None))
            .reconcile::<MyAppReconciler>()
            .expect_err("must fail");
        assert!(matches!(err, Error::InvalidParent(_)), "{err}");
    }

    #[test]
    fn finalizing_reports_finalized_without_children() {
        let response = TestRequest::new(&my_app(3, None))
            .finalizing()
            .reconcile::<MyAppReconciler>()
            .expect("reconcile");
        assert!(response.is_finalized());
        assert!(response.children().is_empty());
    }
}
