"""``cluster.disconnects``: a whole answer's work is cancelled when its client leaves first."""

import asyncio

import pytest
from starlette.requests import Request

from cluster.disconnects import CLIENT_CLOSED_REQUEST, unless_disconnected


def request_with(receive) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)


async def _work(started: asyncio.Event, ended: list[str], seconds: float = 60.0) -> str:
    started.set()
    try:
        await asyncio.sleep(seconds)
        return "the answer"
    finally:
        ended.append("cleaned up")


def test_the_client_leaving_cancels_the_work_and_answers_499():
    async def main():
        started, ended, gone = asyncio.Event(), [], asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        answer = asyncio.ensure_future(unless_disconnected(request_with(receive), _work(started, ended)))
        await started.wait()
        gone.set()
        return await asyncio.wait_for(answer, 10), ended

    response, ended = asyncio.run(main())
    assert response.status_code == CLIENT_CLOSED_REQUEST and ended == ["cleaned up"]


def test_the_answer_comes_when_the_client_stays():
    async def main():
        waits = []

        async def receive():  # a real server: nothing until the connection ends
            waits.append(1)
            await asyncio.Event().wait()

        result = await asyncio.wait_for(
            unless_disconnected(request_with(receive), _work(asyncio.Event(), [], seconds=0.01)), 10)
        return result, waits

    result, waits = asyncio.run(main())
    assert result == "the answer" and waits == [1]


@pytest.mark.timeout(30)  # a spinning event loop never reaches wait_for's own timeout
def test_a_receive_that_answers_other_messages_never_cuts_the_answer_nor_spins():
    """Where ``receive`` keeps answering with the body (an ASGI fake), there is no
    disconnect to see: the work still gets its time (it spun the event loop before)."""
    async def main():
        calls = []

        async def receive():
            calls.append(1)
            return {"type": "http.request", "body": b"{}", "more_body": False}

        result = await asyncio.wait_for(
            unless_disconnected(request_with(receive), _work(asyncio.Event(), [], seconds=0.05)), 10)
        return result, calls

    result, calls = asyncio.run(main())
    assert result == "the answer" and len(calls) == 1


def test_a_receive_that_fails_never_cuts_the_answer():
    async def receive():
        raise RuntimeError("the server's receive broke")

    result = asyncio.run(unless_disconnected(request_with(receive), _work(asyncio.Event(), [], seconds=0.01)))
    assert result == "the answer"


def test_the_works_error_reaches_the_caller():
    async def fails():
        raise ValueError("refused")

    async def receive():
        await asyncio.Event().wait()

    with pytest.raises(ValueError, match="refused"):
        asyncio.run(unless_disconnected(request_with(receive), fails()))
