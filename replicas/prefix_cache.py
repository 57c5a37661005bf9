"""The prefix cache: KV pages of request prefixes (prompt and resumed blocks), shared by
the requests of one replica.

A page's KV depends only on the pages before it when the runner never refreshes a row
(a block-causal model with ``kv_cache: prefix``), so a page computed for one request is
exact for any other whose sequence starts with the same tokens. The cache is a tree of
pages: a node's key is its page's tokens (a whole page, or the prompt's last, partial
one), under the node of the page before it, so a match is exact token for token.

Reference counts say how many live requests hold a node; a node's requests hold its
ancestors too, so an unreferenced node has only unreferenced descendants and the least
recently released unreferenced leaf can always be evicted. The page pool counts
unreferenced pages as available (``PagePool.num_available``) and evicts one when it has
no free page left (``PagePool.take``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


def page_hashes(prompt_ids: Sequence[int], page_size: int) -> tuple[int, ...]:
    """One hash per whole page of ``prompt_ids``, each over that page and every page before
    it: what a router compares to find where a prompt's longest prefix went (ints and
    tuples hash alike in every process)."""
    hashes, last = [], 0
    for start in range(0, len(prompt_ids) - page_size + 1, page_size):
        last = hash((last, tuple(prompt_ids[start:start + page_size])))
        hashes.append(last)
    return tuple(hashes)


@dataclass(eq=False, slots=True)
class CachedPage:
    page: int  # the pool page holding the KV
    tokens: tuple[int, ...]
    parent: CachedPage | None
    children: dict[tuple[int, ...], CachedPage] = field(default_factory=dict)
    refs: int = 0  # live requests holding it


@dataclass
class PrefixCacheTotals:
    """Counts since the engine started (the metrics exporter reads these)."""

    pages_looked_up: int = 0  # prefix pages of admitted requests
    pages_hit: int = 0  # of those, found in the cache
    tokens_hit: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.pages_hit / self.pages_looked_up if self.pages_looked_up else 0.0


class PrefixCache:
    def __init__(self):
        self._roots: dict[tuple[int, ...], CachedPage] = {}
        self._unreferenced: OrderedDict[CachedPage, None] = OrderedDict()  # least recently released first
        self.num_pages = 0
        self.totals = PrefixCacheTotals()

    @property
    def num_unreferenced(self) -> int:
        """Cached pages no live request holds: free for the pool to evict."""
        return len(self._unreferenced)

    def nodes(self) -> Iterator[CachedPage]:
        """Every cached page, parents before their children."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def match(self, pages: Sequence[tuple[int, ...]]) -> list[CachedPage]:
        """The cached nodes of the longest run of ``pages`` (each page's tokens, from the
        sequence's first) found in the cache; nothing changes."""
        found, level = [], self._roots
        for tokens in pages:
            node = level.get(tokens)
            if node is None:
                break
            found.append(node)
            level = node.children
        return found

    def acquire(self, nodes: Sequence[CachedPage]) -> None:
        for node in nodes:
            if node.refs == 0:
                del self._unreferenced[node]
            node.refs += 1

    def release(self, nodes: Sequence[CachedPage]) -> None:
        """A request lets go of its nodes (a chain from the first page)."""
        for node in reversed(nodes):  # the leaf first: it is evicted before its parent
            node.refs -= 1
            if node.refs == 0:
                self._unreferenced[node] = None

    def insert(self, parent: CachedPage | None, keys: Sequence[tuple[int, ...]],
               pages: Sequence[int]) -> list[CachedPage]:
        """Cache ``pages`` (their KV written), keyed by ``keys``, each under the one before
        and the first under ``parent``, held by the request that computed them; the chain
        stops at a key cached already (by another request meanwhile: the pages from there
        stay the request's). Returns the nodes made, in order."""
        made, level = [], self._roots if parent is None else parent.children
        for tokens, page in zip(keys, pages):
            if tokens in level:
                break
            parent = level[tokens] = CachedPage(page, tokens, parent, refs=1)
            made.append(parent)
            level = parent.children
        self.num_pages += len(made)
        return made

    def evict(self) -> int:
        """Drop the least recently released unreferenced leaf; its page, for reuse."""
        node = next((n for n in self._unreferenced if not n.children), None)
        if node is None:
            raise RuntimeError("no cached page to evict")
        del self._unreferenced[node]
        level = self._roots if node.parent is None else node.parent.children
        del level[node.tokens]
        self.num_pages -= 1
        self.totals.evictions += 1
        return node.page

    def count_lookup(self, looked_up: int, hits: Sequence[CachedPage]) -> None:
        self.totals.pages_looked_up += looked_up
        self.totals.pages_hit += len(hits)
        self.totals.tokens_hit += sum(len(node.tokens) for node in hits)
