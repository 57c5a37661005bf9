"""`dllm-serve up --model DIR` serving a checkpoint directory (a random LLaDA, built here)
over two tensor-parallel ranks (gloo), over HTTP with the openai client: infilling with
``suffix``, answered as one process's engine answers."""

import asyncio
import json
import os
import signal
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from cluster.request_path import processes_mentioning
from live_up import start_cluster, stop_cluster
from test_serving import total
from replicas.engine import Engine, EngineConfig
from replicas.messages import SamplingParams
from replicas.models.checkpoint import load_tokenizer
from tests.replicas.models.checkpoint_builders import write_checkpoint

REPLICA = {"max_batch": 2, "torch_threads": 1, "tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("llada"), "LLaDAModelLM")
    running = start_cluster(tmp_path_factory.mktemp("llada-up"), {"model": str(path), "replica": REPLICA})
    yield path, running
    stop_cluster(running.process)


def test_a_suffix_is_filled_in_before(llada):
    path, running = llada
    client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    asked = {"model": model, "prompt": "def add(a, b):\n", "max_tokens": 32, "temperature": 0,
             "extra_body": {"ignore_eos": True}}
    infill = client.completions.create(suffix="\nprint(add(1, 2))", **asked)
    plain = client.completions.create(**asked)
    assert infill.choices[0].finish_reason == "length" and infill.usage.completion_tokens == 32
    assert infill.choices[0].text != plain.choices[0].text  # what comes after shapes the answer
    assert processes_mentioning("ray::RankWorker")  # rank 1, beside the replica's own process

    engine = Engine.from_pretrained(str(path), EngineConfig(max_batch=REPLICA["max_batch"]))  # one process
    suffix_ids = tuple(engine.encode("\nprint(add(1, 2))"))
    [offline] = engine.generate([asked["prompt"]], SamplingParams(
        max_tokens=32, ignore_eos=True, suffix_ids=suffix_ids, algorithm_params={"temperature": 0.0}))
    assert infill.choices[0].text == offline.text  # the engine's infill, which the suffix's tokens end

    messages = [{"role": "user", "content": "你好 🙂, what is 2 + 3?"}]  # the chat route, same text too
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
    prompt = load_tokenizer(str(path)).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    [offline_chat] = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True,
                                                              algorithm_params={"temperature": 0.0}))
    assert chat.choices[0].message.content == offline_chat.text


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int
    tags: list[Literal["admin", "user"]] = pydantic.Field(max_length=2)


def test_structured_output_with_the_openai_client(llada):
    """``response_format`` as the openai client sends it: a pydantic model parsed back, a
    JSON object streamed, n answers; each follows its schema."""
    _, running = llada
    client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Who is Ada? Answer in JSON."}]
    parsed = client.chat.completions.parse(model=model, messages=messages, response_format=Person, max_tokens=48,
                                           temperature=0)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and parsed.choices[0].finish_reason == "stop"  # whole, if at max_tokens

    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=32, n=2, temperature=1.0,
                                            seed=3, stream=True, response_format={"type": "json_object"})
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(isinstance(json.loads(text), dict) for text in texts), texts


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}


def test_tool_calls_with_the_openai_client(llada):
    """``tools`` with a named function (whole and streamed) and with ``"required"``: calls
    whose arguments follow the function's schema; ``"auto"`` is refused by name."""
    _, running = llada
    client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                            tool_choice=named, max_tokens=40, temperature=0)
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and answer.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    streamed = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice=named,
                                              max_tokens=40, temperature=0, stream=True)
    parts = [delta for event in streamed for delta in (event.choices[0].delta.tool_calls or [])]
    assert parts[0].function.name == "get_weather" and parts[0].id
    assert "".join(p.function.arguments for p in parts) == call.function.arguments  # greedy: the same call

    required = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=64, temperature=1.0, seed=5, n=2)
    for choice in required.choices:
        [call] = choice.message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    with pytest.raises(openai.BadRequestError, match="'auto' is not supported") as refused:
        client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=8)
    assert refused.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="needs a block-causal model") as refused:  # LLaDA as published
        client.completions.create(model=model, prompt="hi", max_tokens=8, extra_body={"algorithm": "d2f"})
    assert refused.value.body["param"] == "algorithm"


def test_a_rank_killed_under_load_takes_its_replica_down_and_its_requests_finish(llada):
    """SIGKILL of rank 1 while requests run: rank 0's next collective fails, the replica
    reports unhealthy, Serve replaces the whole group, and the ingress resumes the requests
    from their committed blocks: each answer is the one a single process gives."""
    path, running = llada
    [rank] = processes_mentioning("ray::RankWorker")
    prompts = [f"def f{i}(x):\n" for i in range(4)]
    body = {"max_tokens": 96, "temperature": 0, "ignore_eos": True}
    engine = Engine.from_pretrained(str(path), EngineConfig(max_batch=REPLICA["max_batch"]))
    expected = [answer.text for answer in engine.generate(prompts, SamplingParams(
        max_tokens=96, ignore_eos=True, algorithm_params={"temperature": 0.0}))]

    async def load() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=running.base_url, timeout=240) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            sent = [asyncio.create_task(client.post("/v1/completions", json={"model": model, "prompt": p, **body}))
                    for p in prompts]
            deadline = time.monotonic() + 60
            while total(running.metrics_text(), "dllm_running_requests") < 1:
                assert time.monotonic() < deadline, "the requests never ran"
                await asyncio.sleep(0.05)
            os.kill(rank, signal.SIGKILL)
            return await asyncio.gather(*sent)

    failovers_before = total(running.metrics_text(), "dllm_failovers_total")
    responses = asyncio.run(load())
    assert [r.status_code for r in responses] == [200] * len(prompts), [r.text for r in responses]
    assert [r.json()["choices"][0]["text"] for r in responses] == expected
    deadline = time.monotonic() + 60  # resumed: counted by the ingress at its next report
    while total(running.metrics_text(), "dllm_failovers_total") <= failovers_before:
        assert time.monotonic() < deadline, "no request was resumed"
        time.sleep(0.2)
    deadline = time.monotonic() + 180  # a new group: its rank 1 is another process
    while not (ranks := processes_mentioning("ray::RankWorker")) or ranks == [rank]:
        assert time.monotonic() < deadline, "no replacement rank started"
        time.sleep(0.5)
