"""Token-for-token parity with the published D2F generate (``parity/d2f_fixtures.json``, made
by ``parity/make_d2f_fixtures.py`` from zhijie-group/Discrete-Diffusion-Forcing's
``eval_llada.py``; ``parity/D2F.md``): the tiny random LLaDA with a random D2F LoRA adapter,
decoded by the engine's ``d2f`` algorithm with several blocks of the row at once, the
adapter served unmerged (and merged) and the model block-causal with the prompt one block."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from checkpoint_builders import OVERRIDES, weights_sha256, write_checkpoint
from replicas.engine import Engine, EngineConfig
from replicas.messages import GenerateRequest, RequestError, SamplingParams

PARITY_DIR = Path(__file__).parent / "parity"
D2F = json.loads((PARITY_DIR / "d2f_fixtures.json").read_text())
FIXTURES = {fixture["id"]: fixture for fixture in D2F["fixtures"]}
sys.path.insert(0, str(PARITY_DIR))
from make_d2f_fixtures import tensors_sha256, write_adapter  # noqa: E402  (the fixtures' own adapter)


@pytest.fixture(scope="module")
def d2f_model(tmp_path_factory):
    """The fixtures' checkpoint and adapter (one seed pair for all of them)."""
    [(seed, adapter_seed)] = {(f["checkpoint_seed"], f["adapter_seed"]) for f in D2F["fixtures"]}
    path = write_checkpoint(tmp_path_factory.mktemp("llada"), "LLaDAModelLM", seed)
    adapter = tmp_path_factory.mktemp("adapter") / "d2f"
    tensors = write_adapter(adapter, path, adapter_seed)
    fixture = D2F["fixtures"][0]
    assert weights_sha256(path) == fixture["weights_sha256"], "the checkpoint builder changed: remake the fixtures"
    assert tensors_sha256(tensors) == fixture["adapter_sha256"]
    return path, adapter


def d2f_engine(path: Path, block_length: int, **config) -> Engine:
    overrides = {**OVERRIDES["LLaDAModelLM"], "block_length": block_length, "attention": "block_causal_whole_prompt"}
    return Engine.from_pretrained(str(path), EngineConfig(max_batch=4, model_overrides=overrides, **config))


def d2f_request(fixture: dict, adapter: str | None = None, request_id: str = "r") -> GenerateRequest:
    kw = fixture["kwargs"]
    params = SamplingParams(max_tokens=kw["max_new_tokens"], ignore_eos=True, algorithm="d2f", algorithm_params={
        name: kw[name] for name in ("block_add_threshold", "decoded_token_threshold", "skip_threshold")})
    return GenerateRequest(request_id, fixture["prompt_ids"], params, adapter=adapter)


def expected(fixture: dict) -> list[int]:
    """The published answer: whole blocks of ``max_new_tokens // block_size`` (a rest is never made)."""
    return fixture["generated_ids"]


@pytest.mark.parametrize("fixture_id", sorted(FIXTURES))
def test_the_engine_decodes_as_the_published_d2f(d2f_model, fixture_id):
    fixture = FIXTURES[fixture_id]
    path, adapter = d2f_model
    engine = d2f_engine(path, fixture["kwargs"]["block_size"], adapters={"d2f": str(adapter)})
    [output] = engine.generate([d2f_request(fixture, "d2f")])
    assert output.token_ids[:len(expected(fixture))] == expected(fixture)


def test_a_batch_of_d2f_requests_merged_or_not_answers_as_each_alone(d2f_model):
    """Every fixture with blocks of 4 in one batch, next to base-model rows: each row its own blocks."""
    path, adapter = d2f_model
    batch = sorted(f for f in FIXTURES if FIXTURES[f]["kwargs"]["block_size"] == 4)
    merged = d2f_engine(path, 4, lora=str(adapter))
    outputs = merged.generate([d2f_request(FIXTURES[f], request_id=f) for f in batch])
    assert [o.token_ids[:len(expected(FIXTURES[f]))] for o, f in zip(outputs, batch)] == [
        expected(FIXTURES[f]) for f in batch]


def test_only_committed_blocks_stream_in_order(d2f_model):
    """Blocks decoded ahead are never sent: one chunk a block, in order, joined the whole answer."""
    path, adapter = d2f_model
    fixture = FIXTURES["d2f_g32_b8_add01_dec05_skip003"]  # up to 4 blocks at once
    engine = d2f_engine(path, 8, adapters={"d2f": str(adapter)})
    chunks = []
    engine.add_request(d2f_request(fixture, "d2f"), on_output=chunks.append)
    while engine.has_work():
        engine.step()
    assert [len(chunk.token_ids) for chunk in chunks] == [8, 8, 8, 8]
    assert [t for chunk in chunks for t in chunk.token_ids] == expected(fixture)
    assert chunks[-1].finished and not any(chunk.finished for chunk in chunks[:-1])


def test_pipelined_decoding_is_refused_where_it_cannot_run(d2f_model):
    path, adapter = d2f_model
    request = d2f_request(FIXTURES["d2f_g16_b4_add05_dec09_skip003"])
    bidirectional = Engine.from_pretrained(str(path), EngineConfig(max_batch=1, model_overrides=OVERRIDES["LLaDAModelLM"]))
    with pytest.raises(RequestError, match="needs a block-causal model on the block canvas"):
        bidirectional.make_request(request)
    structured = replace(request, params=replace(request.params, regex="[0-9]+", ignore_eos=False))
    with pytest.raises(RequestError, match="does not take a structured output or logprobs"):
        d2f_engine(path, 4).make_request(structured)


def test_up_refuses_d2f_as_the_default_of_a_model_that_cannot_run_it(d2f_model, capsys):
    from tools.cli import main

    path, _ = d2f_model
    assert main(["up", "--model", str(path), "--algorithm", "d2f"]) == 2  # LLaDA as published: bidirectional
    err = capsys.readouterr().err
    assert "replica.algorithm: algorithm d2f decodes several blocks at once" in err and "Traceback" not in err
