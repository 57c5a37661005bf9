"""Building and running the Ray Serve application from one AppConfig."""

from __future__ import annotations

import logging
import os
import socket

import ray
from ray import serve
from ray.serve.exceptions import RayServeException

from cluster.config import AppConfig, ConfigError
from cluster.ingress import Ingress
from cluster.metrics import ACTOR_NAME, ACTOR_NAMESPACE, MetricsActor
from replicas.deployment import EngineReplica

log = logging.getLogger(__name__)


def replica_deployment_options(config: AppConfig) -> dict:
    """Options of the replica deployment, plain data (classes by import path), so that
    they also render into Kubernetes serveConfigV2 unchanged."""
    scaling = config.autoscaling
    options = {
        "name": "EngineReplica",
        "max_ongoing_requests": config.replica.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.replica.num_cpus, "num_gpus": config.replica.num_gpus},
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 60.0,
        "request_router_config": {
            "request_router_class": "cluster.router:DrainTimeRouter",
            "request_router_kwargs": {"stale_after_s": max(5.0, 10 * config.stats_period_s)},
            "request_routing_stats_period_s": config.stats_period_s,
            "request_routing_stats_timeout_s": max(1.0, config.stats_period_s),
        },
    }
    if scaling.max_replicas > scaling.min_replicas:
        options["autoscaling_config"] = {
            "min_replicas": scaling.min_replicas, "max_replicas": scaling.max_replicas,
            "initial_replicas": scaling.min_replicas,
            "upscale_delay_s": scaling.upscale_delay_s, "downscale_delay_s": scaling.downscale_delay_s,
            "metrics_interval_s": config.stats_period_s, "look_back_period_s": max(2.0, 4 * config.stats_period_s),
            "policy": {"policy_function": "cluster.autoscaling:StepDebtPolicy",
                       "policy_kwargs": {"target_drain_s": config.target_drain_s}},
        }
    else:
        options["num_replicas"] = scaling.min_replicas
    return options


def ingress_deployment_options(config: AppConfig) -> dict:
    return {"name": "Ingress", "num_replicas": 1, "max_ongoing_requests": 100_000,
            "ray_actor_options": {"num_cpus": 0.1}}


def build_app(config: AppConfig):
    """The bound application: Ingress -> EngineReplica (routed by predicted drain time)."""
    replica = serve.deployment(EngineReplica).options(**replica_deployment_options(config)).bind(
        config.model, config.replica,
        metrics_actor={"name": ACTOR_NAME, "namespace": ACTOR_NAMESPACE},
        stats_period_s=config.stats_period_s,
        initial_row_steps_per_s=config.admission.initial_row_steps_per_s,
        torch_threads=config.replica.torch_threads,
    )
    ingress = serve.deployment(Ingress).options(**ingress_deployment_options(config))
    return ingress.bind(replica, app_args(config))


def app_args(config: AppConfig) -> dict:
    """The config as the app builder's JSON arguments (secrets included)."""
    return config.model_dump(mode="json") | _secrets(config)


def build_from_args(args: dict):
    """Serve application builder, the ``import_path`` of `dllm-serve up` and of the rendered
    serveConfigV2: validates ``args`` as an AppConfig, starts the metrics actor, returns the app."""
    config = AppConfig.model_validate(args)
    start_metrics_actor(config)
    return build_app(config)


def _secrets(config: AppConfig) -> dict:
    """model_dump hides SecretStr values; the ingress needs the key itself."""
    return {"api_key": config.api_key.get_secret_value()} if config.api_key else {}


def start_metrics_actor(config: AppConfig):
    """The named metrics actor on the head node (idempotent); returns its scrape URL."""
    actor = ray.remote(MetricsActor).options(
        name=ACTOR_NAME, namespace=ACTOR_NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1, resources={"node:__internal_head__": 0.001},
    ).remote(config.host, config.metrics_port)
    return ray.get(actor.ready.remote())


def check_ports_free(config: AppConfig) -> None:
    """``ConfigError`` naming the setting whose port on ``host`` is taken (before Ray starts)."""
    ports = {"port": config.port, "metrics_port": config.metrics_port, "ray_metrics_port": config.ray_metrics_port}
    for name, port in ports.items():
        if port is None:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((config.host, port))
            except OSError as exc:
                raise ConfigError(f"{name} {port} on {config.host} is not free: {exc.strerror}") from None


def deploy(config: AppConfig, address: str | None = None) -> str:
    """Start (or connect to) Ray, the metrics actor and the Serve app; returns the metrics URL."""
    if address:
        ray.init(address=address, namespace=ACTOR_NAMESPACE, log_to_driver=False)
    else:
        needed = config.autoscaling.max_replicas * config.replica.num_cpus + 0.1
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)),
                 include_dashboard=False, namespace=ACTOR_NAMESPACE, log_to_driver=False,
                 _metrics_export_port=config.ray_metrics_port)
    app = build_from_args(app_args(config))  # the builder Kubernetes runs, metrics actor included
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(app, name=config.name, route_prefix="/")
    return start_metrics_actor(config)


def shutdown(config: AppConfig) -> None:
    """Stop whatever ``deploy`` got to start (it may have failed half-way)."""
    if not ray.is_initialized():
        return
    try:
        serve.delete(config.name)
        serve.shutdown()
    except RayServeException as exc:  # Serve never started
        log.debug("no Serve instance to stop: %s", exc)
    finally:
        try:
            ray.kill(ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE))
        except ValueError:
            pass
        ray.shutdown()


def cluster_status(address: str = "auto") -> dict:
    """Applications, deployments, replica states and per-replica stats of a running cluster."""
    ray.init(address=address, namespace=ACTOR_NAMESPACE, log_to_driver=False)
    try:
        status = serve.status()
        apps = {
            name: {"status": app.status.value, "message": app.message,
                   "deployments": {d: {"status": ds.status.value, "replicas": ds.replica_states}
                                   for d, ds in app.deployments.items()}}
            for name, app in status.applications.items()
        }
        try:
            view = ray.get(ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE).cluster_view.remote(), timeout=10)
        except ValueError:
            view = {}
        return {"applications": apps, "replicas": view}
    finally:
        ray.shutdown()

