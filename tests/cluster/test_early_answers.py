"""cluster.early_answers in front of the ingress's real FastAPI app, over ASGI: a request
its headers refuse is answered below FastAPI with the route's own envelope, before the
body is read; anything else reaches the app."""

import asyncio
import json

import pytest

from cluster.auth import API_KEYS_ENV
from cluster.http_tally import TALLY
from cluster.ingress import app
from test_ingress_path import completion, make_ingress, over_capacity


def call(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, dict, dict, int]:
    """(status, headers, JSON body, times the body was read) of ``app`` for one request."""
    reads, sent = [], []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": body, "more_body": False}

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
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(data), len(reads)


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
    assert ingress.rejected["step_capacity"] == 1 and ingress.tokenizer.calls == 0
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
    assert not ingress.rejected  # only admission's refusals are counted as such


def test_what_the_headers_do_not_refuse_reaches_the_app():
    _, ingress = make_ingress()
    status, _, body, _ = call("POST", "/v1/nothing-here", JSON, BODY)
    assert status == 404 and body["error"]["type"] == "not_found_error"  # FastAPI's router answered
    # an idle cluster admits: the middleware passes the request on (to a route that, outside
    # Serve, cannot find its replica: what matters is that the app, not the middleware, answered)
    status, _, body, reads = call("POST", "/v1/completions", JSON, BODY)
    assert status == 500 and body["error"]["code"] == "internal_error" and ingress.rejected["step_capacity"] == 0
