"""Nothing is kept after a request ends: however it ended (finished, aborted, past its
deadline, failed), no reference to its ``Request`` is left once it has, and reference
counting alone frees it (no cycle waits for the garbage collector, whose full collections
grow with what a replica keeps after its start-up heap is frozen: ``replicas.gc_freeze``)."""

import asyncio
import gc
import itertools
import logging
import weakref
from dataclasses import replace

import pytest

from exploding_algorithm import NAME as EXPLODING, register_exploding
from replicas.async_engine import AsyncEngine
from replicas.engine import Engine
from replicas.messages import SamplingParams
from replicas.request import FinishReason
from replicas.engine_config import EngineConfig
from replicas.tiny import task
from tests.replicas.step_spies import inject_faults

PROMPTS = [request.prompt for request in task.make_requests(10, seed=5)]
SERVED = 600.0  # the deadline the ingress gives every request (``request_timeout_s``)
ASKING = SamplingParams(max_tokens=48, logprobs=20, stop=("34", "2143"), timeout_s=SERVED)  # top-k, a detokenizer
LONG = SamplingParams(max_tokens=256, ignore_eos=True, logprobs=20, timeout_s=SERVED)  # runs until it is ended


@pytest.fixture
def made(monkeypatch, caplog):
    """Weak references to the ``Request`` of every request an engine makes, with the
    garbage collector off meanwhile: only reference counting frees them."""
    refs = []
    make = Engine.make_request

    def recording(self, *args, **kwargs):
        request = make(self, *args, **kwargs)
        refs.append(weakref.ref(request))
        return request

    monkeypatch.setattr(Engine, "make_request", recording)
    for logger in ("replicas.engine", "replicas.executor"):  # pytest keeps a logged traceback, and its frames
        caplog.set_level(logging.CRITICAL, logger=logger)
    gc.disable()
    yield refs
    gc.enable()


def alive(refs) -> list[str]:
    return [request.request_id for request in (ref() for ref in refs) if request is not None]


@pytest.mark.parametrize("mode", ["fdfo", "sync", "static", "fixed_fill"])
def test_an_ended_request_leaves_nothing_in_the_engine(made, monkeypatch, mode):
    now = [0.0]
    engine = Engine.from_pretrained("tiny", EngineConfig(mode=mode, max_batch=4, fdfo_fill_hold=False,
                                                         fill_timeout_s=0.01))
    engine.clock = engine.scheduler.clock = lambda: now[0]
    register_exploding(monkeypatch)
    queue, adds = engine.scheduler.add, itertools.count(1)

    def add_but_the_seventh(request):  # a new error each time: a raised one keeps its traceback's frames
        if next(adds) == 7:
            raise RuntimeError("the queue is broken")
        queue(request)

    monkeypatch.setattr(engine.scheduler, "add", add_but_the_seventh)
    ends = {}

    def add(name, params, whole=False):
        engine.add_request(PROMPTS[len(ends)], params, name, whole=whole,
                           on_output=lambda chunk: chunk.finished and ends.__setitem__(name, chunk.finish_reason))
        ends.setdefault(name, None)

    def run(steps=None):
        while engine.has_work() and steps != 0:
            engine.step()
            now[0] += 0.01
            steps = steps and steps - 1

    add("streamed", ASKING)
    add("whole", ASKING, whole=True)
    add("whole without stop strings", replace(ASKING, stop=()), whole=True)
    add("aborted", LONG)
    add("past its deadline", replace(LONG, timeout_s=0.05))
    add("exploding", replace(ASKING, algorithm=EXPLODING))
    add("refused by the queue", LONG)  # the 7th add
    run(steps=3)
    engine.abort("aborted")
    run()
    add("failed with its step", LONG)
    add("failed with its step too", LONG, whole=True)
    run(steps=2)
    inject_faults(engine, 1)
    run()
    finished = {ends.pop(name) for name in ("streamed", "whole", "whole without stop strings")}
    assert finished <= {FinishReason.STOP, FinishReason.LENGTH}
    assert ends == {"aborted": FinishReason.ABORT, "past its deadline": FinishReason.TIMEOUT,
                    "exploding": FinishReason.ERROR, "refused by the queue": FinishReason.ERROR,
                    "failed with its step": FinishReason.ERROR, "failed with its step too": FinishReason.ERROR}
    assert not engine.has_work() and len(made) == 9
    assert alive(made) == []


def test_an_ended_request_leaves_nothing_behind_the_async_engine(made):
    """Streamed and whole answers, and streams their callers leave mid-way: cancelled, and
    left without closing them (the event loop closes them once dropped)."""
    engine = Engine.from_pretrained("tiny", EngineConfig(max_batch=4))
    runner = AsyncEngine(engine)

    async def answer(prompt, params, whole=False):
        return [chunk async for chunk in runner.generate(prompt, params, whole=whole)]

    async def left(prompt):
        async for chunk in runner.generate(prompt, LONG):
            return chunk

    async def serve():
        started = asyncio.Event()

        async def until_cancelled(prompt):
            async for _ in runner.generate(prompt, LONG):
                started.set()

        cancelled = asyncio.create_task(until_cancelled(PROMPTS[0]))
        await started.wait()
        cancelled.cancel()
        return await asyncio.gather(answer(PROMPTS[1], ASKING), answer(PROMPTS[2], ASKING, whole=True),
                                    left(PROMPTS[3]))

    try:
        streamed, whole, first = asyncio.run(serve())
    finally:
        runner.shutdown()
    assert streamed[-1].finished and len(whole) == 1 and whole[0].finished
    assert not first.finished and engine.totals.requests_aborted == 2
    assert not engine.has_work() and len(made) == 4
    assert alive(made) == []


def test_a_deadline_ends_its_own_request_not_a_later_one_given_its_id(make_engine):
    """The deadlines hold ids, which are the caller's: one that comes again once its
    request has ended names a new request, which the first one's deadline leaves alone."""
    now = [0.0]
    engine = make_engine(max_batch=2, fdfo_fill_hold=False)
    engine.clock = engine.scheduler.clock = lambda: now[0]
    ends = []

    def add(timeout, tokens):
        engine.add_request("abc", SamplingParams(max_tokens=tokens, ignore_eos=True, timeout_s=timeout), "again",
                           on_output=lambda chunk: chunk.finished and ends.append(chunk.finish_reason))

    add(1.0, 1)
    while not ends:
        engine.step()
    now[0] = 2.0
    add(5.0, 128)
    engine.step()  # past the first one's deadline
    assert ends == [FinishReason.LENGTH] and engine.has_work()
    now[0] = 7.0
    engine.step()
    assert ends == [FinishReason.LENGTH, FinishReason.TIMEOUT] and not engine.has_work()
