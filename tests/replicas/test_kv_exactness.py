"""The paged, cached forward gives the same block logits as a dense forward without cache."""

import pytest
import torch

from replicas.attention import DenseAttentionContext
from replicas.batch import ScheduledBatch
from replicas.kv_cache import KVCache, PagePool
from replicas.request import SamplingParams
from replicas.rows import RowTable
from replicas.runner import ModelRunner


def dense_block_logits(model, prompt_ids, committed, block):
    """Reference: one uncached forward over prompt + committed blocks + the active block."""
    size = model.spec.block_length
    prompt_pages = -(-len(prompt_ids) // size)
    positions = list(range(len(prompt_ids)))
    page_indices = [p // size for p in positions]
    tokens = list(prompt_ids)
    for j, blk in enumerate(committed + [block]):
        page = prompt_pages + j
        tokens += blk
        positions += [page * size + o for o in range(size)]
        page_indices += [page] * size
    page_index = torch.tensor(page_indices)
    mask = (page_index[None, :] <= page_index[:, None])[None, None]
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
        request = engine.scheduler.stepped[0] if engine.scheduler.stepped else None
        block = None
        if request is not None:
            block = engine.rows.blocks(torch.tensor([request.row]),
                                       torch.tensor([request.active_page_index]))[0].tolist()
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


def test_runner_works_from_the_plain_batch_alone(random_model):
    """No scheduler and no request: a row filled by hand and a batch of tensors."""
    size = random_model.spec.block_length
    prompt = [5 + (i * 3) % 40 for i in range(20)]  # one full page and 4 tokens
    pool = PagePool(8)
    pool.reserve(3)
    pages = [pool.take() for _ in range(3)]
    rows = RowTable(2, 4, size, pad_id=random_model.spec.eos_token_id)
    row = rows.acquire(prompt, pages[:2])
    rows.start_block(row, 2, pages[2], random_model.spec.mask_token_id)
    block = [random_model.spec.mask_token_id] * size
    block[3] = 7
    rows.write_blocks(torch.tensor([row]), torch.tensor([2]), torch.tensor([block]))
    kv_cache = KVCache(random_model.spec.num_layers, 8, size, random_model.spec.num_kv_heads,
                       random_model.spec.head_dim, torch.float32, "cpu")
    runner = ModelRunner(random_model, rows, kv_cache, torch.device("cpu"))
    batch = ScheduledBatch(
        num_rows=1, unit_row=torch.tensor([row] * 3), unit_page_index=torch.tensor([0, 1, 2]),
        unit_count=torch.tensor([size, 4, size]), unit_is_block=torch.tensor([False, False, True]),
        unit_scratch=torch.tensor([False] * 3), stepped=torch.tensor([True]), block_steps=torch.tensor([0]))
    logits, _ = runner.forward(batch)
    torch.testing.assert_close(logits[0], dense_block_logits(random_model, prompt, [], block), rtol=1e-4, atol=1e-4)
