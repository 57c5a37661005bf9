"""Row-wise tensor helpers shared by the rules: per-row parameters and position picking.

Every function works on all rows at once and treats each row on its own, so a row's
result never depends on the other rows of the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def per_row(
    values: Sequence[Any], name: str, device: torch.device, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``[getattr(v, name) for v in values]`` as a 1-D tensor, one entry per row. The
    tensor may be shared with other calls (a batch's parameters repeat step after step, and
    making a tensor costs more than looking one up): read it, never write to it."""
    return _row_tensor(tuple([getattr(v, name) for v in values]), dtype, torch.device(device))


def per_row_on_host(values: Sequence[Any], name: str) -> np.ndarray:
    """``per_row`` as a float64 numpy array (the rules' host path)."""
    return np.array([getattr(v, name) for v in values], dtype=np.float64)


@functools.lru_cache(maxsize=256)
def _row_tensor(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def masked_confidence(confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``confidence`` at masked positions, -inf elsewhere (so those are never picked)."""
    return torch.where(masked, confidence, float("-inf"))


def above_or_best(confidence: torch.Tensor, threshold: torch.Tensor, inclusive: bool = False) -> torch.Tensor:
    """Positions whose confidence is above ``threshold[row]`` (or equal, if ``inclusive``);
    where a row has none, its single most confident position (ties: the lowest, like argmax).

    ``confidence`` is -inf outside the masked positions (see ``masked_confidence``) and
    thresholds are not negative, so only masked positions are chosen, and a row without a
    mask gets none. Where a row chose any, its best position is among them already, so
    marking every row's best once gives both cases in three ops, with no read back to
    the host.
    """
    chosen = confidence >= threshold[:, None] if inclusive else confidence > threshold[:, None]
    best = confidence.max(-1, keepdim=True)
    return chosen.scatter_(-1, best.indices, best.values != float("-inf"))


def above_or_best_on_host(confidence: np.ndarray, threshold: np.ndarray, inclusive: bool = False) -> np.ndarray:
    """``above_or_best`` on numpy arrays (the rules' host path)."""
    chosen = confidence >= threshold[:, None] if inclusive else confidence > threshold[:, None]
    rows = np.arange(confidence.shape[0])
    best = confidence.argmax(-1)
    chosen[rows, best] |= confidence[rows, best] != -np.inf
    return chosen


def top_n(confidence: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The ``n[row]`` most confident finite positions of each row (ties: lowest position)."""
    order = confidence.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(confidence.shape[-1], device=confidence.device).expand_as(order)
    rank_of = torch.empty_like(order).scatter_(-1, order, ranks)
    return (rank_of < n.unsqueeze(-1)) & confidence.isfinite()

