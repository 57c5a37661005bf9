"""`dllm-serve render k8s`: a KubeRay RayService from the same AppConfig as `dllm-serve up`.

The serveConfigV2 inside it points at the builder `up` runs (``cluster.app:build_from_args``)
with the config as its arguments, and lists the deployments' options from the functions
`up` uses, so a local cluster and a Kubernetes one come from one file.
"""

from __future__ import annotations

import math

import ray
import yaml

from cluster.app import ingress_deployment_options, replica_deployment_options
from cluster.config import AppConfig, ConfigError

RAY_METRICS_PORT = 8080  # KubeRay's convention for Ray's metrics on Kubernetes
MODELS_PATH = "/models"
_RAYLET_HEALTH = "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
_GCS_HEALTH = "wget -T 2 -q -O- http://localhost:8265/api/gcs_healthz | grep success"


def serve_config(config: AppConfig) -> dict:
    """serveConfigV2: one application built by ``cluster.app:build_from_args``."""
    if config.api_key is not None:
        raise ConfigError("api_key is set: rendering would write it into the manifest in clear text; "
                          "unset it for `render` (see deploy/README.md)")
    k8s = config.model_copy(update={"host": "0.0.0.0"})
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": config.port},
        "applications": [{
            "name": config.name,
            "route_prefix": "/",
            "import_path": "cluster.app:build_from_args",
            "args": k8s.model_dump(mode="json", exclude_defaults=True, exclude={"kubernetes"}),
            "deployments": [replica_deployment_options(k8s), ingress_deployment_options(k8s)],
        }],
    }


def worker_pods(config: AppConfig, replicas: int) -> int:
    """Worker pods that hold ``replicas`` engine replicas (and, on one of them, the ingress)."""
    k8s, replica = config.kubernetes, config.replica
    ingress_cpus = ingress_deployment_options(config)["ray_actor_options"]["num_cpus"]
    per_pod = math.floor((k8s.worker_cpus - ingress_cpus) / replica.num_cpus)
    if replica.num_gpus > 0:
        per_pod = min(per_pod, math.floor(k8s.worker_gpus / replica.num_gpus))
    if per_pod < 1:
        raise ConfigError(
            f"a worker pod (kubernetes.worker_cpus={k8s.worker_cpus}, worker_gpus={k8s.worker_gpus}) cannot hold "
            f"one replica (replica.num_cpus={replica.num_cpus}, num_gpus={replica.num_gpus}) and the ingress")
    return math.ceil(replicas / per_pod)


def _pod_range(config: AppConfig) -> tuple[int, int]:
    return worker_pods(config, config.autoscaling.min_replicas), worker_pods(config, config.autoscaling.max_replicas)


def _probe(command: str, failure_threshold: int) -> dict:
    return {"exec": {"command": ["bash", "-c", command]}, "initialDelaySeconds": 30, "periodSeconds": 5,
            "timeoutSeconds": 2, "failureThreshold": failure_threshold}


def _container(config: AppConfig, name: str, cpus: int, memory: str, gpus: int, ports: dict[str, int],
               alive: str, ready: str) -> dict:
    resources = {"cpu": str(cpus), "memory": memory} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
    return {
        "name": name,
        "image": config.kubernetes.image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [{"name": port_name, "containerPort": port} for port_name, port in ports.items()],
        "resources": {"requests": resources, "limits": resources},
        # KubeRay's default probes, spelled out
        "livenessProbe": _probe(alive, failure_threshold=120),
        "readinessProbe": _probe(ready, failure_threshold=10),
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
    }


def _head_group(config: AppConfig, metrics_port: int) -> dict:
    k8s = config.kubernetes
    ports = {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": config.port,
             "metrics": metrics_port, "dllm-metrics": config.metrics_port}
    health = f"{_RAYLET_HEALTH} && {_GCS_HEALTH}"
    container = _container(config, "ray-head", k8s.head_cpus, k8s.head_memory, 0, ports, health, health)
    # num-cpus 0: replicas and the ingress run on workers; the head keeps Serve's controller,
    # a proxy and the metrics actor (pinned to the head, so one scrape target serves it)
    return {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0",
                               "metrics-export-port": str(metrics_port)},
            "template": {"metadata": {"labels": _pod_labels(config)}, "spec": {"containers": [container]}}}


def _worker_group(config: AppConfig, metrics_port: int) -> dict:
    k8s = config.kubernetes
    if config.replica.num_gpus > 0 and k8s.worker_gpus == 0:
        raise ConfigError("replica.num_gpus > 0 needs kubernetes.worker_gpus > 0")
    serving = f"{_RAYLET_HEALTH} && wget -T 2 -q -O- http://localhost:{config.port}/-/healthz | grep success"
    container = _container(config, "ray-worker", k8s.worker_cpus, k8s.worker_memory, k8s.worker_gpus,
                           {"serve": config.port, "metrics": metrics_port}, _RAYLET_HEALTH, serving)
    pod: dict = {"containers": [container]}
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if k8s.model_volume_claim:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": k8s.model_volume_claim,
                                                                    "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODELS_PATH, "readOnly": True})
    container["volumeMounts"], pod["volumes"] = mounts, volumes
    if k8s.worker_gpus:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    low, high = _pod_range(config)
    return {"groupName": "gpu-workers" if k8s.worker_gpus else "cpu-workers",
            "replicas": low, "minReplicas": low, "maxReplicas": high,
            "rayStartParams": {"metrics-export-port": str(metrics_port)},
            "template": {"metadata": {"labels": _pod_labels(config)}, "spec": pod}}


def _pod_labels(config: AppConfig) -> dict:
    return {"app.kubernetes.io/name": "dllm-serve", "app.kubernetes.io/instance": config.name}


def _metadata(config: AppConfig, name: str) -> dict:
    metadata = {"name": name, "labels": _pod_labels(config)}
    if config.kubernetes.namespace:
        metadata["namespace"] = config.kubernetes.namespace
    return metadata


def metrics_services(config: AppConfig) -> list[dict]:
    """Headless Services whose DNS names list the pods to scrape (deploy/prometheus/prometheus.yaml):
    ``NAME-head-metrics`` the head (metrics actor), ``NAME-ray-metrics`` every Ray pod."""
    ray_port = {"name": "metrics", "port": config.ray_metrics_port or RAY_METRICS_PORT}
    return [{
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(config, f"{config.name}-{name}"),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": _pod_labels(config) | selector, "ports": [port]},
    } for name, selector, port in (
        ("head-metrics", {"ray.io/node-type": "head"}, {"name": "dllm-metrics", "port": config.metrics_port}),
        ("ray-metrics", {}, ray_port))]


def rayservice(config: AppConfig) -> dict:
    """The KubeRay RayService manifest (ray.io/v1)."""
    metrics_port = config.ray_metrics_port or RAY_METRICS_PORT
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": _metadata(config, config.name),
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config(config), sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": ray.__version__,
                "enableInTreeAutoscaling": _pod_range(config)[1] > _pod_range(config)[0],
                "headGroupSpec": _head_group(config, metrics_port),
                "workerGroupSpecs": [_worker_group(config, metrics_port)],
            },
        },
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as YAML block literals; no anchors."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def render_k8s(config: AppConfig, source: str) -> str:
    """The RayService and the metrics Services as YAML text, headed by the command that renders them."""
    header = f"# Rendered by `dllm-serve render k8s --config {source}`: edit that file and render again.\n"
    return header + yaml.dump_all([rayservice(config), *metrics_services(config)], Dumper=_Dumper, sort_keys=False)
