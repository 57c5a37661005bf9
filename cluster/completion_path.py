"""The completion routes below FastAPI: cheap refusals first, then the route itself.

A refusal (wrong key, server draining, body too large, cluster at its step capacity) is
decided from the headers and admission's state alone, or, under overload, from the few
body fields that bound the request's output (``max_tokens``, ``n``, the prompts, its
deadline). A request that passes is answered by the ingress's route code all the same,
called from here. Through FastAPI, each went first through its routing, parameter
resolution, the body's validation and the exception handlers: about 0.5 ms of CPU a
refusal on the project's 2-core VM, as much again as a plain uvicorn takes to answer, and
0.3-0.4 ms a served request (docs/architecture.md). This pure-ASGI middleware asks the
ingress of this process (``serve_for``, called by the Ingress when it starts: one per
replica process) and sends its answers itself. It reads a small body and parses it once,
to check it and to hand it to the route as parsed JSON (a body it cannot parse as the
route's validation would, the route reads from the same messages); the route does not
check the headers again. FastAPI
still declares the routes (the OpenAPI schema, and a process whose middleware has no
ingress), and answers every other path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from cluster.errors import APIError
from cluster.preprocess import parsed_json

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATHS = frozenset({"/v1/completions", CHAT_PATH})
PEEK_BODY_BYTES = 1 << 16  # larger bodies go to the route unread here (parsing them twice would cost more)


class CompletionRoutes(Protocol):
    def check_before_body(self, headers: Mapping[str, str]) -> object:
        """Raise the APIError a request with these headers gets before its body is read;
        else return the caller's key (for ``answer``)."""

    def check_body(self, body: object, chat: bool) -> None:
        """Raise the APIError a request with this body (parsed JSON, not validated) gets
        before it is validated."""

    async def answer(self, scope: Scope, receive: Receive, send: Send, key: object,
                     body: "PeekedBody | None" = None) -> None:
        """The completion route's answer to the request (every error as its envelope), its
        headers checked already (``key``: what ``check_before_body`` returned; ``body``:
        the body read and parsed here, None where the route reads it from ``receive``)."""


@dataclass(frozen=True)
class PeekedBody:
    """A small body read here: its bytes, and the JSON object parsed of them."""

    raw: bytes
    parsed: dict


_ingress: CompletionRoutes | None = None  # the ingress of this process


def serve_for(ingress: CompletionRoutes) -> None:
    """Make ``ingress`` the one whose routes the middleware runs in this process. (Not a
    field of the app's state: Serve serves a copy of the app that the Ingress class
    cannot name.)"""
    global _ingress
    _ingress = ingress


class CompletionPath:
    """ASGI middleware over the ingress's app (see the module docstring)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ingress = _ingress
        if ingress is not None and scope["type"] == "http" and scope["method"] == "POST" \
                and scope["path"] in COMPLETION_PATHS:
            headers = _headers(scope)
            read: list[dict] = []
            body: PeekedBody | None = None
            try:
                key = ingress.check_before_body(headers)
                if _small_body(headers):
                    read, body = await _peek(receive)
                    if body is not None:
                        ingress.check_body(body.parsed, scope["path"] == CHAT_PATH)
            except APIError as refusal:
                await refusal.response()(scope, receive, send)
                return
            if body is not None:  # read and parsed: the route takes it as it is
                await ingress.answer(scope, receive, send, key, body)
            else:
                await ingress.answer(scope, _replaying(read, receive), send, key)
            return
        await self.app(scope, receive, send)


def _small_body(headers: Mapping[str, str]) -> bool:
    """Whether the body is announced within ``PEEK_BODY_BYTES`` (a chunked one is read up to it)."""
    length = headers.get("content-length")
    return length is None or (length.isdigit() and int(length) <= PEEK_BODY_BYTES)


async def _peek(receive: Receive) -> tuple[list[dict], PeekedBody | None]:
    """The messages read from ``receive`` (to hand on), and the body they hold, or None:
    not a JSON object as the route reads it (``preprocess.parsed_json``), over
    ``PEEK_BODY_BYTES``, or cut by the client leaving."""
    read, size = [], 0
    while True:
        message = await receive()
        read.append(message)
        size += len(message.get("body", b""))
        if message["type"] != "http.request" or size > PEEK_BODY_BYTES:
            return read, None
        if not message.get("more_body", False):
            break
    raw = b"".join(m.get("body", b"") for m in read)
    parsed = parsed_json(raw)
    return read, None if parsed is None else PeekedBody(raw, parsed)


def _replaying(read: list[dict], receive: Receive) -> Receive:
    """``receive`` for the route: the messages read already, then the client's own."""
    if not read:
        return receive
    pending = deque(read)

    async def replayed() -> dict:
        return pending.popleft() if pending else await receive()
    return replayed


def _headers(scope: Scope) -> dict[str, str]:
    """The two headers the checks read, by lower-case name (ASGI gives them lower-case)."""
    wanted = {b"authorization", b"content-length"}
    return {name.decode(): value.decode("latin-1") for name, value in scope["headers"] if name in wanted}
