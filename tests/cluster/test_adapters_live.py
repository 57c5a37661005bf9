"""Two unmerged LoRA adapters and the base model served by one live cluster (LLaDA as D2F
serves it: block-causal, the prompt one block): each request is answered by its own weights,
concurrent requests for all three share the replica's steps, and an adapter's D2F request
streams the blocks it decodes several at a time."""

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
OVERRIDES = {"attention": "block_causal_whole_prompt", "block_length": 8}
D2F = {"block_add_threshold": 0.1, "decoded_token_threshold": 0.5, "skip_threshold": 0.03}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("llada"), "LLaDAModelLM")
    weights = checkpoint_weights(path)
    layers = sorted(name for name in weights if ".blocks." in name and weights[name].dim() == 2)
    adapters = {"alpha": tmp_path_factory.mktemp("alpha"), "beta": tmp_path_factory.mktemp("beta")}
    write_adapter(adapters["alpha"], {name: weights[name].shape for name in layers[::2]}, rank=4, alpha=8)
    write_adapter(adapters["beta"], {name: weights[name].shape for name in layers[1::2]}, rank=2, alpha=8)
    replica = {"max_batch": 8, "torch_threads": 1, "adapters": {k: str(v) for k, v in adapters.items()},
               "model_overrides": OVERRIDES}
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
        engine = Engine.from_pretrained(str(path), EngineConfig(max_batch=8, lora=lora and str(lora),
                                                                model_overrides=OVERRIDES))
        offline[model] = [chunk.text for chunk in engine.generate(PROMPTS, params)]
    assert [answer.choices[0].text for answer in answers] == [offline[model][PROMPTS.index(prompt)]
                                                              for model, prompt in asked]
    assert len({tuple(texts) for texts in offline.values()}) == 3  # the adapters answer otherwise

    unknown = httpx.post(running.base_url + "/v1/completions", json={"model": "gamma", "prompt": "hi"}, timeout=30)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found" and "'alpha', 'beta'" in unknown.json()["error"]["message"]
    assert httpx.get(running.base_url + "/v1/models/beta", timeout=30).json()["parent"] == base


def test_an_adapters_d2f_request_streams_its_blocks_in_order(served):
    path, adapters, running = served
    client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="alpha", prompt=PROMPTS[1], max_tokens=32, stream=True,
                                       extra_body={"ignore_eos": True, "algorithm": "d2f", "algorithm_params": D2F})
    events = [event.choices[0] for event in stream]
    engine = Engine.from_pretrained(str(path), EngineConfig(max_batch=8, lora=str(adapters["alpha"]),
                                                            model_overrides=OVERRIDES))
    [offline] = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=32, ignore_eos=True, algorithm="d2f",
                                                             algorithm_params=D2F))
    assert "".join(event.text for event in events) == offline.text
    assert offline.steps < 32 and events[-1].finish_reason == "length"  # several tokens a forward
