"""The KV pool sized from memory (``replicas.memory``): pages from a byte budget or a share
of memory, never more than max_batch requests of max_model_len need, max_model_len cut
where the pool cannot hold it (and refused where it was asked for), requests scheduled on
the pages actually free, and the attention of long rows in bounded groups."""

import logging

import pytest
import torch

from replicas import attention
from replicas.attention import BatchLayout, paged_context
from replicas.engine import Engine, EngineConfig
from replicas.memory import PoolSizingError, largest_step, page_bytes
from replicas.messages import RequestError, SamplingParams
from replicas.models import load_model
from replicas.engine_config import ServingShape

TINY_PAGE = page_bytes(load_model("tiny").spec, torch.float32)


def engine(**settings) -> Engine:
    return Engine.from_pretrained("tiny", EngineConfig(fdfo_fill_hold=False, **settings))


def test_a_byte_budget_buys_that_many_pages_and_never_more_than_the_batch_needs():
    small = engine(max_batch=4, kv_cache_memory=40 * TINY_PAGE + TINY_PAGE // 2)
    assert small.shape.num_pages == 40 and small.runner.kv_cache.nbytes == 40 * TINY_PAGE
    assert small.shape.max_model_len == small.spec.max_positions  # 39 pages hold one request of 32

    large = engine(max_batch=4, kv_cache_memory="1GiB")
    pages = large.spec.max_positions // large.block_length
    assert large.shape.num_pages == 4 * pages + 1  # what 4 requests of max_model_len need, not 1 GiB


def test_requests_wait_for_pages_actually_free_and_all_finish():
    """A pool that holds one request at a time of the full length: four such requests
    (from a batch of four rows) run one after the other, none refused, none lost."""
    run = engine(max_batch=4, kv_cache_memory=40 * TINY_PAGE)
    prompt = [7] * 100
    params = SamplingParams(max_tokens=run.shape.max_model_len - 112, ignore_eos=True)
    most_running = 0

    def watch(stats):
        nonlocal most_running
        most_running = max(most_running, stats.running)

    answers = run.generate([prompt] * 4, params, on_step=watch)
    assert [a.finish_reason for a in answers] == ["length"] * 4
    assert all(len(a.token_ids) == params.max_tokens for a in answers)
    assert most_running == 1  # the pages, not the rows, bounded the batch
    assert run.pool.num_available == run.pool.capacity


def test_a_default_max_model_len_is_cut_to_what_the_pool_holds(caplog):
    with caplog.at_level(logging.WARNING, logger="replicas.memory"):
        run = engine(max_batch=2, kv_cache_memory=11 * TINY_PAGE)
    assert run.shape.max_model_len == 10 * run.block_length and run.memory.cut_from == run.spec.max_positions
    assert f"max_model_len cut from {run.spec.max_positions} to {10 * run.block_length}" in caplog.text
    with pytest.raises(RequestError, match="at most 160"):
        run.make_request([5] * 100, SamplingParams(max_tokens=100))
    [answer] = run.generate([[5] * 20], SamplingParams(max_tokens=64, ignore_eos=True))
    assert answer.finish_reason == "length"


def test_a_configured_max_model_len_the_pool_cannot_hold_stops_the_start_with_the_sizes():
    with pytest.raises(PoolSizingError) as refused:
        engine(max_batch=2, max_model_len=512, kv_cache_memory=11 * TINY_PAGE)
    message = str(refused.value)
    assert "\n" not in message
    assert "holds 10 pages of 64 KiB" in message and "max_model_len 512 (32 pages, 2.0 MiB)" in message
    assert "replica.kv_cache_memory" in message and "replica.max_model_len" in message


def test_a_share_of_memory_measures_the_largest_step_and_refuses_a_budget_too_small():
    run = engine(max_batch=8, memory_utilization=0.5)
    assert run.memory.step_peak_bytes > 0 and "memory_utilization 0.5" in run.memory.budget
    assert run.shape.num_pages == ServingShape.of(run.config, run.spec).num_pages  # capped at the batch's need
    with pytest.raises(PoolSizingError, match=r"memory_utilization 1e-06 of this machine's .* largest step"):
        engine(max_batch=8, memory_utilization=1e-6)


def test_the_profiled_step_bounds_the_attention_not_its_cost():
    spec = load_model("tiny").spec
    shape = ServingShape.of(EngineConfig(max_batch=8), spec)
    tokens, key_width, beyond = largest_step(shape, 8, refreshes=False, group_keys=4096)
    assert tokens == shape.token_budget and tokens // spec.block_length * key_width <= max(4096, tokens)
    assert beyond == 0
    long = ServingShape(4, 32768, 8192, 0, 2048, "block", True, 1, True)  # SDAR at 32K positions
    group_keys = attention.keys_per_group(8, 128, torch.float32, torch.device("cpu"))
    tokens, key_width, beyond = largest_step(long, 64, refreshes=False, group_keys=group_keys)
    assert group_keys == 32768 and beyond == 0 and 512 * key_width == group_keys  # one group's worth of keys
    tokens, key_width, beyond = largest_step(long, 64, refreshes=False, group_keys=8192)
    assert beyond == 32768 - 8192 and key_width == 16


def test_attention_over_long_rows_in_groups_equals_one_group(monkeypatch):
    """Units gathered in several groups give the same output as all at once."""
    generator = torch.Generator().manual_seed(1)
    units, width, page, heads, kv_heads, dim = 6, 24, 4, 4, 2, 8
    k_cache = [torch.randn(64, kv_heads, dim, generator=generator)]
    v_cache = [torch.randn(64, kv_heads, dim, generator=generator)]
    layout = BatchLayout(
        span_start=torch.arange(units + 1) * page - torch.tensor([0] + [1] * units),  # the first unit partial
        cache_positions=torch.arange(units * page - 1) + 32,
        key_cache_positions=torch.randint(0, 64, (units, width), generator=generator),
        key_valid=torch.rand(units, width, generator=generator) > 0.3)
    q = torch.randn(units * page - 1, heads, dim, generator=generator)
    k = torch.randn(units * page - 1, kv_heads, dim, generator=generator)
    v = torch.randn(units * page - 1, kv_heads, dim, generator=generator)
    layout.key_valid[:, 0] = True
    whole = paged_context("sdpa", layout, [c.clone() for c in k_cache], [c.clone() for c in v_cache], page)
    assert len(whole.groups) == 1
    expected = whole.attend(0, q, k, v)
    monkeypatch.setattr(attention, "DEFAULT_GROUP_BYTES", 2 * width * 2 * kv_heads * dim * 4)
    grouped = paged_context("sdpa", layout, [c.clone() for c in k_cache], [c.clone() for c in v_cache], page)
    assert grouped.groups == [(0, 2), (2, 4), (4, 6)]
    torch.testing.assert_close(grouped.attend(0, q, k, v), expected)


def test_up_refuses_a_pool_the_settings_fix_too_small_before_starting_anything(capsys):
    from tools.cli import main

    assert main(["up", "--set", f"replica.kv_cache_memory={4 * TINY_PAGE}", "--set", "replica.max_model_len=512"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dllm-serve: error: the KV pool holds 3 pages")
    assert "replica.kv_cache_memory" in err
