"""Which rows run each step: FDFO and the two baselines it is measured against.

* ``fdfo`` (default): the scheduler regains control after every step. Rows whose block
  is done commit and leave (finished) or move on to their next block at once, and
  waiting requests are admitted into the freed room.
* ``sync`` (SGLang before FDFO): the admitted batch runs until every row's current
  block is done; rows that finish early stay in the forward (computed, not advanced)
  until the round ends. Only then do rows move on and new requests join.
* ``static`` (Fast-dLLM / HF generate): like ``sync`` block by block, but new requests
  join only when every request of the batch has finished.
* ``fixed_fill`` (fixed-fill synchronized batching): like ``static``, but a new batch
  starts only when it can be filled (``max_batch`` requests wait) or when the oldest
  waiting request has waited the fill timeout. ``static`` is ``fixed_fill`` with a zero
  timeout.

Pages: admission reserves a request's worst case (prompt pages + max blocks); pages are
taken from the reservation one block at a time and all returned on release.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from replicas.batch import ScheduledBatch
from replicas.batching import Phase, SchedulerMode
from replicas.kv_cache import PagePool
from replicas.request import Request
from replicas.slots import SlotTable


_WAITING_FOR_ROUND = (Phase.BLOCK_DONE, Phase.FINISHED)


class Scheduler:
    def __init__(self, mode: SchedulerMode, pool: PagePool, slots: SlotTable, max_batch: int,
                 max_tokens_per_step: int, block_length: int, mask_id: int,
                 fill_timeout: Callable[[], float] = lambda: 0.0,
                 fdfo_hold: Callable[[int], float] = lambda rows: 0.0):
        self.mode = SchedulerMode(mode)
        self.batch_synchronous = self.mode in (SchedulerMode.STATIC, SchedulerMode.FIXED_FILL)
        self.fill_timeout = fill_timeout  # seconds; read when a fixed_fill batch could start
        self.fdfo_hold = fdfo_hold  # seconds an under-filled fdfo step may wait, given its rows
        self.hold_until: float | None = None  # when to look at the queue again (fill waits)
        self._held_since: float | None = None  # fdfo: the hold of the coming step began then
        self.pool = pool
        self.slots = slots
        self.max_batch = max_batch
        self.max_tokens_per_step = max_tokens_per_step
        self.block_length = block_length
        self.mask_id = mask_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admission_open = True

    # ---- queue ------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out wherever it is (abort or failure) and free what it holds."""
        if request.phase is Phase.WAITING:
            self.waiting.remove(request)
        else:
            self._release(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        self._end_round_if_due()
        if self._admission_open:
            self._admit()
        if not self.running or self._fdfo_holds():
            return None
        self._held_since = None
        return self._build_batch()

    def _fdfo_holds(self) -> bool:
        """fdfo with free rows and an empty queue: wait (once per step, bounded) for arrivals."""
        if self.mode is not SchedulerMode.FDFO or self.waiting or len(self.running) >= self.max_batch:
            return False
        now = time.monotonic()
        if self._held_since is None:
            self._held_since = now
        deadline = self._held_since + self.fdfo_hold(len(self.running))
        if now >= deadline:
            return False
        self.hold_until = deadline
        return True

    def _end_round_if_due(self) -> None:
        """Release finished rows and advance done rows where the mode allows it."""
        if self.mode is SchedulerMode.FDFO:
            round_over = True
        else:
            round_over = all(r.phase in _WAITING_FOR_ROUND for r in self.running)
        if round_over:
            for request in list(self.running):
                if request.phase is Phase.BLOCK_DONE:
                    request.block_index += 1
                    self._start_block(request)
                elif request.phase is Phase.FINISHED and not self.batch_synchronous:
                    self._release(request)
            if self.batch_synchronous and all(r.phase is Phase.FINISHED for r in self.running):
                for request in list(self.running):
                    self._release(request)
        self._admission_open = self.mode is SchedulerMode.FDFO or not self.running or (
            self.mode is SchedulerMode.SYNC and round_over
        )

    def _batch_may_start(self) -> bool:
        """fixed_fill: start when the batch can be filled or the oldest waited long enough."""
        self.hold_until = None
        if self.mode is not SchedulerMode.FIXED_FILL or self.running or len(self.waiting) >= self.max_batch:
            return True
        deadline = self.waiting[0].arrival_time + self.fill_timeout()
        if time.monotonic() >= deadline:
            return True
        self.hold_until = deadline
        return False

    def _admit(self) -> None:
        if not self.waiting or not self._batch_may_start():
            return
        while self.waiting and len(self.running) < self.max_batch and self.slots.num_free:
            request = self.waiting[0]
            prompt_pages = -(-len(request.prompt_ids) // self.block_length)
            if not self.pool.reserve(prompt_pages + request.max_blocks):
                break  # FIFO: the head waits for pages, nobody overtakes it
            self.waiting.popleft()
            request.prompt_pages = prompt_pages
            request.reserved_pages = request.max_blocks
            request.pages = [self.pool.take() for _ in range(prompt_pages)]
            request.slot = self.slots.acquire(request.prompt_ids, request.pages)
            request.phase = Phase.PREFILL
            self.running.append(request)

    def _start_block(self, request: Request) -> None:
        page = self.pool.take()
        request.reserved_pages -= 1
        request.pages.append(page)
        self.slots.start_block(request.slot, request.active_segment, page, self.mask_id)
        request.algorithm_state = request.algorithm.init_state(request.algorithm_params, request.block_index)
        request.block_steps = 0
        request.phase = Phase.DENOISE

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.release(request.pages, request.reserved_pages)
        self.slots.release(request.slot)
        request.pages, request.reserved_pages, request.slot = [], 0, -1

    def _build_batch(self) -> ScheduledBatch:
        size = self.block_length
        budget = self.max_tokens_per_step - size * sum(r.phase is not Phase.PREFILL for r in self.running)
        rows, row_slots = [], []
        unit_row, unit_segment, unit_count, unit_block, unit_scratch = [], [], [], [], []
        block_rows, stepped = [], []

        def add_unit(segment: int, count: int, is_block: bool, scratch: bool = False) -> None:
            unit_row.append(len(rows))
            unit_segment.append(segment)
            unit_count.append(count)
            unit_block.append(is_block)
            unit_scratch.append(scratch)

        for request in self.running:
            if request.phase is Phase.PREFILL:
                chunk = self._prefill_chunk(request, budget)
                if chunk == 0 and request.prompt_done < len(request.prompt_ids):
                    continue
                budget -= chunk
                first_page = request.prompt_done // size
                request.prompt_done += chunk
                last_page = -(-request.prompt_done // size)
                for page in range(first_page, last_page):
                    add_unit(page, min(size, request.prompt_done - page * size), False)
                if request.prompt_done == len(request.prompt_ids) and budget >= size:
                    budget -= size
                    self._start_block(request)  # prefill fused with the first block
                else:
                    if chunk:
                        rows.append(request)
                        row_slots.append(request.slot)
                    continue
            idle = request.phase is not Phase.DENOISE
            add_unit(request.active_segment, size, True, scratch=idle)
            block_rows.append(request)
            stepped.append(not idle)
            rows.append(request)
            row_slots.append(request.slot)

        def as_tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype)

        return ScheduledBatch(
            rows=rows,
            row_slots=as_tensor(row_slots),
            unit_row=as_tensor(unit_row),
            unit_segment=as_tensor(unit_segment),
            unit_count=as_tensor(unit_count),
            unit_is_block=as_tensor(unit_block, torch.bool),
            unit_scratch=as_tensor(unit_scratch, torch.bool),
            block_rows=block_rows,
            stepped=as_tensor(stepped, torch.bool),
        )

    def _prefill_chunk(self, request: Request, budget: int) -> int:
        """Prompt tokens to prefill this step: the rest if it fits, else whole pages."""
        remaining = len(request.prompt_ids) - request.prompt_done
        if remaining <= budget:
            return remaining
        return max(0, budget // self.block_length * self.block_length)
