"""Token-for-token parity with the published generation code of LLaDA, Dream, SDAR and
LLaDA2.0 (the fixtures of ``parity/``, made by ``parity/make_fixtures.py`` from the
published files pinned in ``parity/README.md``), at batch 1.

Each fixture maps to engine settings: LLaDA and Dream on the full canvas (Dream's canvas
is one block as long as the answer), SDAR and LLaDA2.0 with blocks aligned to the
sequence's start; the published samplers are ``fixed_steps`` (LLaDA's, SDAR's and
LLaDA2.0's schedules) and ``dream``. ``kv_cache: none`` is exact for every model; the
block-causal models' default cache is exact too, the bidirectional models' dual cache is
not (its agreement is measured by ``agreement``).
"""

import json
from pathlib import Path

import pytest

from checkpoint_builders import OVERRIDES, weights_sha256, write_checkpoint
from replicas.engine import Engine, EngineConfig
from replicas.request import FinishReason
from replicas.messages import SamplingParams

PARITY = json.loads((Path(__file__).parent / "parity" / "fixtures.json").read_text())
FIXTURES = {fixture["id"]: fixture for fixture in PARITY["fixtures"]}
EOS = PARITY["eos_id"]


def engine_settings(fixture: dict) -> tuple[dict, SamplingParams]:
    """The engine config and sampling parameters that reproduce a fixture's call."""
    kw, family = fixture["kwargs"], fixture["family"]
    if family == "llada":
        blocks = kw["gen_length"] // kw["block_length"]
        algorithm = {"steps": kw["steps"] // blocks, "remasking": kw["remasking"]}
        return ({"canvas": "full", "block_length": kw["block_length"]},
                SamplingParams(max_tokens=kw["gen_length"], algorithm="fixed_steps", algorithm_params=algorithm,
                               ignore_eos=True))
    if family == "dream":
        config = fixture["effective_generation_config"]
        algorithm = {"steps": kw["steps"], "alg": kw["alg"], "alg_temp": config["alg_temp"] or 0.0,
                     "top_k": config["top_k"] or 0, "top_p": config["top_p"], "eps": config["eps"]}
        return ({"canvas": "full", "block_length": kw["max_new_tokens"]},
                SamplingParams(max_tokens=kw["max_new_tokens"], algorithm="dream", algorithm_params=algorithm,
                               ignore_eos=True))
    # SDAR and LLaDA2.0: greedy is temperature 0 here (SDAR's scripts write it temperature 1, top_k 1)
    algorithm = {"steps": kw.get("denoising_steps", kw.get("steps")), "schedule": "block"}
    strategy = kw.get("remasking_strategy")
    if strategy == "sequential":
        algorithm["remasking"] = "sequential"
    elif strategy == "low_confidence_dynamic":
        # generate.py's confidence is the top-1-filtered probability, 1.0 at every mask: above
        # any threshold < 1, so every mask fills at the block's first step
        algorithm["steps"] = 1
    else:
        algorithm["threshold"] = kw["threshold"]
    answer = len(fixture["generated_ids"]) if family == "sdar" else kw["gen_length"]
    return ({"block_alignment": "prompt", "block_length": kw["block_length"]},
            SamplingParams(max_tokens=answer, algorithm="fixed_steps", algorithm_params=algorithm))


def expected_answer(fixture: dict) -> list[int]:
    """The fixture's generated ids as an answer: up to the first EOS where the call stops
    at it (SDAR's stop ids, LLaDA2.0), whole otherwise."""
    ids = fixture["generated_ids"]
    if fixture["family"] in ("sdar", "llada2") and EOS in ids:
        return ids[:ids.index(EOS)]
    return ids


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    built = {}

    def get(arch: str, seed: int) -> Path:
        if (arch, seed) not in built:
            built[arch, seed] = write_checkpoint(tmp_path_factory.mktemp(f"{arch}-{seed}"), arch, seed)
        return built[arch, seed]
    return get


def run_fixture(checkpoints, fixture: dict, kv_cache: str):
    config, params = engine_settings(fixture)
    overrides = {**OVERRIDES[fixture["arch"]], "block_length": config.pop("block_length")}
    path = checkpoints(fixture["arch"], fixture["checkpoint_seed"])
    engine = Engine.from_pretrained(str(path), EngineConfig(max_batch=1, kv_cache=kv_cache,
                                                            model_overrides=overrides, **config))
    return path, engine.generate([fixture["prompt_ids"]], params)[0]


@pytest.mark.parametrize("fixture_id", sorted(FIXTURES))
def test_the_engine_reproduces_the_published_generation(checkpoints, fixture_id):
    fixture = FIXTURES[fixture_id]
    path, output = run_fixture(checkpoints, fixture, kv_cache="none")
    assert weights_sha256(path) == fixture["weights_sha256"], "the checkpoint builder changed: remake the fixtures"
    expected = expected_answer(fixture)
    assert output.token_ids == expected
    stopped = len(expected) < len(fixture["generated_ids"])
    assert output.finish_reason == (FinishReason.STOP if stopped else FinishReason.LENGTH)


@pytest.mark.parametrize("fixture_id", sorted(f for f in FIXTURES if FIXTURES[f]["family"] in ("sdar", "llada2")))
def test_the_block_causal_default_cache_is_exact_too(checkpoints, fixture_id):
    fixture = FIXTURES[fixture_id]
    assert run_fixture(checkpoints, fixture, kv_cache="prefix")[1].token_ids == expected_answer(fixture)


def agreement(checkpoints, family: str, kv_cache: str = "prefix") -> float:
    """Share of a family's fixture tokens the engine reproduces position for position."""
    same = total = 0
    for fixture in (f for f in FIXTURES.values() if f["family"] == family):
        expected = expected_answer(fixture)
        got = run_fixture(checkpoints, fixture, kv_cache)[1].token_ids
        same += sum(a == b for a, b in zip(got, expected))
        total += len(expected)
    return same / total
