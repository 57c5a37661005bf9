"""The paged, cached forward gives the same block logits as a dense forward without cache."""

import pytest
import torch

from replicas.attention import DenseAttentionContext
from replicas.request import SamplingParams


def dense_block_logits(model, prompt_ids, committed, block):
    """Reference: one uncached forward over prompt + committed blocks + the active block."""
    size = model.spec.block_length
    prompt_pages = -(-len(prompt_ids) // size)
    positions = list(range(len(prompt_ids)))
    segments = [p // size for p in positions]
    tokens = list(prompt_ids)
    for j, blk in enumerate(committed + [block]):
        page = prompt_pages + j
        tokens += blk
        positions += [page * size + o for o in range(size)]
        segments += [page] * size
    seg = torch.tensor(segments)
    mask = (seg[None, :] <= seg[:, None])[None, None]
    with torch.inference_mode():
        logits = model(torch.tensor([tokens]), torch.tensor([positions]), DenseAttentionContext(mask))
    return logits[0, -size:]


@pytest.mark.parametrize("prompt_len,budget", [(37, None), (16, None), (100, 32), (5, 16)])
def test_cached_logits_equal_uncached(make_engine, random_model, prompt_len, budget):
    engine = make_engine(max_batch=1, max_tokens_per_step=budget)
    prompt = [5 + (i * 7) % 40 for i in range(prompt_len)]
    seen = []
    forward = engine.runner.forward

    def spy(batch):
        request = batch.block_rows[0] if batch.block_rows else None
        block = None
        if request is not None:
            block = engine.slots.blocks(torch.tensor([request.slot]), torch.tensor([request.active_segment]))[0].tolist()
            committed = [request.output_ids[j * 16:(j + 1) * 16] for j in range(request.block_index)]
        logits, seconds = forward(batch)
        if block is not None:
            seen.append((committed, block, logits[0]))
        return logits, seconds

    engine.runner.forward = spy
    engine.generate([prompt], SamplingParams(max_tokens=48, ignore_eos=True))
    assert len(seen) >= 3
    for committed, block, logits in seen:
        expected = dense_block_logits(random_model, prompt, committed, block)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
