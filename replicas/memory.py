"""How big a replica's KV pool is: sized from memory at start, as vLLM's
``gpu_memory_utilization`` sizes its cache.

The engine's weights are on the device when it is sized. Where a share of memory is the
budget (``memory_utilization``: by default on an accelerator), the largest step the engine
can feed runs once on a scratch cache (``profile_step``: its tokens, rows and key width,
random ids), what it needs beyond the weights is measured (its activations' peak), and the
pool gets what the budget leaves:

* CUDA: ``memory_utilization`` (default 0.9) of the device's memory, less what is in use
  after the weights and that step (this process's and any other's);
* a CPU: ``kv_cache_memory`` (default: a quarter of the memory available at start, at most
  ``CPU_DEFAULT_KV_BYTES``; no step is profiled), or with ``memory_utilization`` that share
  of the machine's memory less this process's resident set and the step's peak;
* ``kv_cache_memory`` given: that many bytes, on any device; ``num_pages``: exactly those.

The pool never takes more pages than ``max_batch`` requests of ``max_model_len`` need, plus
the scratch page. Where one request of ``max_model_len`` does not fit, a default
``max_model_len`` is cut to what does (logged); a configured one, or a pool of fewer than
``MIN_REQUEST_PAGES`` for one request, stops the replica with ``PoolSizingError``: one line
with the sizes and the setting to change.

Models that recompute a row's whole sequence in a step (bidirectional ones, or
``kv_cache: none``) can feed every held page's tokens at once: each of their pages beyond the
profiled step's also keeps room for its tokens' activations (the peak's growth per token,
measured between the step and one of half its tokens; the step's fixed part, its rows'
logits, is counted once).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from replicas.attention import BatchLayout, keys_per_group, paged_context
from replicas.kv_cache import KVCache
from replicas.models.spec import ModelSpec
from replicas.engine_config import EngineConfig, ServingShape

log = logging.getLogger(__name__)

GPU_DEFAULT_UTILIZATION = 0.9
CPU_DEFAULT_KV_BYTES = 4 << 30
CPU_DEFAULT_KV_SHARE = 0.25  # of the memory available at start
MIN_REQUEST_PAGES = 2  # a prompt page and one answer block
GiB, MiB = float(1 << 30), float(1 << 20)


class PoolSizingError(ValueError):
    """The replica cannot serve one request of its longest length in the memory it may use
    (one line: the sizes and the setting to change)."""


@dataclass(frozen=True)
class PoolSize:
    """What the memory decided: the pool's pages and the longest request they serve, with
    the figures behind them (bytes; None where not measured), for logs and reports."""

    num_pages: int
    max_model_len: int
    page_bytes: int
    budget: str  # where the pool's bytes came from, in words
    weights_bytes: int = 0
    step_peak_bytes: int | None = None
    cut_from: int | None = None  # the max_model_len that did not fit, where cut

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def summary(self) -> str:
        cut = f" (cut from {self.cut_from})" if self.cut_from else ""
        peak = "" if self.step_peak_bytes is None else f", largest step {self.step_peak_bytes / GiB:.2f} GiB"
        return (f"KV pool {self.num_pages} pages of {self.page_bytes / 1024:g} KiB = {self.pool_bytes / GiB:.2f} GiB "
                f"({self.budget}); weights {self.weights_bytes / GiB:.2f} GiB{peak}; max_model_len "
                f"{self.max_model_len}{cut}")


def page_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """One page's K and V over every layer."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * spec.block_length * dtype.itemsize


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


# ---- the host's and the device's memory -------------------------------------------------
def _proc_kib(path: str, field: str) -> int | None:
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """This process's resident set."""
    return _proc_kib("/proc/self/status", "VmRSS") or 0


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of the machine's memory."""
    total = _proc_kib("/proc/meminfo", "MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return _proc_kib("/proc/meminfo", "MemAvailable") or total, total


def measure_peak(device: torch.device, run: Callable[[], None]) -> int:
    """Bytes ``run`` needed beyond what was in use before it, at its peak: the CUDA
    allocator's peak, or on a CPU the resident set's high-water mark (reset first)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    try:
        with open("/proc/self/clear_refs", "w") as clear:  # resets VmHWM to the current RSS
            clear.write("5")
        reset = True
    except OSError:
        reset = False
    base = resident_bytes()
    run()
    high = _proc_kib("/proc/self/status", "VmHWM") if reset else None
    return max(0, (high or resident_bytes()) - base)


# ---- the largest step ---------------------------------------------------------------------
def largest_step(shape: ServingShape, max_batch: int, refreshes: bool, group_keys: int) -> tuple[int, int, int]:
    """(tokens, key width, keys beyond) of the profiled step: the scheduler's token budget,
    its units seeing as many keys together as one attention group gathers
    (``attention.span_groups``: at most ``group_keys``), so that the attention's peak is the
    one of any context length, without its cost; "keys beyond": what one unit of
    ``max_model_len`` keys gathers past ``group_keys`` (its own group), added by bytes.
    A refreshing model's steps can be larger (every row's whole sequence): ``plan_pool``
    scales those by page."""
    size = shape.block_length
    tokens = max(shape.token_budget, max_batch * size)
    if refreshes:  # no more than every row's whole sequence
        tokens = min(tokens, max_batch * shape.max_pages_per_request * size)
    tokens = tokens // size * size
    longest = shape.max_pages_per_request * size
    return tokens, min(longest, max(size, group_keys // (tokens // size))), max(0, longest - group_keys)


def profile_step(model: torch.nn.Module, spec: ModelSpec, tokens: int, rows: int, key_width: int,
                 backend: str, device: torch.device, dtype: torch.dtype) -> None:
    """One forward of ``tokens`` tokens in whole pages, every unit attending to
    ``key_width`` keys, with the logits of ``rows`` blocks: the shape of the engine's largest
    step, on a one-page scratch cache (every key reads it)."""
    size = spec.block_length
    units = tokens // size
    scratch = [torch.zeros(size, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
               for _ in range(spec.num_layers)]
    scratch_v = [torch.zeros_like(k) for k in scratch]
    layout = BatchLayout(
        span_start=torch.from_numpy(np.arange(units + 1, dtype=np.int64) * size),
        cache_positions=torch.from_numpy(np.arange(tokens, dtype=np.int64) % size),
        key_cache_positions=torch.zeros(units, key_width, dtype=torch.int64),
        key_valid=torch.ones(units, key_width, dtype=torch.bool))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (tokens,), generator=generator).to(device)
    positions = torch.from_numpy(np.arange(tokens, dtype=np.int64) % max(key_width, 1)).to(device)
    kept = torch.arange(min(rows * size, tokens))
    with torch.inference_mode():
        context = paged_context(backend, layout, scratch, scratch_v, size, kept)
        logits = model(ids, positions, context, kept.to(device))
        logits.float().max()  # as the step reads them: in float32


# ---- the plan -------------------------------------------------------------------------------
def settled_pool(config: EngineConfig, spec: ModelSpec, wanted: ServingShape, dtype: torch.dtype,
                 weights: int = 0) -> PoolSize | None:
    """The pool where the settings fix it without measuring (``num_pages`` or
    ``kv_cache_memory`` given), else None; raises PoolSizingError where it cannot hold one
    request. ``up`` asks this before any process starts; ``plan_pool`` first of all."""
    per_page = page_bytes(spec, dtype)
    if config.num_pages is not None:
        size = PoolSize(config.num_pages, wanted.max_model_len, per_page, "replica.num_pages", weights)
    elif config.kv_cache_memory is not None:
        pages = min(wanted.num_pages, int(config.kv_cache_memory) // per_page)
        size = PoolSize(pages, wanted.max_model_len, per_page,
                        f"replica.kv_cache_memory {config.kv_cache_memory / GiB:.2f} GiB", weights)
    else:
        return None
    return _fit(config, spec, wanted, size)


def plan_pool(model: torch.nn.Module, config: EngineConfig, spec: ModelSpec, wanted: ServingShape,
              backend: str, refreshes: bool) -> PoolSize:
    """The pool's pages and the longest request for ``model`` (on its device, in its dtype)
    under ``config``; ``wanted``: the shape the settings alone give (its ``num_pages``: what
    ``max_batch`` requests of ``max_model_len`` need). Raises PoolSizingError."""
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    per_page = page_bytes(spec, dtype)
    weights = model_bytes(model)
    settled = settled_pool(config, spec, wanted, dtype, weights)
    if settled is not None:
        return settled
    utilization = config.memory_utilization
    if utilization is None and device.type == "cuda":
        utilization = GPU_DEFAULT_UTILIZATION
    if utilization is None:
        available, _ = host_memory()
        pages = min(wanted.num_pages, int(min(CPU_DEFAULT_KV_BYTES, CPU_DEFAULT_KV_SHARE * available)) // per_page)
        return _fit(config, spec, wanted, PoolSize(
            pages, wanted.max_model_len, per_page,
            f"a CPU's default: {CPU_DEFAULT_KV_SHARE:g} of the {available / GiB:.1f} GiB available, at most "
            f"{CPU_DEFAULT_KV_BYTES / GiB:g} GiB", weights))
    group_keys = keys_per_group(spec.num_kv_heads, spec.head_dim, dtype, device)
    tokens, key_width, keys_beyond = largest_step(wanted, config.max_batch, refreshes, group_keys)

    def peak_at(count: int) -> int:
        return measure_peak(device, lambda: profile_step(model, spec, count, config.max_batch, key_width, backend,
                                                         device, dtype))

    try:
        peak = peak_at(tokens)
        # a refresh's peak grows with its tokens beyond the step's fixed part (its rows' logits):
        # the slope between this step and one of half its tokens
        half = tokens // 2 // spec.block_length * spec.block_length
        per_token = max(0.0, (peak - peak_at(half)) / (tokens - half)) if refreshes and half else 0.0
        peak += keys_beyond * 2 * spec.num_kv_heads * spec.head_dim * dtype.itemsize
    except torch.OutOfMemoryError:
        raise PoolSizingError(
            f"the largest step ({tokens} tokens of {config.max_batch} rows, keys up to {key_width}) does not fit "
            f"beside the weights ({weights / GiB:.2f} GiB) on {device}: lower replica.max_tokens_per_step, "
            f"replica.max_batch or replica.max_model_len") from None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        used, where = total - free, f"{device} of {total / GiB:.1f} GiB"
    else:
        _, total = host_memory()
        # (after the profiled steps: the memory they freed, which the heap keeps for the
        # forwards to come, is counted beside their peak, a margin of up to one step)
        used, where = resident_bytes(), f"this machine's {total / GiB:.1f} GiB"
    budget_bytes = int(utilization * total)
    left = budget_bytes - used
    pages = int((left - peak) // per_page)
    if refreshes and pages * spec.block_length > tokens:
        # each page beyond the profiled step's keeps room for its tokens in a step that refreshes them all
        pages = int((left - peak + per_token * tokens) // (per_page + per_token * spec.block_length))
    budget = (f"memory_utilization {utilization:g} of {where} = {budget_bytes / GiB:.2f} GiB, "
              f"{used / GiB:.2f} GiB in use after the weights")
    return _fit(config, spec, wanted, PoolSize(max(0, min(wanted.num_pages, pages)), wanted.max_model_len, per_page,
                                               budget, weights, peak))


def _fit(config: EngineConfig, spec: ModelSpec, wanted: ServingShape, size: PoolSize) -> PoolSize:
    """``size`` with ``max_model_len`` cut to what its pages hold for one request (a default
    one), or PoolSizingError (a configured one, or less than ``MIN_REQUEST_PAGES``)."""
    block = spec.block_length
    holds = size.num_pages - 1  # the scratch page serves no request
    if holds >= wanted.max_pages_per_request:
        return size
    settings = "replica.memory_utilization or replica.kv_cache_memory"
    if config.num_pages is not None:
        settings = "replica.num_pages"
    need = wanted.max_pages_per_request * size.page_bytes
    problem = (f"the KV pool holds {max(holds, 0)} pages of {size.page_bytes / 1024:g} KiB "
               f"({max(holds, 0) * size.page_bytes / MiB:.1f} MiB; {size.budget}; weights {size.weights_bytes / GiB:.2f} "
               f"GiB" + ("" if size.step_peak_bytes is None else f", largest step {size.step_peak_bytes / GiB:.2f} GiB")
               + ")")
    if config.max_model_len is not None or holds < MIN_REQUEST_PAGES:
        raise PoolSizingError(
            f"{problem}: not enough for one request of max_model_len {wanted.max_model_len} "
            f"({wanted.max_pages_per_request} pages, {need / MiB:.1f} MiB); raise {settings}, or lower "
            f"replica.max_model_len" + ("" if config.num_pages is not None else
                                        " or replica.max_batch (a smaller step leaves more for the pool)"))
    cut = holds * block
    log.warning("max_model_len cut from %d to %d: %s, not enough for one request of %d positions; raise %s or set "
                "replica.max_model_len", wanted.max_model_len, cut, problem, wanted.max_model_len, settings)
    return PoolSize(size.num_pages, cut, size.page_bytes, size.budget, size.weights_bytes, size.step_peak_bytes,
                    cut_from=wanted.max_model_len)


def allocate_pool(spec: ModelSpec, size: PoolSize, dtype: torch.dtype, device: torch.device) -> KVCache:
    """The pool's tensors; PoolSizingError where the device cannot hold them (an explicit
    size beyond its free memory, or memory taken since the plan)."""
    try:
        return KVCache(spec.num_layers, size.num_pages, spec.block_length, spec.num_kv_heads, spec.head_dim,
                       dtype, device)
    except torch.OutOfMemoryError:
        raise PoolSizingError(f"{size.summary()}: the pool does not fit in {device}'s free memory; lower "
                              f"replica.kv_cache_memory, replica.num_pages or replica.memory_utilization") from None
