"""Logits with the KV cache against a dense forward without it, per attention kind.

The reference is one uncached forward over prompt + committed blocks + the active block
with contiguous positions: block-causal at block granularity (SDAR, LLaDA2.0) or fully
bidirectional (LLaDA, Dream; Dream's logits read one position earlier).
"""

import pytest
import torch

from checkpoint_builders import OVERRIDES
from replicas.attention import DenseAttentionContext
from replicas.engine import Engine, EngineConfig
from replicas.request import SamplingParams


def record_steps(engine, prompt, max_tokens):
    """(committed blocks, active block, block step, logits) for every forward of one request."""
    size, seen, forward = engine.block_length, [], engine.runner.forward

    def spy(batch):
        request = engine.scheduler.stepped[0] if engine.scheduler.stepped else None
        if request is not None:
            block = engine.rows.blocks(torch.tensor([request.row]), torch.tensor([request.active_page_index]))[0]
            committed = [request.output_ids[j * size:(j + 1) * size] for j in range(request.block_index)]
            step = request.block_steps
        logits, seconds = forward(batch)
        if request is not None:
            seen.append((committed, block.tolist(), step, logits[0]))
        return logits, seconds

    engine.runner.forward = spy
    engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return seen


def dense_logits(engine, prompt, committed, block, block_at_start=None):
    """Uncached reference logits of ``block``. With ``block_at_start`` (the prefix-cache
    approximation): the prefix is computed against the block as it was when it started,
    and the current block sees that prefix and itself."""
    model, spec, size = engine.model, engine.spec, engine.block_length
    prefix = list(prompt) + [t for blk in committed for t in blk]
    n = len(prefix)
    tokens, positions = prefix + block, list(range(n + size))
    page_indices = [p // size for p in range(len(prompt))] + [
        -(-len(prompt) // size) + j for j in range(len(committed) + 1) for _ in range(size)]
    page_index = torch.tensor(page_indices)
    mask = (torch.ones(n + size, n + size, dtype=torch.bool) if spec.bidirectional
            else page_index[None, :] <= page_index[:, None])
    if block_at_start is not None:
        tokens, positions = prefix + block_at_start + block, positions + list(range(n, n + size))
        mask = torch.zeros(n + 2 * size, n + 2 * size, dtype=torch.bool)
        mask[: n + size, : n + size] = True
        mask[n + size:, :n] = True
        mask[n + size:, n + size:] = True
    with torch.inference_mode():
        out = model(torch.tensor([tokens]), torch.tensor([positions]), DenseAttentionContext(mask[None, None]))[0]
    rows = torch.arange(len(tokens) - size, len(tokens))
    if spec.shift_logits:
        rows = rows - 1
        rows[0] = n - 1
    return out[rows]


def make_engine(checkpoint_dir, arch, kv_cache="prefix"):
    return Engine.from_pretrained(str(checkpoint_dir(arch)), EngineConfig(
        max_batch=1, kv_cache=kv_cache, max_tokens_per_step=64, model_overrides=OVERRIDES[arch]))


PROMPT = [5 + (i * 7) % 80 for i in range(45)]  # 45 tokens: chunked prefill, a partial last page


@pytest.mark.parametrize("arch", ["SDARForCausalLM", "LLaDA2MoeModelLM"])
def test_block_causal_cache_is_exact(checkpoint_dir, arch):
    engine = make_engine(checkpoint_dir, arch)
    steps = record_steps(engine, PROMPT, 3 * engine.block_length)
    assert len({len(c) for c, *_ in steps}) == 3  # three blocks, each over several steps
    for committed, block, _, logits in steps:
        torch.testing.assert_close(logits, dense_logits(engine, PROMPT, committed, block), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["LLaDAModelLM", "DreamModel"])
def test_bidirectional_without_cache_is_exact(checkpoint_dir, arch):
    engine = make_engine(checkpoint_dir, arch, kv_cache="none")
    steps = record_steps(engine, PROMPT, 2 * engine.block_length)
    for committed, block, _, logits in steps:
        torch.testing.assert_close(logits, dense_logits(engine, PROMPT, committed, block), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["LLaDAModelLM", "DreamModel"])
def test_bidirectional_prefix_cache_is_the_documented_approximation(checkpoint_dir, arch):
    """Exact at a block's first step; later steps see the prefix KV of the block's start."""
    engine = make_engine(checkpoint_dir, arch)
    steps = record_steps(engine, PROMPT, 2 * engine.block_length)
    approximate = 0
    for committed, block, step, logits in steps:
        if step == 0:
            block_at_start = block
            torch.testing.assert_close(logits, dense_logits(engine, PROMPT, committed, block), rtol=1e-4, atol=1e-4)
            continue
        expected = dense_logits(engine, PROMPT, committed, block, block_at_start)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        exact = dense_logits(engine, PROMPT, committed, block)
        approximate += not torch.allclose(logits, exact, rtol=1e-4, atol=1e-4)
    assert approximate > 0  # the approximation is real: the stale prefix changes the logits
