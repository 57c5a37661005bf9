"""`dllm-serve render k8s`: a KubeRay RayService from the same AppConfig as `dllm-serve up`;
`dllm-serve render rules`: the Prometheus alert rules for it (``cluster.alerts``).

The serveConfigV2 inside it points at the builder `up` runs (``cluster.app:build_from_args``)
with the config as its arguments, and lists the deployments' options from the functions
`up` uses, so a local cluster and a Kubernetes one come from one file.

Beside it: headless Services for Prometheus and a NetworkPolicy that keeps Ray's own ports
(GCS, Ray client, dashboard and its job API) inside the RayService's pods and the metrics
ports to the monitoring namespace. An API key never
enters the manifest: ``--api-key-secret`` makes the pods read it from a Secret.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import ray
import yaml

from cluster.alerts import alert_rules, prometheus_rule
from cluster.app import ingress_deployment_options, replica_deployment_options, size_for_node
from cluster.auth import API_KEYS_ENV
from cluster.config import AppConfig, ConfigError
from cluster.request_path import on_kubernetes, serve_environment

RAY_METRICS_PORT = 8080  # KubeRay's convention for Ray's metrics on Kubernetes
GCS_PORT, DASHBOARD_PORT, CLIENT_PORT = 6379, 8265, 10001  # Ray's head ports (KubeRay's defaults)
MODELS_PATH = "/models"
API_KEY_SECRET_KEY = "api-key"  # default key inside the --api-key-secret Secret
# The pod label of the kuberay-operator Helm chart: the operator calls the head's dashboard
# (Serve's REST API on DASHBOARD_PORT) to deploy serveConfigV2 and read the applications' status.
KUBERAY_OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}
_RAYLET_HEALTH = "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
_GCS_HEALTH = f"wget -T 2 -q -O- http://localhost:{DASHBOARD_PORT}/api/gcs_healthz | grep success"
_SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # DNS subdomain
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


@dataclass(frozen=True)
class RenderOptions:
    """What `render k8s` adds beyond the config: where the API keys come from and whether
    to write the NetworkPolicy."""

    api_key_secret: str | None = None  # Secret whose key ``api_key_secret_key`` holds the keys, comma-separated
    api_key_secret_key: str | None = None  # None: API_KEY_SECRET_KEY
    network_policy: bool = True

    def check(self) -> "RenderOptions":
        if self.api_key_secret is None:
            if self.api_key_secret_key is not None:
                raise ConfigError("--api-key-secret-key needs --api-key-secret")
            return self
        if len(self.api_key_secret) > 253 or not _SECRET_NAME.fullmatch(self.api_key_secret):
            raise ConfigError(f"--api-key-secret {self.api_key_secret!r} is not a Secret name (lower-case "
                              "letters, digits, '-' and '.', at most 253 characters)")
        if len(self.secret_key) > 253 or not _SECRET_KEY.fullmatch(self.secret_key):
            raise ConfigError(f"--api-key-secret-key {self.secret_key!r} is not a Secret key "
                              "(letters, digits, '-', '_' and '.')")
        return self

    @property
    def secret_key(self) -> str:
        return self.api_key_secret_key or API_KEY_SECRET_KEY

    def flags(self) -> str:
        """The `render k8s` flags that give these options."""
        flags = ""
        if self.api_key_secret is not None:
            flags += f" --api-key-secret {self.api_key_secret}"
            if self.secret_key != API_KEY_SECRET_KEY:
                flags += f" --api-key-secret-key {self.secret_key}"
        return flags + ("" if self.network_policy else " --no-network-policy")

    def env(self) -> list[dict]:
        """The Ray containers' environment: API_KEYS_ENV from the Secret. Not optional: a pod
        whose Secret or key is missing does not start (CreateContainerConfigError) rather than
        serve without a key."""
        if self.api_key_secret is None:
            return []
        return [{"name": API_KEYS_ENV, "valueFrom": {"secretKeyRef": {"name": self.api_key_secret,
                                                                      "key": self.secret_key}}}]


def serve_config(config: AppConfig) -> dict:
    """serveConfigV2: one application built by ``cluster.app:build_from_args``."""
    if config.api_key_file is not None:
        raise ConfigError("api_key_file is set: the pods cannot read a file of this machine; "
                          "use --api-key-secret (see deploy/README.md)")
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


def sized_for_workers(config: AppConfig) -> AppConfig:
    """The settings left unset sized for one worker pod (``cluster.app.size_for_node``): a GPU
    pod holds as many engines as it has GPUs for (each tensor-parallel rank a replica's
    ``num_gpus``), a CPU pod one, unless replica.num_cpus says."""
    gpus = config.replica.num_gpus * config.replica.tensor_parallel_size
    engines = max(1, int(config.kubernetes.worker_gpus // gpus)) if gpus > 0 else 1
    return size_for_node(config, config.kubernetes.worker_cpus, engines)


def worker_pods(config: AppConfig, replicas: int) -> int:
    """Worker pods that hold ``replicas`` engine replicas (and, on one of them, the ingress
    replicas); ``config`` is sized (``sized_for_workers``). A tensor-parallel replica's ranks
    share one pod (its placement group is packed on one node), each with the replica's
    ``num_cpus`` and ``num_gpus``."""
    k8s, replica = config.kubernetes, config.replica
    ranks = replica.tensor_parallel_size
    ingress = ingress_deployment_options(config)
    ingress_cpus = ingress["num_replicas"] * ingress["ray_actor_options"]["num_cpus"]
    per_pod = math.floor((k8s.worker_cpus - ingress_cpus) / (replica.num_cpus * ranks))
    if replica.num_gpus > 0:
        per_pod = min(per_pod, math.floor(k8s.worker_gpus / (replica.num_gpus * ranks)))
    if per_pod < 1:
        raise ConfigError(
            f"a worker pod (kubernetes.worker_cpus={k8s.worker_cpus}, worker_gpus={k8s.worker_gpus}) cannot hold "
            f"one replica (replica.num_cpus={replica.num_cpus}, num_gpus={replica.num_gpus}, "
            f"tensor_parallel_size={ranks}) and the ingress")
    return math.ceil(replicas / per_pod)


def _pod_range(config: AppConfig) -> tuple[int, int]:
    return worker_pods(config, config.autoscaling.min_replicas), worker_pods(config, config.autoscaling.max_replicas)


def _probe(command: str, failure_threshold: int) -> dict:
    return {"exec": {"command": ["bash", "-c", command]}, "initialDelaySeconds": 30, "periodSeconds": 5,
            "timeoutSeconds": 2, "failureThreshold": failure_threshold}


def _container(config: AppConfig, options: RenderOptions, name: str, cpus: int, memory: str, gpus: int,
               ports: dict[str, int], alive: str, ready: str) -> dict:
    resources = {"cpu": str(cpus), "memory": memory} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
    # Serve reads its request-path options when its processes start: in every Ray container
    env = options.env() + [{"name": name, "value": value}
                           for name, value in serve_environment(on_kubernetes(config.request_path)).items()]
    return {
        "name": name,
        "image": config.kubernetes.image,
        "imagePullPolicy": "IfNotPresent",
        **({"env": env} if env else {}),
        "ports": [{"name": port_name, "containerPort": port} for port_name, port in ports.items()],
        "resources": {"requests": resources, "limits": resources},
        # KubeRay's default probes, spelled out
        "livenessProbe": _probe(alive, failure_threshold=120),
        "readinessProbe": _probe(ready, failure_threshold=10),
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
    }


def _head_group(config: AppConfig, options: RenderOptions, metrics_port: int) -> dict:
    k8s = config.kubernetes
    ports = {"gcs-server": GCS_PORT, "dashboard": DASHBOARD_PORT, "client": CLIENT_PORT, "serve": config.port,
             "metrics": metrics_port, "dllm-metrics": config.metrics_port}
    health = f"{_RAYLET_HEALTH} && {_GCS_HEALTH}"
    container = _container(config, options, "ray-head", k8s.head_cpus, k8s.head_memory, 0, ports, health, health)
    # num-cpus 0: replicas and the ingress run on workers; the head keeps Serve's controller,
    # a proxy and the metrics actor (pinned to the head, so one scrape target serves it).
    # dashboard-host 0.0.0.0: the operator reaches the dashboard through the head Service;
    # network_policy() admits only the RayService's pods and the operator to it.
    return {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0",
                               "metrics-export-port": str(metrics_port)},
            "template": {"metadata": {"labels": _pod_labels(config)}, "spec": {"containers": [container]}}}


def _worker_group(config: AppConfig, options: RenderOptions, metrics_port: int) -> dict:
    k8s = config.kubernetes
    if config.replica.num_gpus > 0 and k8s.worker_gpus == 0:
        raise ConfigError("replica.num_gpus > 0 needs kubernetes.worker_gpus > 0")
    serving = f"{_RAYLET_HEALTH} && wget -T 2 -q -O- http://localhost:{config.port}/-/healthz | grep success"
    container = _container(config, options, "ray-worker", k8s.worker_cpus, k8s.worker_memory, k8s.worker_gpus,
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


def _tcp(port: int) -> dict:
    return {"protocol": "TCP", "port": port}


def network_policy(config: AppConfig) -> dict:
    """A NetworkPolicy for the RayService's pods (heads and workers of every RayCluster it
    creates, old and new during an upgrade: they carry the template labels, ``_pod_labels``;
    KubeRay's own ``ray.io/cluster`` label names a generated RayCluster, unknown here).

    In: anything from the RayService's own pods (GCS, Ray client, dashboard, object transfers,
    ...); the dashboard from the kuberay-operator in any namespace; the metrics actor's port
    and Ray's metrics port from the monitoring namespaces (``kubernetes.monitoring_namespace_labels``:
    Prometheus scrapes pods directly); from anywhere, the Serve port. Egress is left open."""
    pods = {"matchLabels": _pod_labels(config)}
    metrics_ports = dict.fromkeys([config.metrics_port, config.ray_metrics_port or RAY_METRICS_PORT])
    monitoring = {"namespaceSelector": {"matchLabels": config.kubernetes.monitoring_namespace_labels}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(config, f"{config.name}-ray-pods"),
        "spec": {
            "podSelector": pods,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": pods}]},
                {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": KUBERAY_OPERATOR_LABELS}}],
                 "ports": [_tcp(DASHBOARD_PORT)]},
                {"ports": [_tcp(config.port)]},
                {"from": [monitoring], "ports": [_tcp(port) for port in metrics_ports]},
            ],
        },
    }


def rayservice(config: AppConfig, options: RenderOptions = RenderOptions()) -> dict:
    """The KubeRay RayService manifest (ray.io/v1), sized for the worker pods."""
    options.check()
    config = sized_for_workers(config)
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
                "headGroupSpec": _head_group(config, options, metrics_port),
                "workerGroupSpecs": [_worker_group(config, options, metrics_port)],
            },
        },
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as YAML block literals; no anchors."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def _header(target: str, source: str, flags: str) -> str:
    return f"# Rendered by `dllm-serve render {target} --config {source}{flags}`: edit that file and render again.\n"


def render_k8s(config: AppConfig, source: str, options: RenderOptions = RenderOptions()) -> str:
    """The RayService, the metrics Services and (unless ``options`` say no) the NetworkPolicy as
    YAML documents, headed by the command that renders them."""
    documents = [rayservice(config, options), *metrics_services(config)]
    if options.network_policy:
        documents.append(network_policy(config))
    return _header("k8s", source, options.flags()) + yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False)


def render_rules(config: AppConfig, source: str, operator: bool = False) -> str:
    """The alert rules (``cluster.alerts``) as a Prometheus rule file, or with ``operator`` as
    a PrometheusRule, headed by the command that renders them and the SLO they hold."""
    slo = config.slo.latency_or_floor_s
    where = ("slo.latency_s" if config.slo.latency_s is not None else
             "slo.latency_s is unset: the floor of the SLO derived at run time; set it where the longest "
             "request takes longer")
    header = _header("rules", source, " --prometheus-rule" if operator else "")
    header += f"# Latency SLO {slo:g} s ({where}).\n"
    document = prometheus_rule(config) if operator else alert_rules(config)
    return header + yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=120)
