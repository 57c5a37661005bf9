"""The load drivers: open loop (every request leaves at its planned time, whatever is still
running) and closed loop (a fixed number of clients, each sending its next request when its
last one ends)."""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TextIO

from loadgen.records import OK, REFUSED, Arrival, Record

Send = Callable[[int, Arrival, float], Awaitable[Record]]


class Progress:
    """Counts of a running load, drawn as one stderr line rewritten with a carriage return
    (``total``: the requests planned, None when not known in advance)."""

    def __init__(self, total: int | None, label: str = "", stream: TextIO = sys.stderr, window_s: float = 2.0):
        self.total, self.label, self.stream, self.window_s = total, label, stream, window_s
        self.sent = self.completed = self.refused = self.errors = 0
        self._recent: deque[float] = deque()
        self._width = 0

    def on_sent(self, now: float) -> None:
        self.sent += 1
        self._recent.append(now)

    def on_done(self, record: Record) -> None:
        if record.status == OK:
            self.completed += 1
        elif record.status == REFUSED:
            self.refused += 1
        else:
            self.errors += 1

    def line(self, elapsed_s: float) -> str:
        """The progress text; the rate counts the sends of the last ``window_s`` seconds."""
        while self._recent and self._recent[0] < elapsed_s - self.window_s:
            self._recent.popleft()
        rate = len(self._recent) / max(min(self.window_s, elapsed_s), 1e-9)
        in_flight = self.sent - self.completed - self.refused - self.errors
        planned = "" if self.total is None else f"/{self.total}"
        return (f"{self.label}{elapsed_s:6.1f}s  sent {self.sent}{planned}  completed {self.completed}  "
                f"refused {self.refused}  errors {self.errors}  in flight {in_flight}  rate {rate:.1f}/s")

    def draw(self, elapsed_s: float, end: str = "") -> None:
        text = self.line(elapsed_s)
        self.stream.write(f"\r{text.ljust(self._width)}{end}")  # pad over a longer previous line
        self._width = len(text)
        self.stream.flush()

    async def run(self, start: float, period_s: float = 0.5) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.draw(loop.time() - start)
            await asyncio.sleep(period_s)


@asynccontextmanager
async def _shown(progress: Progress | None, start: float) -> AsyncIterator[None]:
    """Redraw ``progress`` (if any) while the block runs, and a last time with a newline."""
    if progress is None:
        yield
        return
    ticker = asyncio.create_task(progress.run(start))
    try:
        yield
    finally:
        ticker.cancel()
        progress.draw(asyncio.get_running_loop().time() - start, end="\n")


async def run_open_loop(arrivals: list[Arrival], send: Send, progress: Progress | None = None) -> list[Record]:
    """Send each arrival at ``start + arrival.time_s`` on the loop clock (absolute, so no drift
    accumulates) as its own task, then wait for all of them; records come back in arrival order.

    A chat's later turn (``arrival.after``) is sent at its time or when its previous turn has
    ended, whichever is later, with that turn's messages and answer before its own (an
    answer that failed is sent back empty, as a user would carry on)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent: dict[int, Arrival] = {}  # as sent: a chat's turns with their history

    async def tracked(index: int, arrival: Arrival) -> Record:
        if arrival.after is not None:
            answer = await tasks[arrival.after]
            previous = sent[arrival.after]
            arrival = replace(arrival, history=(*previous.history, previous.prompt, answer.text))
        sent[index] = arrival
        if progress:
            progress.on_sent(loop.time() - start)
        record = await send(index, arrival, start)
        if progress:
            progress.on_done(record)
        return record

    tasks: list[asyncio.Task] = []
    async with _shown(progress, start):
        try:
            for index, arrival in enumerate(arrivals):
                delay = start + arrival.time_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(tracked(index, arrival)))
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()


async def run_closed_loop(prompts: list[str], send: Send, clients: int, duration_s: float,
                          progress: Progress | None = None) -> list[Record]:
    """``clients`` concurrent clients, each sending its next request (cycling through
    ``prompts``) as soon as its last one ends, until ``duration_s`` has passed since the
    start; requests still running then are waited for. Records come back in send order."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    counter = itertools.count()
    records: list[Record] = []

    async def client() -> None:
        while loop.time() - start < duration_s:
            index = next(counter)
            if progress:
                progress.on_sent(loop.time() - start)
            record = await send(index, Arrival(loop.time() - start, prompts[index % len(prompts)]), start)
            records.append(record)
            if progress:
                progress.on_done(record)

    async with _shown(progress, start):
        await asyncio.gather(*(client() for _ in range(clients)))
    return sorted(records, key=lambda r: r.index)
