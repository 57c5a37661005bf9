"""A request costs the ingress and the replica no work it does not need: a greedy request
draws no seed, so the replica's kept parameters serve it without validating them again; a
prompt far past the model's context is refused before it is tokenized."""

import asyncio
import json

import pytest

from replicas.deployment import EngineReplica
from replicas.engine_config import EngineConfig
from cluster.preprocess import MAX_CHARS_PER_TOKEN
from test_ingress_path import PROMPT, answer, make_ingress as counting_ingress
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


def test_a_prompt_past_what_the_context_holds_is_refused_untokenized():
    """More characters than ``max_model_len`` tokens hold at ``MAX_CHARS_PER_TOKEN`` each:
    400 ``context_length_exceeded`` with neither the chat template nor the tokenizer run."""
    plain, instance = counting_ingress()
    limit = instance.preprocess.max_model_len * MAX_CHARS_PER_TOKEN
    over = [(completion(prompt="1" * (limit + 1)), "/v1/completions", "prompt"),
            (completion(prompt=[PROMPT, "1" * (limit + 1)], max_tokens=16), "/v1/completions", "prompt"),
            ({"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "1" * (limit // 2 + 1)}] * 2},
             "/v1/chat/completions", "messages")]
    for body, path, param in over:
        response = asyncio.run(answer(plain, instance, body, path=path))
        error = json.loads(response.body)["error"]
        assert response.status_code == 400 and (error["param"], error["code"]) == (param, "context_length_exceeded")
    assert instance.tokenizer.calls == 0 and not instance.tokenizer.threads
    within = [PROMPT, PROMPT + " " * (limit - len(PROMPT))]  # the tiny tokenizer drops whitespace: it fits
    assert asyncio.run(answer(plain, instance, completion(prompt=within))).status_code == 200
    ids = asyncio.run(answer(plain, instance, completion(prompt=[[5] * (limit // 2 + 1)] * 2)))  # the model's check
    assert ids.status_code == 400 and json.loads(ids.body)["error"]["code"] == "context_length_exceeded"
