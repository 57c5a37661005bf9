"""Persistent per-row arrays of the running batch (the "persistent batch").

Each admitted request gets a row. Its row of ``tokens`` is its whole paged sequence
(prompt pages, committed blocks, the active block; with the full canvas also the
masks of every later block, then an infill's suffix) by page index, and its row of
``page_table`` maps its page indices to pool pages. ``last_page`` is the highest page index
the row's tokens attend to with the full canvas (its last block's, or its suffix's last),
and ``last_tail`` the tokens on it. The runner gathers step inputs from
these with a few vectorized index operations instead of rebuilding Python lists every step.

The arrays are numpy on the host: the step's bookkeeping is many small reads and writes,
each of which costs a torch op several times what it costs numpy. The runner hands the
model torch tensors made from them (``torch.from_numpy``, then moved to the device).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class RowTable:
    def __init__(self, num_rows: int, max_pages: int, page_size: int, pad_id: int):
        self.num_rows = num_rows
        self.max_pages = max_pages
        self.page_size = page_size
        self.tokens = np.full((num_rows, max_pages, page_size), pad_id, dtype=np.int64)
        self.page_table = np.zeros((num_rows, max_pages), dtype=np.int64)
        self.prompt_pages = np.ones(num_rows, dtype=np.int64)
        self.prompt_tail = np.full(num_rows, page_size, dtype=np.int64)
        self.last_page = np.zeros(num_rows, dtype=np.int64)
        self.last_tail = np.full(num_rows, page_size, dtype=np.int64)
        self.adapters: list = [None] * num_rows  # each row's unmerged adapter (``replicas.adapters``), or None
        self._free = list(range(num_rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, prompt_ids: list[int], pages: list[int], resume_ids: Sequence[int] = (),
                aligned: bool = False, adapter=None) -> int:
        """Claim a row for a prompt and the blocks ``resume_ids`` it resumes with (whole
        blocks, on the pages after the prompt's); ``pages``: the prompt's pages, then one
        per resumed block. ``aligned``: prompt and resumed ids run on without a gap, and
        ``pages`` are their whole pages (the rest goes in the first block's page).
        ``adapter``: the request's unmerged adapter."""
        row = self._free.pop()
        self.adapters[row] = adapter
        size = self.page_size
        count = len(prompt_ids)
        flat = self.tokens[row].reshape(-1)  # a view
        if aligned:  # the prefix is whole pages; no partial prompt page to mask out
            prompt_pages, tail, resume_at = len(pages), size, count
        else:
            prompt_pages = len(pages) - len(resume_ids) // size
            tail, resume_at = count - (prompt_pages - 1) * size, prompt_pages * size
        flat[:count] = prompt_ids
        if resume_ids:
            flat[resume_at: resume_at + len(resume_ids)] = resume_ids
        self.prompt_pages[row] = prompt_pages
        self.prompt_tail[row] = tail
        self.page_table[row, : len(pages)] = pages
        return row

    def start_blocks(self, rows: list[int], page_indices: list[int], pages: list[int], keep: list[int],
                     mask_id: int) -> None:
        """Put a new masked block on ``pages[i]`` at page index ``page_indices[i]`` of row
        ``rows[i]``, but for its first ``keep[i]`` tokens (an aligned prompt's end): one
        vectorized write for all the blocks a step starts."""
        self.page_table[rows, page_indices] = pages
        if not any(keep):  # the common case: whole blocks of masks
            self.tokens[rows, page_indices] = mask_id
            return
        kept = np.arange(self.page_size) < np.asarray(keep)[:, None]
        self.tokens[rows, page_indices] = np.where(kept, self.tokens[rows, page_indices], mask_id)

    def lay_canvas(self, row: int, first_page_index: int, pages: list[int], mask_id: int,
                   suffix_ids: Sequence[int] = ()) -> None:
        """The full canvas: masked blocks on ``pages`` from ``first_page_index`` on, and on
        the last of them ``suffix_ids`` (an infill's text after the answer; its last page
        may be partial)."""
        end = first_page_index + len(pages)
        self.page_table[row, first_page_index:end] = pages
        self.tokens[row, first_page_index:end] = mask_id
        self.last_page[row] = end - 1
        self.last_tail[row] = self.page_size
        if suffix_ids:
            suffix_pages = -(-len(suffix_ids) // self.page_size)
            flat = self.tokens[row, end - suffix_pages:end].reshape(-1)  # a view (contiguous pages)
            flat[:len(suffix_ids)] = suffix_ids
            self.last_tail[row] = len(suffix_ids) - (suffix_pages - 1) * self.page_size

    def release(self, row: int) -> None:
        self.adapters[row] = None
        self._free.append(row)

    def blocks(self, rows: Sequence[int], page_indices: Sequence[int]) -> np.ndarray:
        """Copy of the active blocks ``[B, L]``."""
        return self.tokens[rows, page_indices]

    def write_blocks(self, rows: Sequence[int], page_indices: Sequence[int], blocks) -> None:
        """``blocks``: ``[B, L]`` ids (nested lists or an array)."""
        self.tokens[rows, page_indices] = blocks
