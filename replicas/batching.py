"""The batching rules of every scheduler mode, as pure functions (no torch).

The engine's scheduler (``replicas.scheduler``) and the capacity simulator
(``loadgen.capacity.simulator``) both decide with these functions, so the simulator
makes the engine's batching decisions by construction.

* ``fdfo`` (default): the scheduler regains control after every step. Rows whose block
  is done commit and leave (finished) or move on to their next block at once, and
  waiting requests are admitted into the freed rows.
* ``sync`` (SGLang before FDFO): the admitted batch runs until every row's current
  block is done; rows that finish early stay in the forward (computed, not advanced)
  until the round ends. Only then do rows move on and new requests join.
* ``static`` (Fast-dLLM / HF generate): like ``sync`` block by block, but new requests
  join only when every request of the batch has finished.
* ``fixed_fill`` (fixed-fill synchronized batching): like ``static``, but a new batch
  starts only when it can be filled (``max_batch`` requests wait) or when the oldest
  waiting request has waited the fill timeout. ``static`` is ``fixed_fill`` with a zero
  timeout.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class SchedulerMode(str, enum.Enum):
    FDFO = "fdfo"
    SYNC = "sync"
    STATIC = "static"
    FIXED_FILL = "fixed_fill"


MODES = tuple(mode.value for mode in SchedulerMode)


class Phase(enum.Enum):
    """Where a request stands in a replica."""

    WAITING = "waiting"
    PREFILL = "prefill"  # prompt pages still being written (chunked prefill)
    DENOISE = "denoise"  # an active block is being denoised
    BLOCK_DONE = "block_done"  # block committed; waits for the round to end (sync/static)
    FINISHED = "finished"  # output complete; waits for the round to end to release


class RowAction(enum.Enum):
    """What a running row does when its round ends."""

    KEEP = "keep"
    ADVANCE = "advance"  # start the next block
    RELEASE = "release"  # leave the batch and free its row and pages


_WAITING_FOR_ROUND = (Phase.BLOCK_DONE, Phase.FINISHED)


def batch_synchronous(mode: SchedulerMode) -> bool:
    """Whether new requests join only once the whole batch has finished."""
    return mode in (SchedulerMode.STATIC, SchedulerMode.FIXED_FILL)


def end_of_round(mode: SchedulerMode, phases: Sequence[Phase]) -> list[RowAction] | None:
    """What each running row (given by its phase) does now, or None while the round goes
    on: fdfo ends a round after every step; the others when no row is still working."""
    if mode is not SchedulerMode.FDFO and any(p not in _WAITING_FOR_ROUND for p in phases):
        return None
    keep_finished = batch_synchronous(mode) and not all(p is Phase.FINISHED for p in phases)
    return [RowAction.ADVANCE if p is Phase.BLOCK_DONE
            else RowAction.RELEASE if p is Phase.FINISHED and not keep_finished
            else RowAction.KEEP for p in phases]


def admission_open(mode: SchedulerMode, running: int, round_over: bool) -> bool:
    """Whether waiting requests may join the batch now (rows and pages permitting)."""
    return mode is SchedulerMode.FDFO or running == 0 or (mode is SchedulerMode.SYNC and round_over)


def waits_to_fill(mode: SchedulerMode, running: int, waiting: int, max_batch: int) -> bool:
    """fixed_fill: a new batch that cannot be filled yet waits, until the oldest waiting
    request has waited the fill timeout."""
    return mode is SchedulerMode.FIXED_FILL and running == 0 and 0 < waiting < max_batch


def may_hold_for_arrivals(mode: SchedulerMode, waiting: int, rows: int, max_batch: int) -> bool:
    """fdfo with free rows and an empty queue may hold a step (for ``fill_timeout.fdfo_hold``
    seconds at most) so that arrivals join it."""
    return mode is SchedulerMode.FDFO and waiting == 0 and 0 < rows < max_batch
