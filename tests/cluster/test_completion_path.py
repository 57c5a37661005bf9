"""cluster.completion_path in front of the ingress's real FastAPI app, over ASGI: a request
its headers refuse is answered with the route's own envelope before the body is read, one
whose output bound cannot fit before the body is validated; the rest by the route's own
code, called below FastAPI; other paths reach FastAPI."""

import asyncio
import json
import types

import pytest

from cluster import completion_path, preprocess
from cluster.auth import API_KEYS_ENV
from cluster.http_tally import TALLY
from cluster.ingress import app
from cluster.protocol import CompletionRequest
from test_ingress_path import answer, completion, make_ingress, over_capacity


def call(method: str, path: str, headers: dict[str, str], body: bytes = b"",
         messages: list[dict] | None = None) -> tuple[int, dict, dict | None, int]:
    """(status, headers, JSON body or None, times the body was read) of ``app`` for one
    request whose client sends ``body`` whole, or ``messages`` and then stays silent."""
    reads, sent = [], []
    messages = [{"type": "http.request", "body": body, "more_body": False}] if messages is None else messages

    async def receive():
        reads.append(1)
        if len(reads) > len(messages):
            await asyncio.Event().wait()
        return messages[len(reads) - 1]

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    try:
        asyncio.run(app(scope, receive, send))
    except Exception:  # Starlette re-raises a route's exception once it has sent the 500
        pass
    start = next(m for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, json.loads(data) if data else None, len(reads)


BODY = json.dumps(completion()).encode()
JSON = {"content-type": "application/json", "content-length": str(len(BODY))}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_request_over_capacity_gets_the_routes_429_without_its_body_read(path):
    _, ingress = make_ingress(**{"admission.max_step_debt_per_replica": 100})
    over_capacity(ingress)
    refused_before = TALLY.responses["429"]
    status, headers, body, reads = call("POST", path, JSON, BODY)
    assert status == 429 and int(headers["retry-after"]) >= 1 and reads == 0
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "step_capacity_exceeded"
    assert ingress.refusals.counts["step_capacity"] == 1 and ingress.tokenizer.calls == 0
    assert TALLY.responses["429"] == refused_before + 1  # the HTTP tally, outside, counted the early answer
    assert ingress.ingress_report()["responses"]["429"] == TALLY.responses["429"]  # and the report carries it


def test_key_draining_and_size_are_answered_first_in_the_routes_order(monkeypatch):
    monkeypatch.setenv(API_KEYS_ENV, "the-right-key")
    _, ingress = make_ingress(**{"admission.max_step_debt_per_replica": 100, "ingress.max_body_bytes": 1024})
    over_capacity(ingress)
    assert call("POST", "/v1/completions", JSON, BODY)[0] == 401  # the key before all else
    key = {"authorization": "Bearer the-right-key"}
    status, _, body, reads = call("POST", "/v1/completions", {**JSON, **key, "content-length": "4096"}, BODY)
    assert (status, body["error"]["code"], reads) == (413, "request_too_large", 0)
    ingress.draining = True
    status, headers, body, _ = call("POST", "/v1/completions", {**JSON, **key}, BODY)
    assert (status, body["error"]["code"], headers["retry-after"]) == (503, "server_draining", "1")
    assert not ingress.refusals.counts  # only admission's refusals are counted as such


def test_other_paths_reach_fastapi_and_completions_are_served_below_it():
    _, ingress = make_ingress()
    status, _, body, _ = call("POST", "/v1/nothing-here", JSON, BODY)
    assert status == 404 and body["error"]["type"] == "not_found_error"  # FastAPI's router answered
    # outside Serve, FastAPI's route cannot find its ingress (a 500): a 200 is the middleware's
    status, _, body, reads = call("POST", "/v1/completions", JSON, BODY)
    assert status == 200 and body["choices"][0]["text"] == "x" and len(ingress.sent) == 1
    assert reads == 2  # the body, then the watch for the client leaving (this receive never says so)
    assert ingress.in_flight == 0


def near_capacity():
    """An ingress with room for a one-block request (1 row-step of the bound), not for more."""
    _, ingress = make_ingress(**{"admission.max_step_debt_per_replica": 100})
    ingress.held = ingress.admission.try_admit(99)  # held, as a request in flight holds its charge
    assert ingress.held.admitted
    return ingress


def send_body(body) -> tuple[int, dict, dict, int]:
    data = json.dumps(body).encode() if not isinstance(body, bytes) else body
    return call("POST", "/v1/completions", {"content-type": "application/json", "content-length": str(len(data))},
                data)


@pytest.mark.parametrize("body", [
    completion(max_tokens=128),  # four blocks
    {**completion(), "n": 2},
    {**completion(), "prompt": ["1.3.", "2.4."]},
    {**completion(max_tokens=128), "temperature": "hot"},  # refused before the body is validated
])
def test_a_body_whose_output_bound_cannot_fit_is_refused_below_the_app(body):
    ingress = near_capacity()
    status, headers, answer, reads = send_body(body)
    assert status == 429 and answer["error"]["code"] == "step_capacity_exceeded" and int(headers["retry-after"]) >= 1
    assert reads == 1 and ingress.refusals.counts["step_capacity"] == 1 and ingress.tokenizer.calls == 0


def test_a_chat_body_counts_one_prompt():
    ingress = near_capacity()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "1.3."}]}
    assert call("POST", "/v1/chat/completions", JSON, json.dumps({**chat, "max_tokens": 128}).encode())[0] == 429
    assert ingress.tokenizer.calls == 0  # four blocks: refused before the body's validation
    call("POST", "/v1/chat/completions", JSON, json.dumps({**chat, "max_tokens": 16}).encode())
    assert ingress.tokenizer.calls == 1  # one block: on to the route, which tokenized its prompt


@pytest.mark.parametrize("body", [
    completion(max_tokens=16),  # fits
    completion(max_tokens=128),
    {**completion(), "max_tokens": "128"},  # fields the check leaves to the route's validation
    {**completion(), "n": 0},
    {**completion(), "n": 9, "max_tokens": 128},  # more choices than the server answers
    {**completion(), "prompt": []},
    {**completion(), "prompt": [{"text": "1.3."}]},
    {**completion(max_tokens=128), "deadline_s": -1},
    {**completion(), "model": "another"},
    [completion(max_tokens=128)],
    b'{"model": "tiny", "max_tokens": 128, "prompt": ',  # not JSON
    b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}",  # nested deeper than a parser recurses
])
def test_the_middleware_answers_as_the_route_does(body):
    """Status and error envelope alike, whether the middleware or FastAPI's route (called
    directly) answers; only a body the route would refuse for its output bound anyway is
    refused before its validation."""
    plain, routed = near_capacity_route()
    expected = asyncio.run(answer(plain, routed, body))
    ingress = near_capacity()
    status, _, got, _ = send_body(body)
    assert (status, got.get("error")) == (expected.status_code, json.loads(expected.body).get("error"))
    assert ingress.refusals.counts == routed.refusals.counts and len(ingress.sent) == len(routed.sent)


@pytest.mark.parametrize("body, parses, status", [
    (completion(), 1, 200), (completion(max_tokens="16"), 1, 200),
    ({**completion(), "n": "two"}, 2, 400),  # its error as the bytes give it
    ({**completion(), "prompt": "\ud800"}, 1, 400)])  # a lone surrogate: left to the route, which refuses it
def test_a_small_body_is_parsed_once_unless_it_is_refused(monkeypatch, body, parses, status):
    """The JSON the middleware parsed to check the body is what preprocess validates: a
    valid body is not parsed again; an invalid one is, for its error as the route gives it."""
    make_ingress()
    parsed = []
    validate_json = CompletionRequest.model_validate_json.__func__
    monkeypatch.setattr(preprocess, "json", types.SimpleNamespace(
        loads=lambda *args, **kwargs: parsed.append(1) or json.loads(*args, **kwargs)))
    monkeypatch.setattr(CompletionRequest, "model_validate_json", classmethod(
        lambda cls, *args, **kwargs: parsed.append(1) or validate_json(cls, *args, **kwargs)))
    answered, _, _, _ = send_body(json.dumps(body).encode())
    assert (answered, len(parsed)) == (status, parses)


def near_capacity_route():
    plain, ingress = make_ingress(**{"admission.max_step_debt_per_replica": 100})
    ingress.held = ingress.admission.try_admit(99)
    return plain, ingress


def test_the_route_gets_the_body_the_middleware_read(monkeypatch):
    """Behind the middleware, the route gets a small body as read and parsed there (once),
    then the client's own next message (its leaving); a large body, unread or read in part,
    whole from the same messages; a small body that is not JSON, from the same messages."""
    got = []

    class Routes:
        def check_before_body(self, headers):
            pass

        def check_body(self, body, chat):
            pass

        async def answer(self, scope, receive, send, key, body=None):
            got.append((body, [await receive() for _ in range(1 if body else 3)]))
    monkeypatch.setattr(completion_path, "_ingress", Routes())

    pieces = [b'{"model": "tiny", ', b'"prompt": "1.3.", "max_tokens": 16}']
    large = json.dumps({**completion(), "prompt": "1" * completion_path.PEEK_BODY_BYTES}).encode()
    halves = [large[:len(large) // 2], large[len(large) // 2:]]  # chunked, over the peek's bound
    broken = [b'{"model": ', b'"tiny"']
    for body, headers in [(pieces, [(b"content-type", b"application/json")]),
                          ([large], [(b"content-length", str(len(large)).encode())]),
                          (halves, [(b"content-type", b"application/json")]),
                          (broken, [(b"content-type", b"application/json")])]:
        queue = [{"type": "http.request", "body": p, "more_body": i < len(body) - 1} for i, p in enumerate(body)]
        queue.append({"type": "http.disconnect"})
        queue.append({"type": "http.disconnect"})

        async def receive(queue=queue):
            return queue.pop(0)
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
        asyncio.run(completion_path.CompletionPath(None)(scope, receive, None))
    peeked, messages = got[0]
    assert peeked.raw == b"".join(pieces) and peeked.parsed == json.loads(b"".join(pieces))
    assert [m["type"] for m in messages] == ["http.disconnect"]
    assert got[1][0] is None and got[1][1][0]["body"] == large and got[1][1][1]["type"] == "http.disconnect"
    assert got[2][0] is None and [m.get("body") for m in got[2][1]] == halves + [None]
    assert got[3][0] is None and [m.get("body") for m in got[3][1]] == broken + [None]
