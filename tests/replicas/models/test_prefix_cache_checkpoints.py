"""The prefix cache on the block-causal published architectures (SDAR, LLaDA2.0; aligned
blocks, their default): the same tokens with and without it, alone and in a mixed batch."""

import random

import pytest

from replicas.messages import SamplingParams


@pytest.mark.parametrize("arch", ["SDARForCausalLM", "LLaDA2MoeModelLM"])
@pytest.mark.parametrize("max_batch", [1, 3])
def test_tokens_with_the_cache_equal_those_without(checkpoint_engine, arch, max_batch):
    outputs, engines = {}, {}
    for cache in (False, True):
        engine = engines[cache] = checkpoint_engine(arch, max_batch=max_batch, prefix_cache=cache)
        size, vocab = engine.block_length, engine.spec.vocab_size
        rng = random.Random(3)
        usable = [t for t in range(vocab) if t not in (engine.spec.mask_token_id, engine.spec.eos_token_id)]
        shared = [rng.choice(usable) for _ in range(2 * size + size // 2)]  # ends inside a block
        prompts = [shared + [rng.choice(usable) for _ in range(rng.randrange(1, size))] for _ in range(7)]
        params = SamplingParams(max_tokens=2 * size, ignore_eos=True)
        outputs[cache] = [o.token_ids for o in engine.generate(prompts, params)]
    assert engines[True].shape.aligned and engines[True].pool.cache.totals.pages_hit >= 2 * (7 - max_batch)
    assert outputs[True] == outputs[False]
