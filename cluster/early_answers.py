"""Answer a completion request that its headers already refuse, below FastAPI.

A refusal (wrong key, server draining, body too large, cluster at its step capacity) is
decided from the headers and admission's state alone. Raised from a route, it first goes
through FastAPI's routing, parameter resolution and exception handlers: about 0.5 ms of
CPU a request on the project's 2-core VM, as much again as a plain uvicorn takes to answer
(request path ``ingress``; behind Serve's own HTTP handling the saving is lost in the
rest, docs/request-path.md). This pure-ASGI middleware asks the ingress of this process
(``answer_for``, called by the Ingress when it starts: one per replica process) before any
of that, and sends the same error envelope itself. The route runs the same checks again
for the requests that pass (they are cheap), so it answers alike where the middleware is
not in front of it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from cluster.errors import APIError

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class RefusesEarly(Protocol):
    def check_before_body(self, headers: Mapping[str, str]) -> None:
        """Raise the APIError a request with these headers gets before its body is read."""


_ingress: RefusesEarly | None = None  # the ingress of this process


def answer_for(ingress: RefusesEarly) -> None:
    """Make ``ingress`` the one whose checks the middleware runs in this process. (Not a
    field of the app's state: Serve serves a copy of the app that the Ingress class
    cannot name.)"""
    global _ingress
    _ingress = ingress


class EarlyAnswers:
    """ASGI middleware over the ingress's app (see the module docstring)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ingress = _ingress
        if ingress is not None and scope["type"] == "http" and scope["method"] == "POST" \
                and scope["path"] in COMPLETION_PATHS:
            try:
                ingress.check_before_body(_headers(scope))
            except APIError as refusal:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _headers(scope: Scope) -> dict[str, str]:
    """The two headers the checks read, by lower-case name (ASGI gives them lower-case)."""
    wanted = {b"authorization", b"content-length"}
    return {name.decode(): value.decode("latin-1") for name, value in scope["headers"] if name in wanted}
