"""How long a closed batch takes under a scheduler mode with zero host overhead: the
ideal that ``dllm-serve bench engine`` measures the engine against.

Every request is there from the start with its prompt length and its measured steps per
block; the batching rules are the engine's own (``replicas.batching``), and a forward
costs ``c0 + c1 * tokens`` seconds, nothing else taking time. A forward's tokens are the
engine's: a block of every row in it (idle rows of the sync and static baselines
included), the prompt of each request starting in it (chunked prefill is not modelled),
and a block for each fused commit write (``EngineConfig.fused_commit``: a block committed
at the step that filled it is written by the row's next forward, as one more block
unless the row is idle then and its idle block is the write).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from replicas.batching import Phase, RowAction, SchedulerMode, batching_policy


@dataclass(frozen=True)
class ClosedRequest:
    prompt_tokens: int
    block_steps: Sequence[int]  # forwards each of its blocks took


@dataclass
class _Row:
    request: ClosedRequest
    block: int = 0
    left: int = 0  # steps left in the active block
    phase: Phase = Phase.DENOISE
    prompt_due: bool = True  # its prompt is computed with its first step
    unwritten: bool = False  # a committed block whose KV the next forward writes

    def __post_init__(self):
        self.left = self.request.block_steps[0]


def closed_batch_seconds(mode: SchedulerMode | str, max_batch: int, requests: Sequence[ClosedRequest],
                         block_length: int, c0: float, c1: float) -> float:
    """Seconds until the last of ``requests`` is done (all fused commits)."""
    policy = batching_policy(mode)
    if any(not r.block_steps or min(r.block_steps) < 1 for r in requests):
        raise ValueError("every request has a block, and every block takes at least one step")
    waiting = deque(requests)
    running: list[_Row] = []
    seconds = 0.0
    while waiting or running:
        actions = policy.end_of_round([row.phase for row in running])
        for row, action in zip(list(running), actions or []):
            if action is RowAction.ADVANCE:
                row.block += 1
                row.left, row.phase = row.request.block_steps[row.block], Phase.DENOISE
            elif action is RowAction.RELEASE:
                running.remove(row)
        if waiting and policy.admits(len(running), actions is not None):
            while waiting and len(running) < max_batch:
                running.append(_Row(waiting.popleft()))
        if not running:
            continue
        tokens = 0
        for row in running:
            tokens += block_length
            if row.prompt_due:
                tokens += row.request.prompt_tokens
                row.prompt_due = False
            if row.unwritten and row.phase is Phase.DENOISE:
                tokens += block_length
            row.unwritten = False
        seconds += c0 + c1 * tokens
        for row in running:
            if row.phase is Phase.DENOISE:
                row.left -= 1
                if row.left == 0:
                    last = row.block == len(row.request.block_steps) - 1
                    row.phase = Phase.FINISHED if last else Phase.BLOCK_DONE
                    row.unwritten = not last
    return seconds
