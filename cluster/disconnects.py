"""A whole (non-streamed) answer stops being computed when its client goes away.

A client may also leave while it still sends its body: Starlette raises ``ClientDisconnect``
where the body is read, and the request gets ``client_closed`` (no failure of ours).

A streamed response notices a closed connection (Starlette's ``StreamingResponse``
listens for it) and the cancelled stream aborts the request on its replica. A request for
a whole answer has nothing to write until the end, so nothing notices: a client that timed
out or was interrupted left its request denoising every block to the end, taking rows and
steps from those still waiting. ``unless_disconnected`` runs the answer's work beside a
wait for the connection's end, and cancels the work (so the replica call, and with it the
engine's request, is cancelled) when the client leaves first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client closed; no client reads it


def client_closed() -> Response:
    """The empty 499 of a request whose client left (logged and counted like any other
    response, sent to no one)."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection. The body is read already, so an
    ASGI server answers ``receive`` only with the disconnect; where it answers anything
    else, or fails, it cannot tell, and this waits until cancelled (an answer is never cut
    short on a doubt)."""
    try:
        message = await request.receive()
    except Exception:
        message = {}
    if message.get("type") != "http.disconnect":
        await asyncio.Event().wait()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """``work``'s result, or, if the client disconnects first, ``work`` cancelled and
    ``client_closed()``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # our own cancellation (the server stopping) ends the work too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # its clean-up (the replica call's cancel) runs now
    return client_closed()
