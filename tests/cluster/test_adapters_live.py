"""Two unmerged LoRA adapters and the base model served by one live cluster: each request is
answered by its own weights, concurrent requests for all three share the replica's steps."""

import asyncio

import httpx
import openai
import pytest

from live_up import start_cluster, stop_cluster
from replicas.engine import Engine, EngineConfig
from replicas.messages import SamplingParams
from tests.replicas.models.checkpoint_builders import write_checkpoint
from tests.replicas.models.test_lora import checkpoint_weights, write_adapter

PROMPTS = ["def add(a, b):\n", "你好 🙂, what is 2 + 3?", "The cat sat on", "import numpy as np\n"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("llada"), "LLaDAModelLM")
    weights = checkpoint_weights(path)
    layers = sorted(name for name in weights if ".blocks." in name and weights[name].dim() == 2)
    adapters = {"alpha": tmp_path_factory.mktemp("alpha"), "beta": tmp_path_factory.mktemp("beta")}
    write_adapter(adapters["alpha"], {name: weights[name].shape for name in layers[::2]}, rank=4, alpha=8)
    write_adapter(adapters["beta"], {name: weights[name].shape for name in layers[1::2]}, rank=2, alpha=8)
    replica = {"max_batch": 8, "torch_threads": 1, "adapters": {k: str(v) for k, v in adapters.items()}}
    running = start_cluster(tmp_path_factory.mktemp("adapters-up"), {"model": str(path), "replica": replica})
    yield path, adapters, running
    stop_cluster(running.process)


def test_each_request_is_answered_by_its_adapters_weights(served):
    path, adapters, running = served
    base = path.name
    listed = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0).models.list().data
    assert [card.id for card in listed] == [base, "alpha", "beta"]
    assert [getattr(card, "parent", None) for card in listed] == [None, base, base]

    asked = [(model, prompt) for model in (base, "alpha", "beta") for prompt in PROMPTS]  # 12 clients at once

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
            for model, prompt in asked))

    answers = asyncio.run(all_at_once())
    assert [answer.model for answer in answers] == [model for model, _ in asked]
    params = SamplingParams(max_tokens=16, ignore_eos=True, algorithm_params={"temperature": 0.0})
    offline = {}
    for model, lora in ((base, None), ("alpha", adapters["alpha"]), ("beta", adapters["beta"])):
        engine = Engine.from_pretrained(str(path), EngineConfig(max_batch=8, lora=lora and str(lora)))
        offline[model] = [chunk.text for chunk in engine.generate(PROMPTS, params)]
    assert [answer.choices[0].text for answer in answers] == [offline[model][PROMPTS.index(prompt)]
                                                              for model, prompt in asked]
    assert len({tuple(texts) for texts in offline.values()}) == 3  # the adapters answer otherwise

    unknown = httpx.post(running.base_url + "/v1/completions", json={"model": "gamma", "prompt": "hi"}, timeout=30)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found" and "'alpha', 'beta'" in unknown.json()["error"]["message"]
    assert httpx.get(running.base_url + "/v1/models/beta", timeout=30).json()["parent"] == base
    d2f = httpx.post(running.base_url + "/v1/completions", timeout=30, json={
        "model": "alpha", "prompt": "hi", "algorithm": "d2f"})  # this LLaDA is bidirectional: no blocks ahead
    assert d2f.status_code == 400 and d2f.json()["error"]["param"] == "algorithm"
