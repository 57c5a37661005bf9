"""A request that reaches its deadline, through the ingress's routes and a real engine of
the tiny model in this process, on a virtual clock (its deadline passes once a chosen
number of its blocks committed): what it committed is its answer, with the text the
detokenizer held back, ``finish_reason`` "timeout" and usage; a 504 (in a stream, an
error event) only where no choice committed a token."""

import asyncio
import json

import pytest

from replicas.engine import Engine
from replicas.messages import SamplingParams
from replicas.engine_config import EngineConfig
from test_ingress_path import PROMPT, answer
from test_input_bounds import error_of, ingress_over, sse_events

BLOCK = 16


@pytest.fixture(scope="module")
def engine():
    engine = Engine.from_pretrained("tiny", EngineConfig(max_batch=4))
    now = [0.0]
    engine.clock = engine.scheduler.clock = lambda: now[0]
    engine.now = now
    return engine


@pytest.fixture(scope="module")
def first_block(engine):
    """The first block of the answer to PROMPT (greedy), and a stop string that holds back
    its last character while the next block is not there."""
    [first] = engine.generate([engine.encode(PROMPT)], SamplingParams(max_tokens=BLOCK, ignore_eos=True))
    return first.text, first.text[-1] + "|"


def deadline_after(engine, blocks: list[int]):
    """A replica ``generate`` serving each job on ``engine``: the n-th job's deadline passes
    once ``blocks[n]`` of its blocks committed."""
    jobs = []

    async def generate(job):
        chunks = []
        engine.add_request(job.prompt_ids, job.params, job.request_id, on_output=chunks.append)
        while sum(bool(c.token_ids) for c in chunks) < blocks[len(jobs)]:
            engine.step()
        jobs.append(job)
        engine.now[0] += job.params.timeout_s
        engine.step()
        for chunk in chunks:
            yield chunk
    return generate


def body(stop: str, **fields) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 3 * BLOCK, "ignore_eos": True, "stop": [stop], **fields}


def test_a_stream_past_its_deadline_ends_with_its_committed_text_and_usage(engine, first_block):
    text, stop = first_block
    plain, instance = ingress_over(deadline_after(engine, [1]))

    async def streamed():
        return await sse_events(await answer(plain, instance, body(stop, stream=True,
                                                                   stream_options={"include_usage": True})))
    *events, done = asyncio.run(streamed())
    assert done == "[DONE]" and not any("error" in event for event in events), events
    *chunks, usage = events
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "timeout"]
    assert chunks[0]["choices"][0]["text"] == text[:-1]  # its last character held back until the end
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == BLOCK
    assert usage["usage"]["prompt_tokens"] == len(engine.encode(PROMPT))


def test_a_whole_answer_past_its_deadline_is_what_its_choices_committed(engine, first_block):
    text, stop = first_block
    plain, instance = ingress_over(deadline_after(engine, [1, 0]))  # the second choice commits nothing
    response = asyncio.run(answer(plain, instance, body(stop, n=2)))
    assert response.status_code == 200, response.body
    answered = json.loads(response.body)
    assert [(c["text"], c["finish_reason"]) for c in answered["choices"]] == [(text, "timeout"), ("", "timeout")]
    assert answered["usage"]["completion_tokens"] == BLOCK


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_past_its_deadline_before_any_token_is_a_504(engine, first_block, stream):
    plain, instance = ingress_over(deadline_after(engine, [0]))
    asked = body(first_block[1], stream=stream, deadline_s=2)

    async def ask():
        response = await answer(plain, instance, asked)
        return await sse_events(response) if stream else response
    answered = asyncio.run(ask())
    if stream:
        assert answered[1:] == ["[DONE]"]
        error = answered[0]["error"]
    else:
        assert answered.status_code == 504
        error = error_of(answered)
    assert (error["type"], error["code"]) == ("timeout_error", "request_timeout")
    assert "deadline of 2 s" in error["message"]
