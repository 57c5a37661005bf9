"""The paged KV cache: a fixed pool of pages of exactly one block each.

A request owns pages for its prompt and committed blocks plus ONE page for its active
block, reused in place for every step of that block. Its pages are one ``PageAllocation``
of the pool: admission allocates its prompt's pages and reserves its worst case up front
(``PagePool.allocate``), each later block then takes a page from that reservation
(``next_page``), so a running request never waits for memory and nothing is ever
preempted. With a prefix cache (``replicas.prefix_cache``), an allocation starts with the
cached pages it shares, and the cached pages no request holds count as available: a page
is evicted when none is free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from replicas.prefix_cache import CachedRun, PrefixCache


@dataclass
class PageAllocation:
    """One request's pages, in sequence order: the first ``shared`` are prefix-cache pages
    it holds (those of its deepest cached run, ``cached``, and the runs above it), the rest
    its own; ``reserved`` more are promised to it, a later block's page each."""

    pages: list[int] = field(default_factory=list)
    cached: CachedRun | None = None
    shared: int = 0
    reserved: int = 0

    @property
    def own(self) -> list[int]:
        return self.pages[self.shared:]

    def share(self, run: CachedRun | None, count: int) -> None:
        """Its next ``count`` own pages are cached now, ending ``run`` (its deepest, which it holds)."""
        if count and run.pages[-1] != self.pages[self.shared + count - 1]:
            raise ValueError("pages are shared in sequence order")
        self.cached = run
        self.shared += count


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

    def allocate(self, cached: CachedRun | None, now: int, later: int) -> PageAllocation | None:
        """The pages of the ``cached`` run and the runs above it (held from now on), ``now``
        pages of its own after them and ``later`` more promised, or None where they do not
        fit (a cached page no request holds yet counts as taken: it is evictable until then)."""
        if now + later + (self.cache.pinned_by(cached) if cached is not None else 0) > self.num_available:
            return None
        shared = []
        if cached is not None:
            self.cache.acquire(cached)
            shared = self.cache.pages_to(cached)
        self._reserved += now + later
        return PageAllocation(shared + self.take(now), cached, len(shared), later)

    def next_page(self, allocation: PageAllocation) -> int:
        """A page out of ``allocation``'s reservation, appended to its pages."""
        if allocation.reserved <= 0:
            raise RuntimeError("next_page() beyond the allocation's reservation")
        allocation.reserved -= 1
        self._reserved -= 1
        page = self._free.pop() if self._free else self.cache.evict()[0]  # ``take`` for one page, in fewer steps
        allocation.pages.append(page)
        return page

    def free(self, allocation: PageAllocation) -> None:
        """Return the allocation's own pages and what it did not take of its reservation,
        and let go of its shared pages (they stay cached)."""
        self._free.extend(allocation.own)
        self._reserved -= allocation.reserved
        if allocation.cached is not None:
            self.cache.release(allocation.cached)

    def take(self, count: int) -> list[int]:
        """``count`` pages out of the reservations: free ones (the last freed first), then
        evicted ones."""
        self._reserved -= count
        free = min(count, len(self._free))
        rest = len(self._free) - free
        pages = self._free[rest:][::-1]
        del self._free[rest:]
        return pages + self.cache.evict(count - free) if count > free else pages


class KVCache:
    """Per-layer K and V tensors indexed by cache position (page x page size + offset):
    ``[num_pages * page_size, heads, head_dim]``."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device):
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V tensors of every layer."""
        return sum(tensor.nbytes for tensor in (*self.k, *self.v))
