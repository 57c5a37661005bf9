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

import numpy as np

if TYPE_CHECKING:
    from replicas.logprobs import TokenLogprob
    from replicas.request import Request


@dataclass
class ScheduledBatch:
    """One forward's worth of work.

    The new tokens are a list of page-sized *units*, sorted by row then page index: a unit
    is ``unit_count[u]`` tokens at the start of page index ``unit_page_index[u]`` of row
    ``unit_row[u]`` (a ``RowTable`` row; prompt chunks are page aligned, so every unit
    starts at offset 0). Block units are the rows' active blocks, whose logits are
    computed; ``advances`` says which of them the algorithm advances (the others are idle
    rows that the sync/static baselines still compute, and whose writes go to the scratch
    page). The arrays are numpy: the runner builds the model's inputs from them on the host.
    """

    num_rows: int  # rows in the forward
    unit_row: np.ndarray  # [U]
    unit_page_index: np.ndarray  # [U]
    unit_count: np.ndarray  # [U]
    unit_is_block: np.ndarray  # [U] bool
    unit_scratch: np.ndarray  # [U] bool: write K/V to the scratch page
    advances: np.ndarray  # [R] bool over the block units (their requests: ``Scheduler.stepped``)
    steps_in_block: np.ndarray  # [R] steps each block unit's block took before this one
    # (rows, page indices) [2, S] of the blocks the algorithms advance (``Scheduler.stepped``'s, in order)
    stepped_blocks: np.ndarray
    num_tokens: int  # new tokens: the units' counts summed
    prefix_units: int  # units that are not block units: prompt chunks and commit writes
    prompt_pages: int = 0  # of the units, the prompt pages computed (prefill; commit writes are not)

    @property
    def block_rows(self) -> np.ndarray:
        """[R] the row of each block unit."""
        return self.unit_row[self.unit_is_block]


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
    # the positions the step wrote and their log-probabilities, for the rows that asked (else
    # None), or None where no row asked
    logprobs: list[list[tuple[int, TokenLogprob]] | None] | None
    # rows whose algorithm failed, and why: the engine ends them, and the update skips them
    failed: list[tuple[Request, str]]
    # each block's algorithm state for its next step, or None: every state stays as it is
    algorithm_states: list | None = None
    forward_s: float = 0.0
    forward_cpu_s: float = 0.0  # CPU time of the engine thread in the forward
