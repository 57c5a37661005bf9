"""One pydantic model for the whole application, loaded from YAML and/or flags.

The same object drives `dllm-serve up` and renders the Kubernetes manifests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from replicas.batching import SchedulerMode


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field and the problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ReplicaSettings(_Section):
    mode: SchedulerMode = Field(SchedulerMode.FDFO, description="scheduler mode of every replica")
    fill_timeout_s: float | None = Field(
        None, ge=0, description="fixed_fill mode: batch fill timeout in seconds (default: tuned online)")
    max_batch: int = Field(16, ge=1, le=1024, description="rows per denoise step")
    num_pages: int | None = Field(None, ge=2, description="KV pages per replica (default: max_batch full-length requests)")
    max_tokens_per_step: int | None = Field(None, ge=1, description="new-token budget per step (chunked prefill)")
    max_model_len: int | None = Field(None, ge=1, description="longest prompt + output (default: the model's limit)")
    device: str = Field("cpu", description="torch device of each replica ('cpu', 'cuda')")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="weights and KV dtype (default: bfloat16 on CUDA, float32 on CPU)")
    lora: str | None = Field(None, description="PEFT LoRA adapter directory merged into the weights at load")
    kv_cache: Literal["prefix", "none"] = Field(
        "prefix", description="'none' recomputes the whole sequence every step (exact for bidirectional models, slow)")
    attention_backend: Literal["auto", "sdpa", "flash"] = Field(
        "auto", description="attention kernel: 'flash' is vllm-flash-attn (CUDA, the gpu extra); auto picks it when usable")
    model_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="per-model defaults to override: block_length, mask_token_id, eos_token_id, "
                    "attention (block_causal|bidirectional), default_algorithm, default_algorithm_params")
    num_cpus: float = Field(0.5, gt=0, description="Ray CPUs reserved per replica")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs reserved per replica")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads per replica (default: torch's)")
    max_ongoing_requests: int = Field(4096, ge=1, description="Serve's per-replica in-flight cap (admission bounds it first)")


class AlgorithmSettings(_Section):
    name: str | None = Field(None, description="default denoise algorithm (default: the model's own, "
                                               "from the per-model defaults table)")
    params: dict[str, Any] = Field(default_factory=dict, description="its default parameters, e.g. {threshold: 0.9}")


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
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    slo: SLOSettings = Field(default_factory=SLOSettings)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        if self.autoscaling.max_replicas < self.autoscaling.min_replicas:
            raise ValueError("autoscaling.max_replicas must be >= autoscaling.min_replicas")
        if self.port == self.metrics_port:
            raise ValueError("port and metrics_port must differ")
        from algorithms import AlgorithmError, get_algorithm

        if self.algorithm.name is not None:  # else checked against the model's default at start
            try:
                get_algorithm(self.algorithm.name).make_params(self.algorithm.params)
            except AlgorithmError as exc:
                raise ValueError(f"algorithm: {exc}") from exc
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
        lines.append(f"  {prefix}{name} (default {default!r}): {field.description or ''}")
    return lines
