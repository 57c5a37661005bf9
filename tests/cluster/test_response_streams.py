"""A streamed response ends the chunk stream it reads as soon as it stops reading it (a 504
midway, a failed choice, the client gone): the stream's ``finally``, where dispatch releases
the request's admission charge, runs then, not whenever the stream is collected (a suite
under load once saw a charge outstanding a minute after its request's 504)."""

import asyncio

from cluster.responses import Answer, Render
from replicas.messages import GenerateChunk, GenerateRequest, SamplingParams
from replicas.request import FinishReason
from tools.bench.canvas import IdsOnly


def _answer() -> Answer:
    job = GenerateRequest("cmpl-1", [1, 2], SamplingParams(max_tokens=8, timeout_s=1.0))
    return Answer(job, 0, chat=False, n=2, echoes=["", ""])


async def _chunks(closed: list[bool]):
    """Choice 0 ends by its deadline before a token: the whole request has no answer (504)."""
    try:
        yield 0, GenerateChunk(finished=True, finish_reason=FinishReason.TIMEOUT)
        yield 1, GenerateChunk(text="never read", token_ids=[3], finished=True, finish_reason="length",
                               completion_tokens=1)
    finally:
        closed.append(True)


def test_a_stream_refused_midway_is_closed_at_once():
    render = Render("m", IdsOnly(), [])
    closed: list[bool] = []

    async def read_events() -> list[str]:
        chunks = _chunks(closed)  # held, as dispatch's caller holds it: no collection closes it
        events = [event async for event in render._sse(chunks, _answer(), include_usage=False)]
        assert closed == [True]
        return events

    events = asyncio.run(read_events())
    assert "request_timeout" in events[0] and events[-1] == "data: [DONE]\n\n"
