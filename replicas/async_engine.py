"""The engine in its own thread, with an asyncio streaming API.

The loop thread steps the engine while it has work and sleeps on an event otherwise.
Each request's committed blocks are handed to the caller's event loop through an
``asyncio.Queue`` (for a whole answer, all of them once, at its end); leaving the iterator
early (client disconnect, cancel) aborts the request, so its pages are freed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence

import torch

from replicas.engine import Engine
from replicas.messages import GenerateChunk, GenerateRequest, SamplingParams, WholeAnswer
from replicas.telemetry.step_stats import StepStats

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable[[StepStats, float | None], None] | None = None):
        """``on_step(stats, busy_period_s)``: after every step; ``busy_period_s`` is the wall
        time since the previous step ended when the loop went straight on to this one (the
        step plus whatever the loop lost to other threads), None after a wait."""
        self.engine = engine
        self.on_step = on_step
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.last_progress = time.monotonic()  # when a step last returned, or the loop was idle
        self._thread = threading.Thread(target=self._loop, name="dllm-engine", daemon=True)
        self._thread.start()

    @torch.inference_mode()  # entered once for all the thread's steps (see ``Engine.step``)
    def _loop(self) -> None:
        engine = self.engine
        previous_end = None  # when the previous step ended, unless the loop waited since
        while not self._stop.is_set():
            if not engine.has_work():
                self.last_progress = time.monotonic()
                previous_end = None
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                stats = engine.step()
            except Exception:  # Engine.step contains its failures; this is the last resort
                log.exception("engine step failed")
                previous_end = None
                continue
            self.last_progress = time.monotonic()
            if stats is None:  # holding to fill a batch, or nothing runnable
                previous_end = None
                self._wake.wait(timeout=min(max(engine.hold_s(), 0.001), 0.05))
                self._wake.clear()
                continue
            end = time.perf_counter()
            if self.on_step is not None:
                self.on_step(stats, None if previous_end is None else end - previous_end)
            previous_end = end

    def stalled_for(self) -> float:
        """Seconds the loop has gone without finishing a step while work is pending (0 if none)."""
        if not self.engine.has_work():
            return 0.0
        return max(0.0, time.monotonic() - self.last_progress)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Let running requests finish (up to ``drain_timeout`` s), then stop the loop."""
        deadline = time.monotonic() + drain_timeout
        while self.engine.has_work() and time.monotonic() < deadline and self.alive:
            time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    async def generate(self, request: GenerateRequest | str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, whole: bool = False,
                       on_progress: Callable[[int, int], None] | None = None) -> AsyncIterator[GenerateChunk]:
        """Yield one chunk per committed block; the last one has ``finished=True``.

        ``request``: the engine request, taken as it comes, or a prompt with ``params`` and
        ``request_id`` (``Engine.make_request``).
        ``whole``: yield one chunk, the whole answer, put together as its blocks commit
        (``messages.WholeAnswer``): the caller's event loop is woken once, at the end, not
        once a block (each wake-up is a thread switch and a loop turn), and decodes its text
        where the engine left that to it (``Engine.with_answer_text``). ``on_progress(steps,
        tokens)`` then sees each block as it commits, in the engine's thread: it must be
        quick and must not raise.

        Raises ``RequestError`` before yielding anything if the request is invalid.
        """
        params = request.params if isinstance(request, GenerateRequest) else params
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerateChunk] = asyncio.Queue()

        def deliver(output: GenerateChunk) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, output)
            except RuntimeError:  # the caller's loop is gone (e.g. the abort after a disconnect)
                pass

        receiver = WholeAnswer(deliver, on_progress) if whole else deliver
        if params is not None and params.regex is not None:  # compiled off this loop (cached for the request)
            await asyncio.to_thread(self.engine.grammars.compile_quietly, params.regex)
        request_id = self.engine.add_request(request, params, request_id, on_output=receiver, whole=whole)
        self._wake.set()
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield self.engine.with_answer_text(output, params) if whole else output
        finally:
            if not finished:
                self.engine.abort(request_id)
                self._wake.set()
