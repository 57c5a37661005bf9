"""cluster.front_door: the ingress replica's own HTTP server, on a port that several share."""

import asyncio
import os
import socket

import aiohttp

from cluster.front_door import FrontDoor
from live_up import free_port


def app_answering(name: str):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": name.encode()})
    return app


async def get(url: str) -> str:
    async with aiohttp.ClientSession() as session:  # a new connection each time
        async with session.get(url) as response:
            return await response.text()


def test_two_front_doors_share_a_port_and_closing_them_frees_it():
    port = free_port()

    async def run() -> set[str]:
        doors = [FrontDoor(app_answering(name), "127.0.0.1", port) for name in ("first", "second")]
        try:
            while not all(door.server.started for door in doors):
                assert not any(door.problem() for door in doors), [door.problem() for door in doors]
                await asyncio.sleep(0.01)
            # the kernel spreads new connections over both (by their source port's hash)
            answers = {await get(f"http://127.0.0.1:{port}/") for _ in range(64)}
        finally:
            for door in doors:
                door.close()
            await asyncio.wait_for(asyncio.gather(*(door.task for door in doors)), 30)
        assert all(door.problem() == f"the HTTP server on 127.0.0.1:{port} stopped" for door in doors)
        return answers

    assert asyncio.run(run()) == {"first", "second"}
    with socket.socket() as probe:  # nothing holds the port now
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))


def test_a_taken_port_fails_the_front_door_at_once():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]

        async def start():
            FrontDoor(app_answering("x"), "127.0.0.1", port)
        try:
            asyncio.run(start())
        except OSError as exc:
            assert exc.errno in (98, getattr(os, "EADDRINUSE", 98))
        else:
            raise AssertionError("bound a port another socket holds without SO_REUSEPORT")
