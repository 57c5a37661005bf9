"""`dllm-serve eval-tiny`: accuracy of the tiny model through the real engine, per mode and batch size."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from replicas.engine import Engine, EngineConfig
from replicas.models import load_model, load_tokenizer
from replicas.messages import GenerateChunk
from replicas.messages import SamplingParams
from replicas.tiny import task


def tiny_params(algorithm: str = "low_confidence", **algorithm_params) -> SamplingParams:
    return SamplingParams(max_tokens=task.MAX_TOKENS, algorithm=algorithm, algorithm_params=algorithm_params)


def score(requests: Sequence[task.Request], outputs: Sequence[GenerateChunk]) -> dict:
    """Request accuracy (every puzzle right), puzzle accuracy and the steps-per-block histogram."""
    graded = [task.grade(r, o.text) for r, o in zip(requests, outputs)]
    puzzles = [ok for g in graded for ok in g]
    histogram = Counter(s for o in outputs for s in o.block_steps)
    return {
        "requests": len(requests),
        "request_accuracy": sum(all(g) for g in graded) / len(graded),
        "puzzle_accuracy": sum(puzzles) / len(puzzles),
        "output_tokens": sum(o.completion_tokens for o in outputs),
        "steps_per_block_histogram": dict(sorted(histogram.items())),
    }


def evaluate_tiny(model: str = "tiny", modes: Sequence[str] = ("fdfo", "sync"),
                  batch_sizes: Sequence[int] = (1, 16), num_requests: int = 300,
                  algorithm: str = "low_confidence") -> dict:
    if not 1 <= num_requests <= task.HELDOUT_REQUESTS:
        raise ValueError(f"--requests must be in 1..{task.HELDOUT_REQUESTS}")
    requests = task.heldout_requests()[:num_requests]
    net, tokenizer = load_model(model), load_tokenizer(model)
    runs = []
    for batch in batch_sizes:
        for mode in modes:
            engine = Engine(net, tokenizer, EngineConfig(mode=mode, max_batch=batch))
            start = time.perf_counter()
            outputs = engine.generate([r.prompt for r in requests], tiny_params(algorithm))
            runs.append({"mode": mode, "max_batch": batch, "seconds": round(time.perf_counter() - start, 2),
                         **score(requests, outputs)})
    gaps = [abs(a["request_accuracy"] - b["request_accuracy"]) * 100
            for a in runs for b in runs if a["max_batch"] == b["max_batch"]]
    return {"model": str(model), "algorithm": algorithm, "runs": runs,
            "max_mode_gap_points": round(max(gaps), 2)}


def format_report(report: dict) -> str:
    lines = [f"tiny model eval ({report['algorithm']}, {report['runs'][0]['requests']} held-out requests)",
             f"{'mode':<7}{'batch':>6}{'request acc':>13}{'puzzle acc':>12}{'seconds':>9}  steps per block"]
    for run in report["runs"]:
        hist = " ".join(f"{k}:{v}" for k, v in run["steps_per_block_histogram"].items())
        lines.append(f"{run['mode']:<7}{run['max_batch']:>6}{run['request_accuracy']:>13.1%}"
                     f"{run['puzzle_accuracy']:>12.1%}{run['seconds']:>9.1f}  {hist}")
    lines.append(f"largest gap between modes at one batch size: {report['max_mode_gap_points']} points")
    return "\n".join(lines)
