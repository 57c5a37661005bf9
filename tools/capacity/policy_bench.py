"""`dllm-serve bench policies`: static, sync, fixed_fill and fdfo under the same Poisson load.

Each policy gets a fresh engine over the same loaded model and the same arrival
schedule (same times, same prompts), driven in real time through the AsyncEngine, so
latencies include queueing. Reported per policy: p50/p99 latency, p50 time to first
block, goodput (requests within the SLO per second) and the ratios of fdfo to each.
"""

from __future__ import annotations

import asyncio
import time

from loadgen.arrivals import poisson_times, tiny_prompts
from loadgen.stats import percentile
from replicas.async_engine import AsyncEngine
from replicas.batching import MODES
from replicas.engine import Engine, EngineConfig
from replicas.models import load_model, load_tokenizer
from tools.bench.engine import run_closed_batch
from tools.bench.evaluation import tiny_params


async def _drive(engine: Engine, times: list[float], prompts: list[str]) -> list[dict]:
    async_engine = AsyncEngine(engine)
    params = tiny_params()
    start = time.monotonic()

    async def one(at: float, prompt: str) -> dict:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        sent = time.monotonic()
        first = None
        async for output in async_engine.generate(prompt, params):
            if first is None and output.token_ids:
                first = time.monotonic() - sent
        return {"latency_s": time.monotonic() - sent, "ttfb_s": first if first is not None else time.monotonic() - sent}

    try:
        return await asyncio.gather(*(one(t, p) for t, p in zip(times, prompts)))
    finally:
        async_engine.shutdown(drain_timeout=0)


def closed_batch_rate(net, tokenizer, prompts: list[str], max_batch: int) -> float:
    """Requests per second fdfo sustains on a closed batch: the capacity the load is scaled to."""
    _, _, wall = run_closed_batch(Engine(net, tokenizer, EngineConfig(max_batch=max_batch)), prompts, tiny_params())
    return len(prompts) / wall


def bench_policies(model: str = "tiny", num_requests: int = 300, load: float = 0.7, rate: float | None = None,
                   max_batch: int = 16, slo_latency_s: float = 1.0, seed: int = 0,
                   fill_timeout_s: float | None = None) -> dict:
    net, tokenizer = load_model(model), load_tokenizer(model)
    prompts = tiny_prompts(num_requests, seed)
    capacity = closed_batch_rate(net, tokenizer, prompts[: 4 * max_batch], max_batch)
    rate = rate or load * capacity
    times = poisson_times(rate, seed, count=num_requests)
    result: dict = {"requests": num_requests, "rate_per_s": round(rate, 2),
                    "fdfo_capacity_per_s": round(capacity, 2), "max_batch": max_batch, "policies": {}}
    latencies = {}
    for policy in MODES:
        config = EngineConfig(mode=policy, max_batch=max_batch, fill_timeout_s=fill_timeout_s)
        records = asyncio.run(_drive(Engine(net, tokenizer, config), times, prompts))
        latencies[policy] = [r["latency_s"] for r in records]
        ttfb = [r["ttfb_s"] for r in records]
        result["policies"][policy] = {
            "latency_p50_s": round(percentile(latencies[policy], 50), 4),
            "latency_p99_s": round(percentile(latencies[policy], 99), 4),
            "ttfb_p50_s": round(percentile(ttfb, 50), 4),
        }
    span = times[-1] if times else 1.0
    result["slo_latency_s"] = slo_latency_s
    for policy, values in latencies.items():
        result["policies"][policy]["goodput_per_s"] = round(sum(v <= slo_latency_s for v in values) / span, 3)
    fdfo = result["policies"]["fdfo"]
    result["fdfo_over"] = {
        policy: {
            "p50_latency_speedup": round(stats["latency_p50_s"] / fdfo["latency_p50_s"], 2),
            "p99_latency_speedup": round(stats["latency_p99_s"] / fdfo["latency_p99_s"], 2),
            "goodput_ratio": round(fdfo["goodput_per_s"] / stats["goodput_per_s"], 2)
            if stats["goodput_per_s"] else None,
        }
        for policy, stats in result["policies"].items() if policy != "fdfo"
    }
    return result
