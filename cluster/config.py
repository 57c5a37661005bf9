"""One pydantic model for the whole application, loaded from YAML and/or flags.

The same object drives `dllm-serve up` and renders the Kubernetes manifests.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from replicas.settings import EngineConfig


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and the problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ReplicaSettings(EngineConfig):
    """The engine settings of every replica, and what Ray and Serve give each one."""

    num_cpus: float = Field(0.5, gt=0, description="Ray CPUs reserved per replica")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs reserved per replica")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads per replica (default: torch's)")
    max_ongoing_requests: int = Field(4096, ge=1, description="Serve's per-replica in-flight cap (admission bounds it first)")

    @model_validator(mode="after")
    def _check_algorithm(self) -> "ReplicaSettings":
        """A named default algorithm is checked here; the model's own is checked at start."""
        if self.algorithm is not None:
            from algorithms import AlgorithmError, get_algorithm

            try:
                get_algorithm(self.algorithm).make_params(self.algorithm_params)
            except AlgorithmError as exc:
                raise ValueError(f"algorithm: {exc}") from exc
        return self


class AdmissionSettings(_Section):
    enabled: bool = Field(True, description="refuse requests beyond the cluster's step capacity with 429")
    cost_quantile: float | None = Field(
        None, gt=0, le=1,
        description="charge blocks x this quantile of measured steps per block (default: the algorithm's worst case)")
    max_step_debt_per_replica: float | None = Field(
        None, gt=0,
        description="row-steps a replica may owe (default: measured row-steps/s x slo.latency_s)")
    initial_row_steps_per_s: float = Field(
        500.0, gt=0, description="drain-rate prior used until replicas have measured theirs")


class SLOSettings(_Section):
    latency_s: float = Field(30.0, gt=0, description="target end-to-end latency (admission capacity, autoscaling, alerts)")
    time_to_first_block_s: float = Field(5.0, gt=0, description="target time to the first streamed block")


class AutoscalingSettings(_Section):
    min_replicas: int = Field(1, ge=1, description="replicas at least")
    max_replicas: int = Field(1, ge=1, description="replicas at most (> min_replicas enables autoscaling)")
    target_drain_s: float | None = Field(None, gt=0, description="scale so that step debt drains in this time (default: slo.latency_s / 2)")
    upscale_delay_s: float = Field(5.0, ge=0, description="seconds a scale-up decision must hold before it acts")
    downscale_delay_s: float = Field(60.0, ge=0, description="seconds a scale-down decision must hold before it acts")


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


_ALGORITHM_KEYS = {"name": "algorithm", "params": "algorithm_params"}


class AppConfig(_Section):
    model: str = Field("tiny", description="checkpoint directory, or 'tiny' for the embedded model")
    served_model_name: str | None = Field(None, description="name in /v1/models (default: 'tiny' or the directory name)")
    name: str = Field("dllm", description="Serve application name")
    host: str = Field("127.0.0.1", description="HTTP host")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the OpenAI API")
    metrics_port: int = Field(9400, ge=1, le=65535, description="Prometheus port of the metrics actor")
    ray_metrics_port: int | None = Field(
        None, ge=1, le=65535,
        description="Prometheus port of Ray's own metrics, ray_serve_* included (default: a free port; 8080 on Kubernetes)")
    api_key: SecretStr | None = Field(None, description="require 'Authorization: Bearer KEY' when set")
    default_max_tokens: int = Field(128, ge=1, description="max_tokens when a request gives none")
    stats_period_s: float = Field(0.5, gt=0, description="how often replicas report routing/metrics stats")
    replica: ReplicaSettings = Field(default_factory=ReplicaSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    slo: SLOSettings = Field(default_factory=SLOSettings)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)

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

    @property
    def target_drain_s(self) -> float:
        return self.autoscaling.target_drain_s or self.slo.latency_s / 2


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
