"""The paged KV cache: a fixed pool of pages of exactly one block each.

A request owns pages for its prompt and committed blocks plus ONE page for its active
block, reused in place for every step of that block. Admission reserves a request's
worst case up front (``reserve``), pages are then taken from that reservation one block
at a time, so a running request never waits for memory and nothing is ever preempted.
With a prefix cache (``replicas.prefix_cache``), the cached pages no request holds count
as available: ``take`` evicts one when no page is free.
"""

from __future__ import annotations

import torch

from replicas.prefix_cache import PrefixCache


class PagePool:
    """Free-list of page ids with reservations; page 0 is kept as a scratch page."""

    SCRATCH_PAGE = 0

    def __init__(self, num_pages: int, cache: PrefixCache | None = None):
        if num_pages < 2:
            raise ValueError("the page pool needs at least 2 pages (one is scratch)")
        self.num_pages = num_pages
        self.cache = cache
        self._free = list(range(num_pages - 1, 0, -1))
        self._reserved = 0

    @property
    def capacity(self) -> int:
        """Pages usable by requests (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_unheld(self) -> int:
        """Pages no request holds: free, or cached and unreferenced."""
        return len(self._free) + (self.cache.num_unreferenced if self.cache is not None else 0)

    @property
    def num_available(self) -> int:
        """Unheld pages not promised to an admitted request."""
        return self.num_unheld - self._reserved

    def reserve(self, count: int) -> bool:
        if count > self.num_available:
            return False
        self._reserved += count
        return True

    def take(self) -> int:
        """One page out of an existing reservation."""
        if self._reserved <= 0:
            raise RuntimeError("take() without a reservation")
        self._reserved -= 1
        return self._free.pop() if self._free else self.cache.evict()

    def release(self, pages: list[int], unused_reservation: int) -> None:
        """Return a request's own pages (not the cached ones it holds) and what it did not
        take of its reservation."""
        self._free.extend(pages)
        self._reserved -= unused_reservation


class KVCache:
    """Per-layer K and V tensors indexed by cache position (page x page size + offset):
    ``[num_pages * page_size, heads, head_dim]``."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device):
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
