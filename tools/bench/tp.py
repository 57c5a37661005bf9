"""``dllm-serve bench tp``: an engine step at tensor-parallel sizes 1 and 2 (CPU ranks over
gloo on this machine), split into compute, collectives and host work.

A random LLaDA (saved once, each rank reading its share) answers a closed batch of
``batch`` requests with ``fixed_steps`` (every request takes the same forwards at every
size). On rank 0 every step's wall time (``StepStats.step_s``) splits into its forward
(``forward_s``) and the host work around it (scheduling, the algorithms, commits, and at
TP > 1 sending the forward's inputs to the other ranks); the forward's time inside the
collectives (the all-reduces after each attention block and MLP, the logits' all-gather,
waiting for the slower rank included) is measured around each call, and the rest of the
forward is compute. The share of the step in collectives is the number the serving paper
asks about ("step-aware tensor parallelism"). Each rank runs one torch thread.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from replicas.engine import Engine, EngineConfig, follow_as_rank
from replicas.messages import SamplingParams
from replicas.models.checkpoint import load_model, save_model
from replicas.models.parallel import TensorParallel
from replicas.models.llada import LLaDAConfig, LLaDAModelLM
from tools.bench.canvas import IdsOnly
from tools.bench.device import built_on
from tools.bench.local_ranks import on_ranks


@dataclass(frozen=True)
class TimedParallel(TensorParallel):
    """``TensorParallel`` that adds the seconds spent in its collectives to ``spent[0]``."""

    spent: list = field(default_factory=lambda: [0.0], compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = super().all_reduce(x)
        self.spent[0] += time.perf_counter() - start
        return out

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = super().gather_last(x)
        self.spent[0] += time.perf_counter() - start
        return out


def _config(batch: int, steps: int, prompt_len: int, max_tokens: int) -> EngineConfig:
    return EngineConfig(max_batch=batch, fdfo_fill_hold=False, max_model_len=prompt_len + max_tokens + 64,
                        algorithm="fixed_steps", algorithm_params={"steps": steps})


def _run(tp: TensorParallel, checkpoint: str, batch: int, steps: int, prompt_len: int, max_tokens: int,
         rounds: int) -> dict | int:
    """Rank 0: the per-step split, medians over ``rounds`` runs; another rank: forwards followed."""
    torch.set_num_threads(1)
    timed = TimedParallel(tp.rank, tp.size, tp.group)
    config = _config(batch, steps, prompt_len, max_tokens)
    model = load_model(checkpoint, tp=timed)
    if tp.rank:
        return follow_as_rank(model, config)
    engine = Engine(model, IdsOnly(), config)
    vocab = engine.spec.vocab_size - 2  # below the mask and end ids
    prompts = [[(i * 37 + r * 101) % vocab for i in range(prompt_len)] for r in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    try:
        engine.generate(prompts[:1], SamplingParams(max_tokens=engine.block_length, ignore_eos=True))  # warm
        runs = []
        for _ in range(rounds):
            stats = []
            timed.spent[0] = 0.0
            engine.generate(prompts, params, on_step=stats.append)
            step = sum(s.step_s for s in stats)
            forward = sum(s.forward_s for s in stats)
            runs.append({"steps": len(stats), "step_ms": 1000 * step / len(stats),
                         "compute_ms": 1000 * (forward - timed.spent[0]) / len(stats),
                         "collectives_ms": 1000 * timed.spent[0] / len(stats),
                         "host_ms": 1000 * (step - forward) / len(stats)})
    finally:
        if engine.runner.broadcast is not None:
            engine.runner.broadcast.close()
    median = {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0] if key != "steps"}
    return {"steps": runs[0]["steps"], **median,
            "collectives_share": round(median["collectives_ms"] / median["step_ms"], 3)}


def bench_tp(sizes=(1, 2), batch_sizes=(1, 16), d_model: int = 512, layers: int = 8, heads: int = 8,
             mlp: int = 1376, vocab: int = 320, steps: int = 4, prompt_len: int = 64, max_tokens: int = 128,
             rounds: int = 3) -> dict:
    report = {"model": f"random LLaDA d_model {d_model}, {layers} layers, {heads} heads, MLP {mlp}, vocab {vocab}",
              "prompt_len": prompt_len, "max_tokens": max_tokens, "steps_per_block": steps, "rounds": rounds,
              "threads_per_rank": 1}
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = Path(directory) / "llada"
        torch.manual_seed(0)
        config = LLaDAConfig(d_model=d_model, n_heads=heads, n_layers=layers, mlp_hidden_size=mlp, vocab_size=vocab,
                             max_sequence_length=4096, mask_token_id=vocab - 1, eos_token_id=vocab - 2)
        save_model(built_on("cpu", torch.float32, lambda: LLaDAModelLM(config)), checkpoint)
        for batch in batch_sizes:
            for size in sizes:
                args = (str(checkpoint), batch, steps, prompt_len, max_tokens, rounds)
                result = on_ranks(size, _run, *args)[0] if size > 1 else _run(TensorParallel(), *args)
                report[f"tp{size}_batch{batch}"] = result
    return report
