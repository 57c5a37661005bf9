"""A request's n choices: rows with their own ids and seeds, streams merged as they come,
admission charged for all of them."""

import asyncio
import json

import pytest

from cluster.choices import SEEDS, merged, rows
from replicas.messages import GenerateRequest, SamplingParams
from test_ingress_path import answer, completion, make_ingress


def test_rows_have_their_own_ids_and_seeds():
    job = GenerateRequest("cmpl-1", [1, 2], SamplingParams(16, algorithm_params={"seed": SEEDS - 2, "temperature": 1.0}))
    assert rows(job, 1) == [job]
    three = rows(job, 3)
    assert [r.request_id for r in three] == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    assert [r.params.algorithm_params["seed"] for r in three] == [SEEDS - 2, SEEDS - 1, 0]
    assert all(r.params.algorithm_params["temperature"] == 1.0 and r.prompt_ids == [1, 2] for r in three)


async def numbers(start, count, delay, fail_at=None, closed=None):
    try:
        for i in range(start, start + count):
            if i == fail_at:
                raise ValueError(f"broke at {i}")
            await asyncio.sleep(delay)
            yield i
    finally:
        if closed is not None:
            closed.append(start)


def test_merged_yields_items_as_they_come_and_closes_every_stream():
    async def collect(streams):
        return [pair async for pair in merged(streams)]

    pairs = asyncio.run(collect([numbers(0, 3, 0.03), numbers(10, 3, 0.01)]))
    assert sorted(pairs) == [(0, 0), (0, 1), (0, 2), (1, 10), (1, 11), (1, 12)]
    assert pairs[0] == (1, 10)  # the faster stream's first item comes first

    closed = []
    with pytest.raises(ValueError, match="broke at 11"):
        asyncio.run(collect([numbers(0, 50, 0.01, closed=closed), numbers(10, 3, 0.01, fail_at=11, closed=closed)]))
    assert sorted(closed) == [0, 10]

    async def first_only():
        closed.clear()
        async for pair in merged([numbers(0, 50, 0.01, closed=closed), numbers(10, 50, 0.01, closed=closed)]):
            return pair
    asyncio.run(first_only())
    assert sorted(closed) == [0, 10]


def test_admission_charges_all_choices_and_the_answer_has_each():
    plain, ingress = make_ingress()
    charged = []
    admit = ingress.admission.try_admit
    ingress.admission.try_admit = lambda cost, slo=None: charged.append(cost) or admit(cost, slo)
    one = asyncio.run(answer(plain, ingress, completion(16)))
    three = asyncio.run(answer(plain, ingress, completion(16) | {"n": 3}))
    assert charged[1] == 3 * charged[0] > 0
    body = json.loads(three.body)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 3 * json.loads(one.body)["usage"]["completion_tokens"]
    assert len(body["dllm"]["choices"]) == 3
    too_many = asyncio.run(answer(plain, ingress, completion(16) | {"n": 9}))
    assert too_many.status_code == 400 and json.loads(too_many.body)["error"]["param"] == "n"
