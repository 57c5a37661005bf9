"""Host tensors onto the model's device."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor.to(device)``, skipped where it is there already (a CPU model): a step makes
    many small host tensors, and on the host each ``to`` is a dispatch of its own."""
    return tensor if tensor.device == device else tensor.to(device)
