"""PEFT LoRA adapters: read, checked against a model, merged into a checkpoint's weights at
load time (``merge_delta``) or kept apart and applied per row (``replicas.adapters``).

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, optional
``use_rslora`` and ``fan_in_fan_out``) and ``adapter_model.safetensors`` with
``base_model.model.<parameter path>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight``
``[out, r]``. The merge is ``W + scale * B @ A`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA), on the checkpoint's own parameter names, so it
needs nothing from the model implementation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

PREFIX = "base_model.model."


class LoraError(ValueError):
    """An adapter that cannot be merged; the message names the file and the problem."""


def read_adapter(path: str | Path) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter's scale and ``{base parameter name: (A, B)}``; every A has ``r`` rows and
    every B ``r`` columns (the module is named where one does not)."""
    path = Path(path).expanduser()
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise LoraError(f"LoRA adapter file {needed} is missing")
    config = json.loads(config_file.read_text())
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraError(f"{config_file}: needs an integer r >= 1 and a numeric lora_alpha")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(weights_file)).items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.weight"
            if name.startswith(PREFIX) and name.endswith(marker):
                base = name[len(PREFIX):-len(marker)] + ".weight"
                pairs.setdefault(base, {})[part] = tensor
                break
        else:
            raise LoraError(f"{weights_file}: unsupported tensor {name!r} (only lora_A/lora_B weights merge)")
    incomplete = [base for base, parts in pairs.items() if len(parts) != 2]
    if incomplete:
        raise LoraError(f"{weights_file}: lora_A or lora_B missing for {incomplete[:3]}")
    transpose = bool(config.get("fan_in_fan_out"))
    adapter = {base: (p["lora_A"], p["lora_B"].T if transpose else p["lora_B"]) for base, p in pairs.items()}
    for base, (a, b) in adapter.items():
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(f"{weights_file}: {base.removesuffix('.weight')} has A{tuple(a.shape)} and "
                            f"B{tuple(b.shape)}, not the rank r={rank} of {config_file.name}")
    return scale, adapter


def adapter_on(linears: dict[str, nn.Linear], path: str | Path,
               rename: Callable[[str], str]) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter at ``path`` for a model whose adaptable layers are ``linears`` (by module
    name): its scale and ``{module name: (A, B)}`` (``rename``: a checkpoint parameter name
    to the model's). Raises ``LoraError`` naming the module where it targets one that is
    not among them or whose shape is not ``B @ A``'s."""
    scale, pairs = read_adapter(path)
    adapted = {}
    for base, (a, b) in pairs.items():
        name = rename(base).removesuffix(".weight")
        module = linears.get(name)
        target = base.removesuffix(".weight")
        if module is None:
            raise LoraError(f"LoRA adapter {path} targets {target}, which is not an attention or dense MLP "
                            "projection of the model (what an unmerged adapter can adapt)")
        if (b.shape[0], a.shape[1]) != (module.out_features, module.in_features):
            raise LoraError(f"LoRA adapter {path}: {target} is [{module.out_features}, {module.in_features}] "
                            f"in the model, B{tuple(b.shape)} @ A{tuple(a.shape)} in the adapter")
        adapted[name] = (a, b)
    return scale, adapted


def merge_delta(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * b @ a``, computed in float32, returned in ``weight``'s dtype."""
    if (b.shape[0], a.shape[1]) != tuple(weight.shape):
        raise LoraError(f"LoRA shapes B{tuple(b.shape)} @ A{tuple(a.shape)} do not fit W{tuple(weight.shape)}")
    merged = weight.float() + scale * (b.float() @ a.float())
    return merged.to(weight.dtype)
