"""The MyApp example plugin in Python: the same decisions as the Rust plugin
(plugins/myapp), passing the same golden cases.

A MyApp becomes a Deployment and (unless the policy's config says ``service: false``) a
Service; the ConfigMap named in ``spec.configMap``, when the policy relates it, becomes the
container's environment, and a hash of it in the pod template rolls the pods when it changes.
The status reports replicas, ready replicas and ``Ready`` / ``ConfigMapFound`` conditions.
"""

import wasmctrl_plugin as wp

APP = "myapp"
DEFAULT_PORT = 80
CONFIG_HASH_ANNOTATION = "example.com/config-hash"


def spec_of(parent: dict) -> dict:
    spec = parent.get("spec")
    if not isinstance(spec, dict):
        raise wp.InvalidParent("spec is missing")
    replicas = spec.get("replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        raise wp.InvalidParent("spec.replicas must be an integer")
    if not isinstance(spec.get("image"), str):
        raise wp.InvalidParent("spec.image must be a string")
    if replicas < 1:
        raise wp.InvalidParent(f"spec.replicas must be at least 1, got {replicas}")
    return spec


def fnv1a(data: dict) -> str:
    """FNV-1a over the sorted entries: tiny, deterministic, enough to tell configs apart."""
    value = 0xCBF29CE484222325
    for name in sorted(data):
        for byte in name.encode() + b"\0" + data[name].encode() + b"\0":
            value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{value:016x}"


def deployment(name: str, spec: dict, port: int, labels: dict, config_map: dict | None) -> dict:
    container = {
        "name": "app",
        "image": spec["image"],
        "ports": [{"name": "http", "containerPort": port}],
    }
    template_metadata = {"labels": dict(labels)}
    data = (config_map or {}).get("data")
    if data is not None:
        template_metadata["annotations"] = {CONFIG_HASH_ANNOTATION: fnv1a(data)}
        if data:
            container["env"] = [{"name": k, "value": data[k]} for k in sorted(data)]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "replicas": spec["replicas"],
            "selector": {"matchLabels": dict(labels)},
            "template": {"metadata": template_metadata, "spec": {"containers": [container]}},
        },
    }


def service(name: str, port: int, labels: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "selector": dict(labels),
            "ports": [{"name": "http", "port": port, "targetPort": "http"}],
        },
    }


def config_map_condition(name: str, found: bool) -> dict:
    if found:
        return wp.condition("ConfigMapFound", True, "Found",
                            f"ConfigMap {name} is the pods' environment")
    return wp.condition(
        "ConfigMapFound", False, "NotFound",
        f"ConfigMap {name} is not among the related ConfigMaps (the example policy relates "
        "those labelled example.com/myapp-config=true); running without it")


@wp.reconciler
def reconcile(request: wp.Request) -> wp.Response:
    response = wp.Response()
    if request.finalizing:
        # Nothing outside the cluster to clean up; owned children are garbage-collected.
        return response.finalize()
    name = request.name
    spec = spec_of(request.parent)
    port = spec["port"] if spec.get("port") is not None else DEFAULT_PORT
    labels = {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": name}

    config_map, config_condition = None, None
    if spec.get("configMap"):
        config_map = request.related.get("v1", "ConfigMap", spec["configMap"])
        config_condition = config_map_condition(spec["configMap"], config_map is not None)
        if config_map is None:
            response.event("Warning", "ConfigMapMissing", config_condition["message"])

    response.add_child(deployment(name, spec, port, labels, config_map))
    if (request.config or {}).get("service", True):
        response.add_child(service(name, port, labels))

    observed = request.children.get("apps/v1", "Deployment", name)
    if observed is None:
        response.event("Normal", "Creating", f"creating Deployment and Service {name}")
    ready = ((observed or {}).get("status") or {}).get("readyReplicas") or 0

    conditions = wp.standard_conditions(request.parent.get("status"))
    if config_condition is not None:
        wp.set_condition(conditions, config_condition)
    else:
        conditions = [c for c in conditions if c.get("type") != "ConfigMapFound"]
    replicas = spec["replicas"]
    all_ready = ready == replicas
    wp.set_condition(conditions, wp.condition(
        "Ready", all_ready, "AllReplicasReady" if all_ready else "ReplicasNotReady",
        f"{ready}/{replicas} replicas ready"))
    return response.set_status({
        "replicas": replicas,
        "readyReplicas": ready,
        "ready": f"{ready}/{replicas}",
        "conditions": conditions,
    })


Reconciler = reconcile
