"""`dllm-serve up` sizing its KV pool from memory: a random checkpoint with SDAR-1.7B's
attention shape and its 32,768 positions (one of its 28 layers, an MLP of 1,024 instead of
6,144 and a vocabulary of 4,096 instead of 151,936, so that 64 rows run on two cores in the
suite's time; the KV pool's size depends on the attention shape alone) at 64 rows, under
a memory budget, starts, answers as users ask, reports its pool, and its replica stays within
the budget."""

import concurrent.futures
import json
import subprocess
import sys
from dataclasses import replace

import httpx
import openai
import pytest
import torch

from live_up import start_cluster, stop_cluster
from loadgen.soak import resident_bytes
from replicas.memory import host_memory
from tests.replicas.models.checkpoint_builders import SDAR_1_7B, write_checkpoint

BUDGET = 3 << 30  # the whole replica process: weights (0.1 GiB in float32), activations, KV pool


@pytest.fixture(scope="module")
def sdar_32k(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("sdar-32k"), "SDARForCausalLM",
                            dims=replace(SDAR_1_7B, layers=1, ffn=1024, vocab=4096, mask_id=4000, eos_id=4001, pad_id=4002),
                            dtype=torch.bfloat16)
    _, total = host_memory()
    replica = {"max_batch": 64, "memory_utilization": BUDGET / total, "max_tokens_per_step": 512,
               "model_overrides": {"mask_token_id": 4000, "eos_token_id": 4001}}
    running = start_cluster(tmp_path_factory.mktemp("sdar-32k-up"), {"model": str(path), "replica": replica},
                            timeout_s=900)
    yield path, running
    stop_cluster(running.process)


def status(running) -> dict:
    result = subprocess.run([sys.executable, "-m", "tools.cli", "status", "--json", "--address", running.ray_address],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_32k_position_checkpoint_at_64_rows_serves_within_its_memory_budget(sdar_32k):
    path, running = sdar_32k
    [view] = status(running)["replicas"].values()
    page = 2 * 1 * 8 * 128 * 4 * 4  # K and V, 1 layer, 8 KV heads of 128, 4 tokens, float32
    assert view["max_model_len"] == 32768 and view["kv_cache_bytes"] == (view["total_pages"] + 1) * page
    assert view["total_pages"] >= 8192  # one request of 32,768 positions fits
    assert view["total_pages"] < 64 * 8192  # far below what 64 rows of the whole context would take

    client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    for text in ("Hello", "Write a haiku about the sea."):  # one client, back to back
        answer = client.completions.create(model=model, prompt=text, max_tokens=8)
        assert answer.choices[0].finish_reason in ("length", "stop")

    def chat(i: int):
        return client.chat.completions.create(
            model=model, max_tokens=8, messages=[{"role": "user", "content": f"第{i}个问题：你好吗？🙂🚀 " * (1 + i % 3)}])

    with concurrent.futures.ThreadPoolExecutor(12) as pool:  # a dozen concurrent clients
        answers = list(pool.map(chat, range(12)))
    assert all(a.choices[0].finish_reason in ("length", "stop") and a.usage.completion_tokens <= 8 for a in answers)

    long_prompt = "The quick brown fox jumps over the lazy dog. " * 25  # 1,125 characters: 3 prompt chunks
    streamed = httpx.post(running.base_url + "/v1/completions", timeout=600, json={
        "model": model, "prompt": long_prompt, "max_tokens": 8, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")

    with pytest.raises(openai.BadRequestError, match="32768"):  # over the positions the replica serves
        client.completions.create(model=model, prompt="x", max_tokens=40000)

    assert resident_bytes(view["pid"]) <= BUDGET  # the replica's process, after all that
