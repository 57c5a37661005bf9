"""A request costs the ingress and the replica no work it does not need: a greedy request
draws no seed, so the replica's kept parameters serve it without validating them again."""

import asyncio

import pytest

from replicas.deployment import EngineReplica
from replicas.settings import EngineConfig
from test_ingress_path import PROMPT, answer
from test_input_bounds import completion, ingress_over, make_ingress


@pytest.fixture(scope="module")
def replica():
    replica = EngineReplica("tiny", EngineConfig(max_batch=4), metrics_actor=None)
    yield replica
    replica.__del__()


def served(plain, instance, body: dict) -> None:
    response = asyncio.run(answer(plain, instance, body))
    assert response.status_code == 200, response.body


def test_greedy_requests_draw_no_seed_and_are_validated_once_on_the_replica(replica):
    """A seed fixes random draws only: greedy requests (the default) get none, so they ask
    the replica alike, and its kept parameters (``Engine.algorithm_for``) serve all but the
    first without validating them again."""
    sent = []

    def generate(job):
        sent.append(job)
        return replica.generate(job)

    plain, instance = ingress_over(generate)
    kept = replica.engine._kept_algorithm
    before = kept.cache_info()
    for _ in range(4):
        served(plain, instance, completion(prompt=PROMPT))
    after = kept.cache_info()
    assert all("seed" not in job.params.algorithm_params for job in sent)
    assert after.misses - before.misses <= 1 and after.hits - before.hits >= 3


@pytest.mark.parametrize("fields", [{"temperature": 0.5}, {"algorithm": "fixed_steps", "algorithm_params": {
    "remasking": "random"}}, {"algorithm": "dream", "algorithm_params": {"alg": "origin"}}])
def test_a_request_that_draws_gets_a_seed_for_its_failover(fields):
    """What a replica draws at random, a resumed attempt on another draws alike."""
    plain, instance = make_ingress()
    served(plain, instance, completion(**fields))
    assert isinstance(instance.sent[-1].params.algorithm_params["seed"], int)
