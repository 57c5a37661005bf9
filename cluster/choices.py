"""A request's ``n`` choices: one replica row each, streamed side by side.

Each choice is a request of its own to the replicas (its own id, so that each may fail
over on its own), with the seed the request drew plus its index, so that sampled choices
differ and a seeded request gives the same n answers again (greedy choices have no seed
and are alike).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import TypeVar

from replicas.messages import GenerateRequest

T = TypeVar("T")
SEEDS = 2 ** 63


def rows(job: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The replica requests of ``n`` choices of ``job``."""
    if n == 1:
        return [job]
    given = job.params.algorithm_params
    seed = given.get("seed")
    return [dataclasses.replace(job, request_id=f"{job.request_id}-{index}", params=dataclasses.replace(
                job.params, algorithm_params=given if seed is None else {**given, "seed": (seed + index) % SEEDS}))
            for index in range(n)]


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of ``streams`` as they come, each with its stream's index. The first
    exception of any stream ends them all and is raised; leaving early closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
            await queue.put((index, ended, None))
        except Exception as exc:
            await queue.put((index, None, exc))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item, failure = await queue.get()
            if failure is not None:
                raise failure
            if item is ended:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
