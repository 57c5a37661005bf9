"""Turns a ScheduledBatch (tensors only; the runner never sees a request) into model
inputs and runs the forward.

KV policy by attention kind (``ModelSpec.attention``) and ``kv_cache`` mode:

* block-causal, ``prefix`` (default): the scheduler's units as they are; committed pages
  are never recomputed, and the cache is exact.
* bidirectional, ``prefix`` (Fast-dLLM prefix cache without the masked suffix): the first
  step of a block *refreshes* the row: every page of its prompt and committed blocks is
  recomputed together with the block, all of them attending to all of them, and their KV
  is written to the pages. The block's later steps feed only the block, which attends to
  those cached pages and itself. The approximation: during a block's later steps the
  prefix KV is the one computed when the block was all masks. The prompt chunks the
  scheduler prefills are dropped (the first block step recomputes them anyway).
* ``none``: every step refreshes the row (exact for both kinds, and slow).

Canvas (``canvas``, bidirectional models only):

* ``block``: future masked blocks are not part of the sequence; a block sees the prompt,
  the committed blocks and itself, so a request's work grows with its progress.
* ``full``: the reference semantics of LLaDA's ``generate`` and Dream's
  ``diffusion_generate``: the row holds the masks of all its blocks from the start
  (``RowTable.last_page``) and every position attends to all of them. A refresh
  recomputes the whole canvas; with ``prefix`` the block's later steps attend to the KV
  of the prefix *and* of the masked suffix computed at that refresh (Fast-dLLM's dual
  cache); with ``none`` every step is the reference forward.

Shifted models (Dream): the logit of a block's first token is the output at the token
before the block, which is fed only when the row refreshes; it is kept per row and
reused for the block's later (cached) steps.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from replicas.attention import BatchLayout, kept_tokens, paged_context, resolve_backend
from replicas.devices import to_device
from replicas.step import ScheduledBatch
from replicas.kv_cache import KVCache, PagePool
from replicas.rows import RowTable

KV_CACHE_MODES = ("prefix", "none")
CANVASES = ("block", "full")


def refreshes_rows(spec, kv_cache_mode: str) -> bool:
    """Whether a step may recompute a row's whole sequence (its first block step, or every
    step without a cache): bidirectional and shifted models, or ``kv_cache: none``."""
    return kv_cache_mode == "none" or spec.bidirectional or spec.shift_logits


class ForwardTimer:
    """A forward's seconds, read after the step has read its results back: timed by CUDA
    events on a GPU (so timing adds no wait of its own to the step), by the wall clock
    elsewhere. Made without a device: no forward ran (0 s)."""

    def __init__(self, device: torch.device | None = None):
        self._events = None
        if device is not None and device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._start = None if device is None else time.perf_counter()
        self._seconds = 0.0

    def stop(self) -> ForwardTimer:
        if self._events is not None:
            self._events[1].record()
        elif self._start is not None:
            self._seconds = time.perf_counter() - self._start
        return self

    def seconds(self) -> float:
        if self._events is None:
            return self._seconds
        self._events[1].synchronize()  # complete already once the step has read its results
        return self._events[0].elapsed_time(self._events[1]) / 1000


class ModelRunner:
    def __init__(self, model: nn.Module, rows: RowTable, kv_cache: KVCache, device: torch.device,
                 kv_cache_mode: str = "prefix", attention_backend: str = "auto", canvas: str = "block"):
        if kv_cache_mode not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache {kv_cache_mode!r}; choose one of {list(KV_CACHE_MODES)}")
        spec = model.spec
        if canvas not in CANVASES:
            raise ValueError(f"canvas {canvas!r}; choose one of {list(CANVASES)}")
        self.full_canvas = canvas == "full"
        self.model = model
        self.rows = rows
        self.kv_cache = kv_cache
        self.device = device
        self.block_length = spec.block_length
        self.bidirectional = spec.bidirectional
        self.shift_logits = spec.shift_logits
        self.contiguous_positions = spec.contiguous_positions
        self.whole_prompt = spec.whole_prompt
        self.refresh_every_step = kv_cache_mode == "none"
        self.refreshes = refreshes_rows(spec, kv_cache_mode)
        self.backend = resolve_backend(attention_backend, device, kv_cache.k[0].dtype)
        self._offsets = np.arange(self.block_length)
        # page x page size + offset for every pool page (its cache positions) and every page index
        # of a row (its tokens' positions): a step's are one gather from these
        pages = max(kv_cache.k[0].shape[0] // self.block_length, rows.max_pages)
        self._page_positions = np.arange(pages)[:, None] * self.block_length + self._offsets
        self._first_logits: torch.Tensor | None = None  # [rows, V]: shifted models' first logit
        self.broadcast = None  # a tensor-parallel rank 0's channel to the other ranks (``replicas.tensor_parallel``)
        self.adapters = None  # the model's ``AdapterBank`` where unmerged adapters are served

    def _refreshed(self, batch: ScheduledBatch) -> np.ndarray | None:
        """[R] bool over block units: recompute the row's whole sequence this step (a
        stepped block's first step, or every step without a cache); None where no row ever
        refreshes (nothing reads it then, and making an array of zeros after a forward cost
        ~18 us on a CPU host)."""
        if not self.refreshes:
            return None
        return batch.advances & (self.refresh_every_step or batch.steps_in_block == 0)

    def _units(self, batch: ScheduledBatch, refreshed: np.ndarray | None):
        """The units to compute: the scheduler's, with refreshed rows expanded to every page
        up to their block (their last block with the full canvas), and prompt chunks
        dropped where refreshes recompute them."""
        page_index, count, is_block, scratch = (batch.unit_page_index, batch.unit_count,
                                                batch.unit_is_block, batch.unit_scratch)
        if not self.refreshes:
            return batch.unit_row, page_index, count, is_block, scratch
        unit_refresh = np.zeros_like(is_block)
        unit_refresh[is_block] = refreshed
        keep = is_block if (self.bidirectional or self.refresh_every_step) else np.ones_like(is_block)
        source = np.flatnonzero(keep)
        reach = self.rows.last_page[batch.unit_row] if self.full_canvas else page_index
        width = np.where(unit_refresh[source], reach[source] + 1, 1)
        source = np.repeat(source, width)
        starts = np.cumsum(width) - width
        within = np.arange(source.size) - np.repeat(starts, width)
        new_page_index = np.where(unit_refresh[source], within, page_index[source])
        own = new_page_index == page_index[source]
        row = batch.unit_row[source]
        page_count = np.where(new_page_index == self.rows.prompt_pages[row] - 1,
                              self.rows.prompt_tail[row], self.block_length)
        if self.full_canvas:  # an infill's suffix may end inside its last page
            page_count = np.where(new_page_index == self.rows.last_page[row], self.rows.last_tail[row], page_count)
        new_count = np.where(own, count[source], page_count)
        return row, new_page_index, new_count, is_block[source] & own, scratch[source] & own

    def build_inputs(self, batch: ScheduledBatch, refreshed: np.ndarray | None):
        """Packed input ids, positions, attention layout and the logits' token indices
        (``[R, L]``; for shifted models the token before each position), as host tensors.
        Computed with numpy (a small op costs a few times less than torch's on the host)."""
        size, rows, offsets = self.block_length, self.rows, self._offsets
        unit_row, page_index, unit_count, unit_is_block, unit_scratch = self._units(batch, refreshed)
        flat_page = unit_row * rows.max_pages + page_index
        unit_start = np.empty(unit_count.size + 1, dtype=np.int64)
        unit_start[0] = 0
        unit_count.cumsum(out=unit_start[1:])
        # whole pages only (denoise steps): no token to drop. (Told by the total, as no unit
        # has more than a page, and the key pages below by a Python max: no numpy reduction
        # runs between forwards, see ``Engine._step``.)
        whole = unit_start[-1] == size * unit_count.size
        valid = None if whole else offsets < unit_count[:, None]  # [U, L]

        def packed(per_unit: np.ndarray) -> np.ndarray:  # [U, L] -> the [T] fed tokens'
            return per_unit.reshape(-1) if whole else per_unit[valid]

        input_ids = packed(rows.tokens.reshape(-1, size)[flat_page])
        prompt_pages = rows.prompt_pages[unit_row]
        prompt_tail = rows.prompt_tail[unit_row]
        positions = self._page_positions[page_index]
        if self.contiguous_positions:  # no gap between the prompt's last token and the blocks
            positions = positions - ((page_index >= prompt_pages) * (size - prompt_tail))[:, None]
        positions = packed(positions)
        page = np.where(unit_scratch, PagePool.SCRATCH_PAGE, rows.page_table.reshape(-1)[flat_page])
        cache_positions = packed(self._page_positions[page])

        if self.full_canvas:  # every page of the row's canvas
            sees = rows.last_page[unit_row]
        elif self.bidirectional:  # every page of the row up to its active block
            top = np.zeros(rows.num_rows, dtype=np.int64)
            np.maximum.at(top, unit_row, page_index)
            sees = top[unit_row]
        elif self.whole_prompt:  # block-causal, the prompt's pages one block (written in one forward)
            sees = np.maximum(page_index, prompt_pages - 1, where=page_index < prompt_pages, out=page_index.copy())
        else:
            sees = page_index
        span_start, span_length, span_row, keys_are_queries = unit_start, None, unit_row, False
        # some row of a bidirectional model has several units: they may attend as one span
        # (a block-causal row's units each see up to their own page)
        if self.bidirectional and unit_row.size > batch.num_rows:
            spans = self._spans(unit_row, sees, unit_start)
            if spans is not None:
                first, span_start, span_length = spans
                span_row, sees, prompt_pages, prompt_tail = (unit_row[first], sees[first], prompt_pages[first],
                                                             prompt_tail[first])
        key_pages = max(sees.tolist()) + 1
        table = rows.page_table[span_row, :key_pages]
        key_cache_positions = self._page_positions[table].reshape(-1, key_pages * size)
        # [A, pages, L] from page-level [A, pages, 1] and offset-level [A, 1, L] conditions
        key_page = np.arange(key_pages)
        key_valid = (key_page <= sees[:, None])[:, :, None] & (
            (key_page != prompt_pages[:, None] - 1)[:, :, None] | (offsets < prompt_tail[:, None])[:, None, :])
        if self.full_canvas:
            key_valid &= (key_page != sees[:, None])[:, :, None] | (offsets < rows.last_tail[span_row][:, None])[:, None, :]
        key_valid = key_valid.reshape(-1, key_pages * size)
        if span_length is not None:  # every span's valid keys its own tokens (a subset of them, as many),
            # none of them written to the scratch page instead of its own
            keys_are_queries = bool((key_valid.sum(1) == span_start[1:] - span_start[:-1]).all()
                                    and not unit_scratch.any())

        logits_index = unit_start[:-1][unit_is_block][:, None] + offsets  # [R, L]
        if self.shift_logits:  # position i reads the output at i - 1; the first, the token before
            logits_index = logits_index - 1
            logits_index[~refreshed, 0] = 0  # not fed this step: replaced by the kept logit
        if self.adapters is not None:
            self.adapters.begin(np.repeat(unit_row, unit_count), logits_index.reshape(-1), rows.adapters, self.device)
        tensor = torch.from_numpy
        layout = BatchLayout(span_start=tensor(span_start), cache_positions=tensor(cache_positions),
                             key_cache_positions=tensor(key_cache_positions), key_valid=tensor(key_valid),
                             span_length=span_length, keys_are_queries=keys_are_queries,
                             cache_kept=not self.refresh_every_step)
        return tensor(input_ids), tensor(positions), layout, tensor(logits_index)

    def _spans(self, unit_row: np.ndarray, sees: np.ndarray,
               unit_start: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The attention spans (``attention.BatchLayout``): the first unit of each, their
        token starts and the longest's tokens; None: one span per unit.

        A row's consecutive units that see the same pages (every unit of a refreshed
        bidirectional row) attend as one span, so their keys are gathered once instead of
        once per unit (at batch 1 without a cache, a 192-token LLaDA canvas gathered its
        keys 6 times a layer), or not at all where they are the span's own tokens
        (``BatchLayout.keys_are_queries``). Torch SDPA pads each span's queries to the
        longest span's, so there units join only where that pads no more queries than one
        span a unit does (rows alike, as at batch 1 or every row refreshing); flash's
        varlen attention pads nothing, so there they always join."""
        first = np.ones(unit_row.size, dtype=bool)
        first[1:] = (unit_row[1:] != unit_row[:-1]) | (sees[1:] != sees[:-1])
        first = np.flatnonzero(first)
        if first.size == unit_row.size:
            return None
        span_start = np.append(unit_start[first], unit_start[-1])
        longest = max((span_start[1:] - span_start[:-1]).tolist())
        if self.backend != "flash" and first.size * longest > unit_row.size * self.block_length:
            return None
        return first, span_start, longest

    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, ForwardTimer]:
        """Logits ``[R, L, V]`` of the batch's block units (on the model's device: the
        algorithms step there), and the forward's timer (read it once the step has read
        its results). Call it under ``torch.inference_mode()``, as ``Engine.step`` does (a
        nested one here cost ~15 us a step on a CPU host)."""
        refreshed = self._refreshed(batch)
        if self.refreshes and (self.bidirectional or self.refresh_every_step) and not batch.unit_is_block.any():
            # prompt chunks only, which the first block step recomputes: nothing to run
            return torch.empty(0, self.block_length, self.model.spec.vocab_size), ForwardTimer()
        input_ids, positions, layout, logits_index = self.build_inputs(batch, refreshed)
        if self.broadcast is not None:
            self.broadcast.send(input_ids, positions, layout, logits_index)
        timer = ForwardTimer(self.device)
        kept = kept_tokens(logits_index, input_ids.numel(), self.shift_logits)
        context = paged_context(self.backend, layout, self.kv_cache.k, self.kv_cache.v, self.block_length, kept)
        try:
            logits = self.model(to_device(input_ids, self.device), to_device(positions, self.device), context,
                                None if kept is None else to_device(kept, self.device))
        finally:
            if self.adapters is not None:
                self.adapters.end()
        logits = logits.view(-1, self.block_length, logits.shape[-1])
        if self.shift_logits:
            logits = self._keep_first_logits(logits, batch, refreshed)
        return logits.float(), timer.stop()

    def _keep_first_logits(self, logits: torch.Tensor, batch: ScheduledBatch, refreshed: np.ndarray) -> torch.Tensor:
        """Store refreshed rows' first-position logits per row; reuse them for the others."""
        if self._first_logits is None:
            self._first_logits = logits.new_zeros(self.rows.num_rows, logits.shape[-1])
        block_rows = to_device(torch.from_numpy(batch.block_rows), logits.device)
        refreshed = to_device(torch.from_numpy(refreshed), logits.device)
        self._first_logits[block_rows[refreshed]] = logits[refreshed, 0]
        logits[~refreshed, 0] = self._first_logits[block_rows[~refreshed]]
        return logits
