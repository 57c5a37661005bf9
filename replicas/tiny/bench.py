"""`dllm-serve bench engine`: fdfo vs sync vs static, side by side on one closed workload."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from replicas.engine import Engine, EngineConfig
from replicas.models import load_model, load_tokenizer
from replicas.tiny import task
from replicas.tiny.evaluation import score, tiny_params

BENCH_SEED = 7
BENCH_MODES = ("fdfo", "sync", "static")


def run_closed_batch(engine: Engine, prompts: list[str], params) -> tuple[list, list, float]:
    """Submit everything at once, step until done; returns outputs, step stats, wall seconds."""
    steps = []
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, on_step=steps.append)
    return outputs, steps, time.perf_counter() - start


def bench_engine(model: str = "tiny", num_requests: int = 256, max_batch: int = 16,
                 on_fdfo_run: Callable[[list, list], None] | None = None) -> dict:
    """Tokens per second of each mode on the same heterogeneous tiny-task workload.

    The workload mixes 1 to 6 puzzles per request with 0 to 12 blanks per puzzle, so
    requests end at different blocks and blocks take different numbers of steps.
    ``on_fdfo_run(step_stats, outputs)`` receives the fdfo run (e.g. to fit a calibration).
    """
    requests = task.make_requests(num_requests, BENCH_SEED)
    prompts = [r.prompt for r in requests]
    net, tokenizer = load_model(model), load_tokenizer(model)
    params = tiny_params()
    warmup = Engine(net, tokenizer, EngineConfig(max_batch=max_batch))
    run_closed_batch(warmup, prompts[:max_batch], params)
    result: dict = {"requests": num_requests, "max_batch": max_batch, "accuracy": {}}
    for mode in BENCH_MODES:
        engine = Engine(net, tokenizer, EngineConfig(mode=mode, max_batch=max_batch))
        outputs, steps, wall = run_closed_batch(engine, prompts, params)
        scored = score(requests, outputs)
        result[f"{mode}_tokens_per_s"] = round(scored["output_tokens"] / wall, 1)
        result[f"{mode}_seconds"] = round(wall, 2)
        result[f"{mode}_steps"] = len(steps)
        result["accuracy"][mode] = round(scored["request_accuracy"], 4)
        if mode == "fdfo":
            if on_fdfo_run is not None:
                on_fdfo_run(steps, outputs)
            result["compute_ratio"] = round(sum(s.forward_s for s in steps) / wall, 3)
            result["overhead_ms_per_step_p50"] = round(statistics.median(s.overhead_s for s in steps) * 1e3, 3)
            result["forward_ms_per_step_p50"] = round(statistics.median(s.forward_s for s in steps) * 1e3, 3)
            result["steps_per_block_histogram"] = scored["steps_per_block_histogram"]
    result["fdfo_over_sync"] = round(result["fdfo_tokens_per_s"] / result["sync_tokens_per_s"], 2)
    result["fdfo_over_static"] = round(result["fdfo_tokens_per_s"] / result["static_tokens_per_s"], 2)
    return result
