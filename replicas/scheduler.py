"""Which rows run each step, and the one owner of request state.

The batching rule is a policy object (``replicas.batching``: fdfo, or a research
baseline); the scheduler applies it to live requests, rows and pages. Request state
changes only here: ``schedule()`` ends rounds, admits requests and returns the step
(``replicas.step.ScheduledStep``); ``update_from_output()`` applies what executing it
computed (steps taken, log-probabilities, blocks done and committed into the outputs,
requests finished) and returns the commits to stream; ``finish()`` ends a request early
(abort, deadline, failure) and frees what it holds.

Pages: admission reserves a request's worst case (prompt pages + max blocks); pages are
taken from the reservation one block at a time and all returned on release. With a
prefix cache (``PagePool.cache``) a request starts with the cached pages of its prefix
(held, never taken from its reservation) and prefills from the first page not cached;
the prefix pages it computes, and its committed blocks, are cached once a step has
written their final KV (a chat's next turn finds its history where blocks are aligned).
With the full canvas (``full_canvas``) every block's page is taken and masked at
admission, since every position attends to all of them from the first step. A
continuation (``SamplingParams.resume_ids``) takes its resumed blocks' pages at admission
and prefills them after its prompt. A request whose blocks are aligned to the sequence's
start (``Request.aligned``) prefills the whole pages of prompt + resumed output, and its
first block starts with the rest (``Request.head``).

Pipelined decoding (``DllmAlgorithm.pipelined``: D2F): a row also steps the blocks decoded
ahead of its active one (``Request.ahead``, each a block unit of the row's forward, its page
taken from the reservation as it joins; ``replicas.block_pipeline`` says when one joins and
which are complete); an ahead block becomes the active block when the one before it
commits, so commits, streaming and the prefix cache stay in block order.

Every wait (fixed_fill's fill timeout, fdfo's hold for arrivals) is decided on ``clock``,
so a test can run the scheduler on virtual time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np

from replicas import block_pipeline
from replicas.batching import Phase, RowAction, SchedulerMode, batching_policy
from replicas.kv_cache import PageAllocation, PagePool
from replicas.prefix_cache import CachedRun
from replicas.commits import BlockCommit, OutputProcessor
from replicas.request import AheadBlock, FinishReason, Request
from replicas.rows import RowTable
from replicas.step import ScheduledBatch, ScheduledStep, StepOutput


class Scheduler:
    def __init__(self, mode: SchedulerMode, pool: PagePool, rows: RowTable, outputs: OutputProcessor,
                 max_batch: int, max_tokens_per_step: int, block_length: int, mask_id: int,
                 fill_timeout: Callable[[], float] = lambda: 0.0,
                 fdfo_hold: Callable[[int], float] = lambda rows: 0.0,
                 clock: Callable[[], float] = time.monotonic, full_canvas: bool = False, whole_prompt: bool = False):
        self.policy = batching_policy(mode)
        self.full_canvas = full_canvas
        self.whole_prompt = whole_prompt  # the prompt's pages see each other: prefilled in one forward
        self.fill_timeout = fill_timeout  # seconds; read when a fixed_fill batch could start
        self.fdfo_hold = fdfo_hold  # seconds an under-filled fdfo step may wait, given its rows
        self.clock = clock
        self.hold_until: float | None = None  # when to look at the queue again (after a None schedule)
        self._held_since: float | None = None  # fdfo: the hold of the coming step began then
        self.pool = pool
        self.rows = rows
        self.outputs = outputs  # computes what a done block commits
        self.max_batch = max_batch
        self.max_tokens_per_step = max_tokens_per_step
        self.block_length = block_length
        self.mask_id = mask_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cache = pool.cache
        self._block_starts: list[tuple[int, int, int, int]] = []  # (row, page index, page, kept tokens)

    # ---- queue ------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason) -> bool:
        """End a request where it is (abort, deadline, failure): record ``reason`` unless it
        had ended already, and free what it holds. Returns whether it ends now."""
        ends_now, status = request.finish_reason is None, request.status
        if ends_now:
            request.finish_reason = reason
        if status is Phase.WAITING:
            self.waiting.remove(request)
        elif request.row >= 0:
            self._release(request)
        return ends_now

    def end_at_deadline(self, request: Request) -> str:
        """End ``request`` at its deadline with what it committed (finish reason
        ``timeout``); returns the text its detokenizer held back, final now."""
        flushed = self.outputs.commit_block(request, [], ends=FinishReason.TIMEOUT)
        self.finish(request, FinishReason.TIMEOUT)
        return flushed.text

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        """The next step, or None (nothing runnable, or waiting until ``hold_until``)."""
        self.hold_until = None
        try:
            round_over = self._end_round()
            if self.waiting and self.policy.admits(len(self.running), round_over):
                self._admit()
            if not self.running or self._fdfo_holds():
                return None
            self._held_since = None
            return self._build_step()
        finally:
            self._write_block_starts()

    def update_from_output(self, step: ScheduledStep, output: StepOutput) -> list[tuple[Request, BlockCommit]]:
        """Apply what executing ``step`` computed: cache the pages whose final KV it wrote,
        count each stepped block's step, keep its algorithm's next state, record its
        log-probabilities, and commit the done
        blocks into their requests' outputs (ending those that end). A block fed with masks
        (``kv_stale``) has its final KV written by the row's next forward (a fused commit,
        see ``_build_step``). A request that ended since it was scheduled (its algorithm
        failed) is skipped. Returns each commit with its request, in block order, for the
        caller to stream."""
        if self.cache is not None:
            for request, first, end, ids in step.written:
                if request.row >= 0:  # not ended in the step (its algorithm failed): it has its pages
                    self._cache_pages(request, first, end, ids)
        committed = []
        logprobs, states = output.logprobs, output.algorithm_states
        for i, (request, ids, done, stale) in enumerate(zip(step.stepped, output.block_ids, output.done,
                                                            output.kv_stale)):
            if isinstance(request, AheadBlock):  # commits once it is the active block (``_start_block``)
                if request.owner.finish_reason is None:
                    request.steps += 1
                    if states is not None:
                        request.algorithm_state = states[i]
                continue
            if request.phase is not Phase.DENOISE or request.finish_reason is not None:
                continue
            request.steps_in_block += 1
            request.num_steps += 1
            if states is not None:
                request.algorithm_state = states[i]
            if logprobs is not None and logprobs[i]:
                for position, logprob in logprobs[i]:
                    request.block_logprobs[position] = logprob
            if not done:
                continue
            committed.append((request, self._commit(request, ids)))
            page = request.active_page_index
            request.phase = Phase.BLOCK_DONE  # its status: finished where the commit ended it
            if stale and request.finish_reason is None:
                request.unwritten_page, request.unwritten_ids = page, tuple(ids)
            if not stale and self.cache is not None:  # its KV is the final tokens' already
                self._cache_pages(request, page, page + 1, tuple(ids))
        return committed

    def _commit(self, request: Request, block_ids: list[int]) -> BlockCommit:
        """Commit the request's done block (``block_ids``: its whole page) into its output
        and record: its answer ids up to an end, their text and log-probabilities."""
        offset = request.answer_offset
        logprobs = None if request.block_logprobs is None else request.block_logprobs[offset:]
        commit = self.outputs.commit_block(request, block_ids[offset:], logprobs)
        request.output_ids.extend(commit.token_ids)
        if request.constraint is not None:
            request.constraint_state = request.constraint.walk(request.constraint_state, commit.token_ids)
            whole = request.constraint_state is not None and request.constraint.accepting[request.constraint_state]
            if commit.finish_reason is FinishReason.LENGTH and whole:
                commit.finish_reason = FinishReason.STOP  # the structure is whole at max_tokens: it ended, not cut
        request.committed_block_steps.append(request.steps_in_block)
        request.finish_reason = commit.finish_reason
        if request.block_logprobs is not None:  # the next block's
            request.block_logprobs = [None] * self.block_length
        return commit

    def _cache_pages(self, request: Request, first: int, end: int, block: tuple[int, ...] | None = None) -> None:
        """Cache the request's pages ``first`` to ``end`` (their final KV written: prompt
        pages, or ``block``, the ids of a committed one on page ``first``, where the answer
        continues the prompt), each under its page before; a request's chain stops at a gap
        or at a page cached already (by another request meanwhile: its copy stays its own).
        Unaligned after a partial page, an answer starts on a page of its own, which a later
        prompt never continues."""
        allocation = request.allocation
        if allocation.shared != first:  # a gap: a page before is not cached (another request's copy)
            return
        if first < request.prefix_pages:
            keys = request.prefix_keys[first:end]
        elif request.answer_continues_prompt:
            keys = (block,)
        else:
            return
        allocation.share(*self.cache.insert(allocation.cached, keys, allocation.pages[first:end], request.cache_tree))

    # ---- rounds and admission ----------------------------------------------------------
    def _end_round(self) -> bool:
        """Advance and release rows as the mode's end of round says; whether the round ended."""
        actions = self.policy.end_of_round([r.status for r in self.running])
        if actions is None:
            return False
        for request, action in zip(list(self.running), actions):
            if action is RowAction.ADVANCE:
                request.block_index += 1
                self._start_block(request)
            elif action is RowAction.RELEASE:
                self._release(request)
        return True

    def _fdfo_holds(self) -> bool:
        """Whether this step waits (once per step, bounded by ``fdfo_hold``) for arrivals."""
        if not self.policy.may_hold_for_arrivals(len(self.waiting), len(self.running), self.max_batch):
            return False
        now = self.clock()
        if self._held_since is None:
            self._held_since = now
        deadline = self._held_since + self.fdfo_hold(len(self.running))
        if now >= deadline:
            return False
        self.hold_until = deadline
        return True

    def _fill_wait_over(self) -> bool:
        """Whether a batch may start now: fixed_fill waits to fill it, for the fill timeout at most."""
        if not self.policy.waits_to_fill(len(self.running), len(self.waiting), self.max_batch):
            return True
        deadline = self.waiting[0].arrival_time + self.fill_timeout()
        if self.clock() >= deadline:
            return True
        self.hold_until = deadline
        return False

    def _admit(self) -> None:
        if not self._fill_wait_over():
            return
        while self.waiting and len(self.running) < self.max_batch and self.rows.num_free:
            request = self.waiting[0]
            cached, depth = self._cached_prefix(request)
            # FIFO: the head waits a few steps for the pages it would compute twice, where it
            # may join later in the round (fdfo; the baselines would keep it out of the round)
            if self.policy.admits(len(self.running), round_over=False) and self._being_prefilled(request, cached, depth):
                break
            # the prompt's pages now; its blocks' (and a suffix's) now on the full canvas, where
            # they are laid out at once, else promised, each taken as its block starts
            blocks = request.blocks_to_denoise + request.suffix_pages
            uncached = request.prefix_pages - depth
            allocation = self.pool.allocate(cached, uncached + blocks if self.full_canvas else uncached,
                                            0 if self.full_canvas else blocks)
            if allocation is None:
                break  # FIFO: the head waits for pages, nobody overtakes it
            self.waiting.popleft()
            request.cached_tokens = sum(request.prefix_page_tokens[:depth])
            if self.cache is not None:
                self.cache.count_lookup(request.prefix_pages, depth, request.cached_tokens)
            request.allocation = allocation
            request.block_index = request.first_block_index
            request.prefilled_pages = depth
            prefix, canvas = allocation.pages[:request.prefix_pages], allocation.pages[request.prefix_pages:]
            request.row = self.rows.acquire(request.prompt_ids, prefix, request.params.resume_ids, request.aligned,
                                              request.adapter)
            if self.full_canvas:
                self.rows.lay_canvas(request.row, request.prefix_pages, canvas, self.mask_id, request.params.suffix_ids)
            request.phase = Phase.PREFILL
            self.running.append(request)

    def _cached_prefix(self, request: Request) -> tuple[CachedRun | None, int]:
        """The deepest cached run of the request's first prefix pages, and how many pages
        that is (none without a cache)."""
        if self.cache is None:
            return None, 0
        return self.cache.match(request.prefix_keys, request.cache_tree)

    def _being_prefilled(self, request: Request, cached: CachedRun | None, depth: int) -> bool:
        """Whether a running request is prefilling the first page of ``request``'s prefix
        that is not cached (after its ``depth`` pages found cached, ending with the
        ``cached`` run): it caches that page once written, so ``request`` finds it then
        instead of computing it too (a burst of requests with one new system prompt
        prefills it once)."""
        if self.cache is None or depth >= request.prefix_pages:
            return False
        return any(other.phase is Phase.PREFILL and other.allocation.shared == depth < other.prefix_pages
                   and other.allocation.cached is cached and other.cache_tree == request.cache_tree
                   and other.prefix_keys[depth] == request.prefix_keys[depth]
                   for other in self.running)

    def _start_block(self, request: Request) -> None:
        if request.ahead:  # pipelined decoding: the block was decoded ahead, on its page already
            ahead = request.ahead.pop(0)
            request.algorithm_state, request.steps_in_block = ahead.algorithm_state, ahead.steps
            request.phase = Phase.DENOISE
            return
        if self.full_canvas:
            page = request.allocation.pages[request.active_page_index]  # laid out at admission
        else:
            page = self.pool.next_page(request.allocation)
        self._block_starts.append((request.row, request.active_page_index, page, request.answer_offset))
        request.algorithm_state = request.algorithm.init_state(request.algorithm_params, request.block_index)
        request.steps_in_block = 0
        request.phase = Phase.DENOISE

    def _pipeline(self, request: Request, budget: int) -> int:
        """Pipelined decoding, before the request's step: mark its blocks complete as the
        blocks before them are decoded far enough, and start one more block after its last
        where its rule says so (``block_pipeline.joins``) and ``budget`` has room for it.
        Returns the tokens the new block takes from ``budget`` (0: none started)."""
        states = block_pipeline.complete_flags(request, self.rows, self.mask_id)
        if states is not None:
            request.algorithm_state = states[0]
            for ahead, state in zip(request.ahead, states[1:]):
                ahead.algorithm_state = state
        if budget < self.block_length or not block_pipeline.joins(request, self.rows, self.mask_id,
                                                                   self.outputs.end_ids):
            return 0
        page_index = request.active_page_index + len(request.ahead) + 1
        self._block_starts.append((request.row, page_index, self.pool.next_page(request.allocation), 0))
        request.ahead.append(AheadBlock(request, page_index, block_pipeline.joining_state(request, self.rows,
                                                                                          self.mask_id)))
        return self.block_length

    def _write_block_starts(self) -> None:
        """Lay out the blocks this schedule started, in one write (before anything reads them)."""
        if self._block_starts:
            self.rows.start_blocks(*map(list, zip(*self._block_starts)), self.mask_id)
            self._block_starts = []

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.free(request.allocation)
        self.rows.release(request.row)
        request.allocation, request.row, request.ahead = PageAllocation(), -1, []

    # ---- the batch -------------------------------------------------------------------
    def _build_step(self) -> ScheduledStep:
        """Prompt chunks within the token budget, then every running row's active block.

        A block committed at the step that filled its last mask (a fused commit) has the
        KV of its masked input in the cache: the row's next forward also feeds the block's
        final tokens as a prefix unit, which writes its KV, and the row's new block, later
        in the same forward, attends to it. A row that waits for its round to end
        (sync, static) writes it with its idle unit instead of to the scratch page."""
        size = self.block_length
        budget = self.max_tokens_per_step - size * sum(
            (r.phase is not Phase.PREFILL) + (r.phase is Phase.DENOISE and r.unwritten_page is not None) + len(r.ahead)
            for r in self.running)
        unit_row, unit_page_index, unit_count, unit_is_block, unit_scratch = [], [], [], [], []
        advances, steps_in_block = [], []
        stepped_rows, stepped_pages = [], []
        scheduled, stepped, written = [], [], []
        prompt_pages = 0

        def add_unit(request: Request, page_index: int, count: int, is_block: bool, scratch: bool = False) -> None:
            unit_row.append(request.row)
            unit_page_index.append(page_index)
            unit_count.append(count)
            unit_is_block.append(is_block)
            unit_scratch.append(scratch)

        for request in self.running:
            if request.phase is Phase.PREFILL:
                first = request.prefilled_pages
                last = self._prefill_end(request, budget)
                for page_index, count in enumerate(request.prefix_page_tokens[first:last], first):
                    budget -= count
                    add_unit(request, page_index, count, False)
                request.prefilled_pages = last
                prompt_pages += last - first
                if last > first:
                    written.append((request, first, last, None))
                if last == request.prefix_pages and budget >= size:
                    budget -= size
                    self._start_block(request)  # prefill fused with the first block
                else:
                    if last > first:
                        scheduled.append(request)
                    continue
            idle = request.phase is not Phase.DENOISE  # a done block (its request finished or not)
            if request.unwritten_page is not None:  # written by a unit of its own, or by the idle block unit
                written.append((request, request.unwritten_page, request.unwritten_page + 1,
                                      request.unwritten_ids))
                if not idle:
                    add_unit(request, request.unwritten_page, size, False)
            block_page = request.active_page_index
            add_unit(request, block_page, size, True, scratch=idle and request.unwritten_page is None)
            request.unwritten_page, request.unwritten_ids = None, None
            advances.append(not idle)
            steps_in_block.append(request.steps_in_block)
            scheduled.append(request)
            if not idle:
                stepped.append(request)
                stepped_rows.append(request.row)
                stepped_pages.append(block_page)
                if request.algorithm.pipelined:
                    budget -= self._pipeline(request, budget)
                for ahead in request.ahead:  # stepped with the active block, each a block unit after it
                    add_unit(request, ahead.page_index, size, True)
                    advances.append(True)
                    steps_in_block.append(ahead.steps)
                    stepped.append(ahead)
                    stepped_rows.append(request.row)
                    stepped_pages.append(ahead.page_index)

        # three arrays made, their rows viewed (each array made costs more than its values)
        units = np.array([unit_row, unit_page_index, unit_count, unit_is_block, unit_scratch], dtype=np.int64)
        blocks = np.array([advances, steps_in_block], dtype=np.int64)
        batch = ScheduledBatch(
            num_rows=len(scheduled),
            unit_row=units[0],
            unit_page_index=units[1],
            unit_count=units[2],
            unit_is_block=units[3].astype(bool),
            unit_scratch=units[4].astype(bool),
            advances=blocks[0].astype(bool),
            steps_in_block=blocks[1],
            stepped_blocks=np.array([stepped_rows, stepped_pages], dtype=np.int64),
            num_tokens=sum(unit_count),
            prefix_units=len(unit_is_block) - sum(unit_is_block),
            prompt_pages=prompt_pages,
        )
        return ScheduledStep(batch, scheduled, stepped, written)

    def _prefill_end(self, request: Request, budget: int) -> int:
        """The page index the prefill reaches this step: whole pages, as many as fit ``budget``;
        where the prompt is one block (``whole_prompt``), all its pages at once, whatever the budget."""
        tokens, end = request.prefix_page_tokens, request.prefilled_pages
        if self.whole_prompt and end < request.prompt_pages:
            budget -= sum(tokens[end:request.prompt_pages])
            end = request.prompt_pages
        while end < len(tokens) and tokens[end] <= budget:
            budget -= tokens[end]
            end += 1
        return end
