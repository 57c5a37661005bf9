"""Constrained answers from random weights: every answer matches its structure, greedy and
sampled, streamed and whole, several at once, and resumed after a failover, on a block
canvas (SDAR) and on the full canvas (LLaDA), with a byte-level BPE tokenizer.

``DLLM_STRUCTURE_EXAMPLES`` sets how many generated schemas and regexes each property
test runs (default 6; the closing notes' runs used hundreds)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jsonschema
import pytest
from cli_help import assert_help_explains_every_option
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cluster.structured import literal, schema_regex
from replicas.engine import Engine
from replicas.engine_config import EngineConfig
from replicas.grammar import ConstraintError
from replicas.messages import RequestError, SamplingParams
from tools.bench.bytelevel import bytelevel_tokenizer, random_model

EXAMPLES = int(os.environ.get("DLLM_STRUCTURE_EXAMPLES", "6"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
WORDS = ["a", "中文", "🙂", "x y", "1", "名字", "ok"]
KEYS = ["name", "age", "城市", "tags", "ok", "emoji🙂"]


@pytest.fixture(scope="module")
def tokenizer():
    return bytelevel_tokenizer()


@pytest.fixture(scope="module", params=["sdar", "llada"])
def engine(request, tokenizer):
    canvas = "block" if request.param == "sdar" else "full"
    return Engine(random_model(tokenizer, request.param), tokenizer,
                  EngineConfig(max_batch=4, canvas=canvas, fdfo_fill_hold=False, max_model_len=384))


leaves = st.one_of(
    st.sampled_from([{"type": "integer"}, {"type": "boolean"}, {"type": "null"}, {"type": "number"},
                     {"type": "string"}, {"type": "string", "format": "email"}, {"type": "string", "format": "uuid"}]),
    st.builds(lambda low, span: {"type": "string", "minLength": low, "maxLength": low + span},
              st.integers(0, 3), st.integers(0, 6)),
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=3, unique=True).map(lambda values: {"enum": values}),
    st.sampled_from(["北京", "ok", 3, True, None]).map(lambda value: {"const": value}),
)


def _object(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required}


def _containers(children):
    return st.one_of(
        st.builds(lambda items, low, span: {"type": "array", "items": items, "minItems": low,
                                            "maxItems": low + span}, children, st.integers(0, 1), st.integers(0, 2)),
        st.dictionaries(st.sampled_from(KEYS), children, min_size=1, max_size=3).flatmap(
            lambda properties: st.lists(st.sampled_from(sorted(properties)), unique=True).map(
                lambda required: _object(properties, required))),
        st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options}),
    )


schemas = st.recursive(leaves, _containers, max_leaves=6)
regexes = st.recursive(
    st.one_of(st.sampled_from(WORDS).map(literal), st.sampled_from(["[0-9]", "[a-c]", "[中文]", "."])),
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda parts: "(" + "|".join(parts) + ")"),
        st.tuples(inner, st.integers(0, 2), st.integers(0, 3)).map(lambda t: f"({t[0]}){{{t[1]},{t[1] + t[2]}}}"),
    ), max_leaves=5)


def answers(engine: Engine, prompt: str, params: list[SamplingParams], stream: bool) -> list[str]:
    """Each answer's text, streamed (its chunks joined) or whole."""
    if not stream:
        return [chunk.text for chunk in engine.generate([prompt] * len(params), params)]
    chunks: list[list] = [[] for _ in params]
    for sink, one in zip(chunks, params):
        engine.add_request(prompt, one, on_output=sink.append)
    while engine.has_work():
        engine.step()
    assert all(sink[-1].finished and sink[-1].error is None for sink in chunks), [s[-1].error for s in chunks]
    return ["".join(chunk.text for chunk in sink) for sink in chunks]


def room(engine: Engine, regex: str) -> int:
    """max_tokens with room to spare over the structure's shortest answer."""
    automaton = engine.grammars.automaton(regex)
    return int(automaton.to_accept[automaton.start]) + 24


def constrained(regex: str, max_tokens: int, **sampling) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, regex=regex, algorithm_params=sampling)


@PROPERTY
@given(schema=schemas, stream=st.booleans(), seed=st.integers(0, 2**32))
def test_every_answer_follows_its_json_schema(engine, schema, stream, seed):
    try:
        regex = schema_regex(schema, "response_format")
        max_tokens = room(engine, regex)
    except (ValueError, ConstraintError):
        assume(False)
    params = [constrained(regex, max_tokens),  # greedy
              constrained(regex, max_tokens, temperature=1.0, seed=seed),  # sampled: n = 2
              constrained(regex, max_tokens, temperature=1.0, seed=seed + 1)]
    for text in answers(engine, "a JSON 🙂 中文:", params, stream):
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
    # a failover after the sampled answer's first block: another replica goes on from it
    chunks = []
    engine.add_request("a JSON 🙂 中文:", params[1], on_output=chunks.append)
    while engine.has_work():
        engine.step()
    if len(chunks) > 1:
        resumed = dataclasses.replace(params[1], resume_ids=tuple(chunks[0].token_ids))
        [rest] = engine.generate(["a JSON 🙂 中文:"], resumed)
        assert chunks[0].text + rest.text == "".join(chunk.text for chunk in chunks)


@PROPERTY
@given(regex=regexes, stream=st.booleans(), seed=st.integers(0, 2**32))
def test_every_answer_matches_its_regex(engine, regex, stream, seed):
    max_tokens = room(engine, regex)
    params = [constrained(regex, max_tokens), constrained(regex, max_tokens, temperature=1.0, seed=seed)]
    for text in answers(engine, "pick:", params, stream):
        assert re.fullmatch(regex, text), (regex, text)


def test_a_resumed_answer_follows_its_schema_and_goes_on_as_the_first_attempt(engine):
    schema = _object({"name": {"type": "string", "minLength": 30, "maxLength": 40}, "tags": {"type": "array", "items": {
        "enum": ["中文", "🙂", "ok"]}, "minItems": 12, "maxItems": 14}, "age": {"type": "integer"}}, ["name", "tags", "age"])
    regex = schema_regex(schema, "response_format")
    params = constrained(regex, 96)
    chunks = []
    engine.add_request("user:", params, on_output=chunks.append)
    while engine.has_work():
        engine.step()
    whole = "".join(chunk.text for chunk in chunks)
    jsonschema.validate(json.loads(whole), schema)
    first_block = chunks[0].token_ids
    assert first_block and len(chunks) > 1
    # the replica failed after the first block: another goes on from it
    resumed = SamplingParams(max_tokens=96, regex=regex, resume_ids=tuple(first_block))
    [rest] = engine.generate(["user:"], resumed)
    assert chunks[0].text + rest.text == whole


def test_choices_are_answered_from_the_list(engine):
    choices = ["北京", "上海 🙂", "New York"]
    regex = "(" + "|".join(literal(c) for c in choices) + ")"
    params = [constrained(regex, 16, temperature=1.0, seed=seed) for seed in range(4)]
    assert set(answers(engine, "city:", params, stream=False)) <= set(choices)


def test_too_few_tokens_for_any_answer_is_refused_before_it_runs(engine):
    regex = schema_regex(_object({"name": {"type": "string", "minLength": 5}}, ["name"]), "response_format")
    shortest = int(engine.grammars.automaton(regex).to_accept[engine.grammars.automaton(regex).start])
    with pytest.raises(ConstraintError, match=f"shortest answer .* has {shortest} tokens; max_tokens is 3"):
        engine.make_request("x", SamplingParams(max_tokens=3, regex=regex))
    with pytest.raises(ConstraintError, match="cannot be compiled"):
        engine.make_request("x", SamplingParams(max_tokens=8, regex="(?=lookahead)a"))
    with pytest.raises(RequestError, match="ignore_eos cannot be used"):
        engine.make_request("x", SamplingParams(max_tokens=8, regex="(yes|no)", ignore_eos=True))


@pytest.mark.bench
def test_bench_structured_reports_ratios_compile_times_and_accuracy():
    from tools.bench.structured import accuracy, puzzle_regex, step_times
    from replicas.tiny import task

    report = step_times(600, batch_sizes=(2,), rounds=1, max_tokens=32, sources=[("regex", "(yes|no)")])
    entry = report["batch_2"]
    assert entry["constrained_over_free"] > 0 and entry["valid_json"] == "2/2"
    assert report["compile"]["compiled"] == 1 and report["compile"]["p99_ms"] >= report["compile"]["p50_ms"] > 0
    request = task.heldout_requests()[0]
    assert re.fullmatch(puzzle_regex(request), "".join(request.solutions))
    graded = accuracy(num_requests=4, max_batch=4)
    assert 0 <= graded["free"]["request_accuracy"] <= 1 and 0 <= graded["constrained"]["puzzle_accuracy"] <= 1


def test_bench_structured_help_explains_every_option(capsys):
    assert_help_explains_every_option(capsys, ("bench", "structured"), 7, ("schema", "accuracies"))
