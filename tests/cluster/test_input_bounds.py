"""Every request field is bounded (docs/api.md "Request bounds") and a failure of ours never
reaches the client as text: unit tests on the ingress without Ray, then a property test
(hypothesis) of both endpoints through the ingress's routes and a real engine in this
process, whose hostile examples are replayed against a live `dllm-serve up`."""

import asyncio
import json
import logging
import math
import re
import time
import types
from collections import Counter

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from algorithms import available_algorithms, get_algorithm
from algorithms.joint_threshold import MAX_POST_EDIT_STEPS
from algorithms.sampling import MAX_TOP_K
from cluster import protocol
from cluster.config import IngressSettings, load_config
from cluster.errors import install_error_handlers
from replicas.request_cost import max_request_cost, request_cost
from replicas.messages import GenerateChunk
from replicas.tiny import task
from exploding_algorithm import MESSAGE as EXPLODING_MESSAGE, NAME as EXPLODING, register_exploding
from replica_stand_in import Replicas, handle_over
from test_ingress_path import PROMPT, MetricsActor, answer
from test_serving import series

API_KEY = "test-key"  # the cluster fixture's
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
INTERNAL = re.compile(r"^internal error; request id (chat)?cmpl-[0-9a-f]{24}$")
MAX_PROMPT_CHARS = protocol.RequestLimits().max_prompt_chars


def error_of(response) -> dict:
    return json.loads(response.body)["error"]


# ---- bounds at the ingress (no Ray) ---------------------------------------------------------
def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, **fields}


def chat(messages, **fields) -> dict:
    return {"model": "tiny", "messages": messages, "max_tokens": 16, **fields}


OUT_OF_BOUNDS = [
    ("model too long", completion(model="m" * 257), "model"),
    ("prompt over max_prompt_chars", completion(prompt="1" * (MAX_PROMPT_CHARS + 1)), "prompt"),
    ("more prompts than choices", completion(prompt=["1."] * 9), "prompt"),
    ("a prompt of a list over max_prompt_chars", completion(prompt=["1.", "1" * (MAX_PROMPT_CHARS + 1)]), "prompt"),
    ("a prompt list of token ids and text", completion(prompt=[[5], "x"]), "prompt"),
    ("token ids as floats and booleans", completion(prompt=[5.0, True]), "prompt"),
    ("echo with logprobs", completion(echo=True, logprobs=1), "logprobs"),
    ("max_tokens 0", completion(max_tokens=0), "max_tokens"),
    ("max_tokens past int64", completion(max_tokens=2 ** 63), "max_tokens"),
    ("max_tokens past the model", completion(max_tokens=513), "max_tokens"),
    ("max_completion_tokens past the model", completion(max_completion_tokens=10 ** 6), "max_completion_tokens"),
    ("temperature nan", completion(temperature=float("nan")), "temperature"),
    ("temperature too high", completion(temperature=100.5), "temperature"),
    ("temperature negative", completion(temperature=-1), "temperature"),
    ("top_p past 1", completion(top_p=1.5), "top_p"),
    ("top_p negative", completion(top_p=-0.1), "top_p"),
    ("top_k -2", completion(top_k=-2), "top_k"),
    ("a nucleus cut on a rule without one", completion(algorithm="fixed_steps", top_p=0.9), "top_p"),
    ("a top-k cut on a rule without one", completion(algorithm="fast_dllm_factor", top_k=5), "top_k"),
    ("top_k past the cap", completion(top_k=MAX_TOP_K + 1), "top_k"),
    ("top_k 1e20", completion(top_k=1e20), "top_k"),
    ("negative seed", completion(seed=-1), "seed"),
    ("seed past 63 bits", completion(seed=2 ** 63), "seed"),
    ("five stops", completion(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("long stop", completion(stop="s" * 257), "stop"),
    ("stop strings that are numbers", completion(stop=[5]), "stop"),
    ("include_usage not a boolean", completion(stream=True, stream_options={"include_usage": "yes"}), "stream_options"),
    ("user too long", completion(user="u" * 257), "user"),
    ("threshold over 1", completion(threshold=1.5), "threshold"),
    ("algorithm name too long", completion(algorithm="a" * 300), "algorithm"),
    ("unknown algorithm", completion(algorithm="magic"), "algorithm"),
    ("too many algorithm_params", completion(algorithm_params={f"p{i}": 1 for i in range(33)}), "algorithm_params"),
    ("long algorithm_params name", completion(algorithm_params={"p" * 65: 1}), "algorithm_params"),
    ("the issue's top_k", completion(algorithm="joint_threshold", temperature=1, algorithm_params={"top_k": 10 ** 20}),
     "algorithm_params.top_k"),
    ("max_post_edit_steps past the cap",
     completion(algorithm="joint_threshold", algorithm_params={"max_post_edit_steps": 10 ** 9}),
     "algorithm_params.max_post_edit_steps"),
    ("fixed_steps steps 0", completion(algorithm="fixed_steps", algorithm_params={"steps": 0}),
     "algorithm_params.steps"),
    ("unknown algorithm parameter", completion(algorithm_params={"nope": 1}), "algorithm_params.nope"),
    ("block_length 0", completion(block_length=0), "block_length"),
    ("block_length not the model's", completion(block_length=32), "block_length"),
    ("mode not the replicas'", completion(mode="sync"), "mode"),
    ("n 9", completion(n=9), "n"),
    ("n 0", completion(n=0), "n"),
    ("too many messages", chat([{"role": "user", "content": "1"}] * 513), "messages"),
    ("messages too long together", chat([{"role": "user", "content": "1" * (MAX_PROMPT_CHARS // 2)}] * 2
                                        + [{"role": "user", "content": "1"}]), "messages"),
    ("too many content parts", chat([{"role": "user", "content": [{"type": "text", "text": "1"}] * 257}]),
     "messages.0.content"),
    ("empty messages", chat([]), "messages"),
    # the tiny model's chat template keeps the last user message: a tool message alone renders to nothing
    ("null content", chat([{"role": "user", "content": None}]), "messages.0.content"),
    ("content parts that are numbers", chat([{"role": "user", "content": [5]}]), "messages.0.content"),
    ("a text part without its text", chat([{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content"),
    ("messages that render to nothing", chat([{"role": "tool", "content": "7", "tool_call_id": "1"}]), "messages"),
]


def ingress_over(generate, **settings):
    """An Ingress of the tiny model outside Serve whose replicas are ``generate(job)``, and
    whose metrics actor never answers (its calls time out: nothing else changes)."""
    from cluster.ingress import Ingress

    plain = next(c for c in Ingress.__mro__ if "_complete" in vars(c))  # under serve.ingress's wrapper
    handle = types.SimpleNamespace(options=lambda **_: handle_over(generate))
    instance = plain.__new__(plain)
    plain.__init__(instance, handle, load_config(overrides=settings).model_dump(mode="json"))
    instance._metrics = MetricsActor(hang=True)  # never ray.get_actor, which would start Ray
    return plain, instance


def make_ingress(**settings):
    replicas = Replicas()
    plain, instance = ingress_over(replicas.generate.remote, **settings)
    instance.sent = replicas.jobs  # what reached the replicas
    return plain, instance


@pytest.fixture(scope="module")
def ingress():
    return make_ingress()


@pytest.mark.parametrize("name,body,param", OUT_OF_BOUNDS, ids=[c[0] for c in OUT_OF_BOUNDS])
def test_a_field_out_of_bounds_is_a_400_naming_it(ingress, name, body, param):
    plain, instance = ingress
    path = CHAT if "messages" in body else "/v1/completions"
    response = asyncio.run(answer(plain, instance, body, path=path))
    assert response.status_code == 400, response.body
    error = error_of(response)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert not error["message"].startswith("Value error"), error


def test_the_limits_at_their_bounds_are_served(ingress):
    plain, instance = ingress
    edge = [
        ("/v1/completions", completion(temperature=100.0, top_k=MAX_TOP_K, seed=2 ** 63 - 1, stop=["s" * 256] * 4,
                                       user="u" * 256, top_p=1.0, threshold=1.0)),
        ("/v1/completions", completion(algorithm="joint_threshold", temperature=1e-4,
                                       algorithm_params={"max_post_edit_steps": MAX_POST_EDIT_STEPS, "top_k": 1})),
        (CHAT, chat([{"role": "user", "content": "1"}] * 512)),
        (CHAT, chat([{"role": "user", "content": [{"type": "text", "text": "1"}] * 256}])),
    ]
    for path, body in edge:
        response = asyncio.run(answer(plain, instance, body, path=path))
        assert response.status_code == 200, (body, response.body)


NO_FILTERS = ["fixed_steps", "fast_dllm_threshold", "fast_dllm_factor"]  # the rules without top_p / top_k


@pytest.mark.parametrize("name", NO_FILTERS)
def test_neutral_openai_values_are_taken_as_absent(ingress, name):
    """What clients send by default: top_p 1 and top_k 0 or -1 filter nothing, so a rule
    without the filters serves them as absent; an empty stop string stops nothing."""
    plain, instance = ingress
    for top_k in (0, -1):
        body = completion(algorithm=name, top_p=1, top_k=top_k, temperature=1, stop="")
        response = asyncio.run(answer(plain, instance, body))
        assert response.status_code == 200, (body, response.body)
        params = instance.sent[-1].params
        assert "top_p" not in params.algorithm_params and "top_k" not in params.algorithm_params
        assert params.algorithm_params["temperature"] == 1 and params.stop == ()


def test_the_values_openai_and_vllm_take_are_served(ingress):
    """top_p 0 keeps the most likely token, top_k -1 keeps every token (vLLM's "no
    limit"), a temperature below the smallest supported is greedy, an empty stop string
    among others is dropped."""
    plain, instance = ingress
    body = completion(top_p=0, top_k=-1, temperature=1e-5, stop=["", "4"])
    response = asyncio.run(answer(plain, instance, body))
    assert response.status_code == 200, response.body
    params = instance.sent[-1].params
    assert params.stop == ("4",)
    made = get_algorithm("low_confidence").make_params(params.algorithm_params)
    assert (made.top_p, made.top_k, made.temperature) == (0, -1, 0)


def test_the_chat_and_prompt_limits_come_from_the_settings():
    defaults = IngressSettings()
    assert (defaults.max_prompt_chars, defaults.max_messages) == (protocol.RequestLimits().max_prompt_chars,
                                                                  protocol.RequestLimits().max_messages)
    plain, instance = make_ingress(**{"ingress.max_messages": 2, "ingress.max_prompt_chars": 30})
    three = chat([{"role": "user", "content": "1"}] * 3)
    assert error_of(asyncio.run(answer(plain, instance, three, path=CHAT)))["param"] == "messages"
    assert error_of(asyncio.run(answer(plain, instance, completion(prompt="1" * 31))))["param"] == "prompt"
    assert asyncio.run(answer(plain, instance, completion(prompt="1" * 30))).status_code == 200


def test_admission_cost_is_capped_at_what_one_replica_row_holds(ingress):
    _, instance = ingress
    block, max_len = instance.spec.block_length, instance.preprocess.shape.max_model_len
    cap = max_request_cost(max_len, block)
    assert cap == (max_len // block - 1) * (block + 1)
    body = protocol.CompletionRequest(model="tiny", prompt="1", max_tokens=max_len - block, algorithm="joint_threshold",
                                      algorithm_params={"max_post_edit_steps": MAX_POST_EDIT_STEPS})
    job = instance.preprocess.prepare(body, "1")
    worst = block + MAX_POST_EDIT_STEPS + 1
    assert request_cost(job.params.max_tokens, block, worst) > cap and job.cost == cap
    small = instance.preprocess.prepare(protocol.CompletionRequest(model="tiny", prompt="1", max_tokens=16), "1")
    assert small.cost == block  # one block at the worst case (fused commit: L fills), under the cap


def test_aligned_blocks_are_charged_for_the_prompts_end_in_the_first_block():
    """With blocks aligned to the sequence's start, 16 answer tokens after a 3-token prompt
    span two blocks of 16 (the first holds the prompt's 3): two blocks' worst case."""
    _, instance = make_ingress(**{"replica.block_alignment": "prompt"})
    body = protocol.CompletionRequest(model="tiny", prompt="1.3", max_tokens=16)
    assert instance.preprocess.prepare(body, "1.3").cost == 2 * instance.spec.block_length


# ---- internal failures: generic to the client, detailed in the log ---------------------------
async def sse_events(response) -> list:
    events = []
    async for piece in response.body_iterator:
        for line in piece.splitlines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


@pytest.fixture
def exploding_replica(monkeypatch):
    from replicas.deployment import EngineReplica
    from replicas.engine_config import EngineConfig

    register_exploding(monkeypatch)
    replica = EngineReplica("tiny", EngineConfig(max_batch=4), metrics_actor=None)
    yield replica
    replica.__del__()


def test_an_algorithm_failure_is_a_generic_500_with_the_details_in_the_log(exploding_replica, caplog):
    plain, instance = ingress_over(exploding_replica.generate)
    body = completion(algorithm=EXPLODING)
    with caplog.at_level(logging.ERROR):
        response = asyncio.run(answer(plain, instance, body))
    assert response.status_code == 500
    error = error_of(response)
    assert INTERNAL.match(error["message"]) and (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "boom" not in response.body.decode() and "RuntimeError" not in response.body.decode()
    request_id = error["message"].rsplit(" ", 1)[1]
    logged = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert any(EXPLODING_MESSAGE in m for m in logged), logged
    assert instance.admission.outstanding == 0

    async def streamed():
        response = await answer(plain, instance, body | {"stream": True})
        return await sse_events(response)

    with caplog.at_level(logging.ERROR):
        events = asyncio.run(streamed())
    assert events[-1] == "[DONE]" and len(events) == 2
    error = events[0]["error"]
    assert INTERNAL.match(error["message"]) and "boom" not in json.dumps(events)
    assert any(error["message"].rsplit(" ", 1)[1] in r.getMessage() and "boom" in r.getMessage()
               for r in caplog.records)
    # the replica serves the others as before
    assert asyncio.run(answer(plain, instance, completion())).status_code == 200


def test_a_broken_replica_stream_is_a_generic_500(caplog):
    async def generate(job):
        yield GenerateChunk(text="12", token_ids=[5] * 16, steps=3, block_steps=[3])
        raise KeyError("secret internal detail")

    plain, instance = ingress_over(generate)
    with caplog.at_level(logging.ERROR):
        response = asyncio.run(answer(plain, instance, completion()))
    assert response.status_code == 500 and INTERNAL.match(error_of(response)["message"])
    assert "secret" not in response.body.decode() and "KeyError" not in response.body.decode()
    assert any("secret internal detail" in (r.exc_text or "") or "secret internal detail" in str(r.exc_info)
               for r in caplog.records)


def test_replica_failed_and_timeout_keep_their_status_without_internal_text():
    async def faulty(job):
        yield GenerateChunk(finished=True, error="CUDA error: secret internal detail", error_kind="replica_fault")

    plain, instance = ingress_over(faulty, **{"failover.backoff_s": 0.0})
    response = asyncio.run(answer(plain, instance, completion()))
    error = error_of(response)
    assert response.status_code == 503 and error["code"] == "replica_failed"
    assert response.headers["Retry-After"] == "1"
    assert "secret" not in error["message"] and "CUDA" not in error["message"] and "cmpl-" in error["message"]

    async def late(job):  # its deadline passed before it committed a token
        yield GenerateChunk(finished=True, finish_reason="timeout")

    plain, instance = ingress_over(late)
    response = asyncio.run(answer(plain, instance, completion(deadline_s=1.5)))
    assert response.status_code == 504
    assert error_of(response)["message"] == "the request ran past its deadline of 1.5 s before it committed a token"


@pytest.mark.parametrize("name, last, status", [
    ("replica error", GenerateChunk(finished=True, error="secret", error_kind="algorithm"), 500),
    ("replica failed", GenerateChunk(finished=True, error="CUDA error", error_kind="replica_fault"), 503),
    ("timeout after a block: its end, no error",
     GenerateChunk(finished=True, finish_reason="timeout", completion_tokens=16), None),
    ("broken stream", KeyError("secret"), 500),
    ("none", GenerateChunk(text="x", token_ids=[5], finished=True, finish_reason="stop", steps=1), None),
])
def test_an_error_event_inside_a_stream_is_counted_by_its_status(name, last, status):
    """A stream's 200 goes out before its end: the error event that ends it is counted
    apart (``dllm_stream_errors_total``), by the status it would have had."""
    async def generate(job):
        yield GenerateChunk(text="12", token_ids=[5] * 16, steps=3, block_steps=[3])
        if isinstance(last, Exception):
            raise last
        yield last

    plain, instance = ingress_over(generate, **{"failover.backoff_s": 0.0, "failover.healthy_wait_s": 0.0})

    async def streamed():
        response = await answer(plain, instance, completion(max_tokens=32, stream=True))
        return response.status_code, await sse_events(response)

    code, events = asyncio.run(streamed())
    assert code == 200 and events[-1] == "[DONE]"
    assert ("error" in events[-2]) == (status is not None)
    expected = {} if status is None else {str(status): 1}
    assert instance.ingress_report()["stream_errors"] == expected


def test_a_stream_past_its_deadline_before_any_token_counts_a_504():
    async def late(job):
        yield GenerateChunk(finished=True, finish_reason="timeout")

    plain, instance = ingress_over(late)

    async def streamed():
        response = await answer(plain, instance, completion(max_tokens=32, stream=True, deadline_s=1.5))
        return response.status_code, await sse_events(response)

    code, events = asyncio.run(streamed())
    assert code == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert instance.ingress_report()["stream_errors"] == {"504": 1}


def test_any_other_exception_in_a_route_is_a_generic_500(caplog):
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/broken")
    async def broken():
        raise ZeroDivisionError("secret internal detail")

    with caplog.at_level(logging.ERROR), TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/broken")
    assert response.status_code == 500
    error = response.json()["error"]
    assert re.match(r"^internal error; request id req-[0-9a-f]{24}$", error["message"])
    assert "secret" not in response.text and "ZeroDivisionError" not in response.text
    request_id = error["message"].rsplit(" ", 1)[1]
    assert any(request_id in r.getMessage() and "secret internal detail" in str(r.exc_info) for r in caplog.records)


# ---- the live property test -------------------------------------------------------------------
FIELDS = set(protocol.CompletionRequest.model_fields) | set(protocol.ChatCompletionRequest.model_fields)
PUZZLES = [r.prompt for r in task.heldout_requests()[:8]]
PARAM_NAMES = sorted({f for name in available_algorithms()
                      for f in get_algorithm(name).params_class.__dataclass_fields__})

JUNK = st.sampled_from([None, True, False, "", "x", [], {}, [1], {"a": 1}, "16"])
INTS = st.one_of(st.integers(-(2 ** 65), 2 ** 65),
                 st.sampled_from([0, 1, -1, 2 ** 31 - 1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 10 ** 20, 10 ** 30]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1.0, 2.0, 1e-300, 5e-324, 1e-5, 1e-4, 100.0, 100.5, 1e20, 1e308]))
TEXT = st.text(max_size=24)


def messages(good: bool):
    content = st.one_of(st.sampled_from(PUZZLES), TEXT,
                        st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                 min_size=1, max_size=3))
    bad_content = st.one_of(st.just("1" * (MAX_PROMPT_CHARS + 1)),
                            st.just([{"type": "text", "text": "1"}] * 257),
                            st.lists(st.fixed_dictionaries({"type": st.just("image_url"), "text": TEXT}), min_size=1),
                            st.just([{"type": "text"}]), JUNK)
    role = st.sampled_from(["user", "system", "assistant", "developer", "tool"])
    message = st.fixed_dictionaries({"role": role, "content": content})
    if good:
        return st.one_of(st.lists(message, min_size=1, max_size=4), st.just([{"role": "user", "content": "1"}] * 512))
    bad_message = st.one_of(st.fixed_dictionaries({"role": role, "content": bad_content}),
                            st.fixed_dictionaries({"role": st.sampled_from(["god", "", 3]), "content": content}),
                            st.fixed_dictionaries({"role": role}), JUNK)
    return st.one_of(st.lists(bad_message, min_size=1, max_size=3), st.just([]),
                     st.just([{"role": "user", "content": "1"}] * 513), JUNK)


# field -> (good values, values out of bounds or of the wrong type); junk is bad for every field
FIELD_VALUES = {
    "model": (st.just("tiny"), st.sampled_from(["gpt-4", "m" * 257, ""])),
    "prompt": (st.one_of(st.sampled_from(PUZZLES), TEXT.filter(str.strip), st.sampled_from(PUZZLES).map(lambda p: [p])),
               st.one_of(st.sampled_from(["", "1" * 600, "1" * (MAX_PROMPT_CHARS + 1),
                                          ["a", "b"], []]), INTS)),
    "messages": (messages(True), messages(False)),
    "max_tokens": (st.one_of(st.integers(1, 32), st.sampled_from([480, 496])),
                   st.one_of(INTS, st.sampled_from([0, 497, 512, 513, 1.5]))),
    "max_completion_tokens": (st.integers(1, 32), INTS),
    "temperature": (st.sampled_from([0.0, 0.7, 1.0, 2.0, 1e-4, 100.0]), FLOATS),
    "top_p": (st.floats(0.05, 1.0), FLOATS),
    "top_k": (st.one_of(st.integers(0, 50), st.just(MAX_TOP_K)),
              st.one_of(INTS, st.sampled_from([MAX_TOP_K + 1, 1e20]))),
    "seed": (st.integers(0, 2 ** 63 - 1), INTS),
    "stop": (st.one_of(st.lists(st.text(min_size=1, max_size=4), max_size=4), st.text(min_size=1, max_size=8)),
             st.one_of(st.lists(st.text(max_size=300), min_size=5, max_size=6), st.just("s" * 257), st.just([""]))),
    "stream": (st.booleans(), st.sampled_from(["yes", 1])),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}),
                       st.sampled_from([{f"o{i}": 1 for i in range(9)}, {"include_usage": "yes"}])),
    "n": (st.integers(1, 2), INTS),
    "user": (TEXT, st.just("u" * 257)),
    "ignore_eos": (st.booleans(), st.just("no")),
    "echo": (st.booleans(), st.sampled_from(["yes", 1])),
    "logprobs": (st.one_of(st.none(), st.integers(0, 20)), INTS),
    "top_logprobs": (st.integers(0, 20), INTS),  # a chat's; it needs logprobs: true (drawn below)
    "best_of": (st.just(1), INTS),
    "algorithm": (st.sampled_from(available_algorithms()), st.sampled_from(["magic", "a" * 300])),
    "threshold": (st.floats(0, 1), FLOATS),
    "algorithm_params": (
        st.dictionaries(st.sampled_from(PARAM_NAMES), st.one_of(st.floats(0, 1), st.integers(0, 300)), max_size=3),
        st.one_of(st.dictionaries(st.sampled_from(PARAM_NAMES), st.one_of(FLOATS, INTS, JUNK), min_size=1, max_size=3),
                  st.dictionaries(TEXT, INTS, min_size=1, max_size=3),
                  st.sampled_from([{f"p{i}": 1 for i in range(33)}, {"p" * 65: 1}]))),
    "block_length": (st.just(16), INTS),
    "mode": (st.just("fdfo"), st.sampled_from(["sync", "static", "fixed_fill", "bogus"])),
    "frequency_penalty": (st.just(0), FLOATS),  # cannot be honoured: only its neutral value passes
    "logit_bias": (st.just({}), st.dictionaries(TEXT, INTS, min_size=1, max_size=2)),
}
REQUIRED = ("model", "max_tokens")  # and the prompt or the messages; max_tokens keeps cases short
COMPLETION_ONLY = {"prompt", "echo", "best_of", "logprobs"}
CHAT_ONLY = {"messages", "top_logprobs"}
CHEAP_STEPS = 32  # over this many output tokens, a case runs the default algorithm (about 17 steps a block)


@st.composite
def cases(draw):
    """(path, body): some of every field of both endpoints, good ones and a few (often none)
    out of bounds, of the wrong type, junk or missing."""
    chat_request = draw(st.booleans())
    skip = COMPLETION_ONLY if chat_request else CHAT_ONLY
    fields = sorted(set(FIELD_VALUES) - skip)
    present = [*REQUIRED, "messages" if chat_request else "prompt",
               *draw(st.lists(st.sampled_from([f for f in fields if f not in (*REQUIRED, "messages", "prompt")]),
                              max_size=6, unique=True))]
    bad = draw(st.lists(st.sampled_from(present), max_size=draw(st.sampled_from([0, 0, 1, 1, 2])), unique=True))
    body = {}
    for name in present:
        good, wrong = FIELD_VALUES[name]
        if name not in bad:
            body[name] = draw(good)
        elif draw(st.sampled_from([True] * 4 + [False])):  # else: missing
            body[name] = draw(st.one_of(wrong, JUNK))
    if chat_request and draw(st.booleans()):
        body["logprobs"] = draw(st.sampled_from([False, True, None, 1]))
    # keep each case fast: long outputs run the default algorithm without ignore_eos
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens", 128) if limit is None else limit
    if not isinstance(limit, int) or isinstance(limit, bool) or limit > CHEAP_STEPS:
        for costly in ("algorithm", "algorithm_params", "ignore_eos"):
            body.pop(costly, None)
    return (CHAT if chat_request else "/v1/completions"), body


def check_answer(response: httpx.Response, body: dict) -> None:
    """200 with a well-formed body or stream, or a 4xx OpenAI error envelope naming the field."""
    assert response.status_code < 500, (response.status_code, response.text[:500], body)
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events and events[-1] == "[DONE]", response.text[:500]
            for event in map(json.loads, events[:-1]):
                assert "error" not in event, (event, body)
        else:
            payload = response.json()
            assert payload["choices"][0]["finish_reason"] in ("stop", "length"), payload
        return
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str) and error["message"]
    if response.status_code == 400 and error["code"] != "invalid_json":
        assert error["param"] is not None and error["param"].split(".")[0] in FIELDS, (error, body)


# hostile requests that once crashed or hung a layer: run first in-process, and against the live cluster
EXAMPLES = [
    ("/v1/completions", completion(algorithm="joint_threshold", temperature=1, top_k=1e20)),
    ("/v1/completions", completion(algorithm="joint_threshold", temperature=1, algorithm_params={"top_k": 10 ** 20})),
    ("/v1/completions", completion(algorithm="joint_threshold", algorithm_params={"max_post_edit_steps": 10 ** 12})),
    ("/v1/completions", completion(seed=2 ** 64, top_k=2 ** 64, temperature=0.5)),
    (CHAT, chat([{"role": "user", "content": "1"}] * 50_000)),
    ("/v1/completions", completion(prompt="1" * (MAX_PROMPT_CHARS + 1))),
]


def check_bounds(send, generated: bool) -> Counter:
    """``send(path, body bytes) -> httpx.Response`` for each of ``EXAMPLES`` and, where
    ``generated``, 250 drawn ``cases``; each answer checked; returns the statuses counted."""
    counts: Counter = Counter()

    def one(case):
        path, body = case
        # json.dumps writes NaN and Infinity as Python does (httpx's json= would refuse them)
        response = send(path, json.dumps(body).encode())
        counts[response.status_code] += 1
        check_answer(response, body)

    test = given(cases())(one)
    for case in reversed(EXAMPLES):
        test = example(case)(test)
    phases = (Phase.explicit, Phase.generate) if generated else (Phase.explicit,)  # never shrinking
    settings(max_examples=250, deadline=None, derandomize=True, database=None, phases=phases,
             suppress_health_check=list(HealthCheck))(test)()
    return counts


def check_a_real_answer(send) -> None:
    """A held-out puzzle answered as before (at least half its grids right)."""
    request = task.heldout_requests()[0]
    response = send("/v1/completions", json.dumps({"model": "tiny", "prompt": request.prompt,
                                                   "max_tokens": task.MAX_TOKENS}).encode())
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert sum(task.grade(request, response.json()["choices"][0]["text"])) >= math.ceil(len(request.puzzles) / 2)


async def as_received(answered) -> httpx.Response:
    """A route's response (awaited from ``answered``) as a client receives it, a stream
    read to its end."""
    response = await answered
    if hasattr(response, "body_iterator"):
        body = b"".join([p if isinstance(p, bytes) else p.encode() async for p in response.body_iterator])
    else:
        body = response.body
    return httpx.Response(response.status_code, headers=response.headers.items(), content=body)


@pytest.fixture(scope="module")
def tiny_replica():
    """A real engine replica of the tiny model in this process (no Ray)."""
    from replicas.deployment import EngineReplica
    from replicas.engine_config import EngineConfig

    replica = EngineReplica("tiny", EngineConfig(max_batch=16), metrics_actor=None)
    yield replica
    replica.__del__()


@pytest.mark.timeout(1200)
def test_any_request_gets_200_or_a_4xx_envelope_and_the_engine_recovers(tiny_replica):
    """The property over the ingress's routes and a real engine, in this process."""
    plain, instance = ingress_over(tiny_replica.generate)

    def send(path: str, data: bytes) -> httpx.Response:
        return asyncio.run(as_received(answer(plain, instance, data, path=path)))

    start = time.monotonic()
    counts = check_bounds(send, generated=True)
    print(f"statuses {sorted(counts.items())} in {time.monotonic() - start:.0f} s")
    assert counts[200] >= 25 and counts[400] >= 25, counts  # both kinds were exercised
    engine = tiny_replica.engine
    deadline = time.monotonic() + 60
    while engine.scheduler.running or engine.scheduler.waiting or engine.pool.num_unheld != engine.pool.capacity:
        assert time.monotonic() < deadline, "the engine kept requests or pages"
        time.sleep(0.05)
    assert instance.admission.outstanding == 0
    check_a_real_answer(send)


@pytest.mark.timeout(600)
def test_the_hostile_examples_get_200_or_a_4xx_envelope_live_and_the_server_recovers(cluster):
    with httpx.Client(base_url=cluster.base_url, headers=AUTH | {"Content-Type": "application/json"},
                      timeout=120) as client:
        def send(path: str, data: bytes) -> httpx.Response:
            return client.post(path, content=data)

        counts = check_bounds(send, generated=False)
        assert sum(counts.values()) == len(EXAMPLES), counts
        # the server serves normally afterwards: pages and admission back to 0 ...
        deadline = time.monotonic() + 180
        while True:
            text = cluster.metrics_text()
            free, pages = series(text, "dllm_free_pages"), series(text, "dllm_total_pages")
            live = sum(series(text, "dllm_running_requests").values()) + \
                sum(series(text, "dllm_step_queue_length").values())
            outstanding = sum(series(text, "dllm_admission_outstanding").values())
            if free and free == pages and live == 0 and outstanding == 0:
                break
            assert time.monotonic() < deadline, f"free {free} of {pages}, live {live}, outstanding {outstanding}"
            time.sleep(0.5)
        # ... and answers a real request as before
        check_a_real_answer(send)
