"""The ranks of a tensor-parallel replica: rank 0 runs the engine, the others follow.

Rank 0 holds the scheduler, the requests and the streams; its runner builds each forward's
inputs as always and, before running its share of the model, broadcasts them to the other
ranks (``ForwardBroadcast``): the packed token ids and positions, the attention layout and
the logits' positions, seven integer tensors behind one fixed-size header. No Python
object per request crosses. Every other rank (``follow``) runs the same forward with its
share of the weights and of the KV pool (its own KV heads; the same pages, since rank 0
lays them out), joining the collectives inside the model, until rank 0 closes the channel.

The ranks size their pools alike (``agreed_pool``): each plans as a single replica would
(the same profiled forwards, whose collectives pair up), and all take the smallest.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

from replicas.attention import BatchLayout, kept_tokens, paged_context
from replicas.kv_cache import KVCache
from replicas.memory import PoolSize
from replicas.models.parallel import TensorParallel

GROUP_TIMEOUT_S = 120.0  # a collective waiting this long for a rank fails (a dead rank ends its replica)
_FORWARD, _CLOSE = 1, 0
_TENSORS = 7  # input ids, positions, the layout's four, the logits' positions
# the command, the layout's span length (0: none), keys_are_queries and cache_kept, each tensor's two
# dimensions (-1: none)
_FLAGS = 4
_HEADER = _FLAGS + 2 * _TENSORS


class ForwardBroadcast:
    """Rank 0's side of the channel."""

    def __init__(self, tp: TensorParallel, device: torch.device):
        """``device``: where the group's collectives run (the GPU for NCCL, the host for gloo)."""
        self.tp = tp
        self.device = device
        self.source = dist.get_global_rank(tp.group, 0)

    def send(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout,
             logits_index: torch.Tensor) -> None:
        """The inputs of the forward rank 0 is about to run, to every other rank."""
        tensors = [input_ids, positions, layout.span_start, layout.cache_positions, layout.key_cache_positions,
                   layout.key_valid.to(torch.int64), logits_index]
        dims = []
        for tensor in tensors:
            dims += list(tensor.shape) + [-1] * (2 - tensor.dim())
        self._broadcast(torch.tensor([_FORWARD, layout.span_length or 0, layout.keys_are_queries,
                                      layout.cache_kept] + dims,
                                     dtype=torch.int64))
        for tensor in tensors:
            self._broadcast(tensor.to(torch.int64))

    def close(self) -> None:
        """Tell the other ranks to stop following."""
        self._broadcast(torch.tensor([_CLOSE] + [-1] * (_HEADER - 1), dtype=torch.int64))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor.to(self.device), src=self.source, group=self.tp.group)


def follow(model: torch.nn.Module, kv_cache: KVCache, backend: str, tp: TensorParallel,
           device: torch.device) -> int:
    """Run every forward rank 0 sends with this rank's share of ``model`` and its
    ``kv_cache``, until rank 0 closes the channel; returns how many ran."""
    source = dist.get_global_rank(tp.group, 0)
    block_length = model.spec.block_length
    forwards = 0

    def receive(shape: list[int]) -> torch.Tensor:
        tensor = torch.empty([d for d in shape if d >= 0], dtype=torch.int64, device=device)
        dist.broadcast(tensor, src=source, group=tp.group)
        return tensor.cpu()

    with torch.inference_mode():
        while True:
            header = receive([_HEADER]).tolist()
            if header[0] == _CLOSE:
                return forwards
            dims = [header[_FLAGS + 2 * i: _FLAGS + 2 + 2 * i] for i in range(_TENSORS)]
            input_ids, positions, span_start, cache_positions, key_positions, key_valid, logits_index = map(
                receive, dims)
            layout = BatchLayout(span_start=span_start, cache_positions=cache_positions,
                                 key_cache_positions=key_positions, key_valid=key_valid.bool(),
                                 span_length=header[1] or None, keys_are_queries=bool(header[2]),
                                 cache_kept=bool(header[3]))
            kept = kept_tokens(logits_index, input_ids.numel(), model.spec.shift_logits)  # as rank 0's runner
            context = paged_context(backend, layout, kv_cache.k, kv_cache.v, block_length, kept)
            model(input_ids.to(device), positions.to(device), context, None if kept is None else kept.to(device))
            forwards += 1


def agreed_pool(size: PoolSize, tp: TensorParallel, device: torch.device) -> PoolSize:
    """``size`` with the fewest pages any rank's plan found room for (every rank calls it)."""
    if tp.size == 1:
        return size
    pages = torch.tensor([size.num_pages], dtype=torch.int64, device=device)
    dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=tp.group)
    return dataclasses.replace(size, num_pages=int(pages.item()))


def join_group(rank: int, size: int, address: str, device: torch.device,
               expert_size: int | None = None) -> TensorParallel:
    """Join the replica's ``size`` ranks as ``rank`` (rendezvous at ``address``, host:port,
    which rank 0 listens on): NCCL on CUDA, gloo elsewhere. ``expert_size``: the
    expert-parallel size (``TensorParallel``)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return TensorParallel(rank, size, dist.group.WORLD, expert_size)
