"""One request against a stand-in OpenAI endpoint on 127.0.0.1: SSE parsing and outcomes."""

import asyncio
import json
import socket
from dataclasses import replace

import httpx
import pytest

from loadgen.client import Endpoint, chunk_text, first_model, make_client, send, sse_data
from loadgen.records import ERROR, OK, REFUSED, Arrival, LoadgenError
from tests.loadgen.http_stand_in import stand_in

ARRIVAL = Arrival(0.0, "1.3. ..2. 4... .1.4", max_tokens=32)


def sse(*bodies) -> bytes:
    return b"".join(b"data: " + (b if isinstance(b, bytes) else json.dumps(b).encode()) + b"\n\n" for b in bodies)


def chunk(text, usage=None, steps=3):
    body = {"choices": [{"index": 0, "text": text, "finish_reason": None}], "dllm": {"steps": steps, "replica": "r1"}}
    if usage is not None:
        body = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": usage,
                                         "prompt_tokens_details": {"cached_tokens": 5}}}
    return body


def send_to(url, endpoint=None, timeout_s=5.0):
    endpoint = replace(endpoint or Endpoint(url=url, model="tiny", timeout_s=timeout_s), url=url)

    async def main():
        async with make_client(endpoint) as client:
            return await send(client, endpoint, 3, ARRIVAL, asyncio.get_running_loop().time())
    return asyncio.run(main())


def run_send(handler, endpoint=None, timeout_s=5.0):
    with stand_in(handler) as url:
        return send_to(url, endpoint, timeout_s)


def test_sse_data_joins_lines_and_skips_comments():
    async def lines():
        for line in [": keep-alive", "data: {\"a\": 1}", "", "event: x", "data:two", "data: lines", "", "data: [DONE]"]:
            yield line

    async def collect():
        return [d async for d in sse_data(lines())]

    assert asyncio.run(collect()) == ['{"a": 1}', "two\nlines", "[DONE]"]


def test_chunk_text_of_completions_and_chat():
    assert chunk_text({"choices": [{"text": "12"}]}) == "12"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": "34"}}]}) == "34"
    assert chunk_text({"choices": [], "usage": {}}) == ""
    assert chunk_text({"choices": [{"message": {"role": "assistant", "content": "56"}}]}) == "56"


def test_ok_stream_with_usage():
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(200, content=sse(chunk(""), chunk("1234 1234"), chunk("4321", steps=9),
                                                chunk("", usage=12), b"[DONE]"))

    record = run_send(handler)
    assert seen["stream"] is True and seen["stream_options"] == {"include_usage": True}
    assert seen["prompt"] == ARRIVAL.prompt and seen["max_tokens"] == 32 and seen["model"] == "tiny"
    assert (record.status, record.http_status, record.error) == (OK, 200, None)
    assert (record.output_tokens, record.tokens_from, record.steps, record.replica) == (12, "usage", 9, "r1")
    assert (record.prompt_tokens, record.cached_tokens) == (7, 5)
    assert 0 < record.ttfb_s <= record.latency_s and record.index == 3
    assert record.text == "1234 12344321"


def test_a_whole_answer_when_not_streamed():
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"text": "1234"}], "usage": {"completion_tokens": 4},
                                         "dllm": {"steps": 5, "replica": "r2", "engine_s": 0.25}})

    record = run_send(handler, Endpoint(url="", model="tiny", stream=False))
    assert seen["stream"] is False and "stream_options" not in seen
    assert (record.status, record.output_tokens, record.tokens_from, record.steps, record.replica,
            record.engine_s) == (OK, 4, "usage", 5, "r2", 0.25)
    assert (record.prompt_tokens, record.cached_tokens) == (None, None)  # a server that does not say
    assert record.ttfb_s == pytest.approx(record.latency_s, abs=0.05) and record.text == "1234"
    record = run_send(lambda r: httpx.Response(200, content=b"not json"),
                      Endpoint(url="", model="tiny", stream=False))
    assert record.status == ERROR and record.error.startswith("malformed answer")


def test_without_usage_tokens_are_characters():
    record = run_send(lambda r: httpx.Response(200, content=sse(chunk("12 34"), chunk("5"), b"[DONE]")))
    assert (record.status, record.output_tokens, record.tokens_from) == (OK, 5, "characters")


def test_chat_body_and_extra_fields():
    seen = {}

    def handler(request):
        seen["path"], seen["body"] = request.url.path, json.loads(request.content)
        return httpx.Response(200, content=sse({"choices": [{"delta": {"content": "12"}}]}, b"[DONE]"))

    endpoint = Endpoint(url="", model="tiny", chat=True, max_tokens=64, extra={"algorithm": "fixed_steps"})
    record = run_send(handler, endpoint)
    assert seen["path"] == "/v1/chat/completions" and seen["body"]["algorithm"] == "fixed_steps"
    assert seen["body"]["messages"] == [{"role": "user", "content": ARRIVAL.prompt}] and "prompt" not in seen["body"]
    assert record.status == OK and record.ttfb_s is not None


def test_a_chats_later_turn_sends_the_chat_so_far():
    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=sse(chunk("9"), b"[DONE]"))

    later = Arrival(0.0, "new", history=("first", "answer"))
    with stand_in(handler) as url:
        for chat in (False, True):
            endpoint = Endpoint(url=url, model="tiny", chat=chat)

            async def main():
                async with make_client(endpoint) as client:
                    return await send(client, endpoint, 0, later, asyncio.get_running_loop().time())
            assert asyncio.run(main()).status == OK
    assert seen[0]["prompt"] == "firstanswernew"
    assert seen[1]["messages"] == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "answer"},
                                   {"role": "user", "content": "new"}]


def test_429_is_refused_with_retry_after():
    record = run_send(lambda r: httpx.Response(
        429, headers={"Retry-After": "3"}, json={"error": {"message": "at step capacity", "type": "rate_limit_error"}}))
    assert (record.status, record.http_status, record.retry_after_s) == (REFUSED, 429, 3.0)
    assert record.error == "HTTP 429: at step capacity" and record.latency_s is not None


@pytest.mark.parametrize("handler, message", [
    (lambda r: httpx.Response(400, json={"error": {"message": "max_tokens too large"}}),
     "HTTP 400: max_tokens too large"),
    (lambda r: httpx.Response(502, text="bad gateway"), "HTTP 502: bad gateway"),
    (lambda r: httpx.Response(200, content=sse(chunk("12"), {"error": {"message": "replica died"}}, b"[DONE]")),
     "replica died"),
    (lambda r: httpx.Response(200, content=sse(chunk("12"))), "the stream ended before data: [DONE]"),
    (lambda r: httpx.Response(200, content=sse(b"{oops")), "malformed event"),
])
def test_failures_are_errors_with_their_message(handler, message):
    record = run_send(handler)
    assert record.status == ERROR and message in record.error and record.latency_s is not None


def test_connection_error_and_timeout():
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    record = send_to(f"http://127.0.0.1:{port}")
    assert record.status == ERROR and record.error.startswith("ClientConnectorError") and str(port) in record.error

    async def stall():
        yield b"data: " + json.dumps(chunk("12")).encode() + b"\n\n"
        await asyncio.sleep(10)

    record = run_send(lambda r: httpx.Response(200, content=stall()), timeout_s=0.3)
    assert record.status == ERROR and record.error == "timed out after 0.3 s"
    assert record.ttfb_s is not None and 0.3 <= record.latency_s < 2


def test_first_model():
    async def ask_at(url):
        async with make_client(Endpoint(url=url)) as client:
            return await first_model(client)

    def ask(handler):
        with stand_in(handler) as url:
            return asyncio.run(ask_at(url))

    assert ask(lambda r: httpx.Response(200, json={"data": [{"id": "tiny"}, {"id": "b"}]})) == "tiny"
    with pytest.raises(LoadgenError, match="did not list any model"):
        ask(lambda r: httpx.Response(200, json={"data": []}))
    with pytest.raises(LoadgenError, match="answered 401: wrong key"):
        ask(lambda r: httpx.Response(401, json={"error": {"message": "wrong key"}}))


def test_an_event_longer_than_aiohttps_line_limit():
    long_text = "1234" * 40_000  # 160 kB in one SSE line
    record = run_send(lambda r: httpx.Response(200, content=sse(chunk(long_text), chunk("", usage=7), b"[DONE]")))
    assert (record.status, record.output_tokens, record.error) == (OK, 7, None)


def test_a_base_url_with_a_path_prefix():
    seen = []

    def handler(request):
        seen.append(request.url.path)
        return httpx.Response(200, json={"data": [{"id": "tiny"}]})

    async def ask(url):
        async with make_client(Endpoint(url=url + "/prefix/")) as client:
            return await first_model(client)

    with stand_in(handler) as url:
        assert asyncio.run(ask(url)) == "tiny" and seen == ["/prefix/v1/models"]
