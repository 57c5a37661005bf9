"""A continuation (``SamplingParams.resume_ids``) goes on exactly where the first run was:
resumed after any number of committed blocks, it produces the same tokens and text, for
every model format and KV policy, greedy and seeded (SDAR and LLaDA2.0 with their blocks
aligned to the sequence's start, whose first answer block holds the prompt's end)."""

import pytest

from replicas.engine import Engine
from replicas.messages import RequestError, SamplingParams
from test_model_kv_cache import PROMPT

ARCHS = ["tiny", "SDARForCausalLM", "LLaDA2MoeModelLM", "LLaDAModelLM", "DreamModel"]
GREEDY = {"algorithm": "low_confidence"}
SEEDED = {"algorithm": "fixed_steps", "algorithm_params": {"temperature": 1.0, "seed": 7}}


@pytest.fixture
def engine_for(checkpoint_engine, make_engine):
    def make(arch: str, **config) -> Engine:
        return make_engine(**config) if arch == "tiny" else checkpoint_engine(arch, **config)
    return make


def committed_tokens(engine: Engine, blocks: int) -> int:
    """Answer tokens in the first ``blocks`` committed blocks."""
    size = engine.block_length
    first = size - len(PROMPT) % size if engine.shape.aligned else size
    return first + (blocks - 1) * size


def run(engine: Engine, prompt, params: SamplingParams):
    [output] = engine.generate([prompt], params)
    return output


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_resumed_request_equals_the_uninterrupted_one(engine_for, arch, sampling):
    engine = engine_for(arch, max_batch=1, max_tokens_per_step=64)
    size = engine.block_length
    params = SamplingParams(max_tokens=3 * size + 3, ignore_eos=True, **sampling)
    whole = run(engine, PROMPT, params)
    assert len(whole.token_ids) == 3 * size + 3
    for blocks in (1, 3):
        done = committed_tokens(engine, blocks)
        resumed = run(engine, PROMPT, SamplingParams(
            max_tokens=params.max_tokens, ignore_eos=True, resume_ids=tuple(whole.token_ids[:done]), **sampling))
        assert resumed.token_ids == whole.token_ids[done:]
        assert resumed.completion_tokens == len(whole.token_ids)
        prefix = engine.tokenizer.decode(whole.token_ids[:done], skip_special_tokens=True)
        assert prefix + resumed.text == whole.text
    assert engine.pool.num_available == engine.pool.capacity


def test_resumed_request_shares_a_batch_with_fresh_ones(make_engine):
    engine = make_engine(max_batch=4)
    size = engine.block_length
    params = SamplingParams(max_tokens=4 * size, ignore_eos=True)
    prompts = ["abc", "hello world", "q"]
    whole = engine.generate(prompts, params)
    resumed = engine.generate(prompts, [
        params, SamplingParams(max_tokens=4 * size, ignore_eos=True, resume_ids=tuple(whole[1].token_ids[:2 * size])),
        params])
    assert [o.token_ids for o in resumed] == [whole[0].token_ids, whole[1].token_ids[2 * size:],
                                                 whole[2].token_ids]


@pytest.mark.parametrize("resume, message", [
    (lambda size: [5] * (size - 1), "whole blocks"),
    (lambda size: [5] * (4 * size), "shorter than max_tokens"),
    (lambda size: [10 ** 9] * size, "outside the vocabulary"),
])
def test_bad_resume_ids_are_refused(make_engine, resume, message):
    engine = make_engine()
    with pytest.raises(RequestError, match=message):
        engine.make_request("abc", SamplingParams(max_tokens=4 * engine.block_length,
                                                  resume_ids=tuple(resume(engine.block_length))))
