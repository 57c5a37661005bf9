"""The ingress request path without Ray: cheap refusals before parsing and tokenizing,
tokenization off the event loop, one metrics-actor call per stats period."""

import asyncio
import json
import re
import threading
import time
import types

import pytest
from starlette.requests import Request

from cluster.auth import API_KEYS_ENV
from cluster.config import load_config
from cluster.errors import APIError
from cluster.ingress import app
from cluster.preprocess import INLINE_PREPARE_CHARS
from replica_stand_in import Replicas

PROMPT = "1.3. ..2. 4... .1.4 "


class CountingTokenizer:
    """The real tokenizer and the ingress's encoder of it (``replicas.text_encoding``),
    counting the encodes and the threads they come from."""

    def __init__(self, tokenizer, encode):
        self.tokenizer, self._encode, self.calls, self.threads = tokenizer, encode, 0, []

    def encode(self, *args, **kwargs):
        self.calls += 1
        self.threads.append(threading.get_ident())
        return self._encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.threads.append(threading.get_ident())
        return self.tokenizer.apply_chat_template(*args, **kwargs)


class MetricsActor:
    """Stands in for the metrics actor's handle; ``hang``: its calls never answer."""

    def __init__(self, hang: bool = False):
        self.calls, self.hang = [], hang
        self.ingress_sync = types.SimpleNamespace(remote=self._sync)

    def _sync(self, ingress_id, report):
        self.calls.append((time.monotonic(), report))
        return asyncio.Event().wait() if self.hang else _answer({"replicas": {}, "draining": False, "ingresses": 1})


async def _answer(value):
    return value


def make_ingress(**settings):
    """An Ingress of the tiny model built outside Serve, with a counting tokenizer."""
    from cluster.ingress import Ingress

    plain = next(c for c in Ingress.__mro__ if "_complete" in vars(c))  # under serve.ingress's wrapper
    replicas = Replicas()
    handle = types.SimpleNamespace(options=lambda **_: replicas)
    instance = plain.__new__(plain)
    plain.__init__(instance, handle, load_config(overrides=settings).model_dump(mode="json"))
    preprocess = instance.preprocess
    instance.tokenizer = preprocess.tokenizer = CountingTokenizer(preprocess.tokenizer, preprocess.encode)
    preprocess.encode = instance.tokenizer.encode
    instance._metrics = MetricsActor()  # never ray.get_actor, which would start Ray
    instance.sent = replicas.jobs  # what reached the replicas
    return plain, instance


class Body:
    """An ASGI request body, counting how often the app asked for it."""

    def __init__(self, data: bytes):
        self.data, self.reads = data, 0

    async def receive(self):
        self.reads += 1
        return {"type": "http.request", "body": self.data, "more_body": False}


def request(body: dict | bytes, path: str = "/v1/completions", content_length: bool = True) -> tuple[Request, Body]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = [(b"content-type", b"application/json")]
    if content_length:
        headers.append((b"content-length", str(len(data)).encode()))
    source = Body(data)
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}
    return Request(scope, source.receive), source


def completion(max_tokens: int = 16) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens}


async def answer(plain, ingress, body: dict | bytes, **kwargs):
    """The route's response, or the APIError it raised as a response."""
    req, _ = request(body, **kwargs)
    route = plain.chat_completions if kwargs.get("path", "").endswith("chat/completions") else plain.completions
    try:
        return await route(ingress, req)
    except APIError as exc:
        return exc.response()


def over_capacity(ingress) -> None:
    """Fill the admission controller far beyond its fixed bound."""
    ingress.held = ingress.admission.try_admit(10 ** 9)  # held, as a request in flight holds its charge
    assert ingress.held.admitted  # an idle cluster admits anything once


def test_over_capacity_refuses_before_reading_parsing_or_tokenizing():
    plain, ingress = make_ingress(**{"admission.max_step_debt_per_replica": 100})
    over_capacity(ingress)
    req, body = request(completion())
    with pytest.raises(APIError) as refused:
        asyncio.run(plain.completions(ingress, req))
    assert refused.value.status == 429 and int(refused.value.headers["Retry-After"]) >= 1
    assert refused.value.body()["error"]["type"] == "rate_limit_error"
    assert body.reads == 0 and ingress.tokenizer.calls == 0
    assert ingress.refusals.counts["step_capacity"] == 1 and ingress.dispatch.admitted == 0


def test_auth_comes_before_admission_and_the_body(monkeypatch):
    monkeypatch.setenv(API_KEYS_ENV, "the-right-key")
    plain, ingress = make_ingress(**{"admission.max_step_debt_per_replica": 100})
    over_capacity(ingress)
    req, body = request(completion())
    with pytest.raises(APIError) as refused:
        asyncio.run(plain.completions(ingress, req))
    assert refused.value.status == 401 and body.reads == 0 and not ingress.refusals.counts


@pytest.mark.parametrize("content_length", [True, False], ids=["declared", "streamed"])
def test_body_over_the_limit_gets_413(content_length):
    plain, ingress = make_ingress(**{"ingress.max_body_bytes": 2048})
    big = completion() | {"prompt": "1" * 4000}
    response = asyncio.run(answer(plain, ingress, big, content_length=content_length))
    assert response.status_code == 413
    assert json.loads(response.body)["error"]["code"] == "request_too_large"
    assert ingress.tokenizer.calls == 0


def test_bad_json_is_a_400_after_the_cheap_checks():
    plain, ingress = make_ingress()
    response = asyncio.run(answer(plain, ingress, b'{"model": "tiny", "prompt": '))
    assert response.status_code == 400 and json.loads(response.body)["error"]["code"] == "invalid_json"
    for shape in (123, [[5, "a"]], [5.0, 6], [True, 5], [[5], "x"]):  # one error, not one per branch of the union
        response = asyncio.run(answer(plain, ingress, {"model": "tiny", "prompt": shape}))
        error = json.loads(response.body)["error"]
        assert response.status_code == 400 and error["param"] == "prompt", shape
        assert error["message"].startswith("prompt: must be a string, a list of strings, a list of token ids"), shape


def test_the_output_bound_refuses_before_tokenizing():
    """A request whose own output blocks cannot fit is refused before its prompt is tokenized."""
    plain, ingress = make_ingress(**{"admission.max_step_debt_per_replica": 100})
    held = ingress.admission.try_admit(80)  # held, as a request in flight holds its charge
    assert held.admitted  # room for a one-block request, not for 32 blocks
    response = asyncio.run(answer(plain, ingress, completion(max_tokens=512)))
    assert response.status_code == 429 and ingress.tokenizer.calls == 0


def test_the_default_output_limit_is_what_fits_beside_the_prompt():
    """max_tokens not given: the default (128), or less where the prompt leaves less room
    (the tiny model serves 512 positions in blocks of 16); given, it is the client's."""
    plain, ingress = make_ingress()

    def sent(prompt: str, **fields):
        response = asyncio.run(answer(plain, ingress, {"model": "tiny", "prompt": prompt, **fields}))
        error = json.loads(response.body).get("error")
        return response.status_code, ingress.sent[-1].params.max_tokens if response.status_code == 200 else error

    assert sent("1" * 20) == (200, 128)
    assert sent("1" * 396) == (200, 112)  # 25 prompt pages of 32
    assert sent("1" * 396, max_tokens=16) == (200, 16)
    status, error = sent("1" * 396, max_tokens=128)  # asked for: refused, not cut
    assert status == 400 and error["code"] == "context_length_exceeded" and "max_tokens (128)" in error["message"]
    status, error = sent("1" * 500)
    assert status == 400 and (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert error["message"].startswith("the prompt leaves no room for an answer (500 tokens)")
    chat = asyncio.run(answer(plain, ingress, {"model": "tiny", "messages": [{"role": "user", "content": "1" * 380}]},
                              path="/v1/chat/completions"))
    assert chat.status_code == 200 and ingress.sent[-1].params.max_tokens == 512 - 16 * -(-len(
        ingress.sent[-1].prompt_ids) // 16)


def test_long_prompts_are_tokenized_off_the_event_loop_short_ones_on_it():
    """A short prompt costs less to tokenize than the hop to a thread; a long one would hold
    the event loop (and every refusal behind it)."""
    plain, ingress = make_ingress()
    long_prompt = PROMPT * (INLINE_PREPARE_CHARS // len(PROMPT) + 1)  # over the tiny model's context

    async def run():
        loop_thread = threading.get_ident()
        answers = []
        for prompt in (PROMPT, long_prompt):
            answers.append(await answer(plain, ingress, {"model": "tiny", "prompt": prompt, "max_tokens": 16}))
            answers.append(await answer(plain, ingress, {"model": "tiny", "max_tokens": 16,
                                                         "messages": [{"role": "user", "content": prompt}]},
                                        path="/v1/chat/completions"))
        return loop_thread, answers

    loop_thread, answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200, 200, 400, 400], [a.body for a in answers]
    threads = ingress.tokenizer.threads  # completion: tokenizer; chat: template, then tokenizer
    assert ingress.tokenizer.calls == 4 and threads[:3] == [loop_thread] * 3 and loop_thread not in threads[3:]
    assert ingress.dispatch.admitted == 2 and ingress.admission.outstanding == 0


def test_decisions_reach_the_metrics_actor_batched_once_per_period():
    period = 0.2
    plain, ingress = make_ingress(stats_period_s=period, **{"admission.max_step_debt_per_replica": 100})
    actor = ingress._metrics

    async def load():
        start = time.monotonic()
        assert (await answer(plain, ingress, completion())).status_code == 200  # starts the sync task
        over_capacity(ingress)
        codes = [(await answer(plain, ingress, completion())).status_code for _ in range(200)]
        await asyncio.sleep(2.5 * period)  # the next report carries them
        return codes, time.monotonic() - start

    codes, elapsed = asyncio.run(load())
    assert codes == [429] * 200
    assert 1 <= len(actor.calls) <= elapsed / period + 1  # per period, not per request
    last = actor.calls[-1][1]
    assert last["admitted"] == 1 and last["rejected"] == {"step_capacity": 200}
    assert last["outstanding"] == ingress.admission.outstanding and last["cpu_s"] > 0


def test_a_metrics_actor_that_never_answers_does_not_hold_requests():
    plain, ingress = make_ingress(stats_period_s=0.05, **{"ingress.metrics_timeout_s": 0.1})
    actor = ingress._metrics = MetricsActor(hang=True)

    async def load():
        codes = [(await answer(plain, ingress, completion())).status_code for _ in range(5)]
        await asyncio.sleep(0.5)
        return codes

    assert asyncio.run(load()) == [200] * 5
    assert len(actor.calls) >= 2  # timed out and tried again, on the same handle


def test_exporter_adds_what_is_new_in_each_ingress_report():
    from prometheus_client import generate_latest

    from cluster.metrics import MetricsExporter
    from test_metrics_exporter import sample

    exporter = MetricsExporter()
    report = {"admitted": 3, "rejected": {"step_capacity": 5}, "failovers": 1, "outstanding": 40.0, "cpu_s": 1.5}
    exporter.push_ingress("a", report)
    exporter.push_ingress("a", report)  # sent twice: counted once
    exporter.push_ingress("b", {"admitted": 1, "rejected": {}, "failovers": 0, "outstanding": 2.0, "cpu_s": 0.5})
    answer = exporter.ingress_sync("a", report | {"admitted": 4, "failovers": 2, "outstanding": 10.0, "cpu_s": 2.0})
    assert answer == {"replicas": {}, "draining": False, "ingresses": 2}  # no replica has reported
    text = generate_latest(exporter.registry).decode()
    assert sample(text, "dllm_admitted_total") == 5
    assert sample(text, "dllm_failovers_total") == 2
    assert sample(text, "dllm_rejected_total", 'reason="step_capacity"') == 5
    assert sample(text, "dllm_admission_outstanding") == 12.0  # summed over the ingress replicas
    assert sample(text, "dllm_ingress_cpu_seconds_total") == 2.5


def test_the_docs_page_carries_the_api_description_behind_the_key(monkeypatch):
    """A browser loading /docs with the key fetches nothing else from the server: the page
    holds the OpenAPI description (fetching /openapi.json, keyless, got 401)."""
    monkeypatch.setenv(API_KEYS_ENV, "the-right-key")
    plain, ingress = make_ingress()
    with pytest.raises(APIError) as refused:
        asyncio.run(plain.docs(ingress, authorization=None))
    assert refused.value.status == 401
    page = asyncio.run(plain.docs(ingress, authorization="Bearer the-right-key")).body.decode()
    spec = json.loads(re.search(r'^"spec": (.*),$', page, flags=re.M).group(1))
    assert spec["info"]["title"] == "dllm-serve" and spec["paths"].keys() == app.openapi()["paths"].keys()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= spec["paths"].keys()
    assert "openapi.json" not in page


def test_a_stream_tells_proxies_in_front_not_to_buffer_or_cache_it():
    plain, ingress = make_ingress()
    response = asyncio.run(answer(plain, ingress, {**completion(), "stream": True}))
    assert response.media_type == "text/event-stream"
    assert (response.headers["cache-control"], response.headers["x-accel-buffering"]) == ("no-cache", "no")
