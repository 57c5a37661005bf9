"""The paged, cached forward gives the same block logits as a dense forward without cache."""

import numpy as np
import pytest
import torch

from replicas.attention import DenseAttentionContext
from replicas.step import ScheduledBatch
from replicas.kv_cache import KVCache, PagePool
from replicas.messages import SamplingParams
from replicas.rows import RowTable
from replicas.runner import ModelRunner
from tests.replicas.step_spies import track_stepped


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


def record_block_logits(engine):
    """Wrap the engine's forward: per stepped row, (prompt, committed blocks, active block, logits)."""
    seen = []
    forward = engine.runner.forward
    size = engine.block_length
    stepped = track_stepped(engine)

    def spy(batch):
        requests = list(stepped())
        blocks = engine.rows.blocks([r.row for r in requests], [r.active_page_index for r in requests]).tolist()
        committed = [[r.output_ids[j * size:(j + 1) * size] for j in range(r.block_index)] for r in requests]
        logits, seconds = forward(batch)
        stepped_logits = logits[torch.from_numpy(batch.advances)] if len(logits) else logits
        for k, request in enumerate(requests):
            seen.append((request.prompt_ids, committed[k], blocks[k], stepped_logits[k]))
        return logits, seconds

    engine.runner.forward = spy
    return seen


def assert_dense_equal(model, seen):
    for prompt, committed, block, logits in seen:
        torch.testing.assert_close(logits, dense_block_logits(model, prompt, committed, block), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused_commit", [True, False])
@pytest.mark.parametrize("prompt_len,budget", [(37, None), (16, None), (100, 32), (5, 16)])
def test_cached_logits_equal_uncached(make_engine, random_model, prompt_len, budget, fused_commit):
    if budget and fused_commit:  # each step also writes the last committed block: twice the room
        budget *= 2
    engine = make_engine(max_batch=1, max_tokens_per_step=budget, fused_commit=fused_commit)
    prompt = [5 + (i * 7) % 40 for i in range(prompt_len)]
    seen = record_block_logits(engine)
    engine.generate([prompt], SamplingParams(max_tokens=48, ignore_eos=True))
    assert len(seen) >= 3
    assert_dense_equal(random_model, seen)


@pytest.mark.parametrize("mode", ["fdfo", "sync", "static"])
def test_fused_commit_writes_every_committed_block_before_it_is_attended(make_engine, random_model, mode):
    """Rows that finish blocks at different steps (threshold 0 fills a block in one step;
    the untrained model meets 0.9 nowhere, one position a step), fused commits: every
    block's logits equal the dense forward over the committed blocks' final tokens. fdfo
    writes each non-final block as a prefix unit of the row's next forward; sync and
    static write some with the idle unit of a row that waits for its round instead."""
    engine = make_engine(max_batch=4, mode=mode)
    size = engine.block_length
    prompts = [[5 + (i * k) % 40 for i in range(n)] for k, n in ((7, 37), (3, 16), (5, 9), (11, 50))]
    max_tokens, thresholds = (48, 32, 64, 16), (0.9, 0.0, 0.0, 0.9)
    seen = record_block_logits(engine)
    steps = []
    engine.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True, algorithm="fast_dllm_threshold",
                                             algorithm_params={"threshold": t})
                              for m, t in zip(max_tokens, thresholds)], on_step=steps.append)
    assert any(committed for _, committed, _, _ in seen)
    assert_dense_equal(random_model, seen)
    prompt_pages = sum(-(-len(p) // size) for p in prompts)
    commit_writes = sum(s.prefix_units for s in steps) - prompt_pages
    non_final_blocks = sum(m // size - 1 for m in max_tokens)
    if mode == "fdfo":
        assert commit_writes == non_final_blocks
    else:
        assert 0 <= commit_writes < non_final_blocks


def test_runner_works_from_the_plain_batch_alone(random_model):
    """No scheduler and no request: a row filled by hand and a batch of tensors."""
    size = random_model.spec.block_length
    prompt = [5 + (i * 3) % 40 for i in range(20)]  # one full page and 4 tokens
    pages = PagePool(8).allocate(None, 3, 0).pages
    rows = RowTable(2, 4, size, pad_id=random_model.spec.eos_token_id)
    row = rows.acquire(prompt, pages[:2])
    rows.start_blocks([row], [2], [pages[2]], [0], random_model.spec.mask_token_id)
    block = [random_model.spec.mask_token_id] * size
    block[3] = 7
    rows.write_blocks([row], [2], [block])
    kv_cache = KVCache(random_model.spec.num_layers, 8, size, random_model.spec.num_kv_heads,
                       random_model.spec.head_dim, torch.float32, "cpu")
    runner = ModelRunner(random_model, rows, kv_cache, torch.device("cpu"))
    batch = ScheduledBatch(
        num_rows=1, unit_row=np.array([row] * 3), unit_page_index=np.array([0, 1, 2]),
        unit_count=np.array([size, 4, size]), unit_is_block=np.array([False, False, True]),
        unit_scratch=np.array([False] * 3), advances=np.array([True]), steps_in_block=np.array([0]),
        stepped_blocks=np.array([[row], [2]]), num_tokens=2 * size + 4, prefix_units=2)
    with torch.inference_mode():
        logits, _ = runner.forward(batch)
    torch.testing.assert_close(logits[0], dense_block_logits(random_model, prompt, [], block), rtol=1e-4, atol=1e-4)
