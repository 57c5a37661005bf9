"""Building blocks shared by our transformer implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32 like the reference implementations, then back to the input dtype
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return out.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout (Llama, Qwen, OLMo, Ling).

    ``rotary_dim < head_dim`` is partial rotary (LLaDA2.0): only the first ``rotary_dim``
    dimensions of each head turn, the rest pass through. Angles are computed per call
    from the positions (no table, so a long context costs nothing up front).
    """

    def __init__(self, head_dim: int, theta: float, rotary_dim: int | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.theta = theta
        self._inv_freq: torch.Tensor | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
            self._inv_freq = 1.0 / (self.theta ** exponent)
        return self._inv_freq

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x[..., T, H, D]`` by ``positions[..., T]``."""
        angles = positions.unsqueeze(-1).float() * self.inv_freq(x.device)
        cos = torch.cat([angles.cos()] * 2, dim=-1).unsqueeze(-2).to(x.dtype)
        sin = torch.cat([angles.sin()] * 2, dim=-1).unsqueeze(-2).to(x.dtype)
        turned, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat([-turned[..., half:], turned[..., :half]], dim=-1)
        out = turned * cos + rotated * sin
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
