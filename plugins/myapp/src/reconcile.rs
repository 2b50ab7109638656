use std::collections::BTreeMap;

use serde::Deserialize;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, ContainerPort, EnvVar, PodSpec, PodTemplateSpec, Service, ServicePort,
    ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use wasmctrl_plugin_sdk::{
    Condition, ConditionStatus, Error, EventType, Reconciler, Request, Response, labels,
    set_condition,
};

use crate::types::{DEFAULT_PORT, MyApp, MyAppConfig, MyAppStatus};

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

/// Pod template annotation carrying a hash of the ConfigMap's data: a new hash rolls the pods.
pub const CONFIG_HASH_ANNOTATION: &str = "example.com/config-hash";

/// What the Deployment's pods get from the MyApp's ConfigMap.
#[derive(Default)]
struct PodConfig {
    env: Vec<EnvVar>,
    hash: Option<String>,
}

/// Turns a MyApp into a Deployment and a Service.
pub struct MyAppReconciler;

impl Reconciler for MyAppReconciler {
    type Parent = MyApp;
    type Config = MyAppConfig;

    fn reconcile(request: &Request<MyApp, MyAppConfig>) -> Result<Response, Error> {
        let app = &request.parent;
        let mut response = Response::new();
        if request.finalizing {
            // Nothing outside the cluster to clean up; owned children are garbage-collected.
            response.set_finalized();
            return Ok(response);
        }
        let name = request.name();
        if app.spec.replicas < 1 {
            return Err(Error::invalid_parent(format!(
                "spec.replicas must be at least 1, got {}",
                app.spec.replicas
            )));
        }
        let port = app.spec.port.unwrap_or(DEFAULT_PORT);
        let selector = labels::selector(APP, name);
        let (pod_config, config_condition) = match &app.spec.config_map {
            Some(config_map) => {
                let found = request.related.get::<ConfigMap>(config_map)?;
                let condition = config_map_condition(config_map, found.is_some());
                if found.is_none() {
                    response.add_event(
                        EventType::Warning,
                        "ConfigMapMissing",
                        condition.message.clone(),
                    );
                }
                (pod_config(found.as_ref()), Some(condition))
            }
            None => (PodConfig::default(), None),
        };

        let mut deployment = deployment(name, &app.spec.image, app.spec.replicas, port, &selector);
        configure_pods(&mut deployment, pod_config);
        response.add_child(&deployment)?;
        if request.config.service {
            response.add_child(&service(name, port, &selector))?;
        }

        let observed = request
            .children
            .get_part::<Deployment, ObservedReadiness>(name)?;
        if observed.is_none() {
            response.add_event(
                EventType::Normal,
                "Creating",
                format!("creating Deployment and Service {name}"),
            );
        }
        let ready_replicas = observed
            .and_then(|d| d.status)
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0);
        response.set_status(&status(app, ready_replicas, config_condition))?;
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

/// The ConfigMap's data as environment variables (sorted, so the output is stable), and a
/// hash of it.
fn pod_config(config_map: Option<&ConfigMap>) -> PodConfig {
    let Some(data) = config_map.and_then(|c| c.data.as_ref()) else {
        return PodConfig::default();
    };
    let env: Vec<EnvVar> = data
        .iter()
        .map(|(name, value)| EnvVar {
            name: name.clone(),
            value: Some(value.clone()),
            ..EnvVar::default()
        })
        .collect();
    // FNV-1a: tiny, deterministic and plenty to tell two configs apart.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (name, value) in data {
        for byte in name.bytes().chain([0]).chain(value.bytes()).chain([0]) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    PodConfig {
        env,
        hash: Some(format!("{hash:016x}")),
    }
}

fn configure_pods(deployment: &mut Deployment, config: PodConfig) {
    let template = &mut deployment.spec.template;
    if let Some(hash) = config.hash {
        template
            .metadata
            .get_or_insert_with(ObjectMeta::default)
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(CONFIG_HASH_ANNOTATION.to_owned(), hash);
    }
    if !config.env.is_empty()
        && let Some(container) = template
            .spec
            .as_mut()
            .and_then(|spec| spec.containers.first_mut())
    {
        container.env = Some(config.env);
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

/// `ConfigMapFound`: whether the ConfigMap the spec names reached the plugin. A missing one
/// is not a failure (the app runs without it), but it must show where people look, in the
/// status, not only in an Event that expires.
fn config_map_condition(name: &str, found: bool) -> Condition {
    if found {
        Condition::new(
            "ConfigMapFound",
            ConditionStatus::True,
            "Found",
            format!("ConfigMap {name} is the pods' environment"),
        )
    } else {
        Condition::new(
            "ConfigMapFound",
            ConditionStatus::False,
            "NotFound",
            format!(
                "ConfigMap {name} is not among the related ConfigMaps (the example policy relates those labelled example.com/myapp-config=true); running without it"
            ),
        )
    }
}

fn status(app: &MyApp, ready_replicas: i32, config_map: Option<Condition>) -> MyAppStatus {
    let replicas = app.spec.replicas;
    let mut conditions = app
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    match config_map {
        Some(condition) => set_condition(&mut conditions, condition),
        None => conditions.retain(|c| c.type_ != "ConfigMapFound"),
    }
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
    use crate::types::MyAppSpec;
    use k8s_openapi::api::apps::v1::DeploymentStatus;
    use wasmctrl_plugin_sdk::testing::TestRequest;

    fn my_app(replicas: i32, port: Option<i32>) -> MyApp {
        let mut app = MyApp::new(
            "web",
            MyAppSpec {
                replicas,
                image: "nginx:1.25".into(),
                port,
                config_map: None,
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
        assert!(response.children_json().is_empty());
    }

    #[test]
    fn the_policy_can_turn_the_service_off() {
        let response = TestRequest::new(&my_app(1, None))
            .config(&MyAppConfig { service: false })
            .reconcile::<MyAppReconciler>()
            .expect("reconcile");
        assert_eq!(response.children_json().len(), 1);
        let no_service = response.child::<Service>("web").expect_err("no Service");
        assert!(
            no_service
                .to_string()
                .contains("no desired v1 Service named \"web\""),
            "{no_service}"
        );
    }

    fn config_map(data: &[(&str, &str)]) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some("web-config".into()),
                namespace: Some("default".into()),
                ..ObjectMeta::default()
            },
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ConfigMap::default()
        }
    }

    fn with_config(data: &[(&str, &str)]) -> Deployment {
        let mut app = my_app(1, None);
        app.spec.config_map = Some("web-config".into());
        TestRequest::new(&app)
            .related(&config_map(data))
            .reconcile::<MyAppReconciler>()
            .expect("reconcile")
            .child("web")
            .expect("deployment")
    }

    fn config_hash(deployment: &Deployment) -> Option<String> {
        deployment
            .spec
            .template
            .metadata
            .as_ref()?
            .annotations
            .as_ref()?
            .get(CONFIG_HASH_ANNOTATION)
            .cloned()
    }

    #[test]
    fn a_related_config_map_becomes_the_environment_and_rolls_pods_on_change() {
        let deployment = with_config(&[("LOG_LEVEL", "info"), ("GREETING", "hello")]);
        let env = deployment
            .spec
            .template
            .spec
            .as_ref()
            .expect("pod spec")
            .containers[0]
            .env
            .clone()
            .expect("env");
        let pairs: Vec<(&str, Option<&str>)> = env
            .iter()
            .map(|e| (e.name.as_str(), e.value.as_deref()))
            .collect();
        assert_eq!(
            pairs,
            [("GREETING", Some("hello")), ("LOG_LEVEL", Some("info"))]
        );
        let hash = config_hash(&deployment).expect("hash");
        assert_eq!(
            Some(hash.clone()),
            config_hash(&with_config(&[
                ("GREETING", "hello"),
                ("LOG_LEVEL", "info")
            ]))
        );
        assert_ne!(
            Some(hash),
            config_hash(&with_config(&[("GREETING", "hi"), ("LOG_LEVEL", "info")]))
        );
    }

    #[test]
    fn a_missing_config_map_is_a_warning_not_a_failure() {
        let mut app = my_app(1, None);
        app.spec.config_map = Some("absent".into());
        let response = TestRequest::new(&app)
            .reconcile::<MyAppReconciler>()
            .expect("reconcile");
        assert_eq!(response.events()[0].reason, "ConfigMapMissing");
        let deployment: Deployment = response.child("web").expect("deployment");
        assert_eq!(config_hash(&deployment), None);
        let status: MyAppStatus = response.status().expect("status");
        let condition = status
            .conditions
            .iter()
            .find(|c| c.type_ == "ConfigMapFound")
            .expect("ConfigMapFound condition");
        assert_eq!(condition.status, ConditionStatus::False);
        assert!(condition.message.contains("example.com/myapp-config=true"));
    }
}
