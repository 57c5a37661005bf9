"""Infilling (``suffix``): on the full canvas the suffix's tokens sit after the answer's
masked blocks, every forward of the answer attends to them, and the answer fills the gap;
a block-causal model refuses it."""

import pytest
import torch

from replicas.attention import DenseAttentionContext
from replicas.messages import INFILL_NEEDS, RequestError, SamplingParams
from tests.replicas.step_spies import track_stepped

PROMPT = [5 + (i * 7) % 80 for i in range(45)]
SUFFIX = [7 + (i * 11) % 70 for i in range(20)]


def spy_canvas(engine):
    """For every forward of a one-request engine: the row's canvas as a dense sequence
    (prompt, answer blocks, suffix, without page padding), where its active block starts
    in it, and the block's logits."""
    seen, forward = [], engine.runner.forward
    size = engine.block_length
    stepped = track_stepped(engine)

    def spy(batch):
        logits, seconds = forward(batch)
        if stepped():
            request = stepped()[0]
            tokens = engine.rows.tokens[request.row].reshape(-1)
            answer_start = request.prefix_pages * size
            answer_end = answer_start + request.blocks_to_denoise * size
            sequence = (tokens[:len(PROMPT)].tolist() + tokens[answer_start:answer_end].tolist()
                        + tokens[answer_end:answer_end + len(request.params.suffix_ids)].tolist())
            block_start = len(PROMPT) + (request.active_page_index - request.prefix_pages) * size
            seen.append((sequence, block_start, logits[0]))
        return logits, seconds

    engine.runner.forward = spy
    return seen


def dense(engine, sequence):
    """The model's logits over ``sequence``, every position attending to every other."""
    positions = torch.arange(len(sequence))
    everything = torch.ones(1, 1, len(sequence), len(sequence), dtype=torch.bool)
    with torch.inference_mode():
        return engine.model(torch.tensor([sequence]), positions[None], DenseAttentionContext(everything))[0]


def test_every_forward_attends_to_the_suffix_as_a_dense_forward_does(checkpoint_engine):
    engine = checkpoint_engine("LLaDAModelLM", max_batch=1, kv_cache="none")
    size = engine.block_length
    seen = spy_canvas(engine)
    free = engine.pool.num_free
    output = engine.generate([PROMPT], SamplingParams(max_tokens=2 * size, ignore_eos=True,
                                                      suffix_ids=tuple(SUFFIX)))[0]
    assert len(output.token_ids) == 2 * size and engine.pool.num_free == free
    assert len(seen) >= 2
    for sequence, block_start, logits in seen:
        assert sequence[:len(PROMPT)] == PROMPT and sequence[-len(SUFFIX):] == SUFFIX
        torch.testing.assert_close(logits, dense(engine, sequence)[block_start:block_start + size],
                                   rtol=1e-4, atol=1e-4)
        without = dense(engine, sequence[:-len(SUFFIX)])[block_start:block_start + size]
        assert not torch.allclose(logits, without, atol=1e-3)  # the suffix is attended
    # the answer is what fills the gap: the last forward's canvas with its masks filled
    final = seen[-1][0][len(PROMPT):len(PROMPT) + 2 * size]
    assert all(seen_token in (token, engine.spec.mask_token_id) for token, seen_token in zip(output.token_ids, final))


def test_the_suffix_changes_the_answer_and_the_dual_cache_serves_it(checkpoint_engine):
    size = 32
    answers = {}
    for kv_cache in ("prefix", "none"):
        engine = checkpoint_engine("LLaDAModelLM", max_batch=2, kv_cache=kv_cache)
        answers[kv_cache] = [out.token_ids for out in engine.generate(
            [PROMPT, PROMPT], [SamplingParams(max_tokens=2 * size, ignore_eos=True, suffix_ids=tuple(SUFFIX)),
                               SamplingParams(max_tokens=2 * size, ignore_eos=True)])]
    assert answers["none"][0] != answers["none"][1]  # what comes after shapes the answer
    assert len(answers["prefix"][0]) == 2 * size


@pytest.mark.parametrize("arch", ["SDARForCausalLM", "LLaDA2MoeModelLM"])
def test_a_block_causal_model_refuses_a_suffix(checkpoint_engine, arch):
    engine = checkpoint_engine(arch, max_batch=1)
    with pytest.raises(RequestError, match="needs a bidirectional model on the full canvas"):
        engine.make_request(PROMPT, SamplingParams(max_tokens=32, suffix_ids=(5, 6)))
    assert "full canvas" in INFILL_NEEDS


def test_a_suffix_counts_in_the_length(checkpoint_engine):
    engine = checkpoint_engine("LLaDAModelLM", max_batch=1)
    room = engine.shape.max_model_len - 2 * engine.block_length
    with pytest.raises(RequestError, match=r"and the suffix \(\d+ tokens\)"):
        engine.make_request(PROMPT, SamplingParams(max_tokens=room, suffix_ids=tuple(SUFFIX * 4)))


def test_usage_counts_the_suffix_in_the_prompt_tokens(checkpoint_engine):
    """The suffix's tokens are on the canvas (and in max_model_len): streamed and whole
    answers count them in ``prompt_tokens``."""
    engine = checkpoint_engine("LLaDAModelLM", max_batch=1)
    params = SamplingParams(max_tokens=engine.block_length, ignore_eos=True, suffix_ids=tuple(SUFFIX))
    streamed = []
    engine.add_request(PROMPT, params, on_output=streamed.append)
    while engine.has_work():
        engine.step()
    [whole] = engine.generate([PROMPT], params)
    assert {chunk.prompt_tokens for chunk in streamed + [whole]} == {len(PROMPT) + len(SUFFIX)}
