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


class Rotation:
    """The rotary angles of one forward's tokens, computed once and applied to every
    layer's q and k (per layer and per call they cost a tenth of a CPU forward's
    element-wise time)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int):
        self.cos = cos  # [..., T, 1, rotary_dim]: each angle's cosine, twice
        self.signed_sin = sin  # [..., T, 1, rotary_dim]: -sin over the first half, sin over the second
        self.rotary_dim = rotary_dim

    def select(self, index: torch.Tensor) -> "Rotation":
        """The rotation of the tokens ``index`` (of a packed forward's)."""
        return Rotation(self.cos[index], self.signed_sin[index], self.rotary_dim)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., T, H, D]`` turned: ``x * cos + rotate_half(x) * sin``."""
        turned, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        swapped = torch.cat([turned[..., half:], turned[..., :half]], dim=-1)
        out = turned * self.cos
        out = out.addcmul_(swapped, self.signed_sin) if not torch.is_grad_enabled() else out + swapped * self.signed_sin
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout (Llama, Qwen, OLMo, Ling).

    ``rotary_dim < head_dim`` is partial rotary (LLaDA2.0): only the first ``rotary_dim``
    dimensions of each head turn, the rest pass through. Angles are computed per forward
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

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation of tokens at ``positions[..., T]``, in ``dtype``."""
        angles = positions.unsqueeze(-1).float() * self.inv_freq(positions.device)
        cos, sin = angles.cos(), angles.sin()
        return Rotation(torch.cat([cos, cos], dim=-1).unsqueeze(-2).to(dtype),
                        torch.cat([-sin, sin], dim=-1).unsqueeze(-2).to(dtype), self.rotary_dim)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))  # serving: in gate's memory
