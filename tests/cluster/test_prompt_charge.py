"""Admission charges a prompt's pages that no replica is likely to hold cached (through the
ingress, no Ray): a prompt sent before is charged nothing for its pages, one that shares
only a beginning is charged for the rest, and the whole charge is released by the end."""

import asyncio
import json
import math
import time

import pytest

from replicas.deployment import EngineReplica
from replicas.engine_config import EngineConfig
from test_ingress_path import answer
from test_input_bounds import ingress_over

PAGE = 16  # the tiny model's block: one character per token
C0, C1, C2, MAX_BATCH = 0.004, 0.001, 0.0005, 4


@pytest.fixture(scope="module")
def replica():
    replica = EngineReplica("tiny", EngineConfig(max_batch=MAX_BATCH), metrics_actor=None)
    yield replica
    replica.__del__()


def test_a_cached_prompt_is_charged_nothing_for_its_pages(replica):
    jobs = []

    def generate(job):
        jobs.append(job)
        return replica.generate(job)

    plain, instance = ingress_over(generate)
    # a replica that measured a prompt page to cost C2 seconds, at a full batch
    instance.admission.update_view({"r1": {"c0": C0, "c1": C1, "c2": C2, "max_batch": MAX_BATCH,
                                           "measured_rows": MAX_BATCH, "live_requests": MAX_BATCH - 1,
                                           "stats_time": time.time()}})
    page_row_steps = C2 * MAX_BATCH / (C0 + C1 * MAX_BATCH)

    def charge(prompt: str):
        response = asyncio.run(answer(plain, instance, {"model": "tiny", "prompt": prompt, "max_tokens": 16}))
        assert response.status_code == 200, response.body
        assert json.loads(response.body)["choices"][0]["text"]
        return jobs[-1].cost, jobs[-1].prompt_cost

    system = "12+34=46;" * 8 + "5*6=30;1"  # 80 characters: 5 whole pages
    first_cost, first_prompt = charge(system)
    assert first_prompt == math.ceil(5 * page_row_steps) > 0
    again_cost, again_prompt = charge(system)
    assert again_prompt == 0 and again_cost == first_cost - first_prompt
    shared = system[:3 * PAGE] + "9-4=5;" * 5 + "77"  # 3 pages sent before, 2 new
    assert charge(shared)[1] == math.ceil(2 * page_row_steps)
    assert instance.admission.outstanding == 0  # every charge, its prompt's part included, released
