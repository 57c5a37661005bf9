"""One pydantic model for the whole application, loaded from YAML and/or flags.

The same object drives `dllm-serve up` and renders the Kubernetes manifests.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.auth import API_KEYS_ENV
from cluster.request_path import RequestPath
from replicas.request_cost import SLO_HEADROOM
from replicas.quality import QualityKnob, QualityLevel
from replicas.engine_config import EngineConfig


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and the problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ReplicaSettings(EngineConfig):
    """The engine settings of every replica, and what Ray and Serve give each one."""

    num_cpus: float | None = Field(
        None, gt=0, description="Ray CPUs reserved per replica (default: the node's cores left to engines, "
                                "shared by the replicas on it; see cluster.app.size_for_node)")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs reserved per replica (1 with replica.device cuda: one GPU each)")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads per replica (default: the whole CPUs it reserves, at least 1)")
    max_ongoing_requests: int = Field(4096, ge=1, description="requests Serve lets one engine replica hold at once (queued and running); admission bounds them well before")
    stall_timeout_s: float = Field(
        30.0, gt=0, description="a replica whose engine has not finished a step for this long with work pending "
                                "fails its health check (Serve replaces it; its requests resume elsewhere)")
    unhealthy_after_failed_steps: int = Field(
        3, ge=1, description="a replica whose last this many engine steps failed fails its health check")

    @model_validator(mode="after")
    def _check_algorithm(self) -> "ReplicaSettings":
        """A named default algorithm is checked here; the model's own is checked at start."""
        if self.algorithm is not None:
            _check_algorithm_params(self.algorithm, self.algorithm_params, "algorithm")
        return self


def _check_algorithm_params(name: str, params: dict[str, Any], setting: str) -> None:
    """ValueError (a config error naming ``setting``) unless algorithm ``name`` takes ``params``."""
    from algorithms import AlgorithmError, get_algorithm

    try:
        get_algorithm(name).make_params(params)
    except AlgorithmError as exc:
        raise ValueError(f"{setting}: {exc}") from exc


class AdmissionSettings(_Section):
    enabled: bool = Field(
        True, description="refuse with 429 a request whose predicted completion time is over slo.latency_s "
                          "(cluster.admission)")
    cost_quantile: float | None = Field(
        None, gt=0, le=1,
        description="charge blocks x this quantile of measured steps per block (default: their mean; "
                    "the algorithm's worst case until measured)")
    max_step_debt_per_replica: float | None = Field(
        None, gt=0,
        description="a fixed bound instead of the SLO: row-steps a replica may owe (a request's own deadline_s "
                    "is still checked against the predicted completion; default: none, admit by predicted completion)")
    initial_row_steps_per_s: float = Field(
        500.0, gt=0, description="row-steps a second a replica is assumed to drain until the replicas have measured "
                                 "their step cost (their warm-up measures it before they report ready)")
    slo_headroom: float = Field(
        SLO_HEADROOM, gt=0, le=1,
        description="admit while the predicted completion is within this fraction of the SLO (or of a request's "
                    "deadline_s): the prediction is a mean, and a queue filled to the SLO itself would finish "
                    "about half of its requests late")


SLO_MULTIPLE = 2.0
SLO_FLOOR_S = 10.0  # a wait an interactive user still accepts; the default SLO is never tighter


class SLOSettings(_Section):
    latency_s: float | None = Field(
        None, gt=0,
        description=f"target end-to-end latency (admission, autoscaling); default: {SLO_FLOOR_S:g} s, or {SLO_MULTIPLE:g} "
                    f"x the seconds the longest request (max_model_len) takes alone at full batch where that is "
                    f"more (from the replicas' measured step cost and mean steps per block); a request may ask "
                    f"for less with deadline_s")
    time_to_first_block_s: float = Field(5.0, gt=0, description="target time to the first streamed block; recorded only: admission, alerts and "
                                "autoscaling read latency_s alone")

    def latency_for(self, longest_request_s: Iterable[float]) -> float:
        """``latency_s``, or derived from the replicas' reported ``longest_request_s``."""
        if self.latency_s is not None:
            return self.latency_s
        return max([SLO_FLOOR_S, *(SLO_MULTIPLE * s for s in longest_request_s)])

    @property
    def latency_or_floor_s(self) -> float:
        """The SLO as the config tells it before anything runs: ``latency_s``, or where that
        is derived at run time, its floor."""
        return self.latency_s or SLO_FLOOR_S


class QualityLevelSettings(_Section):
    algorithm: str = Field(description="the algorithm whose requests this level changes, e.g. low_confidence")
    params: dict[str, Any] = Field(description="its parameters at this level, e.g. {threshold: 0.9}")
    accuracy_loss: float = Field(
        ge=0, description="points of accuracy this setting was measured to lose against the default "
                          "(`dllm-serve bench quality`)")
    step_ratio: float = Field(
        1.0, gt=0, le=1, description="its steps per block over the default setting's, as measured (`dllm-serve "
                                     "bench quality`): admission charges an adaptive request that fraction while "
                                     "every replica runs at this level or a deeper one")

    @model_validator(mode="after")
    def _check_params(self) -> "QualityLevelSettings":
        _check_algorithm_params(self.algorithm, self.params, "quality level")
        return self


class QualitySettings(_Section):
    """The load knob (``replicas.quality``): while a replica predicts it drains its work in
    more than ``raise_at`` x the SLO, requests that allow it run one level lower, and so on."""

    default: Literal["fixed", "adaptive"] = Field(
        "fixed", description="the quality of requests that do not say (their dllm.quality): 'adaptive' ones may "
                             "run at a degraded level under load, 'fixed' ones never do")
    levels: list[QualityLevelSettings] = Field(
        default_factory=list, description="the degraded settings, mildest first, each {algorithm, params, accuracy_loss, "
                                        "step_ratio} (none: the knob is off)")
    accuracy_budget: float = Field(
        1.0, ge=0, description="points of accuracy a level may lose at most; levels that lose more are never used")
    raise_at: float = Field(0.8, gt=0, description="one level lower while predicted drain time > this x the SLO")
    lower_at: float = Field(0.4, ge=0, description="one level back up while predicted drain time < this x the SLO")
    hold_s: float = Field(2.0, ge=0, description="seconds a level holds at least before the next move")

    @model_validator(mode="after")
    def _check_band(self) -> "QualitySettings":
        if self.lower_at >= self.raise_at:
            raise ValueError("quality.lower_at must be below quality.raise_at")
        return self

    def knob(self, slo_s: float) -> QualityKnob | None:
        """The replicas' knob for an SLO of ``slo_s``; None when no level is configured."""
        if not self.levels:
            return None
        levels = [QualityLevel(level.algorithm, level.params, level.accuracy_loss, level.step_ratio)
                  for level in self.levels]
        return QualityKnob(levels, slo_s, self.accuracy_budget, self.raise_at, self.lower_at, self.hold_s)


class AutoscalingSettings(_Section):
    min_replicas: int = Field(1, ge=1, description="engine replicas at least (--replicas N sets min and max)")
    max_replicas: int = Field(1, ge=1, description="engine replicas at most; above min_replicas, Serve scales between the two on step debt "
                                                             "(cluster.autoscaling)")
    target_drain_s: float | None = Field(
        None, gt=0, description="scale so that step debt drains in this time at full batch (default: slo.latency_s / 2)")
    upscale_delay_s: float = Field(5.0, ge=0, description="seconds a scale-up decision must hold before it acts")
    downscale_delay_s: float = Field(60.0, ge=0, description="seconds a scale-down decision must hold before it acts")


class IngressSettings(_Section):
    """The OpenAI ingress deployment and Serve's queue in front of it."""

    replicas: int | None = Field(
        None, ge=1, description="ingress replicas (default: 1 on a node of <= 4 cores, else 2; "
                                "they admit consistently through the replicas' reported step debt)")
    num_cpus: float = Field(0.5, gt=0, description="Ray CPUs reserved per ingress replica")
    max_ongoing_requests: int = Field(
        1024, ge=1, description="requests one ingress replica holds at once (admitted streams and refusals in progress)")
    max_queued_requests: int = Field(
        256, ge=1, description="requests the Serve proxy queues for a busy ingress; beyond it the proxy answers 429 "
                               "(plain text, Retry-After: 1)")
    max_body_bytes: int = Field(
        1 << 20, ge=1024, description="largest request body; larger ones get 413 before they are read")
    max_prompt_chars: int = Field(
        1 << 18, ge=1, description="most characters of a completion's prompt, and of a chat's messages together "
                                   "(400 beyond; the model's max_model_len bounds the tokens after that)")
    max_messages: int = Field(
        512, ge=1, description="most messages of one chat request (400 beyond, counted before they are parsed)")
    max_n: int = Field(
        8, ge=1, le=128, description="most choices one request may ask for (n, times its prompts where a "
                                     "completion sends a list); each is a row of its own and admission charges "
                                     "them all")
    metrics_timeout_s: float = Field(
        2.0, gt=0, description="how long the ingress waits for the metrics actor before it gives up on a call")


class RoutingSettings(_Section):
    """How the ingress picks a replica for a request (cluster.router)."""

    prefix_affinity_s: float = Field(
        0.5, ge=0, description="a request goes to the replica last sent its longest prompt prefix (whose prefix "
                               "cache likely holds it) unless that replica's predicted drain time is more than "
                               "this many seconds above the soonest replica's; 0: always the soonest")


class FailoverSettings(_Section):
    """Resuming a request on another replica when its replica fails (cluster.failover)."""

    max_attempts: int = Field(
        4, ge=1, description="replica attempts per request, the first included; then the request fails with 503")
    backoff_s: float = Field(
        0.25, ge=0, description="wait before the second attempt, doubled for each further one")
    healthy_wait_s: float = Field(
        30.0, ge=0, description="before a resumed attempt, wait up to this long (within the request's deadline) "
                                "for a replica that has not failed the request and whose steps are not failing, "
                                "as while Serve replaces the only one left; then attempt anyway")


class KubernetesSettings(_Section):
    """What `dllm-serve render k8s` needs beyond the application itself."""

    image: str = Field("dllm-serve:0.1.0", description="container image with dllm-serve installed (deploy/Dockerfile)")
    namespace: str | None = Field(None, description="namespace of the RayService (default: kubectl's current one)")
    head_cpus: int = Field(2, ge=1, description="CPUs of the head pod (Serve controller, proxy, ingress, metrics actor)")
    head_memory: str = Field("4Gi", description="memory of the head pod")
    worker_cpus: int = Field(4, ge=1, description="CPUs of each worker pod")
    worker_memory: str = Field("16Gi", description="memory of each worker pod")
    worker_gpus: int = Field(0, ge=0, description="nvidia.com/gpu per worker pod; > 0 makes the worker group a GPU group")
    model_volume_claim: str | None = Field(
        None, description="PersistentVolumeClaim with checkpoints, mounted read-only at /models in the workers")
    monitoring_namespace_labels: dict[str, str] = Field(
        {"kubernetes.io/metadata.name": "monitoring"},
        description="labels of the namespaces whose pods may scrape the metrics ports (the NetworkPolicy): "
                    "Prometheus's; by default the namespace named monitoring ({}: every namespace)")


_ALGORITHM_KEYS = {"name": "algorithm", "params": "algorithm_params"}

class AppConfig(_Section):
    model: str = Field("tiny", description="checkpoint directory, or 'tiny' for the embedded model")
    served_model_name: str | None = Field(None, description="name in /v1/models (default: 'tiny' or the directory name)")
    name: str = Field("dllm", description="the Ray Serve application's name (dllm-serve status lists it)")
    host: str = Field("127.0.0.1", description="address the OpenAI API (and the metrics port) listens on; 0.0.0.0 for every interface")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the OpenAI API")
    metrics_port: int = Field(9400, ge=1, le=65535, description="Prometheus port of the metrics actor")
    ray_metrics_port: int | None = Field(
        None, ge=1, le=65535,
        description="Prometheus port of Ray's own metrics, ray_serve_* included (default: a free port; 8080 on Kubernetes)")
    api_key_file: str | None = Field(
        None, description=f"file of API keys, one per line: KEY or 'KEY MAX_CONCURRENT' (its requests in flight per "
                          f"ingress replica); keys also come from the environment variable {API_KEYS_ENV} (entries "
                          f"separated by commas); with any key, requests need 'Authorization: Bearer KEY' "
                          f"(cluster.auth)")
    request_path: RequestPath = Field(
        "ingress", description="the front end of the HTTP API: 'ingress' (the ingress replicas serve the port "
                               "themselves, no proxy; on Kubernetes the pods run 'haproxy'), 'haproxy' (HAProxy "
                               "forwards straight to the ingress replicas, Serve's throughput-optimized options "
                               "on), 'throughput' (those options behind Serve's Python proxy) or 'proxy' (Serve as "
                               "it ships); see cluster.request_path")
    default_max_tokens: int = Field(128, ge=1, description="max_tokens when a request gives none (less where the "
                                                            "prompt leaves less room)")
    request_timeout_s: float | None = Field(
        600.0, gt=0, description="a request still running this long after it arrived ends with what it committed, "
                                 "finish_reason 'timeout' (504 where nothing was), its pages and admission "
                                 "charge freed; none: no deadline")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="on SIGTERM `dllm-serve up` stops admitting (503 server_draining, Retry-After) "
                                "and waits this long at most for the requests in flight to finish, then stops")
    stats_period_s: float = Field(0.5, gt=0, description="seconds between two reports of each replica's statistics (routing, admission, metrics, "
                                                          "autoscaling read them); replicas silent for 20 periods (at least 10 s) count as stale")
    access_log: bool = Field(
        False, description="Serve's access log in the replicas' logs: a line per request each replica handles "
                           "(and its CPU: about 1% of an engine replica's under load); errors are logged either way")
    replica: ReplicaSettings = Field(default_factory=ReplicaSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    slo: SLOSettings = Field(default_factory=SLOSettings)
    quality: QualitySettings = Field(default_factory=QualitySettings)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    ingress: IngressSettings = Field(default_factory=IngressSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    failover: FailoverSettings = Field(default_factory=FailoverSettings)
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)

    @model_validator(mode="before")
    @classmethod
    def _no_key_in_the_config(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "api_key" in raw:
            raise ValueError(f"api_key is not a setting: a key in the configuration would reach the application's "
                             f"arguments in clear text; put the keys in api_key_file or in {API_KEYS_ENV}")
        return raw

    @model_validator(mode="before")
    @classmethod
    def _algorithm_section(cls, raw: Any) -> Any:
        """``algorithm: {name, params}`` is short for replica.algorithm and replica.algorithm_params."""
        if not isinstance(raw, dict) or "algorithm" not in raw:
            return raw
        raw = dict(raw)
        section = raw.pop("algorithm")
        if not isinstance(section, dict) or not set(section) <= {"name", "params"}:
            raise ValueError("algorithm: a mapping with name and params")
        if isinstance(raw.setdefault("replica", {}), dict):
            raw["replica"] = {**raw["replica"], **{_ALGORITHM_KEYS[k]: v for k, v in section.items()}}
        return raw

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        if self.autoscaling.max_replicas < self.autoscaling.min_replicas:
            raise ValueError("autoscaling.max_replicas must be >= autoscaling.min_replicas")
        if self.port == self.metrics_port:
            raise ValueError("port and metrics_port must differ")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or ("tiny" if self.model == "tiny" else Path(self.model).name)

    def quality_knob(self) -> QualityKnob | None:
        """The load knob, against the configured SLO or, where it is derived, its floor."""
        return self.quality.knob(self.slo.latency_or_floor_s)

    @property
    def target_drain_s(self) -> float | None:
        """None: half the SLO derived at run time (``SLOSettings.latency_for``)."""
        if self.autoscaling.target_drain_s is not None or self.slo.latency_s is None:
            return self.autoscaling.target_drain_s
        return self.slo.latency_s / 2


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {key} is not a section")
    node[leaf] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> AppConfig:
    """Defaults, then the YAML file, then ``overrides`` (dotted keys, e.g. 'replica.max_batch')."""
    raw: dict = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    for key, value in (overrides or {}).items():
        _set_path(raw, key, value)
    try:
        return AppConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from None


def describe_fields(model: type[BaseModel] = AppConfig, prefix: str = "") -> list[str]:
    """One line per setting (dotted key, default, description), for `--help`."""
    lines = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines += describe_fields(annotation, f"{prefix}{name}.")
            continue
        default = field.get_default(call_default_factory=True)
        default = default.value if isinstance(default, enum.Enum) else default
        lines.append(f"  {prefix}{name} (default {default!r}): {field.description or ''}")
    return lines


def check_ports_free(config: AppConfig) -> None:
    """``ConfigError`` naming the setting whose port on ``host`` is taken (before Ray starts)."""
    ports = {"port": config.port, "metrics_port": config.metrics_port, "ray_metrics_port": config.ray_metrics_port}
    for name, port in ports.items():
        if port is None:
            continue
        with socket.socket() as probe:
            # as the servers bind: a port left with TIME_WAIT connections only (a stop
            # just before) is free to them
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((config.host, port))
            except OSError as exc:
                raise ConfigError(f"{name} {port} on {config.host} is not free: {exc.strerror}") from None
