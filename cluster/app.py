"""Building and running the Ray Serve application from one AppConfig."""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import time

import httpx
import ray
from ray import serve
from ray.serve.exceptions import RayServeException

from cluster.config import AppConfig
from cluster.ingress import Ingress
from cluster.metrics import ACTOR_NAME, ACTOR_NAMESPACE, MetricsActor
from cluster.request_path import LocalRequestPath
from replicas.deployment import EngineReplica
from replicas.telemetry.reports import stale_after_s

log = logging.getLogger(__name__)


def control_plane_cores(cores: int) -> int:
    """Cores a node keeps for the control plane: 1 on <= 4 cores, else 2."""
    return 1 if cores <= 4 else 2


def size_for_node(config: AppConfig, cores: int, engines_on_node: int) -> AppConfig:
    """``config`` with the settings left unset derived from a node of ``cores`` CPUs that
    runs ``engines_on_node`` engine replicas; settings given explicitly win.

    * The control plane (Serve's proxy, the metrics actor, the ingress replicas) keeps
      ``control_plane_cores``: 1 core on <= 4 cores, else 2, and runs one ingress replica
      per control-plane core (``ingress.replicas``).
    * The engines share the other cores equally: ``replica.num_cpus`` = (cores - control
      cores) / (engines_on_node x ``replica.tensor_parallel_size``: each rank of a replica
      reserves it) (whole CPUs above 1, as Ray wants), and
      ``replica.torch_threads`` = the whole CPUs a replica reserves, at least 1, so that no
      engine's threads spill onto the control plane's core. On a GPU node the engine's
      Python thread is what feeds the GPU: its reserved core matters more than torch's
      CPU threads.
    * Ray reservations: ``replica.num_cpus`` per engine, ``ingress.num_cpus`` (0.5) per
      ingress replica; Serve's proxy and the metrics actor (pinned to the head, which
      offers Ray no CPUs on Kubernetes) reserve none: their core stays free because the
      engines are sized to the rest.

    `dllm-serve up` sizes for the machine it runs on, all replicas on it; `render k8s`
    for one worker pod of ``kubernetes.worker_cpus``.
    """
    replica = config.replica
    num_cpus = replica.num_cpus
    if num_cpus is None:
        # a tensor-parallel replica's every rank reserves num_cpus
        share = max(cores - control_plane_cores(cores), 1) / max(engines_on_node * replica.tensor_parallel_size, 1)
        num_cpus = float(math.floor(share)) if share >= 1 else max(0.01, math.floor(share * 100) / 100)
    threads = replica.torch_threads or max(1, math.floor(num_cpus))
    ingress = config.ingress.replicas or control_plane_cores(cores)
    return config.model_copy(update={
        "replica": replica.model_copy(update={"num_cpus": num_cpus, "torch_threads": threads}),
        "ingress": config.ingress.model_copy(update={"replicas": ingress}),
    })


def size_for_this_node(config: AppConfig) -> AppConfig:
    """``size_for_node`` for the machine this runs on, holding every engine replica."""
    return size_for_node(config, os.cpu_count() or 1, config.autoscaling.max_replicas)


def replica_deployment_options(config: AppConfig) -> dict:
    """Options of the replica deployment, plain data (classes by import path), so that
    they also render into Kubernetes serveConfigV2 unchanged."""
    scaling = config.autoscaling
    options = {
        "name": "EngineReplica",
        "max_ongoing_requests": config.replica.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.replica.num_cpus, "num_gpus": config.replica.num_gpus},
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
        "graceful_shutdown_timeout_s": 60.0,
        "logging_config": {"enable_access_log": config.access_log},
        "request_router_config": {
            "request_router_class": "cluster.router:DrainTimeRouter",
            "request_router_kwargs": {"stale_after_s": stale_after_s(config.stats_period_s),
                                      "prefix_affinity_s": config.routing.prefix_affinity_s},
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
    ranks = config.replica.tensor_parallel_size
    if ranks > 1:  # one bundle a rank, on one node: the replica's process is rank 0, in the first
        bundle = {"CPU": config.replica.num_cpus or 1.0, **({"GPU": config.replica.num_gpus}
                                                            if config.replica.num_gpus else {})}
        options["placement_group_bundles"] = [bundle] * ranks
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


DEADLINE_END_S = 10.0  # past a request's deadline, time for its end (error event, [DONE]) to go out


def ingress_shutdown_s(config: AppConfig) -> float:
    """How long a stopping ingress replica (a rolling update, a scale-down) waits for the
    requests it holds: as long as one may run (``request_timeout_s`` and ``DEADLINE_END_S``),
    so that no stream is cut before ``[DONE]``; ``drain_timeout_s`` where that is longer or
    requests have no deadline. It stops as soon as its last request ends."""
    if config.request_timeout_s is None:
        return config.drain_timeout_s
    return max(config.drain_timeout_s, config.request_timeout_s + DEADLINE_END_S)


def ingress_deployment_options(config: AppConfig) -> dict:
    """Options of the ingress deployment. Serve's proxy queues at most
    ``ingress.max_queued_requests`` requests for busy ingress replicas and answers the next
    ones itself: 429, ``Retry-After: 1`` and a plain-text body (Serve writes it, not us)."""
    ingress = config.ingress
    return {"name": "Ingress", "num_replicas": ingress.replicas,
            "max_ongoing_requests": ingress.max_ongoing_requests,
            "max_queued_requests": ingress.max_queued_requests,
            "backpressure_config": {"status_code": 429, "retry_after_s": 1},
            "graceful_shutdown_timeout_s": ingress_shutdown_s(config),
            "logging_config": {"enable_access_log": config.access_log},
            "ray_actor_options": {"num_cpus": ingress.num_cpus}}


def build_app(config: AppConfig):
    """The bound application: Ingress -> EngineReplica (routed by predicted drain time);
    settings left unset are sized for this node (``size_for_this_node``)."""
    config = size_for_this_node(config)
    replica = serve.deployment(EngineReplica).options(**replica_deployment_options(config)).bind(
        config.model, config.replica,
        metrics_actor={"name": ACTOR_NAME, "namespace": ACTOR_NAMESPACE},
        stats_period_s=config.stats_period_s,
        initial_row_steps_per_s=config.admission.initial_row_steps_per_s,
        torch_threads=config.replica.torch_threads,
        stall_timeout_s=config.replica.stall_timeout_s,
        unhealthy_after_failed_steps=config.replica.unhealthy_after_failed_steps,
        quality=config.quality_knob(),
        rank_resources={"num_cpus": config.replica.num_cpus, "num_gpus": config.replica.num_gpus},
    )
    ingress = serve.deployment(Ingress).options(**ingress_deployment_options(config))
    return ingress.bind(replica, app_args(config))


def app_args(config: AppConfig) -> dict:
    """The config as the app builder's JSON arguments (no key: each ingress reads them, ``cluster.auth``)."""
    return config.model_dump(mode="json")


def build_from_args(args: dict):
    """Serve application builder, the ``import_path`` of `dllm-serve up` and of the rendered
    serveConfigV2: validates ``args`` as an AppConfig, starts the metrics actor, returns the app."""
    config = AppConfig.model_validate(args)
    start_metrics_actor(config)
    return build_app(config)


METRICS_ACTOR_START_S = 120.0  # how long a start waits for the metrics actor (a busy node starts slowly)


def start_metrics_actor(config: AppConfig):
    """The named metrics actor on the head node (idempotent); returns its scrape URL.

    Detached and restarted whenever it dies (``max_restarts=-1``): the new process binds
    ``metrics_port`` again (SO_REUSEADDR, ``cluster.metrics.serve_metrics``) and the replicas
    and ingress replicas refill it at their next report; nobody waits on it unboundedly."""
    actor = ray.remote(MetricsActor).options(
        name=ACTOR_NAME, namespace=ACTOR_NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1, resources={"node:__internal_head__": 0.001},
    ).remote(config.host, config.metrics_port, stale_after_s(config.stats_period_s), config.slo.latency_or_floor_s)
    return ray.get(actor.ready.remote(), timeout=METRICS_ACTOR_START_S)


GCS_CONNECT_TIMEOUT_S = 3.0  # a named cluster's address must accept a connection within this


class NoCluster(ValueError):
    """No running Ray cluster where one was asked for (the CLI prints it as its error)."""


def connect(address: str) -> None:
    """``ray.init`` on an existing cluster (``auto``: the one Ray finds here), failing at
    once with ``NoCluster`` where there is none: Ray itself retries a silent address for a
    minute and more, and raises a bare ``ConnectionError`` where it finds no local one."""
    host, _, port = address.rpartition(":")
    if "://" not in address and host and port.isdigit():
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=GCS_CONNECT_TIMEOUT_S).close()  # [v6]
        except OSError as exc:
            raise NoCluster(f"no Ray cluster answers at {address} ({exc.strerror or exc}); "
                            "`dllm-serve up` prints the address to give") from None
    try:
        ray.init(address=address, namespace=ACTOR_NAMESPACE, log_to_driver=False)
    except ConnectionError as exc:
        raise NoCluster(f"no running cluster found ({exc}); start one with `dllm-serve up`, "
                        "or give the address it printed with --address") from None


def deploy(config: AppConfig, address: str | None = None, request_path: LocalRequestPath | None = None) -> str:
    """Start (or connect to) Ray, the metrics actor and the Serve app; returns the metrics URL.
    A local Ray starts with ``request_path``'s environment (the caller's, to stop with
    ``shutdown``); a cluster at ``address`` keeps the request path it was started with."""
    config = size_for_this_node(config)
    if address:
        connect(address)
    else:
        if request_path is None:
            raise ValueError("a local cluster needs its LocalRequestPath(config.request_path)")
        request_path.apply()
        needed = (config.autoscaling.max_replicas * config.replica.num_cpus
                  + config.ingress.replicas * config.ingress.num_cpus)
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(needed)),
                 include_dashboard=False, namespace=ACTOR_NAMESPACE, log_to_driver=False,
                 _metrics_export_port=config.ray_metrics_port)
    app = build_from_args(app_args(config))  # the builder Kubernetes runs, metrics actor included
    # one HTTP proxy, on the head: nodes of one machine (tests) would fight over the port,
    # and `up` serves on the address of the machine it runs on; none where the ingress
    # replicas serve the port themselves
    own_http = request_path is not None and request_path.path == "ingress"
    serve.start(proxy_location="Disabled" if own_http else "HeadOnly",
                http_options={"host": config.host, "port": config.port})
    serve.run(app, name=config.name, route_prefix="/")
    return start_metrics_actor(config)


def start_failure(config: AppConfig) -> str | None:
    """Why the app's deployments could not start, in one line: the last exception line of
    what Serve reports (a replica constructor's error, e.g. a KV pool that the memory cannot
    hold), or None where it reports none."""
    try:
        app = serve.status().applications.get(config.name)
    except Exception as exc:  # Serve itself is gone
        log.debug("no Serve status: %s", exc)
        return None
    for name, deployment in (app.deployments.items() if app is not None else ()):
        errors = [line.strip() for line in (deployment.message or "").splitlines()
                  if re.match(r"\s*[\w.()]+(Error|Exception)\b.*: ", line)]
        if errors:
            return f"{name} could not start: {errors[-1]}"
    return None


ADMITTING_WAIT_S = 120.0  # how long `up` waits for the ingress to hold every replica's first report


def wait_until_admitting(config: AppConfig, timeout_s: float = ADMITTING_WAIT_S) -> str:
    """Wait until an ingress has the first report of ``autoscaling.min_replicas`` replicas
    (each measured its step cost before it reported ready), so that admission decides the
    first requests from measured figures; returns a line on the request path and the SLO."""
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    url = f"http://{host}:{config.port}/health"
    deadline = time.monotonic() + timeout_s
    health: dict = {}
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                health = client.get(url).json()
            except (httpx.HTTPError, ValueError):
                health = {}
            if health.get("replicas_reporting", 0) >= config.autoscaling.min_replicas:
                break
            time.sleep(0.2)
        else:
            log.warning("no replica report reached the ingress within %.0f s: admission starts from its prior",
                        timeout_s)
    running = health.get("request_path", "unknown")
    line = (f"request path: {running}; admission: {health.get('replicas_reporting', 0)} replica(s) reporting, "
            f"SLO {health.get('slo_latency_s', float('nan')):.1f} s")
    if running != config.request_path:
        line += f" (request_path {config.request_path} was asked for: the Ray cluster runs {running})"
    return line


def shutdown(config: AppConfig, request_path: LocalRequestPath | None = None) -> None:
    """Stop whatever ``deploy`` got to start (it may have failed half-way). A local cluster
    (``request_path`` given) stops at once: Ray ends its processes, ``request_path`` its
    HAProxy (a SIGTERM's drain has let the requests in flight finish before; Serve's own
    graceful stop would hold each direct-ingress replica open for its load-balancer
    deregistration period, 30 s). On a cluster at an address the app is deleted and Serve
    and the metrics actor stopped."""
    try:
        if ray.is_initialized():
            if request_path is None:
                _delete_app(config)
            ray.shutdown()
    finally:
        if request_path is not None:
            request_path.stop()


def _delete_app(config: AppConfig) -> None:
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


def cluster_status(address: str = "auto") -> dict:
    """Applications, deployments, replica states and per-replica stats of a running cluster."""
    connect(address)
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
        except (ValueError, ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
            log.warning("no replica stats: the metrics actor is not answering (%s)", type(exc).__name__)
            view = {}
        return {"applications": apps, "replicas": view}
    finally:
        ray.shutdown()

