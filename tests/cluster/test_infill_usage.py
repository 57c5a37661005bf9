"""Usage of an infill through the ingress's routes and a real engine replica of a random
LLaDA checkpoint, in this process: the suffix's tokens are on the canvas, so
``prompt_tokens`` counts them, streamed and whole."""

import asyncio
import json

import pytest

from replicas.deployment import EngineReplica
from replicas.engine_config import EngineConfig
from tests.replicas.models.checkpoint_builders import write_checkpoint
from test_ingress_path import answer
from test_input_bounds import ingress_over, sse_events

PROMPT, SUFFIX = "def add(a, b):\n", "\nprint(add(1, 2))"


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    path = str(write_checkpoint(tmp_path_factory.mktemp("llada"), "LLaDAModelLM"))
    replica = EngineReplica(path, EngineConfig(max_batch=2), metrics_actor=None)
    yield ingress_over(replica.generate, model=path)
    replica.__del__()


def test_an_infills_usage_counts_its_suffix(llada):
    plain, instance = llada
    body = {"model": instance.config.model_name, "prompt": PROMPT, "suffix": SUFFIX, "max_tokens": 32,
            "ignore_eos": True}
    expected = len(instance.preprocess.encode(PROMPT, True)) + len(instance.preprocess.encode(SUFFIX, True))

    async def both():
        whole = await answer(plain, instance, body)
        streamed = await answer(plain, instance, {**body, "stream": True, "stream_options": {"include_usage": True}})
        return whole, await sse_events(streamed)

    whole, events = asyncio.run(both())
    assert whole.status_code == 200, whole.body
    assert json.loads(whole.body)["usage"]["prompt_tokens"] == expected
    assert [event["usage"]["prompt_tokens"] for event in events[:-1] if event.get("usage")] == [expected]
