"""``cluster.disconnects``: a whole answer's work is cancelled when its client leaves first."""

import asyncio
import logging

import pytest
from fastapi import FastAPI
from starlette.requests import Request

from cluster import completion_path
from cluster.disconnects import CLIENT_CLOSED_REQUEST, unless_disconnected
from cluster.errors import install_error_handlers
from cluster.http_tally import TALLY
from test_completion_path import call
from test_ingress_path import make_ingress


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


@pytest.mark.parametrize("declared", [64, completion_path.PEEK_BODY_BYTES + 1], ids=["peeked", "large"])
def test_a_client_that_leaves_while_sending_its_body_is_a_499_not_a_failure(declared, caplog):
    """Starlette's ClientDisconnect, raised where the body is read, is the client's doing:
    a 499 logged at debug level, neither a 500 nor an error with its traceback."""
    _, ingress = make_ingress()
    before = TALLY.responses.copy()
    cut = [{"type": "http.request", "body": b'{"model": "tiny", "pro', "more_body": True},
           {"type": "http.disconnect"}, {"type": "http.disconnect"}]
    headers = {"content-type": "application/json", "content-length": str(declared)}
    with caplog.at_level(logging.DEBUG):
        status, _, body, _ = call("POST", "/v1/completions", headers, messages=cut)
    assert (status, body) == (CLIENT_CLOSED_REQUEST, None)
    assert TALLY.responses["499"] == before["499"] + 1 and TALLY.responses["500"] == before["500"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert any(r.levelno == logging.DEBUG and "left while sending" in r.getMessage() for r in caplog.records)
    assert ingress.in_flight == 0 and len(ingress.sent) == 0


def test_fastapi_routes_answer_a_client_that_left_with_499_too(caplog):
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/read")
    async def read(request: Request):
        return len(await request.body())

    async def receive():
        return {"type": "http.disconnect"}

    sent = []

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "method": "POST", "path": "/read", "headers": [],
             "query_string": b""}
    with caplog.at_level(logging.DEBUG):
        asyncio.run(app(scope, receive, send))  # before: the catch-all's 500, then the exception raised again
    assert sent[0]["status"] == CLIENT_CLOSED_REQUEST
    assert [r.levelno for r in caplog.records if "/read" in r.getMessage()] == [logging.DEBUG]
