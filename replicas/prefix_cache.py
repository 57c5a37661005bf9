"""The prefix cache: KV pages of request prefixes (prompt, resumed and committed blocks),
shared by the requests of one replica.

A page's KV depends only on the pages before it when the runner never refreshes a row
(a block-causal model with ``kv_cache: prefix``), so a page computed for one request is
exact for any other whose sequence starts with the same tokens. A page's key is its
tokens (a whole page, or the prompt's last, partial one), so a match is exact token for
token.

The cache is a radix tree of *runs*: a run is a sequence of pages that continues its
parent run's last page; a parent's children each start with a different page, by which
they are keyed. A match that ends inside a run splits it there, so a request always holds
whole runs: its deepest (``PageAllocation.cached``) and, through it, every run above. The
pages a request caches after its deepest run are appended to that run where it holds it
alone and nothing hangs below it (a step caches a dozen pages: a list append each, not a
node each), else they start a child run.

Reference counts say how many live requests hold a run (the holders of its descendants
included), so an unreferenced run has only unreferenced descendants and the least
recently released unreferenced leaf run can always give up its last page. The page pool
counts the pages of unreferenced runs as available (``PagePool.num_available``) and
evicts the pages it lacks when too few are free (``PagePool.take``).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

Key = tuple[int, ...]  # a page's tokens


def page_hashes(prompt_ids: Sequence[int], page_size: int, tree: str | None = None) -> tuple[int, ...]:
    """One hash per whole page of ``prompt_ids``, each over that page and every page before
    it (and ``tree``, the adapter whose KV the pages hold): what a router compares to find
    where a prompt's longest prefix went (ints and tuples hash alike in every process; a
    string's hash does not, so the adapter's name enters by its CRC)."""
    hashes, last = [], 0 if tree is None else zlib.crc32(tree.encode())
    for start in range(0, len(prompt_ids) - page_size + 1, page_size):
        last = hash((last, tuple(prompt_ids[start:start + page_size])))
        hashes.append(last)
    return tuple(hashes)


@dataclass(eq=False, slots=True)
class CachedRun:
    keys: list[Key]  # each page's tokens
    pages: list[int]  # the pool pages holding their KV
    parent: CachedRun | None  # the run this one continues (None: it starts a sequence)
    children: dict[Key, CachedRun] = field(default_factory=dict)  # by their first page's tokens
    refs: int = 0  # live requests holding it
    tree: str | None = None  # the adapter whose KV it holds (None: the base model's)

    def path(self) -> Iterator[CachedRun]:
        """This run and the runs above it, up to the first."""
        run: CachedRun | None = self
        while run is not None:
            yield run
            run = run.parent


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
        self._roots: dict[str | None, dict[Key, CachedRun]] = {}  # per tree (adapter), its first runs
        self._unreferenced: OrderedDict[CachedRun, None] = OrderedDict()  # least recently released first
        self.num_unreferenced = 0  # pages of the unreferenced runs: free for the pool to evict
        self.num_pages = 0
        self.totals = PrefixCacheTotals()

    def runs(self) -> Iterator[CachedRun]:
        """Every cached run, parents before their children."""
        stack = [run for roots in self._roots.values() for run in roots.values()]
        while stack:
            run = stack.pop()
            yield run
            stack.extend(run.children.values())

    def match(self, keys: Sequence[Key], tree: str | None = None) -> tuple[CachedRun | None, int]:
        """The deepest run of the longest prefix of ``keys`` (each page's tokens, from the
        sequence's first) found in the cache of ``tree`` (an adapter's name: its KV differs
        from the base model's), and how many pages that prefix has; a run the prefix ends
        inside is split there first (what is cached does not change)."""
        run, depth, level = None, 0, self._children_of(None, tree)
        while depth < len(keys) and (child := level.get(keys[depth])) is not None:
            same, limit = 1, min(len(child.keys), len(keys) - depth)
            while same < limit and child.keys[same] == keys[depth + same]:
                same += 1
            run = self._split(child, same) if same < len(child.keys) else child
            depth += same
            level = run.children
        return run, depth

    def pages_to(self, run: CachedRun | None) -> list[int]:
        """The pages of ``run`` and every run above it, in sequence order."""
        return [page for above in reversed(list(run.path())) for page in above.pages] if run is not None else []

    def pinned_by(self, run: CachedRun | None) -> int:
        """Unreferenced pages that holding ``run`` would take from the evictable ones."""
        pages = 0
        for above in run.path() if run is not None else ():
            if above.refs:
                break  # held, and so is every run above it
            pages += len(above.pages)
        return pages

    def acquire(self, run: CachedRun) -> None:
        """A request holds ``run`` (and so every run above it)."""
        for above in run.path():
            if above.refs == 0:
                del self._unreferenced[above]
                self.num_unreferenced -= len(above.pages)
            above.refs += 1

    def release(self, run: CachedRun) -> None:
        """A request lets go of ``run``, its deepest (the leaf first: it is evicted first)."""
        for above in run.path():
            above.refs -= 1
            if above.refs == 0:
                self._unreferenced[above] = None
                self.num_unreferenced += len(above.pages)

    def insert(self, run: CachedRun | None, keys: Sequence[Key], pages: Sequence[int],
               tree: str | None = None) -> tuple[CachedRun | None, int]:
        """Cache ``pages`` (their KV written), keyed by ``keys``, after ``run`` (the deepest
        run of the request that computed them, which holds it; None: from the sequence's
        start, in ``tree``); the request holds them. Where another request cached the first key already
        meanwhile, nothing is cached (the pages stay the request's own). Returns the
        request's deepest run now and how many pages it cached."""
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        level = self._children_of(run, tree)
        if not keys or keys[0] in level:
            return run, 0
        if run is not None and run.refs == 1 and not run.children:  # its own leaf: extended in place
            run.keys.extend(keys)
            run.pages.extend(pages)
        else:
            run = level[keys[0]] = CachedRun(list(keys), list(pages), run, refs=1, tree=tree)
        self.num_pages += len(keys)
        return run, len(keys)

    def evict(self, count: int = 1) -> list[int]:
        """Drop ``count`` pages, each the last of the least recently released unreferenced
        leaf run; their pages, for reuse."""
        if count > self.num_unreferenced:
            raise RuntimeError(f"{count} cached pages to evict; {self.num_unreferenced} are unreferenced")
        pages: list[int] = []
        while len(pages) < count:
            run = next(iter(self._unreferenced))  # a leaf, unless a child was released after it
            if run.children:
                run = next(r for r in self._unreferenced if not r.children)
            take = min(count - len(pages), len(run.pages))
            pages += run.pages[:-take - 1:-1]  # the last first
            first_key = run.keys[0]
            del run.keys[-take:], run.pages[-take:]
            if not run.pages:
                del self._unreferenced[run]
                del self._children_of(run.parent, run.tree)[first_key]
        self.num_unreferenced -= count
        self.num_pages -= count
        self.totals.evictions += count
        return pages

    def count_lookup(self, looked_up: int, pages_hit: int, tokens_hit: int) -> None:
        self.totals.pages_looked_up += looked_up
        self.totals.pages_hit += pages_hit
        self.totals.tokens_hit += tokens_hit

    def _children_of(self, run: CachedRun | None, tree: str | None) -> dict[Key, CachedRun]:
        """The runs that continue ``run``, by their first page's tokens (None: ``tree``'s first)."""
        return self._roots.setdefault(tree, {}) if run is None else run.children

    def _split(self, run: CachedRun, at: int) -> CachedRun:
        """Split ``run`` after its first ``at`` pages; the new run of those, which its
        holders hold as they held ``run`` (``run`` keeps the rest, and its holders)."""
        head = CachedRun(run.keys[:at], run.pages[:at], run.parent, {run.keys[at]: run}, run.refs, run.tree)
        level = self._children_of(run.parent, run.tree)
        level[run.keys[0]] = head
        del run.keys[:at], run.pages[:at]
        run.parent = head
        if run.refs == 0:
            self._unreferenced[head] = None  # its pages counted with ``run``'s already
        return head
