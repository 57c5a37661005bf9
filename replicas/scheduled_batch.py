"""The plain data object the scheduler hands the runner for one step (host arrays and ints only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

