"""``dllm-serve bench prefix``: the prefix cache on and off, side by side, on a random SDAR.

Random weights in SDAR's architecture (block-causal, blocks aligned to the prompt): what
is measured is the work the cache saves, not the answers. Every request is a shared
prefix (a system prompt, few-shot examples) and a tail of its own; all run ``fixed_steps``,
so both settings take the same denoise steps and differ only in the prompt pages they
compute. One request warms the cache first (the prefix was seen before, as in a serving
system that has been up a while; untimed in both settings), then ``requests`` arrive at
once into ``max_batch`` rows. The two settings run in alternating order for ``rounds``
rounds; each ratio is the median of its rounds.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from tools.bench.canvas import IdsOnly
from tools.bench.device import built_on
from replicas.engine import Engine, EngineConfig
from replicas.messages import SamplingParams
from replicas.models.defaults import apply_overrides
from replicas.models.sdar import SDARForCausalLM
from replicas.models.transformer import QwenStyleConfig


def random_sdar(hidden: int = 512, layers: int = 8, heads: int = 8, vocab: int = 32768, block_length: int = 32,
                seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                ffn: int | None = None) -> SDARForCausalLM:
    """Random weights in SDAR's architecture: half as many KV heads as heads, heads of
    ``hidden / heads``, an FFN of ``ffn`` (default 3 x ``hidden``), tied embeddings (``hidden=2048, layers=28,
    heads=16, vocab=151936``: SDAR-1.7B's shape)."""
    torch.manual_seed(seed)
    config = QwenStyleConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn or 3 * hidden,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                             max_position_embeddings=8192, tie_word_embeddings=True, mask_token_id=vocab - 1,
                             eos_token_id=vocab - 2, architectures=("SDARForCausalLM",), model_type="sdar")
    net = built_on(device, dtype, lambda: SDARForCausalLM(config))
    net.spec = apply_overrides(net.spec, {"block_length": block_length})
    return net


def prefix_and_tails(count: int, prefix_len: int, tail_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts: one shared prefix, then each its own tail (ids clear of the last
    two, the mask and EOS)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab - 2) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(10, vocab - 2) for _ in range(tail_len)] for _ in range(count + 1)]


def run_once(net, prompts: list[list[int]], cache: bool, max_batch: int, max_tokens: int, steps: int) -> dict:
    """The first prompt alone (untimed), then the rest at once: tokens/s, time to the first
    block per request, and the cache's hit rate."""
    engine = Engine(net, IdsOnly(), EngineConfig(
        max_batch=max_batch, prefix_cache=cache, fdfo_fill_hold=False, algorithm="fixed_steps",
        algorithm_params={"steps": steps}, max_model_len=len(prompts[0]) + max_tokens + 2 * net.spec.block_length))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:1], params)
    first_block: dict[int, float] = {}
    tokens = [0]

    def record(index: int):
        def on_output(chunk) -> None:
            if chunk.token_ids and index not in first_block:
                first_block[index] = time.perf_counter() - start
            tokens[0] += len(chunk.token_ids)
        return on_output

    start = time.perf_counter()
    for index, prompt in enumerate(prompts[1:]):
        engine.add_request(prompt, params, on_output=record(index))
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - start
    cache_totals = engine.pool.cache.totals if engine.pool.cache is not None else None
    return {"seconds": seconds, "tokens_per_s": tokens[0] / seconds,
            "ttfb_p50_s": statistics.median(first_block.values()),
            "hit_rate": cache_totals.hit_rate if cache_totals else 0.0}


def bench_prefix(requests: int = 16, prefix_len: int = 1024, tail_len: int = 64, max_tokens: int = 128,
                 max_batch: int = 8, steps: int = 8, rounds: int = 2, **shape) -> dict:
    net = random_sdar(**shape)
    prompts = prefix_and_tails(requests, prefix_len, tail_len, net.spec.vocab_size)
    report = {"parameters": sum(p.numel() for p in net.parameters()), "requests": requests,
              "prefix_len": prefix_len, "tail_len": tail_len, "max_tokens": max_tokens, "max_batch": max_batch,
              "block_length": net.spec.block_length, "steps_per_block": steps, "rounds": rounds}
    run_once(net, prompts[:2], True, max_batch, net.spec.block_length, steps)  # warm-up: allocator, weights
    runs = {"on": [], "off": []}
    for r in range(rounds):
        for setting in ("on", "off") if r % 2 == 0 else ("off", "on"):
            runs[setting].append(run_once(net, prompts, setting == "on", max_batch, max_tokens, steps))
    speedups = [on["tokens_per_s"] / off["tokens_per_s"] for on, off in zip(runs["on"], runs["off"])]
    ttfb = [on["ttfb_p50_s"] / off["ttfb_p50_s"] for on, off in zip(runs["on"], runs["off"])]
    for setting, done in runs.items():
        report[f"cache_{setting}"] = {key: round(statistics.median(run[key] for run in done), 4)
                                      for key in ("tokens_per_s", "ttfb_p50_s", "hit_rate")}
    report["throughput_on_over_off"] = round(statistics.median(speedups), 3)
    report["throughput_spread"] = round(max(speedups) - min(speedups), 3)
    report["ttfb_p50_on_over_off"] = round(statistics.median(ttfb), 3)
    report["ttfb_spread"] = round(max(ttfb) - min(ttfb), 3)
    return report
