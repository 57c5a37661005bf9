"""End to end against a real `dllm-serve up`: OpenAI client, load, overload, bad input, metrics."""

import asyncio
import json
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from cluster.metrics import METRICS
from replicas.engine import Engine, EngineConfig
from tools.bench.evaluation import score, tiny_params
from replicas.tiny.task import MAX_TOKENS as TINY_MAX_TOKENS
from replicas.messages import GenerateChunk
from replicas.models import load_tokenizer
from replicas.tiny import task

API_KEY = "test-key"  # the cluster fixture's
AUTH = {"Authorization": f"Bearer {API_KEY}"}

SIX_PUZZLES = next(r for r in task.heldout_requests() if len(r.puzzles) == 6)
SLOW = {"algorithm": "fixed_steps", "algorithm_params": {"steps": 16}}  # 16 steps per block


def series(text: str, name: str) -> dict[str, float]:
    """All samples of one metric: label string -> value."""
    out = {}
    for line in text.splitlines():
        match = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if match:
            out[match.group(1) or ""] = float(match.group(2))
    return out


def total(text: str, name: str, label_filter: str = "") -> float:
    return sum(v for k, v in series(text, name).items() if label_filter in k)


async def post_all(base_url: str, bodies: list[dict], concurrency: int, timeout: float = 120,
                   retries: int = 0) -> list[httpx.Response]:
    """Each body's response; a 429 is sent again after its Retry-After, ``retries`` times at
    most (as the openai client does)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits, headers=AUTH) as client:
        semaphore = asyncio.Semaphore(concurrency)

        async def one(body):
            async with semaphore:
                for _ in range(retries):
                    response = await client.post("/v1/completions", json=body)
                    if response.status_code != 429:
                        return response
                    await asyncio.sleep(float(response.headers["retry-after"]))
                return await client.post("/v1/completions", json=body)

        return await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), timeout=timeout + 60)


def test_openai_client_completes_chats_and_streams(cluster):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("org/other-model")
    assert unknown.value.body["code"] == "model_not_found" and "'org/other-model' does not exist" in unknown.value.body["message"]

    completion = client.completions.create(model="tiny", prompt=SIX_PUZZLES.prompt, max_tokens=TINY_MAX_TOKENS)
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens == 112 and completion.usage.completion_tokens == 96
    assert sum(task.grade(SIX_PUZZLES, completion.choices[0].text)) >= 5
    # the same prompt again: routed to the replica that computed it, whose prefix cache
    # holds all 7 pages of it (the same tokens come back)
    again = client.completions.create(model="tiny", prompt=SIX_PUZZLES.prompt, max_tokens=TINY_MAX_TOKENS)
    assert again.usage.prompt_tokens_details.cached_tokens == 112 and again.choices[0].text == completion.choices[0].text

    chat = client.chat.completions.create(model="tiny", max_tokens=TINY_MAX_TOKENS,
                                          messages=[{"role": "user", "content": SIX_PUZZLES.prompt}])
    assert chat.choices[0].message.role == "assistant"
    assert chat.id.startswith("chatcmpl-") and completion.id.startswith("cmpl-")  # as OpenAI names them
    assert chat.choices[0].message.content == completion.choices[0].text

    arrivals, chunks = [], []
    stream = client.chat.completions.create(model="tiny", max_tokens=TINY_MAX_TOKENS, stream=True,
                                            messages=[{"role": "user", "content": SIX_PUZZLES.prompt}],
                                            extra_body=SLOW)
    for chunk in stream:
        arrivals.append(time.monotonic())
        chunks.append(chunk)
    texts = [c.choices[0].delta.content for c in chunks]
    block_steps = chunks[-1].model_extra["dllm"]["block_steps"]
    # one chunk per committed block: six grids of 16 cells, then the EOS block (no text)
    assert len(chunks) == len(block_steps) == 7
    assert [len(t) for t in texts] == [16] * 6 + [0]
    assert all(s == 16 for s in block_steps)  # one cell a forward; the last fill commits the block
    assert chunks[-1].choices[0].finish_reason == "stop"
    # streamed as they commit, not all at the end
    assert arrivals[-1] - arrivals[0] > 0.05
    # every event of a stream names the one response: its id and when it was created
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert len({c.created for c in chunks}) == 1 and abs(chunks[0].created - time.time()) < 600

    text_stream = client.completions.create(model="tiny", prompt=SIX_PUZZLES.prompt, max_tokens=32, stream=True)
    pieces = [c.choices[0].text for c in text_stream]
    assert "".join(pieces) == completion.choices[0].text[:32] and len(pieces) == 2


def test_a_token_id_prompt_answers_as_its_text_does(cluster):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)
    tokenizer = load_tokenizer("tiny")
    ids = tokenizer(SIX_PUZZLES.prompt, add_special_tokens=False)["input_ids"]
    seeded = {"seed": 11, "temperature": 1.0}
    by_text = client.completions.create(model="tiny", prompt=SIX_PUZZLES.prompt, max_tokens=32, extra_body=seeded)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=32, extra_body=seeded)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    for bad, words in (([10**6], "outside the vocabulary"), ([], "the prompt list is empty"),
                       ([tokenizer.mask_token_id], "mask token")):
        with pytest.raises(openai.BadRequestError, match=words) as refused:
            client.completions.create(model="tiny", prompt=bad, max_tokens=8)
        assert refused.value.body["param"] == "prompt"


def test_a_list_of_prompts_gets_each_prompts_choices_in_order(cluster):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)
    tokenizer = load_tokenizer("tiny")
    prompts = [SIX_PUZZLES.prompt, "1.3. ..2. 4... .1.4 ----"]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=16).choices[0].text for p in prompts]
    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=16, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [alone[0], alone[0], alone[1], alone[1]]  # greedy: a prompt's alike
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert batch.usage.prompt_tokens == sum(map(len, ids)) and batch.usage.completion_tokens == 4 * 16
    texts, usage = {}, None
    for chunk in client.completions.create(model="tiny", prompt=ids, max_tokens=16, echo=True, stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {i: tokenizer.decode(ids[i]) + alone[i] for i in (0, 1)}
    assert usage.prompt_tokens == sum(map(len, ids)) and usage.completion_tokens == 2 * 16
    with pytest.raises(openai.BadRequestError, match="5 prompts x n 2 make 10 choices") as refused:
        client.completions.create(model="tiny", prompt=["1.3."] * 5, max_tokens=8, n=2)
    assert refused.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="prompt 1: the prompt has token ids outside") as refused:
        client.completions.create(model="tiny", prompt=[ids[0], [10**6]], max_tokens=8)
    assert refused.value.body["param"] == "prompt"


def test_echo_puts_the_prompt_before_each_answer(cluster):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)
    prompt = SIX_PUZZLES.prompt
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=32)
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, echo=True, n=2)
    assert [c.text for c in echoed.choices] == [prompt + plain.choices[0].text] * 2  # greedy: both alike
    assert echoed.usage.completion_tokens == 2 * 32  # the echo is not output
    tokenizer = load_tokenizer("tiny")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="tiny", prompt=ids, max_tokens=32, echo=True, stream=True))
    assert streamed == tokenizer.decode(ids) + plain.choices[0].text  # token ids are echoed as their text
    for refused_field, fields in (("logprobs", {"echo": True, "logprobs": 1}), ("best_of", {"best_of": 2}),
                                  ("best_of", {"extra_body": {"best_of": True}})):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=8, **fields)
        assert refused.value.body["param"] == refused_field


def test_logprobs_as_the_openai_client_parses_them(cluster):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)
    completion = client.completions.create(model="tiny", prompt=SIX_PUZZLES.prompt, max_tokens=32, logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == completion.usage.completion_tokens == 32
    assert "".join(logprobs.tokens) == completion.choices[0].text  # one character per tiny token
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(32)]
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3 and max(top.values()) >= chosen - 1e-6
    plain = client.completions.create(model="tiny", prompt=SIX_PUZZLES.prompt, max_tokens=32)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == completion.choices[0].text

    stream = client.chat.completions.create(
        model="tiny", max_tokens=TINY_MAX_TOKENS, stream=True, logprobs=True, top_logprobs=2,
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": SIX_PUZZLES.prompt}])
    entries, usage = [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].logprobs is not None:
            content = chunk.choices[0].logprobs.content
            assert "".join(e.token for e in content) == chunk.choices[0].delta.content  # each block carries its own
            entries += content
    assert len(entries) == usage.completion_tokens > 0
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 and bytes(e.bytes).decode() == e.token for e in entries)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="tiny", max_tokens=8, top_logprobs=2,
                                       messages=[{"role": "user", "content": "1.3."}])


def test_n_choices_stream_with_their_indices(cluster):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)
    sampled = {"temperature": 5.0}  # far from the model's certainty: rows that sample differ
    texts = {}
    stream = client.completions.create(model="tiny", prompt=SIX_PUZZLES.prompt, max_tokens=32, n=3, seed=7,
                                       stream=True, stream_options={"include_usage": True}, extra_body=sampled)
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) > 1
    assert usage.completion_tokens == 3 * 32 and usage.prompt_tokens == 112
    again = client.completions.create(model="tiny", prompt=SIX_PUZZLES.prompt, max_tokens=32, n=3, seed=7,
                                      extra_body=sampled)
    assert {c.index: c.text for c in again.choices} == texts  # seeded: the same three answers, whole or streamed
    chat = client.chat.completions.create(model="tiny", max_tokens=16, n=2, messages=[
        {"role": "user", "content": SIX_PUZZLES.prompt}])
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 2 * 16
    with pytest.raises(openai.BadRequestError, match="n must be 1 to 8") as refused:
        client.completions.create(model="tiny", prompt="1.3.", max_tokens=8, n=9)
    assert refused.value.body["param"] == "n"


UNHONOURED_FIELDS = [("logit_bias", {"5": 10}), ("presence_penalty", 0.5), ("function_call", "auto")]


@pytest.mark.parametrize("field, value", UNHONOURED_FIELDS, ids=[f for f, _ in UNHONOURED_FIELDS])
def test_a_field_this_server_cannot_honour_is_refused_by_name(cluster, field, value):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1.3."}], **{field: value})
    error = refused.value.body
    assert error["param"] == field and error["message"].startswith(f"{field}: ") and "not supported" in error["message"]


def test_structured_output_on_the_tiny_model_and_its_refusals(cluster):
    """The tiny model's characters spell digits and dots, not JSON: a choice list and a
    regular expression are followed; an object, a bad regex, too few tokens and two
    structures at once are refused by name."""
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)
    chosen = client.completions.create(model="tiny", prompt="1.3.", max_tokens=8, n=3, temperature=1.0,
                                       extra_body={"guided_choice": ["1.3.2", "4.4", "9"]})
    assert {c.text for c in chosen.choices} <= {"1.3.2", "4.4", "9"}
    matched = client.chat.completions.create(model="tiny", max_tokens=16, messages=[{"role": "user", "content": "1.3."}],
                                             extra_body={"guided_regex": "[0-9]\\.[0-9]{2,4}"})
    assert re.fullmatch(r"[0-9]\.[0-9]{2,4}", matched.choices[0].message.content)
    refusals = [({"response_format": {"type": "json_object"}}, "response_format", "cannot be compiled"),
                ({"extra_body": {"guided_regex": "(1"}}, "guided_regex", "cannot be compiled"),
                ({"extra_body": {"guided_regex": "[0-9]{12}"}, "max_tokens": 4}, "max_tokens", "has 12 tokens"),
                ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
                 "response_format", "not supported"),
                ({"response_format": {"type": "xml"}}, "response_format", "is not one of"),
                ({"extra_body": {"guided_choice": ["1"], "guided_regex": "1"}}, "guided_regex", "one structure"),
                ({"extra_body": {"guided_choice": ["1"], "ignore_eos": True}}, "ignore_eos", "cannot be used"),
                ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "'auto' is not supported"),
                ({"tool_choice": "required"}, "tool_choice", "needs tools"),
                ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", "each tool must be")]
    for fields, param, message in refusals:
        with pytest.raises(openai.BadRequestError, match=message) as refused:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1.3."}],
                                           **{"max_tokens": 8, **fields})
        assert refused.value.body["param"] == param, fields


def test_a_suffix_on_a_model_that_cannot_infill_is_refused_with_the_reason(cluster):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="needs a bidirectional model on the full canvas") as refused:
        client.completions.create(model="tiny", prompt="1.3.", suffix="4...", max_tokens=16)
    assert refused.value.body["param"] == "suffix"


def test_neutral_values_and_unknown_fields_are_accepted(cluster):
    response = httpx.post(cluster.base_url + "/v1/chat/completions", timeout=60, headers=AUTH, json={
        "model": "tiny", "messages": [{"role": "user", "content": "1.3."}], "max_tokens": 8,
        "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "logit_bias": {},
        "presence_penalty": 0, "store": False, "metadata": {"a": "b"}, "some_future_field": 1})
    assert response.status_code == 200, response.text
    # what clients send by default, to a rule without top_p / top_k; a developer message; text parts
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", max_tokens=8, top_p=1, temperature=1e-5, stop="", extra_body={"algorithm": "fixed_steps", "top_k": -1},
        messages=[{"role": "developer", "content": "Solve."}, {"role": "user", "content": [{"type": "text", "text": "1.3."}]}])
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_64_concurrent_requests_on_two_replicas_match_offline_accuracy(cluster):
    requests = task.heldout_requests()[:100]  # one request apart: 1 point
    bodies = [{"model": "tiny", "prompt": r.prompt, "max_tokens": TINY_MAX_TOKENS} for r in requests]
    # a client that retries a 429 after its Retry-After: a cold cluster charges worst cases
    responses = asyncio.run(post_all(cluster.base_url, bodies, concurrency=64, retries=10))
    assert [r.status_code for r in responses] == [200] * len(bodies)
    payloads = [r.json() for r in responses]
    views = json.loads(_status(cluster, "--json"))["replicas"]
    replicas = set(views)
    assert {p["dllm"]["replica"] for p in payloads} == replicas
    assert all(0 <= v["kv_cache_usage"] <= 1 and v["kv_cache_bytes"] > 0 and v["max_model_len"] > 0
               for v in views.values()), views
    table = _status(cluster)  # the table a person reads: one row per replica, its prefix cache included ...
    assert "prefix hits" in table and all(re.search(rf"^{r}\s+\d+\s+\d+\s+\d+/\d+.*\d+\s+(\d+%|-)$", table, re.M)
                                          for r in replicas)
    assert all(re.search(rf"^{r}\s+\d+\s+\d+\.\d [MG]iB\s+\d+\.\d%\s+\d+\.\d%\s+\d+$", table, re.M)
               for r in replicas), table  # ... and its KV pool
    assert len({p["dllm"]["replica"] for p in payloads}) == 2
    http_outputs = [GenerateChunk(p["choices"][0]["text"]) for p in payloads]
    http_accuracy = score(requests, http_outputs)["request_accuracy"]
    engine = Engine.from_pretrained("tiny", EngineConfig(max_batch=16))
    offline_accuracy = score(requests, engine.generate([r.prompt for r in requests], tiny_params()))["request_accuracy"]
    assert abs(http_accuracy - offline_accuracy) <= 0.01


def _status(cluster, *flags: str) -> str:
    """`dllm-serve status` of ``cluster`` (at the Ray address its `up` printed: other
    clusters of the suite run on this machine too)."""
    result = subprocess.run([sys.executable, "-m", "tools.cli", "status", *flags, "--address", cluster.ray_address],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_burst_above_capacity_is_refused_cleanly(cluster):
    """Capacity is 2 x 2000 row-steps; each request is charged up to 24 blocks (384
    tokens) x the mean measured steps per block (about 2.4): about 58."""
    bodies = [{"model": "tiny", "prompt": r.prompt, "max_tokens": 384}
              for r in task.make_requests(300, seed=99)]
    responses = asyncio.run(post_all(cluster.base_url, bodies, concurrency=300))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}
    refused = [r for r in responses if r.status_code == 429]
    admitted = [r for r in responses if r.status_code == 200]
    assert len(refused) >= 100 and len(admitted) >= 50
    for response in refused:
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["type"] == "rate_limit_error"
    for response in admitted:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


BAD_INPUTS = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, "invalid_request_error"),
    ("prompt of wrong type", "/v1/completions", {"model": "tiny", "prompt": 123}, 400, "invalid_request_error"),
    ("max_tokens of wrong type", "/v1/completions", {"model": "tiny", "prompt": "1", "max_tokens": "many"}, 400, "invalid_request_error"),
    ("stream of wrong type", "/v1/completions", {"model": "tiny", "prompt": "1", "stream": "yes"}, 400, "invalid_request_error"),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, 400, "invalid_request_error"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "1"}, 404, "not_found_error"),
    ("max_tokens zero", "/v1/completions", {"model": "tiny", "prompt": "1", "max_tokens": 0}, 400, "invalid_request_error"),
    ("max_tokens negative", "/v1/completions", {"model": "tiny", "prompt": "1", "max_tokens": -5}, 400, "invalid_request_error"),
    ("max_tokens over the limit", "/v1/completions", {"model": "tiny", "prompt": "1", "max_tokens": 10**6}, 400, "invalid_request_error"),
    ("prompt longer than the context", "/v1/completions", {"model": "tiny", "prompt": "1" * 600}, 400, "invalid_request_error"),
    ("unknown algorithm", "/v1/completions", {"model": "tiny", "prompt": "1", "algorithm": "magic"}, 400, "invalid_request_error"),
    ("bad threshold", "/v1/completions", {"model": "tiny", "prompt": "1", "threshold": 5}, 400, "invalid_request_error"),
    ("unknown algorithm parameter", "/v1/completions", {"model": "tiny", "prompt": "1", "algorithm_params": {"x": 1}}, 400, "invalid_request_error"),
    ("block length the model lacks", "/v1/completions", {"model": "tiny", "prompt": "1", "block_length": 32}, 400, "invalid_request_error"),
    ("mode the replicas do not run", "/v1/completions", {"model": "tiny", "prompt": "1", "mode": "sync"}, 400, "invalid_request_error"),
    ("too many choices", "/v1/completions", {"model": "tiny", "prompt": "1", "n": 9}, 400, "invalid_request_error"),
    ("empty prompt", "/v1/completions", {"model": "tiny", "prompt": ""}, 400, "invalid_request_error"),
    ("empty messages", "/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "invalid_request_error"),
    ("message without content", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400, "invalid_request_error"),
    ("unknown role", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "god", "content": "1"}]}, 400, "invalid_request_error"),
    ("unknown route", "/v1/engines", {"model": "tiny"}, 404, "not_found_error"),
]


@pytest.mark.parametrize("name,path,body,status,error_type", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_an_openai_error(cluster, name, path, body, status, error_type):
    kwargs = {"content": body, "headers": {**AUTH, "Content-Type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body, "headers": AUTH}
    response = httpx.post(cluster.base_url + path, timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == error_type and error["message"]


def test_literal_mask_token_is_text_and_replicas_keep_serving(cluster):
    response = httpx.post(cluster.base_url + "/v1/completions", timeout=30, headers=AUTH,
                          json={"model": "tiny", "prompt": "[MASK]", "max_tokens": 16})
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == 6  # six characters, not one mask
    for request in task.heldout_requests()[:4]:
        ok = httpx.post(cluster.base_url + "/v1/completions", timeout=30, headers=AUTH,
                        json={"model": "tiny", "prompt": request.prompt, "max_tokens": TINY_MAX_TOKENS})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}], ids=["missing", "wrong"])
def test_api_key_is_required(cluster, headers):
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("POST", "/v1/completions")):
        response = httpx.request(method, cluster.base_url + path, headers=headers, timeout=30,
                                 json={"model": "tiny", "prompt": "1"} if method == "POST" else None)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"


def wait_idle_metrics(cluster, timeout=20.0) -> str:
    """A scrape taken once every replica reports no live request and a full page pool."""
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(1.0)
        text = cluster.metrics_text()
        free, pages = series(text, "dllm_free_pages"), series(text, "dllm_total_pages")
        live = total(text, "dllm_running_requests") + total(text, "dllm_step_queue_length")
        if free and free == pages and live == 0:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas did not go idle: free {free} of {pages}, live {live}")


def test_metrics_after_load_are_complete_and_consistent(cluster):
    before = wait_idle_metrics(cluster)
    requests = task.heldout_requests()[200:240]
    bodies = [{"model": "tiny", "prompt": r.prompt, "max_tokens": TINY_MAX_TOKENS} for r in requests]
    payloads = [r.json() for r in asyncio.run(post_all(cluster.base_url, bodies, concurrency=20))]
    after = wait_idle_metrics(cluster)

    def delta(name, label_filter=""):
        return total(after, name, label_filter) - total(before, name, label_filter)

    for spec in METRICS:
        assert f"# TYPE {spec.name}" in after, spec.name
    assert delta("dllm_requests_total", 'finish_reason="stop"') == len(requests)
    assert delta("dllm_admitted_total") == len(requests)
    assert delta("dllm_blocks_committed_total") == sum(len(p["dllm"]["block_steps"]) for p in payloads)
    assert delta("dllm_output_tokens_total") == sum(p["usage"]["completion_tokens"] for p in payloads)
    row_steps = sum(p["dllm"]["steps"] for p in payloads)
    assert max(p["dllm"]["steps"] for p in payloads) <= delta("dllm_steps_total") <= row_steps
    assert delta("dllm_steps_per_block_count") == delta("dllm_blocks_committed_total")
    assert delta("dllm_request_latency_seconds_count") == len(requests)
    assert delta("dllm_time_to_first_block_seconds_count") == len(requests)
    assert delta("dllm_dispatch_overhead_seconds_count") == delta("dllm_steps_total")
    assert all(0 < v <= 1 for v in series(after, "dllm_compute_ratio").values())
    assert total(after, "dllm_replicas") == 2
    assert total(after, "dllm_rejected_total") >= 100  # from the burst test


def test_a_client_leaving_before_its_whole_answer_aborts_it(cluster):
    """A request for a whole answer has nothing to send until the end; the client closing
    its connection still stops it on the replica (it was computed to the end before)."""
    before = wait_idle_metrics(cluster)
    aborted_before = total(before, "dllm_requests_total", 'finish_reason="abort"')
    body = json.dumps({"model": "tiny", "prompt": SIX_PUZZLES.prompt, "max_tokens": 384, "ignore_eos": True,
                       **SLOW}).encode()  # 24 blocks of 16 steps: seconds, not one report period
    host, port = cluster.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() +
                           b"\r\nContent-Type: application/json\r\nAuthorization: Bearer " + API_KEY.encode() +
                           b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while total(cluster.metrics_text(), "dllm_running_requests") < 1:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.05)
    # the connection is closed while the replica denoises the answer
    after = wait_idle_metrics(cluster)
    assert total(after, "dllm_requests_total", 'finish_reason="abort"') - aborted_before == 1
    assert total(after, "dllm_requests_total", 'finish_reason="length"') == \
        total(before, "dllm_requests_total", 'finish_reason="length"')
    closed_before = total(before, "dllm_http_responses_total", 'code="499"')  # nginx's "client closed request"
    deadline = time.monotonic() + 20  # the ingress reports its responses apart from the replicas
    while (closed := total(cluster.metrics_text(), "dllm_http_responses_total", 'code="499"') - closed_before) < 1:
        assert time.monotonic() < deadline, "no 499 counted"
        time.sleep(0.1)
    assert closed == 1


def test_client_disconnect_mid_stream_frees_pages(cluster):
    before = wait_idle_metrics(cluster)
    body = {"model": "tiny", "prompt": SIX_PUZZLES.prompt, "max_tokens": TINY_MAX_TOKENS, "stream": True, **SLOW}
    with httpx.Client(timeout=30, headers=AUTH) as client:
        with client.stream("POST", cluster.base_url + "/v1/completions", json=body) as response:
            first = next(response.iter_lines())
            assert first.startswith("data: ")
        # leaving the block closes the connection mid-stream
    after = wait_idle_metrics(cluster)
    assert total(after, "dllm_requests_total", 'finish_reason="abort"') - \
        total(before, "dllm_requests_total", 'finish_reason="abort"') == 1
