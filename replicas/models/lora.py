"""PEFT LoRA adapters merged into a checkpoint's weights at load time.

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
from pathlib import Path

import torch
from safetensors.torch import load_file

PREFIX = "base_model.model."


class LoraError(ValueError):
    """An adapter that cannot be merged; the message names the file and the problem."""


def read_adapter(path: str | Path) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter's scale and ``{base parameter name: (A, B)}``."""
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
    return scale, {base: (p["lora_A"], p["lora_B"].T if transpose else p["lora_B"]) for base, p in pairs.items()}


def merge_delta(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * b @ a``, computed in float32, returned in ``weight``'s dtype."""
    if (b.shape[0], a.shape[1]) != tuple(weight.shape):
        raise LoraError(f"LoRA shapes B{tuple(b.shape)} @ A{tuple(a.shape)} do not fit W{tuple(weight.shape)}")
    merged = weight.float() + scale * (b.float() @ a.float())
    return merged.to(weight.dtype)
