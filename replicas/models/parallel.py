"""Tensor and expert parallelism of the decoder stack: which rank holds which slice.

At tensor-parallel size N each rank holds 1/N of every large matrix and the ranks add
their partial results with one all-reduce per attention block and one per MLP:

* attention: the q/k/v projections split by heads (column-wise: rows of the weight), the
  output projection by its input (row-wise: columns), so each rank attends with its own
  heads (and keeps the KV of its own KV heads) and the all-reduce sums the heads'
  contributions;
* dense MLPs (and a MoE's shared experts): gate and up split column-wise, down row-wise;
* a MoE's routed experts are distributed over an expert-parallel size E that divides N
  (default N): the experts fall into E parts, each held by N / E ranks, each of which holds
  a 1/(N/E) slice of every expert of its part (gate and up column-wise, down row-wise).
  At E = N every rank holds ``num_experts / N`` whole experts; at E = 1 every rank holds
  a slice of every expert. A rank routes every token with the replicated gate and adds its
  experts' partial contributions before the MLP's all-reduce, which completes them;
* the embedding and the LM head split over the vocabulary: a rank looks up only its ids
  (the all-reduce fills in the others), and its head scores only its share of the
  vocabulary; the logits are gathered at the positions the caller asked for.

Norms, the router and rotary are replicated. ``shard_of`` says, for each parameter name
(ours, ``replicas.models.transformer``), what a rank reads of the checkpoint's tensor, so
that a rank never loads the whole model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch


class ShardingError(ValueError):
    """A model that does not split over the ranks asked for; the message says what."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among ``size`` ranks (``group``: their torch.distributed group);
    ``expert_size``: the expert-parallel size (None: ``size``)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    expert_size: int | None = None

    def __post_init__(self) -> None:
        if self.expert_size is not None and (self.expert_size < 1 or self.size % self.expert_size):
            raise ShardingError(f"the expert-parallel size ({self.expert_size}) must divide the tensor-parallel "
                                f"size ({self.size})")

    @property
    def expert_slices(self) -> int:
        """How many ranks share each expert, each holding a slice of its width."""
        return self.size // (self.expert_size or self.size)

    def split(self, total: int, what: str) -> int:
        """``total`` / ``size`` (what each rank holds of ``what``); raises ShardingError."""
        if total % self.size:
            raise ShardingError(f"{what} ({total}) does not split evenly over {self.size} tensor-parallel ranks")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (``x`` itself at size 1)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()

_LAYER = r"^model\.layers\.\d+\."
_COLUMN = re.compile(_LAYER + r"(self_attn\.[qkv]_proj\.(weight|bias)|mlp\.(shared_experts\.)?(gate|up)_proj\.weight)$")
_ROW = re.compile(_LAYER + r"(self_attn\.o_proj|mlp\.(shared_experts\.)?down_proj)\.weight$")
_FUSED_QKV = re.compile(_LAYER + r"self_attn\.qkv_proj\.(weight|bias)$")
_EXPERT = re.compile(_LAYER + r"mlp\.experts\.(\d+)\.")
_VOCAB = re.compile(r"^(model\.embed_tokens|lm_head)\.weight$")


@dataclass(frozen=True)
class Shard:
    """What a rank reads of one checkpoint tensor: along ``dim``, the (start, end) ranges
    in ``ranges`` concatenated (several for a fused q/k/v projection); no ranges: all of it."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()

    def read(self, tensor_slice, ndim: int) -> torch.Tensor:
        """The rank's part (``ranges`` not empty) of a tensor of ``ndim`` dimensions, from
        a safetensors slice (``safe_open(...).get_slice``: only that part is read) or a tensor."""
        parts = []
        for start, end in self.ranges:
            index = [slice(None)] * ndim
            index[self.dim] = slice(start, end)
            parts.append(tensor_slice[tuple(index)])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def _even(total: int, parts: int, index: int) -> tuple[tuple[int, int], ...]:
    """Part ``index`` of ``total`` split in ``parts`` equal runs."""
    part = total // parts
    return ((index * part, (index + 1) * part),)


def local_experts(num_experts: int, tp: TensorParallel) -> range:
    """The routed experts this rank holds (a contiguous run, a slice of each)."""
    parts = tp.expert_size or tp.size
    if num_experts % parts:
        raise ShardingError(f"the routed experts ({num_experts}) do not split evenly over {parts} expert-parallel "
                            "parts")
    part, index = num_experts // parts, tp.rank // tp.expert_slices
    return range(index * part, (index + 1) * part)


def expert_width(width: int, tp: TensorParallel) -> int:
    """The slice of a routed expert's width this rank holds."""
    if width % tp.expert_slices:
        raise ShardingError(f"the experts' width ({width}) does not split evenly over the {tp.expert_slices} ranks "
                            "that share each expert")
    return width // tp.expert_slices


def shard_of(name: str, shape: tuple[int, ...], tp: TensorParallel, qkv_split: tuple[int, int, int] | None = None,
             num_experts: int | None = None) -> Shard | None:
    """What rank ``tp.rank`` reads of the parameter ``name`` (of full ``shape``), or None
    where it holds none of it (another rank's expert). ``qkv_split``: the q, k and v rows
    of a fused projection; ``num_experts``: the routed experts of a MoE model."""
    expert = _EXPERT.match(name)
    if expert:
        if int(expert.group(1)) not in local_experts(num_experts, tp):
            return None
        if tp.expert_slices == 1:
            return Shard()
        dim = 1 if name.endswith("down_proj.weight") else 0  # gate and up by rows, down by columns
        return Shard(dim, _even(shape[dim], tp.expert_slices, tp.rank % tp.expert_slices))
    if _FUSED_QKV.match(name):
        ranges, offset = [], 0
        for rows in qkv_split:
            (start, end), = _even(rows, tp.size, tp.rank)
            ranges.append((offset + start, offset + end))
            offset += rows
        return Shard(0, tuple(ranges))
    if _COLUMN.match(name) or _VOCAB.match(name):
        return Shard(0, _even(shape[0], tp.size, tp.rank))
    if _ROW.match(name):
        return Shard(1, _even(shape[1], tp.size, tp.rank))
    return Shard()
