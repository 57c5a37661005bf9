"""A real HTTP server on 127.0.0.1 that answers with a test's handler, for the load
generator's tests: ``handler(httpx.Request) -> httpx.Response`` (sync or async; a
response's content may be an async generator, streamed as it yields)."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
from aiohttp import web

HOP_BY_HOP = {"content-length", "transfer-encoding", "connection"}


def _app(handler: Callable) -> web.Application:
    async def answer(request: web.Request) -> web.StreamResponse:
        asked = httpx.Request(request.method, str(request.url), headers=dict(request.headers),
                              content=await request.read())
        reply = handler(asked)
        if inspect.isawaitable(reply):
            reply = await reply
        response = web.StreamResponse(status=reply.status_code, headers={
            k: v for k, v in reply.headers.items() if k.lower() not in HOP_BY_HOP})
        await response.prepare(request)
        try:
            await response.write(reply.content)  # given whole
        except httpx.ResponseNotRead:  # given as an async generator
            async for piece in reply.aiter_raw():
                await response.write(piece)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


@contextmanager
def stand_in(handler: Callable) -> Iterator[str]:
    """Serve ``handler`` in a thread of its own; yields the base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_app(handler), handler_cancellation=True, shutdown_timeout=1.0)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
