"""The prefix cache: exact reuse of prompt pages across requests, reference counts that
never let a held page go, LRU eviction of the rest, and no page lost on any path."""

import random
from collections import Counter

import pytest

from replicas.batching import SchedulerMode
from replicas.kv_cache import PagePool
from replicas.messages import SamplingParams
from replicas.prefix_cache import CachedRun, PrefixCache

BLOCK = 16  # the random tiny model's block length


# ---- the cache and the pool ---------------------------------------------------------------
def test_match_is_exact_and_eviction_takes_the_least_recent_unreferenced_leaf():
    cache = PrefixCache()
    ab, cached = cache.insert(None, [(1, 2), (3, 4)], [5, 6])  # one request computed a and b: one run
    assert (cached, ab.pages, ab.parent, ab.refs, cache.num_pages) == (2, [5, 6], None, 1, 2)
    assert cache.insert(None, [(1, 2), (3, 5)], [8, 9]) == (None, 0)  # cached already: the pages stay their request's
    a, depth = cache.match([(1, 2), (3, 9)])  # another request finds a: the run splits after it
    assert (depth, a.pages, ab.pages, ab.parent, a.refs) == (1, [5], [6], a, 1)
    assert cache.match([(1, 2), (3, 4), (5, 6)]) == (ab, 2) and cache.match([(1, 2), (3,)]) == (a, 1)
    assert cache.match([(2, 1)]) == (None, 0) and cache.pages_to(ab) == [5, 6]
    cache.acquire(a)  # that request holds a and computes c after it
    c, cached = cache.insert(a, [(3, 9)], [7])
    assert (cached, c.parent, a.refs, c.refs, cache.num_unreferenced) == (1, a, 2, 1, 0)
    cache.release(ab)  # the first request ends
    assert [run.refs for run in (a, ab, c)] == [1, 0, 1] and cache.num_unreferenced == 1
    cache.release(c)
    assert cache.num_unreferenced == 3
    assert cache.evict() == [6]  # b, released first, went first; a has a child
    assert cache.pinned_by(a) == 1
    cache.acquire(a)  # a request holds a again: only c may go
    assert cache.evict() == [7]
    with pytest.raises(RuntimeError):
        cache.evict()
    cache.release(a)
    assert cache.evict() == [5] and cache.num_pages == 0 and list(cache.runs()) == []


def test_a_request_alone_on_its_run_extends_it_and_a_shared_one_branches():
    cache = PrefixCache()
    run, _ = cache.insert(None, [(1,), (2,)], [1, 2])
    assert cache.insert(run, [(3,)], [3]) == (run, 1) and run.pages == [1, 2, 3]  # held alone: one run still
    cache.acquire(run)  # a second request holds it too
    child, cached = cache.insert(run, [(4,)], [4])
    assert cached == 1 and child.parent is run and run.pages == [1, 2, 3] and cache.num_pages == 4
    assert cache.insert(run, [(4,)], [5]) == (run, 0)  # the other request's copy of that page stays its own
    with pytest.raises(ValueError):
        cache.insert(child, [(5,), (6,)], [6])  # a key without its page


def test_a_parent_left_without_children_is_evicted_in_its_own_release_order():
    cache = PrefixCache()
    leaf, _ = cache.insert(None, [(1,), (2,)], [1, 2])  # request A computed both
    parent, _ = cache.match([(1,)])  # request B holds the first page too
    cache.acquire(parent)
    other, _ = cache.insert(None, [(9,)], [3])  # request C's page
    cache.release(leaf)  # A: the leaf is unreferenced; B still holds the parent
    cache.release(other)  # C, after A
    cache.release(parent)  # B, last: the parent has a child still
    assert cache.evict(3) == [2, 3, 1]  # leaf, other (released before the parent), parent


def test_the_pool_counts_unreferenced_pages_as_available_and_evicts_when_none_is_free():
    cache = PrefixCache()
    pool = PagePool(4, cache)  # three usable pages
    first = pool.allocate(None, 2, 1)
    assert first.own == first.pages and len(first.pages) == 2 and first.reserved == 1
    assert pool.allocate(None, 1, 0) is None  # every page taken or promised
    taken_first = list(first.pages)
    page = pool.next_page(first)
    pages = list(first.pages)
    assert pages == taken_first + [page] and first.reserved == 0
    with pytest.raises(RuntimeError):
        pool.next_page(first)
    run, cached = cache.insert(None, [(1,)], pages[:1])
    with pytest.raises(ValueError):
        first.share(CachedRun([(2,)], [pages[1]], None), 1)  # not its next own page
    first.share(run, cached)
    assert first.own == pages[1:]
    pool.free(first)  # its own pages go back; the cached one stays, unreferenced
    assert pool.num_available == 3 and cache.num_unreferenced == 1
    second = pool.allocate(run, 1, 1)  # the cached page shared, held again
    assert second.pages[0] == run.pages[0] and run.refs == 1 and pool.num_available == 0
    pool.free(second)
    taken = pool.allocate(None, 3, 0)  # no page free but one cached: evicted
    assert sorted(taken.pages) == sorted(pages) and cache.num_pages == 0 and cache.totals.evictions == 1


def test_a_take_uses_the_free_pages_first_then_evicts_across_runs_least_recent_first():
    cache = PrefixCache()
    pool = PagePool(6, cache)  # five usable pages
    first = pool.allocate(None, 3, 0)
    first.share(*cache.insert(None, [(1,), (2,)], first.pages[:2]))
    second = pool.allocate(None, 1, 0)
    second.share(*cache.insert(None, [(9,)], second.pages))  # another request's page
    [never_taken] = pool._free
    pool.free(first)  # its third page goes back to the free list
    pool.free(second)
    assert pool.num_free == 2 and cache.num_unreferenced == 3
    taken = pool.allocate(None, 5, 0).pages
    # the free pages (the last freed first), then the first run's from its last, then the second's
    assert taken == [first.pages[2], never_taken, first.pages[1], first.pages[0], second.pages[0]]
    assert cache.num_pages == cache.num_unreferenced == 0 and list(cache.runs()) == []
    with pytest.raises(RuntimeError):
        cache.evict()


# ---- the engine: same tokens with and without the cache --------------------------------------
def prompts_with_a_shared_prefix(tokenizer, count: int) -> list[list[int]]:
    """A shared system prompt of 3.5 blocks, then each its own question: the shared part
    ends inside a page, so the pages after it differ."""
    rng = random.Random(7)
    system = [rng.randrange(5, 60) for _ in range(3 * BLOCK + BLOCK // 2)]
    return [system + [rng.randrange(5, 60) for _ in range(rng.randrange(1, 2 * BLOCK))] for _ in range(count)]


def generate(make_engine, prompts, **config):
    engine = make_engine(**config)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=2 * BLOCK, ignore_eos=True))
    return [o.token_ids for o in outputs], engine


@pytest.mark.parametrize("mode", [m.value for m in SchedulerMode])
@pytest.mark.parametrize("alignment", ["page", "prompt"])
@pytest.mark.parametrize("max_batch", [1, 4])
def test_tokens_with_the_cache_equal_those_without(make_engine, tokenizer, mode, alignment, max_batch):
    prompts = prompts_with_a_shared_prefix(tokenizer, 10)
    prompts.append(list(prompts[3]))  # the same prompt again: its last, partial page hits too
    config = dict(mode=mode, max_batch=max_batch, block_alignment=alignment, fill_timeout_s=0.0)
    without, _ = generate(make_engine, prompts, prefix_cache=False, **config)
    with_cache, engine = generate(make_engine, prompts, **config)
    assert with_cache == without
    totals = engine.pool.cache.totals
    # every later request found the system pages; with fdfo even those admitted with the
    # first (they waited for its prefill), with the baselines those of later rounds
    later = len(prompts) - (1 if mode == "fdfo" else max_batch)
    assert totals.pages_hit >= 3 * later
    assert engine.pool.num_available == engine.pool.capacity


def test_a_cold_burst_prefills_its_shared_prefix_once(make_engine, tokenizer):
    """Eight requests with one new system prompt at once: the first prefills it, the
    others wait the few steps that takes and find it cached (they would each compute it)."""
    prompts = prompts_with_a_shared_prefix(tokenizer, 8)

    def burst(cache: bool):
        steps = []
        outputs = make_engine(max_batch=8, prefix_cache=cache).generate(
            prompts, SamplingParams(max_tokens=2 * BLOCK, ignore_eos=True), on_step=steps.append)
        return outputs, sum(s.prefix_units for s in steps)

    (outputs, units), (plain, plain_units) = burst(True), burst(False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert [o.cached_tokens for o in outputs] == [0] + [3 * BLOCK] * 7
    assert units == plain_units - 3 * 7  # the system prompt's 3 whole pages, computed once instead of 8 times


def test_a_prompt_of_whole_cached_pages_starts_denoising_at_once(make_engine, tokenizer):
    prompt = prompts_with_a_shared_prefix(tokenizer, 1)[0][:4 * BLOCK]
    engine = make_engine(max_batch=1)
    first = engine.generate([prompt], SamplingParams(max_tokens=BLOCK, ignore_eos=True))[0]
    steps = []
    again = engine.generate([prompt], SamplingParams(max_tokens=BLOCK, ignore_eos=True), on_step=steps.append)[0]
    assert again.token_ids == first.token_ids
    assert steps[0].prefix_units == 0 and engine.pool.cache.totals.pages_hit == 4  # no prompt page computed


def test_models_that_recompute_their_prompt_do_not_cache(make_engine):
    assert make_engine(kv_cache="none").pool.cache is None
    assert make_engine(prefix_cache=False).pool.cache is None
    assert make_engine().pool.cache is not None


# ---- no leak, nothing held evicted ---------------------------------------------------------------
def check_pages(engine) -> None:
    """Every page is exactly one of: scratch, free, cached, a running request's own; a
    cached run's count is its holders' (those of the runs below it included); an
    unreferenced one is evictable; a request's shared pages are its cached runs'."""
    pool, cache = engine.pool, engine.pool.cache
    running = engine.scheduler.running
    held = Counter(run for request in running if request.allocation.cached is not None
                   for run in request.allocation.cached.path())
    runs = list(cache.runs())
    assert all(run.refs == held[run] and run.pages for run in runs) and set(held) <= set(runs)
    assert all(cache.pages_to(r.allocation.cached) == r.allocation.pages[:r.allocation.shared] for r in running)
    cached = [page for run in runs for page in run.pages]
    assert cache.num_unreferenced == sum(len(run.pages) for run in runs if run.refs == 0)
    assert cache.num_pages == len(cached)
    own = [page for request in running for page in request.allocation.own]
    everything = [PagePool.SCRATCH_PAGE] + pool._free + cached + own
    assert len(everything) == len(set(everything))  # no page in two places
    reserved = sum(request.allocation.reserved for request in running)
    assert pool.num_available == pool.num_free + cache.num_unreferenced - reserved >= 0


@pytest.mark.parametrize("mode", ["fdfo", "static"])
def test_a_long_random_run_leaks_nothing_and_never_evicts_a_held_page(make_engine, mode):
    """500 requests over a few shared prefixes, a pool small enough to evict all the time,
    aborts at random steps and deadlines on the engine's clock; the pages are checked
    after every step."""
    rng = random.Random(mode)
    now = [0.0]
    engine = make_engine(mode=mode, max_batch=6, num_pages=40, fill_timeout_s=0.0)
    engine.clock = engine.scheduler.clock = engine.outputs.clock = lambda: now[0]
    systems = [[rng.randrange(5, 60) for _ in range(rng.randrange(BLOCK, 5 * BLOCK))] for _ in range(6)]
    ended = Counter()
    live: list[str] = []
    for i in range(500):
        prompt = rng.choice(systems) + [rng.randrange(5, 60) for _ in range(rng.randrange(0, BLOCK))]
        timeout = rng.choice([None] * 6 + [0.05, 0.5])
        request_id = f"r{i}"
        engine.add_request(prompt, SamplingParams(max_tokens=rng.choice([1, BLOCK, 2 * BLOCK]), ignore_eos=True,
                                                  timeout_s=timeout),
                           request_id=request_id, on_output=lambda o: o.finished and ended.update([o.finish_reason]))
        live.append(request_id)
        if rng.random() < 0.1:
            engine.abort(live.pop(rng.randrange(len(live))))
        for _ in range(rng.randrange(0, 3)):
            now[0] += 0.01
            engine.step()
            check_pages(engine)
    while engine.has_work():
        now[0] += 0.01
        engine.step()
        check_pages(engine)
    assert sum(ended.values()) == 500 and ended["abort"] > 20 and ended["timeout"] > 10 and ended["length"] > 200
    cache = engine.pool.cache
    assert cache.totals.evictions > 100 and cache.totals.pages_hit > 200
    assert all(run.refs == 0 for run in cache.runs())
    assert engine.pool.num_available == engine.pool.capacity


def run_checked(engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """``prompts`` run to their end, the pages checked after every step (with a cache);
    their answers' ids."""
    answers: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, on_output=lambda o, i=i: answers.__setitem__(i, o.token_ids), whole=True)
    while engine.has_work():
        engine.step()
        if engine.pool.cache is not None:
            check_pages(engine)
    return [answers[i] for i in range(len(prompts))]


@pytest.mark.parametrize("alignment", ["prompt", "page"])
def test_interleaved_chats_give_the_tokens_of_no_cache_and_keep_the_pages_sound(make_engine, alignment):
    """Six chats of four turns on two system prompts, one turn of each at a time on a pool
    small enough to evict: a turn's prompt repeats its chat (prompt and answers), so runs
    are extended by answers, split where chats part and evicted; every turn's answers
    equal the engine's without a cache, and the pages are checked after every step."""
    rng = random.Random(alignment)
    systems = [[rng.randrange(5, 60) for _ in range(length)] for length in (2 * BLOCK, 2 * BLOCK + 5)]
    chats = [list(systems[i % 2]) for i in range(6)]
    params = SamplingParams(max_tokens=2 * BLOCK, ignore_eos=True)
    config = dict(max_batch=3, num_pages=40, block_alignment=alignment, fill_timeout_s=0.0)
    cached, plain = make_engine(**config), make_engine(prefix_cache=False, **config)
    for _ in range(4):
        prompts = [chat + [rng.randrange(5, 60) for _ in range(rng.choice([3, BLOCK]))] for chat in chats]
        answers = run_checked(cached, prompts, params)
        assert answers == run_checked(plain, prompts, params)
        chats = [prompt + answer for prompt, answer in zip(prompts, answers)]
    totals = cached.pool.cache.totals
    assert totals.pages_hit > 4 * 6 and totals.evictions > 0
    assert cached.pool.num_available == cached.pool.capacity


@pytest.mark.parametrize("alignment, whole_pages", [("prompt", False), ("page", False), ("page", True)])
def test_a_next_turn_finds_the_blocks_its_first_turn_committed(make_engine, tokenizer, alignment, whole_pages):
    """A chat's second turn is its first prompt, the first answer and a new message: with
    blocks aligned to the prompt it finds the answer's whole pages in the cache too, and so
    with page alignment after a prompt of whole pages (the answer continues it); after a
    partial page only the first prompt's whole pages (the answer started on a fresh page)."""
    first_prompt = prompts_with_a_shared_prefix(tokenizer, 1)[0]
    assert len(first_prompt) % BLOCK
    if whole_pages:
        first_prompt = first_prompt[:len(first_prompt) // BLOCK * BLOCK]
    params = SamplingParams(max_tokens=3 * BLOCK, ignore_eos=True)

    def turns(**config):
        engine = make_engine(max_batch=2, block_alignment=alignment, **config)
        first = engine.generate([first_prompt], params)[0]
        second = engine.generate([first_prompt + first.token_ids + [7, 8, 9]], params)[0]
        assert engine.pool.num_available == engine.pool.capacity
        return first.token_ids, second.token_ids, second.cached_tokens

    *answers, cached = turns()
    *plain, not_cached = turns(prefix_cache=False)
    assert answers == plain and not_cached == 0
    whole_prompt_pages = len(first_prompt) // BLOCK
    if alignment == "prompt" or whole_pages:
        assert cached >= BLOCK * (whole_prompt_pages + 2)  # the blocks it committed, bar the last
    else:
        assert cached == BLOCK * whole_prompt_pages


def test_bench_prefix_reports_both_settings_side_by_side():
    from tools.bench.prefix import bench_prefix

    report = bench_prefix(requests=3, prefix_len=96, tail_len=8, max_tokens=32, max_batch=2, steps=2, rounds=2,
                          hidden=64, layers=1, heads=2, vocab=512)
    on, off = report["cache_on"], report["cache_off"]
    assert off["hit_rate"] == 0 and on["hit_rate"] >= 0.5  # the warm request cached the prefix's 3 pages
    assert all(run["tokens_per_s"] > 0 and run["ttfb_p50_s"] > 0 for run in (on, off))
    assert report["throughput_on_over_off"] > 0 and report["ttfb_p50_on_over_off"] > 0 and report["rounds"] == 2
