"""The values one engine step passes along: schedule -> execute -> update.

``Scheduler.schedule`` returns a ``ScheduledStep`` (everything the step needs);
``StepExecutor.execute`` runs it and returns a ``StepOutput`` (what the forward and the
algorithms computed, read once from the device); ``Scheduler.update_from_output`` applies
that to the requests, the one place that changes their state, and returns the blocks
committed, which the engine streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from replicas.scheduled_batch import ScheduledBatch

if TYPE_CHECKING:
    from replicas.logprobs import TokenLogprob
    from replicas.output import BlockCommit
    from replicas.request import Request


@dataclass(slots=True)
class ScheduledStep:
    """One step as the scheduler decided it."""

    batch: ScheduledBatch  # the forward's units, host arrays only (the runner's input)
    requests: list[Request]  # the requests with a row in the forward
    stepped: list[Request]  # those whose active block the algorithms advance, in block-unit order
    # (request, first, end page index, a committed block's ids or None): pages whose final KV
    # this forward writes, cached once it has (``Scheduler.update_from_output``)
    written: list[tuple[Request, int, int, tuple[int, ...] | None]]


@dataclass(slots=True)
class StepOutput:
    """What executing a ``ScheduledStep`` computed, per stepped block (``stepped``'s order)."""

    block_ids: list[list[int]]  # the block's tokens after the step (its whole page)
    done: list[bool]  # the block is final: it commits
    kv_stale: list[bool]  # the forward fed it with masks: its final KV is still to write
    # the positions the step wrote and their log-probabilities, for the rows that asked (else None)
    logprobs: list[list[tuple[int, TokenLogprob]] | None]
    failed: list[tuple[Request, str]]  # rows whose algorithm failed, and why (their blocks not done)
    forward_s: float = 0.0
    forward_cpu_s: float = 0.0  # CPU time of the engine thread in the forward


@dataclass(slots=True)
class Committed:
    """A block the step committed to its request (``Scheduler.update_from_output``)."""

    request: Request
    commit: BlockCommit
