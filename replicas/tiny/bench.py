"""`dllm-serve bench engine`: fdfo vs sync vs static, side by side on one closed workload,
interleaved in rounds."""

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


def bench_engine(model: str = "tiny", num_requests: int = 256, max_batch: int = 16, rounds: int = 3,
                 on_fdfo_run: Callable[[list, list], None] | None = None) -> dict:
    """Tokens per second of each mode on the same heterogeneous tiny-task workload.

    The workload mixes 1 to 6 puzzles per request with 0 to 12 blanks per puzzle, so
    requests end at different blocks and blocks take different numbers of steps. The
    modes run interleaved, ``rounds`` times (fdfo, sync, static, fdfo, ...), and each
    ratio is the median of its per-round values, reported with their spread (max - min):
    a machine whose speed drifts during the run moves all modes of a round alike.
    ``tokens_per_forward``: committed tokens per row-forward (rows in a forward, idle KV
    writes included). ``on_fdfo_run(step_stats, outputs)`` receives the first fdfo run
    (e.g. to fit a calibration).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    requests = task.make_requests(num_requests, BENCH_SEED)
    prompts = [r.prompt for r in requests]
    net, tokenizer = load_model(model), load_tokenizer(model)
    params = tiny_params()
    warmup = Engine(net, tokenizer, EngineConfig(max_batch=max_batch))
    run_closed_batch(warmup, prompts[:max_batch], params)
    runs: dict[str, list[dict]] = {mode: [] for mode in BENCH_MODES}
    for round_index in range(rounds):
        for mode in BENCH_MODES:
            engine = Engine(net, tokenizer, EngineConfig(mode=mode, max_batch=max_batch))
            outputs, steps, wall = run_closed_batch(engine, prompts, params)
            if mode == "fdfo" and round_index == 0 and on_fdfo_run is not None:
                on_fdfo_run(steps, outputs)
            runs[mode].append({"outputs": outputs, "steps": steps, "wall": wall, **score(requests, outputs)})
    result: dict = {"requests": num_requests, "max_batch": max_batch, "rounds": rounds, "accuracy": {},
                    "tokens_per_forward": {}}
    for mode, mode_runs in runs.items():
        tokens_per_s = [r["output_tokens"] / r["wall"] for r in mode_runs]
        result[f"{mode}_tokens_per_s"] = round(statistics.median(tokens_per_s), 1)
        result[f"{mode}_seconds"] = round(statistics.median(r["wall"] for r in mode_runs), 2)
        result[f"{mode}_steps"] = len(mode_runs[0]["steps"])
        result["accuracy"][mode] = round(mode_runs[0]["request_accuracy"], 4)
        row_forwards = sum(s.batch_size for s in mode_runs[0]["steps"])
        result["tokens_per_forward"][mode] = round(mode_runs[0]["output_tokens"] / row_forwards, 3)
    fdfo = runs["fdfo"]
    steps = [s for r in fdfo for s in r["steps"]]
    result["compute_ratio"] = round(statistics.median(sum(s.forward_s for s in r["steps"]) / r["wall"] for r in fdfo), 3)
    result["overhead_ms_per_step_p50"] = round(statistics.median(s.overhead_s for s in steps) * 1e3, 3)
    result["forward_ms_per_step_p50"] = round(statistics.median(s.forward_s for s in steps) * 1e3, 3)
    result["steps_per_block_histogram"] = fdfo[0]["steps_per_block_histogram"]
    for baseline in ("sync", "static"):
        ratios = [(f["output_tokens"] / f["wall"]) / (b["output_tokens"] / b["wall"])
                  for f, b in zip(fdfo, runs[baseline])]
        result[f"fdfo_over_{baseline}"] = round(statistics.median(ratios), 2)
        result[f"fdfo_over_{baseline}_spread"] = round(max(ratios) - min(ratios), 2)
    return result
