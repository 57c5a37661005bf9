"""The plain data object the scheduler hands the runner for one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replicas.request import Request


@dataclass
class ScheduledBatch:
    """One forward's worth of work.

    The new tokens are a list of page-sized *units*, sorted by row then page: a unit is
    ``unit_count[u]`` tokens at the start of page ``unit_segment[u]`` of row ``unit_row[u]``
    (prompt chunks are page aligned, so every unit starts at offset 0). Block units are the
    rows' active blocks, whose logits are computed; ``stepped`` says which of them the
    algorithm advances (the others are idle rows that the sync/static baselines still
    compute, and whose writes go to the scratch page).
    """

    rows: list[Request]
    row_slots: torch.Tensor  # [B]
    unit_row: torch.Tensor  # [U]
    unit_segment: torch.Tensor  # [U]
    unit_count: torch.Tensor  # [U]
    unit_is_block: torch.Tensor  # [U] bool
    unit_scratch: torch.Tensor  # [U] bool: write K/V to the scratch page
    block_rows: list[Request]  # rows with a block unit, in unit order
    stepped: torch.Tensor  # [R] bool over block_rows

    @property
    def num_tokens(self) -> int:
        return int(self.unit_count.sum())
