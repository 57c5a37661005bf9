"""`dllm-serve up --model DIR` serving a checkpoint directory (a random LLaDA, built here)
over two tensor-parallel ranks (gloo), over HTTP with the openai client: infilling with
``suffix``, answered as one process's engine answers."""

import openai
import pytest

from cluster.request_path import processes_mentioning
from live_up import start_cluster, stop_cluster
from replicas.engine import Engine, EngineConfig
from replicas.messages import SamplingParams
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
