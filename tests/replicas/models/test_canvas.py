"""The sequence layout settings: the canvas (per-model defaults, refusal where it cannot
apply, pages and batching) and the blocks' alignment."""

import pytest
import torch

from tools.bench.canvas import bench_canvas
from replicas.attention import DenseAttentionContext
from replicas.engine import Engine, EngineConfig
from replicas.messages import RequestError, SamplingParams
from tests.replicas.step_spies import track_stepped


@pytest.mark.parametrize("arch, canvas, aligned", [
    ("LLaDAModelLM", "full", False), ("DreamModel", "full", False),
    ("SDARForCausalLM", "block", True), ("LLaDA2MoeModelLM", "block", True)])
def test_the_default_layout_is_the_models_reference(checkpoint_engine, arch, canvas, aligned):
    engine = checkpoint_engine(arch, max_batch=1)
    assert (engine.shape.canvas, engine.shape.aligned) == (canvas, aligned)
    assert not Engine.from_pretrained("tiny", EngineConfig(max_batch=1)).shape.aligned  # trained on fresh pages


def test_a_block_causal_model_refuses_the_full_canvas(checkpoint_engine):
    with pytest.raises(ValueError, match="canvas 'full' needs a bidirectional model"):
        checkpoint_engine("SDARForCausalLM", max_batch=1, canvas="full")


@pytest.mark.parametrize("kv_cache", ["none", "prefix"])
def test_full_canvas_rows_do_not_depend_on_their_batch(checkpoint_engine, kv_cache):
    """Four requests of different lengths in one batch answer as each does alone; every
    page of the canvas is taken at admission and all come back."""
    prompts = [[5 + (i * 7 + r) % 80 for i in range(9 + 13 * r)] for r in range(4)]
    params = [SamplingParams(max_tokens=(3 - r % 3) * 32, ignore_eos=True) for r in range(4)]
    alone = []
    for prompt, p in zip(prompts, params):
        engine = checkpoint_engine("LLaDAModelLM", max_batch=1, kv_cache=kv_cache)
        alone.append(engine.generate([prompt], p)[0].token_ids)
    engine = checkpoint_engine("LLaDAModelLM", max_batch=4, kv_cache=kv_cache)
    free = engine.pool.num_free
    streamed = []
    engine.add_request(prompts[0], params[0], on_output=streamed.append)
    engine.step()  # admission lays out the whole canvas: prompt pages and every block's page
    assert free - engine.pool.num_free == 1 + 3
    together = engine.generate(prompts[1:], params[1:])  # the first request runs on with them
    assert [t for o in streamed for t in o.token_ids] == alone[0]
    assert [o.token_ids for o in together] == alone[1:]
    assert engine.pool.num_free == free


@pytest.mark.bench
def test_bench_canvas_runs_both_canvases_through_the_same_forwards():
    from tools.cli import main

    report = bench_canvas((1, 2), prompt_len=20, max_tokens=64, steps=4, rounds=2, d_model=64, layers=1, heads=4,
                          mlp=128)
    for batch in (1, 2):
        block, full = report[f"batch_{batch}"]["block"], report[f"batch_{batch}"]["full"]
        assert block["steps"] == full["steps"] == 2 * 4  # two blocks of four forwards, fused commits
        assert full["tokens_per_s"] > 0 and block["tokens_per_s"] > 0
    assert main(["bench", "canvas", "--batch-sizes", "1", "--d-model", "64", "--layers", "1", "--max-tokens", "32",
                 "--prompt-len", "8", "--json"]) == 0


PROMPT = [5 + (i * 7) % 80 for i in range(45)]


def spy_sequences(engine):
    """For every forward of a one-request engine: the row's whole sequence up to the end of
    its active block (what the block attends to) and the block's logits."""
    seen, forward = [], engine.runner.forward
    stepped = track_stepped(engine)

    def spy(batch):
        logits, seconds = forward(batch)
        if stepped():
            request = stepped()[0]
            end = (request.active_page_index + 1) * engine.block_length
            seen.append((engine.rows.tokens[request.row].reshape(-1)[:end].tolist(), logits[0]))
        return logits, seconds

    engine.runner.forward = spy
    return seen


@pytest.mark.parametrize("arch", ["SDARForCausalLM", "LLaDA2MoeModelLM"])
def test_aligned_blocks_continue_the_prompts_last_block(checkpoint_engine, arch):
    """block_alignment 'prompt': the sequence is prompt + answer without a gap, cut into
    blocks from its start; every forward's logits equal a dense block-causal forward over
    it, and the answer is what follows the prompt."""
    engine = checkpoint_engine(arch, max_batch=1, block_alignment="prompt", max_tokens_per_step=64)
    size = engine.block_length
    seen = spy_sequences(engine)
    output = engine.generate([PROMPT], SamplingParams(max_tokens=2 * size, ignore_eos=True))[0]
    assert len(PROMPT) % size  # the prompt ends inside a block
    first_block_start = len(PROMPT) // size * size
    assert seen[0][0][:len(PROMPT)] == PROMPT and len(seen[0][0]) == first_block_start + size
    for sequence, logits in seen:
        positions = torch.arange(len(sequence))
        page = positions // size
        mask = (page[None, :] <= page[:, None])[None, None]
        with torch.inference_mode():
            dense = engine.model(torch.tensor([sequence]), positions[None], DenseAttentionContext(mask))[0]
        torch.testing.assert_close(logits, dense[-size:], rtol=1e-4, atol=1e-4)
    final = seen[-1][0][len(PROMPT):]  # the last forward filled the masks left in it
    assert len(output.token_ids) == 2 * size <= len(final)  # the last block may run past max_tokens
    assert all(seen_token in (token, engine.spec.mask_token_id) for token, seen_token in zip(output.token_ids, final))


def test_an_aligned_request_resumes_where_prompt_and_output_end_a_block(checkpoint_engine):
    engine = checkpoint_engine("SDARForCausalLM", max_batch=1, block_alignment="prompt")
    size = engine.block_length
    whole = engine.generate([PROMPT], SamplingParams(max_tokens=4 * size, ignore_eos=True))[0].token_ids
    committed = whole[:size - len(PROMPT) % size + size]  # the first two answer blocks
    resumed = engine.generate([PROMPT], SamplingParams(max_tokens=4 * size, ignore_eos=True,
                                                       resume_ids=tuple(committed)))[0]
    assert committed + resumed.token_ids == whole
    with pytest.raises(RequestError, match="after the prompt, must end a block"):
        engine.make_request(PROMPT, SamplingParams(max_tokens=4 * size, resume_ids=tuple(whole[:size])))
