"""The canvas setting: per-model defaults, refusal where it cannot apply, pages and batching."""

import pytest

from checkpoint_builders import OVERRIDES
from replicas.canvas_bench import bench_canvas
from replicas.engine import Engine, EngineConfig
from replicas.request import SamplingParams


def engine_for(checkpoint_dir, arch, **config):
    return Engine.from_pretrained(str(checkpoint_dir(arch)), EngineConfig(
        model_overrides=OVERRIDES[arch], **config))


@pytest.mark.parametrize("arch, expected", [("LLaDAModelLM", "full"), ("DreamModel", "full"),
                                            ("SDARForCausalLM", "block"), ("LLaDA2MoeModelLM", "block")])
def test_the_default_canvas_is_the_models_reference(checkpoint_dir, arch, expected):
    assert engine_for(checkpoint_dir, arch, max_batch=1).canvas == expected


def test_a_block_causal_model_refuses_the_full_canvas(checkpoint_dir):
    with pytest.raises(ValueError, match="canvas 'full' needs a bidirectional model"):
        engine_for(checkpoint_dir, "SDARForCausalLM", max_batch=1, canvas="full")


@pytest.mark.parametrize("kv_cache", ["none", "prefix"])
def test_full_canvas_rows_do_not_depend_on_their_batch(checkpoint_dir, kv_cache):
    """Four requests of different lengths in one batch answer as each does alone; every
    page of the canvas is taken at admission and all come back."""
    prompts = [[5 + (i * 7 + r) % 80 for i in range(9 + 13 * r)] for r in range(4)]
    params = [SamplingParams(max_tokens=(3 - r % 3) * 32, ignore_eos=True) for r in range(4)]
    alone = []
    for prompt, p in zip(prompts, params):
        engine = engine_for(checkpoint_dir, "LLaDAModelLM", max_batch=1, kv_cache=kv_cache)
        alone.append(engine.generate([prompt], p)[0].new_token_ids)
    engine = engine_for(checkpoint_dir, "LLaDAModelLM", max_batch=4, kv_cache=kv_cache)
    free = engine.pool.num_free
    streamed = []
    engine.add_request(prompts[0], params[0], on_output=streamed.append)
    engine.step()  # admission lays out the whole canvas: prompt pages and every block's page
    assert free - engine.pool.num_free == 1 + 3
    together = engine.generate(prompts[1:], params[1:])  # the first request runs on with them
    assert [t for o in streamed for t in o.new_token_ids] == alone[0]
    assert [o.new_token_ids for o in together] == alone[1:]
    assert engine.pool.num_free == free


def test_bench_canvas_runs_both_canvases_through_the_same_forwards():
    from cluster.cli import main

    report = bench_canvas((1, 2), prompt_len=20, max_tokens=64, steps=4, d_model=64, layers=1, heads=4, mlp=128)
    for batch in (1, 2):
        block, full = report[f"batch_{batch}"]["block"], report[f"batch_{batch}"]["full"]
        assert block["steps"] == full["steps"] == 2 * 4  # two blocks of four forwards, fused commits
        assert full["tokens_per_s"] > 0 and block["tokens_per_s"] > 0
    assert main(["bench", "canvas", "--batch-sizes", "1", "--d-model", "64", "--layers", "1", "--max-tokens", "32",
                 "--prompt-len", "8", "--json"]) == 0
