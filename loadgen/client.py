"""One streamed request against an OpenAI-compatible endpoint, with SSE parsing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field

import httpx

from loadgen.records import OK, REFUSED, Arrival, LoadgenError, Record


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: base URL, model, body defaults, per-request timeout."""

    url: str
    model: str | None = None
    max_tokens: int = 128
    chat: bool = False
    api_key: str | None = None
    extra: dict = field(default_factory=dict)  # merged into every body (dLLM fields)
    timeout_s: float = 120.0
    stream: bool = True  # False: one JSON answer per request (no per-block events)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, arrival: Arrival) -> dict:
        body = {"model": self.model, "max_tokens": arrival.max_tokens or self.max_tokens, "stream": self.stream,
                **({"stream_options": {"include_usage": True}} if self.stream else {}), **self.extra}
        if self.chat:
            body["messages"] = [{"role": "user", "content": arrival.prompt}]
        else:
            body["prompt"] = arrival.prompt
        return body


def make_client(endpoint: Endpoint) -> httpx.AsyncClient:
    """An HTTP client with no connection cap, so that no request waits client-side."""
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    return httpx.AsyncClient(base_url=endpoint.url, headers=headers, timeout=endpoint.timeout_s,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                             trust_env=False)


def error_message(response: httpx.Response) -> str:
    """The message of an OpenAI error envelope, else the start of the body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase


async def first_model(client: httpx.AsyncClient) -> str:
    """The first model that ``GET /v1/models`` lists; ``LoadgenError`` if that fails."""
    try:
        response = await client.get("/v1/models", timeout=10)
    except httpx.HTTPError as exc:
        raise LoadgenError(f"cannot reach {client.base_url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise LoadgenError(f"GET {response.url} answered {response.status_code}: {error_message(response)}")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise LoadgenError(f"GET {response.url} did not list any model; give --model") from None


async def sse_data(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """The data of each server-sent event (multi-line data joined with newlines)."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def chunk_text(event: dict) -> str:
    """The text a completion or chat-completion chunk carries ('' for none)."""
    choices = event.get("choices") or [{}]
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None


async def _read_stream(response: httpx.Response, record: Record, sent: float) -> None:
    """Fill ``record`` from an SSE body; ``ok`` only if it reaches ``[DONE]`` without an error event."""
    loop = asyncio.get_running_loop()
    characters, usage_tokens = 0, None
    async for data in sse_data(response.aiter_lines()):
        if data == "[DONE]":
            record.status = OK
            break
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            record.error = f"malformed event: {data[:120]!r}"
            return
        if "error" in event:
            record.error = str((event["error"] or {}).get("message", event["error"]))
            return
        text = chunk_text(event)
        if text and record.ttfb_s is None:
            record.ttfb_s = loop.time() - sent
        characters += len("".join(text.split()))
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
        dllm = event.get("dllm") or {}
        record.steps = dllm.get("steps", record.steps)
        record.replica = dllm.get("replica", record.replica)
        record.engine_s = dllm.get("engine_s", record.engine_s)
    else:
        record.error = "the stream ended before data: [DONE]"
        return
    if usage_tokens is None:
        record.output_tokens, record.tokens_from = characters, "characters"
    else:
        record.output_tokens, record.tokens_from = usage_tokens, "usage"


def _read_answer(body: dict, record: Record, latency_s: float) -> None:
    """Fill ``record`` from a non-streamed answer (its text arrives all at once: TTFB = latency)."""
    record.status, record.ttfb_s = OK, latency_s
    record.output_tokens, record.tokens_from = body["usage"]["completion_tokens"], "usage"
    dllm = body.get("dllm") or {}
    record.steps, record.replica, record.engine_s = dllm.get("steps"), dllm.get("replica"), dllm.get("engine_s")


async def send(client: httpx.AsyncClient, endpoint: Endpoint, index: int, arrival: Arrival,
               start: float) -> Record:
    """Send one request now (streamed unless ``endpoint.stream`` is False) and record its
    outcome; never raises for request failures.

    ``start`` is the run's origin on the event loop's clock.
    """
    loop = asyncio.get_running_loop()
    sent = loop.time()
    record = Record(index=index, planned_s=arrival.time_s, sent_s=sent - start)
    try:
        async with asyncio.timeout(endpoint.timeout_s):
            async with client.stream("POST", endpoint.path, json=endpoint.body(arrival)) as response:
                record.http_status = response.status_code
                if response.status_code == 200 and endpoint.stream:
                    await _read_stream(response, record, sent)
                elif response.status_code == 200:
                    try:
                        _read_answer(json.loads(await response.aread()), record, loop.time() - sent)
                    except (ValueError, KeyError, TypeError):
                        record.error = f"malformed answer: {response.text[:120]!r}"
                else:
                    await response.aread()
                    record.error = f"HTTP {response.status_code}: {error_message(response)}"
                    if response.status_code == 429:
                        record.status, record.retry_after_s = REFUSED, _retry_after(response)
    except TimeoutError:
        record.error = f"timed out after {endpoint.timeout_s:g} s"
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.latency_s = loop.time() - sent
    return record
