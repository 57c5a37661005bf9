"""Persistent per-row tensors of the running batch (the "persistent batch").

Each admitted request gets a row. Its row of ``tokens`` is its whole paged sequence
(prompt pages, committed blocks, the active block; with the full canvas also the
masks of every later block, then an infill's suffix) by page index, and its row of
``page_table`` maps its page indices to pool pages. ``last_page`` is the highest page index
the row's tokens attend to with the full canvas (its last block's, or its suffix's last),
and ``last_tail`` the tokens on it. The runner gathers step inputs from
these with a few vectorized index operations instead of rebuilding Python lists every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RowTable:
    def __init__(self, num_rows: int, max_pages: int, page_size: int, pad_id: int):
        self.num_rows = num_rows
        self.max_pages = max_pages
        self.page_size = page_size
        self.tokens = torch.full((num_rows, max_pages, page_size), pad_id, dtype=torch.long)
        self.page_table = torch.zeros((num_rows, max_pages), dtype=torch.long)
        self.prompt_pages = torch.ones(num_rows, dtype=torch.long)
        self.prompt_tail = torch.full((num_rows,), page_size, dtype=torch.long)
        self.last_page = torch.zeros(num_rows, dtype=torch.long)
        self.last_tail = torch.full((num_rows,), page_size, dtype=torch.long)
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, prompt_ids: list[int], pages: list[int], resume_ids: Sequence[int] = (),
                aligned: bool = False) -> int:
        """Claim a row for a prompt and the blocks ``resume_ids`` it resumes with (whole
        blocks, on the pages after the prompt's); ``pages``: the prompt's pages, then one
        per resumed block. ``aligned``: prompt and resumed ids run on without a gap, and
        ``pages`` are their whole pages (the rest goes in the first block's page)."""
        row = self._free.pop()
        size = self.page_size
        count = len(prompt_ids)
        flat = self.tokens[row].view(-1)
        if aligned:  # the prefix is whole pages; no partial prompt page to mask out
            prompt_pages, tail, resume_at = len(pages), size, count
        else:
            prompt_pages = len(pages) - len(resume_ids) // size
            tail, resume_at = count - (prompt_pages - 1) * size, prompt_pages * size
        flat[:count] = torch.tensor(prompt_ids, dtype=torch.long)
        if resume_ids:
            flat[resume_at: resume_at + len(resume_ids)] = torch.tensor(resume_ids, dtype=torch.long)
        self.prompt_pages[row] = prompt_pages
        self.prompt_tail[row] = tail
        self.page_table[row, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        return row

    def start_blocks(self, rows: list[int], page_indices: list[int], pages: list[int], keep: list[int],
                     mask_id: int) -> None:
        """Put a new masked block on ``pages[i]`` at page index ``page_indices[i]`` of row
        ``rows[i]``, but for its first ``keep[i]`` tokens (an aligned prompt's end): one
        vectorized write for all the blocks a step starts."""
        where = torch.tensor([rows, page_indices, pages])
        index = (where[0], where[1])
        self.page_table[index] = where[2]
        if not any(keep):  # the common case: whole blocks of masks
            self.tokens[index] = mask_id
            return
        kept = torch.arange(self.page_size) < torch.tensor(keep)[:, None]
        self.tokens[index] = torch.where(kept, self.tokens[index], mask_id)

    def lay_canvas(self, row: int, first_page_index: int, pages: list[int], mask_id: int,
                   suffix_ids: Sequence[int] = ()) -> None:
        """The full canvas: masked blocks on ``pages`` from ``first_page_index`` on, and on
        the last of them ``suffix_ids`` (an infill's text after the answer; its last page
        may be partial)."""
        end = first_page_index + len(pages)
        self.page_table[row, first_page_index:end] = torch.tensor(pages, dtype=torch.long)
        self.tokens[row, first_page_index:end] = mask_id
        self.last_page[row] = end - 1
        self.last_tail[row] = self.page_size
        if suffix_ids:
            suffix_pages = -(-len(suffix_ids) // self.page_size)
            flat = self.tokens[row, end - suffix_pages:end].view(-1)
            flat[:len(suffix_ids)] = torch.tensor(suffix_ids, dtype=torch.long)
            self.last_tail[row] = len(suffix_ids) - (suffix_pages - 1) * self.page_size

    def release(self, row: int) -> None:
        self._free.append(row)

    def blocks(self, rows: torch.Tensor, page_indices: torch.Tensor) -> torch.Tensor:
        """Copy of the active blocks ``[B, L]``."""
        return self.tokens[rows, page_indices]

    def write_blocks(self, rows: torch.Tensor, page_indices: torch.Tensor, blocks: torch.Tensor) -> None:
        self.tokens[rows, page_indices] = blocks
