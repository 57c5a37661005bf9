"""The batching rules of every scheduler mode, as stateless policy objects (no torch).

The engine's scheduler (``replicas.scheduler``) and the capacity simulator
(``tools.capacity.simulator``) both decide with ``batching_policy(mode)``, so the
simulator makes the engine's batching decisions by construction. ``BatchingPolicy`` is
the production rule (fdfo); the other modes are research baselines that override it.

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


class BatchingPolicy:
    """``fdfo``, the production rule: a round ends after every step; rows whose block is
    done move on or leave at once and waiting requests take the freed rows. An under-filled
    step with an empty queue may hold for arrivals (``fill_timeout.fdfo_hold``).

    The research baselines override these methods (``SyncBaseline`` and its subclasses);
    the scheduler and the simulators only ever call them."""

    mode = SchedulerMode.FDFO

    def end_of_round(self, phases: Sequence[Phase]) -> list[RowAction] | None:
        """What each running row (given by its phase) does now, or None while the round goes on."""
        return [RowAction.ADVANCE if p is Phase.BLOCK_DONE else RowAction.RELEASE if p is Phase.FINISHED
                else RowAction.KEEP for p in phases]

    def admits(self, running: int, round_over: bool) -> bool:
        """Whether waiting requests may join the batch now (rows and pages permitting)."""
        return True

    def waits_to_fill(self, running: int, waiting: int, max_batch: int) -> bool:
        """Whether a new batch waits to be filled (until the oldest waiting request has
        waited the fill timeout)."""
        return False

    def may_hold_for_arrivals(self, waiting: int, rows: int, max_batch: int) -> bool:
        """Whether a step may wait (for ``fill_timeout.fdfo_hold`` seconds at most) so that
        arrivals join it: free rows and an empty queue."""
        return waiting == 0 and 0 < rows < max_batch


class SyncBaseline(BatchingPolicy):
    """``sync``: a round lasts until every row's block is done; new requests join between rounds."""

    mode = SchedulerMode.SYNC
    keeps_finished = False  # finished rows stay until the whole batch has finished

    def end_of_round(self, phases: Sequence[Phase]) -> list[RowAction] | None:
        if any(p not in (Phase.BLOCK_DONE, Phase.FINISHED) for p in phases):
            return None
        keep_finished = self.keeps_finished and not all(p is Phase.FINISHED for p in phases)
        return [RowAction.ADVANCE if p is Phase.BLOCK_DONE
                else RowAction.KEEP if keep_finished else RowAction.RELEASE for p in phases]

    def admits(self, running: int, round_over: bool) -> bool:
        return running == 0 or round_over

    def may_hold_for_arrivals(self, waiting: int, rows: int, max_batch: int) -> bool:
        return False


class StaticBaseline(SyncBaseline):
    """``static``: rounds as ``sync``, and new requests join only an empty batch."""

    mode = SchedulerMode.STATIC
    keeps_finished = True

    def admits(self, running: int, round_over: bool) -> bool:
        return running == 0


class FixedFillBaseline(StaticBaseline):
    """``fixed_fill``: as ``static``, and a new batch starts full or after the fill timeout."""

    mode = SchedulerMode.FIXED_FILL

    def waits_to_fill(self, running: int, waiting: int, max_batch: int) -> bool:
        return running == 0 and 0 < waiting < max_batch


_POLICIES = {policy.mode: policy() for policy in (BatchingPolicy, SyncBaseline, StaticBaseline, FixedFillBaseline)}


def batching_policy(mode: SchedulerMode | str) -> BatchingPolicy:
    return _POLICIES[SchedulerMode(mode)]
