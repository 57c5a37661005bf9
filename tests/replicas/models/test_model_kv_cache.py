"""Logits with the KV cache against a dense forward without it, per attention kind and canvas.

The reference is one uncached forward over prompt + committed blocks + the active block
(+ the masks of every later block with the full canvas) with contiguous positions:
block-causal at block granularity (SDAR, LLaDA2.0) or fully bidirectional (LLaDA, Dream;
Dream's logits read one position earlier).
"""

import pytest
import torch

from checkpoint_builders import OVERRIDES
from replicas.attention import DenseAttentionContext
from replicas.engine import Engine, EngineConfig
from replicas.messages import SamplingParams
from tests.replicas.step_spies import track_stepped


def record_steps(engine, prompt, max_tokens):
    """(committed blocks, active block, block step, logits, later blocks) for every forward
    of one request."""
    size, seen, forward = engine.block_length, [], engine.runner.forward
    stepped = track_stepped(engine)

    def spy(batch):
        request = stepped()[0] if stepped() else None
        if request is not None:
            block = engine.rows.blocks([request.row], [request.active_page_index])[0]
            committed = [request.output_ids[j * size:(j + 1) * size] for j in range(request.block_index)]
            step = request.steps_in_block
            later = request.max_blocks - request.block_index - 1
        logits, seconds = forward(batch)
        if request is not None:
            seen.append((committed, block.tolist(), step, logits[0], later))
        return logits, seconds

    engine.runner.forward = spy
    engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return seen


def dense_logits(engine, prompt, committed, block, block_at_start=None, later=0):
    """Uncached reference logits of ``block``, followed by ``later`` masked blocks (the full
    canvas). With ``block_at_start`` (the prefix or dual cache): the sequence is computed
    with the block as it was when it started, and the current block sees that sequence's
    other tokens and itself."""
    model, spec, size = engine.model, engine.spec, engine.block_length
    prefix = list(prompt) + [t for blk in committed for t in blk]
    n = len(prefix)
    tokens = prefix + (block if block_at_start is None else block_at_start) + [spec.mask_token_id] * (later * size)
    total = len(tokens)
    positions, query = list(range(total)), torch.arange(n, n + size)
    page_indices = [p // size for p in range(len(prompt))] + [
        -(-len(prompt) // size) + j for j in range(len(committed) + 1 + later) for _ in range(size)]
    page_index = torch.tensor(page_indices)
    mask = (torch.ones(total, total, dtype=torch.bool) if spec.bidirectional
            else page_index[None, :] <= page_index[:, None])
    if block_at_start is not None:
        tokens, positions, query = tokens + block, positions + list(range(n, n + size)), query - n + total
        mask = torch.nn.functional.pad(mask, (0, size, 0, size))
        mask[total:, :n] = mask[total:, n + size:] = True
    with torch.inference_mode():
        out = model(torch.tensor([tokens]), torch.tensor([positions]), DenseAttentionContext(mask[None, None]))[0]
    if spec.shift_logits:
        query = query - 1
        query[0] = n - 1
    return out[query]


def make_engine(checkpoint_dir, arch, kv_cache="prefix", canvas=None):
    """The first answer block on a fresh page (the layout ``dense_logits`` builds; the
    aligned one is checked in test_canvas)."""
    return Engine.from_pretrained(str(checkpoint_dir(arch)), EngineConfig(
        max_batch=1, kv_cache=kv_cache, max_tokens_per_step=64, model_overrides=OVERRIDES[arch], canvas=canvas,
        block_alignment="page"))


PROMPT = [5 + (i * 7) % 80 for i in range(45)]  # 45 tokens: chunked prefill, a partial last page


@pytest.mark.parametrize("arch", ["SDARForCausalLM", "LLaDA2MoeModelLM"])
def test_block_causal_cache_is_exact(checkpoint_dir, arch):
    engine = make_engine(checkpoint_dir, arch)
    steps = record_steps(engine, PROMPT, 3 * engine.block_length)
    assert len({len(c) for c, *_ in steps}) == 3  # three blocks, each over several steps
    for committed, block, _, logits, _ in steps:
        torch.testing.assert_close(logits, dense_logits(engine, PROMPT, committed, block), rtol=1e-4, atol=1e-4)


BIDIRECTIONAL = [(arch, canvas) for arch in ("LLaDAModelLM", "DreamModel") for canvas in ("block", "full")]


@pytest.mark.parametrize("arch, canvas", BIDIRECTIONAL)
def test_bidirectional_without_cache_is_exact(checkpoint_dir, arch, canvas):
    engine = make_engine(checkpoint_dir, arch, kv_cache="none", canvas=canvas)
    steps = record_steps(engine, PROMPT, 3 * engine.block_length)
    assert {later for *_, later in steps} == {2, 1, 0}
    for committed, block, _, logits, later in steps:
        later = later if canvas == "full" else 0
        torch.testing.assert_close(logits, dense_logits(engine, PROMPT, committed, block, later=later),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch, canvas", BIDIRECTIONAL)
def test_bidirectional_cache_is_the_documented_approximation(checkpoint_dir, arch, canvas):
    """Exact at a block's first step; later steps see the KV the block's first step computed
    for the prefix (and, with the full canvas, for the masked suffix: the dual cache)."""
    engine = make_engine(checkpoint_dir, arch, canvas=canvas)
    steps = record_steps(engine, PROMPT, 3 * engine.block_length)
    approximate = 0
    for committed, block, step, logits, later in steps:
        later = later if canvas == "full" else 0
        if step == 0:
            block_at_start = block
            torch.testing.assert_close(logits, dense_logits(engine, PROMPT, committed, block, later=later),
                                       rtol=1e-4, atol=1e-4)
            continue
        expected = dense_logits(engine, PROMPT, committed, block, block_at_start, later)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        exact = dense_logits(engine, PROMPT, committed, block, later=later)
        approximate += not torch.allclose(logits, exact, rtol=1e-4, atol=1e-4)
    assert approximate > 0  # the approximation is real: the stale KV changes the logits
