"""The ingress replica's own HTTP server (request path ``ingress``).

With ``request_path: ingress`` no Serve proxy and no HAProxy carry requests: each ingress
replica serves the API port itself, with uvicorn over the same FastAPI app, from its own
event loop. Several ingress replicas on one node share the port (``SO_REUSEPORT``: the
kernel spreads connections over them). Serve still places, health-checks, restarts and
scales the replicas, and routes each request on to an engine replica through its handle.

Why: on the project's 2-core VM, Serve's per-request HTTP handling in a direct-ingress
replica (its ASGI wrapper, request context, metrics) cost 1.2-1.5 ms of the ingress's CPU
per request on top of uvicorn's and the app's, and HAProxy 0.3-0.4 ms more (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

log = logging.getLogger(__name__)

BACKLOG = 2048


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port) that other ingress replicas of this node may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Leave signals alone: this process is a Ray worker, and its signals are Ray's."""
        yield


class FrontDoor:
    """uvicorn serving ``app`` on the shared API port, on the running event loop."""

    def __init__(self, app, host: str, port: int):
        self.address = f"{host}:{port}"
        self.server = _Server(uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                                             lifespan="off", timeout_keep_alive=30))
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[shared_socket(host, port)]))
        log.info("serving HTTP on %s (request path 'ingress')", self.address)

    def problem(self) -> str | None:
        """Why the server stopped serving, or None while it serves."""
        if not self.task.done():
            return None
        exc = None if self.task.cancelled() else self.task.exception()
        return f"the HTTP server on {self.address} stopped" + (f": {exc!r}" if exc else "")

    def close(self) -> None:
        """Stop serving: uvicorn closes the socket and ends the open connections as it exits
        (within a second); a replica that exits meanwhile frees the port with its process."""
        self.server.should_exit = True
