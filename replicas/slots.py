"""Persistent per-slot tensors of the running batch (the "persistent batch").

Each admitted request gets a slot. Its row of ``tokens`` is its whole paged sequence
(prompt pages, committed blocks, the active block) and its row of ``page_table`` maps
its page indices to pool pages. The runner gathers step inputs from these with a few
vectorized index operations instead of rebuilding Python lists every step.
"""

from __future__ import annotations

import torch


class SlotTable:
    def __init__(self, num_slots: int, max_pages: int, page_size: int, pad_id: int):
        self.num_slots = num_slots
        self.max_pages = max_pages
        self.page_size = page_size
        self.tokens = torch.full((num_slots, max_pages, page_size), pad_id, dtype=torch.long)
        self.page_table = torch.zeros((num_slots, max_pages), dtype=torch.long)
        self.prompt_pages = torch.ones(num_slots, dtype=torch.long)
        self.prompt_tail = torch.full((num_slots,), page_size, dtype=torch.long)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, prompt_ids: list[int], pages: list[int]) -> int:
        """Claim a slot for a prompt whose prompt pages are ``pages``."""
        slot = self._free.pop()
        size = self.page_size
        count = len(prompt_ids)
        flat = self.tokens[slot].view(-1)
        flat[:count] = torch.tensor(prompt_ids, dtype=torch.long)
        self.prompt_pages[slot] = len(pages)
        self.prompt_tail[slot] = count - (len(pages) - 1) * size
        self.page_table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        return slot

    def start_block(self, slot: int, segment: int, page: int, mask_id: int) -> None:
        self.page_table[slot, segment] = page
        self.tokens[slot, segment] = mask_id

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def blocks(self, slots: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """Copy of the active blocks ``[B, L]``."""
        return self.tokens[slots, segments]

    def write_blocks(self, slots: torch.Tensor, segments: torch.Tensor, blocks: torch.Tensor) -> None:
        self.tokens[slots, segments] = blocks
