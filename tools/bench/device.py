"""Where an engine bench runs (``--device``, ``--dtype``): checked before anything is built,
models built there directly, and the wall clock read only once the device is done."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from replicas.engine import EngineConfig, torch_dtype
from replicas.models.spec import ModelSpec
from replicas.engine_config import ServingShape

DEVICES = ("cpu", "cuda")


def synchronize(device: str | torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on a CPU): before each
    read of the wall clock around it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def built_on(device: str | torch.device, dtype: torch.dtype, make: Callable[[], nn.Module]) -> nn.Module:
    """``make()``'s module in eval mode, its parameters made on ``device`` (not on the host,
    then copied) and cast to ``dtype`` there."""
    with torch.device(device):
        return make().to(dtype).eval()


@dataclass(frozen=True)
class BenchDevice:
    """A bench's device and dtype (``dtype`` None: the engine's default for the device,
    bfloat16 on CUDA and float32 on a CPU). Raises ValueError where this machine has no
    such device."""

    device: str = "cpu"
    dtype: str | None = None

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r}; choose one of {list(DEVICES)}")
        if self.device == "cuda" and not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
            raise ValueError(f"--device cuda: no CUDA device is available here (torch {torch.__version__}, {build})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(EngineConfig(device=self.device, dtype=self.dtype))

    def report(self) -> dict:
        """The report's fields that say where it ran."""
        name = torch.cuda.get_device_name() if self.device == "cuda" else "cpu"
        return {"device": self.device, "device_name": name, "dtype": str(self.torch_dtype).removeprefix("torch.")}

    def engine_config(self, spec: ModelSpec, **settings) -> EngineConfig:
        """The engine's settings on this device, with the KV pool that ``max_batch`` requests of
        ``max_model_len`` need, on every device: nothing measures memory at start (which on
        CUDA profiles a forward of its own: a replayed run makes the recorded forwards only)."""
        config = EngineConfig(device=self.device, dtype=self.dtype, **settings)
        return config.model_copy(update={"num_pages": ServingShape.of(config, spec).num_pages})
