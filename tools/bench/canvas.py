"""``dllm-serve bench canvas``: the full canvas (dual cache) against the block canvas on a
random LLaDA, side by side at each batch size.

Random weights in LLaDA's architecture (the default shape is 1B-class: d_model 2048, 16
layers, LLaDA's vocabulary of 126464): what is measured is the work of each canvas, not
the answers. Every request has the same prompt length and answer length and runs
``fixed_steps``, so both canvases take the same number of forwards and differ only in what
each forward computes (a refresh over the whole canvas vs up to the active block). After a
warm-up, the two canvases run in alternating order for ``rounds`` rounds; each ratio is the
median of its rounds.
"""

from __future__ import annotations

import statistics
import time

import torch

from tools.bench.device import built_on
from replicas.engine import Engine, EngineConfig
from replicas.messages import SamplingParams
from replicas.models.llada import LLaDAConfig, LLaDAModelLM

LLADA_MASK_ID, LLADA_EOS_ID, LLADA_VOCAB = 126336, 126081, 126464


class IdsOnly:
    """A tokenizer stand-in for random weights: their ids decode to nothing worth reading."""

    def decode(self, ids, **kwargs) -> str:
        return ""


def random_llada(d_model: int = 2048, layers: int = 16, heads: int = 16, mlp: int = 5632,
                 vocab: int = LLADA_VOCAB, seed: int = 0, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> LLaDAModelLM:
    """A random LLaDA; a vocabulary smaller than LLaDA's has its mask and end ids at its top."""
    torch.manual_seed(seed)
    mask_id, eos_id = (LLADA_MASK_ID, LLADA_EOS_ID) if vocab > LLADA_MASK_ID else (vocab - 1, vocab - 2)
    config = LLaDAConfig(d_model=d_model, n_heads=heads, n_layers=layers, mlp_hidden_size=mlp, vocab_size=vocab,
                         max_sequence_length=4096, mask_token_id=mask_id, eos_token_id=eos_id)
    return built_on(device, dtype, lambda: LLaDAModelLM(config))


def run_canvas(net, canvas: str, batch: int, prompt_len: int, max_tokens: int, steps: int) -> dict:
    engine = Engine(net, IdsOnly(), EngineConfig(
        max_batch=batch, canvas=canvas, fdfo_fill_hold=False, max_model_len=prompt_len + max_tokens + 64,
        algorithm="fixed_steps", algorithm_params={"steps": steps}))
    prompts = [[1000 + (i * 37 + r * 101) % 90000 for i in range(prompt_len)] for r in range(batch)]
    steps_run = []
    start = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              on_step=steps_run.append)
    seconds = time.perf_counter() - start
    tokens = sum(o.completion_tokens for o in outputs)
    return {"seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2), "steps": len(steps_run)}


def bench_canvas(batch_sizes=(1, 16), prompt_len: int = 64, max_tokens: int = 128, steps: int = 8,
                 rounds: int = 2, **shape) -> dict:
    net = random_llada(**shape)
    params = sum(p.numel() for p in net.parameters())
    report = {"parameters": params, "prompt_len": prompt_len, "max_tokens": max_tokens, "steps_per_block": steps,
              "rounds": rounds}
    for canvas in ("block", "full"):  # warm-up: allocator, weights paged in
        run_canvas(net, canvas, 1, prompt_len, net.spec.block_length, steps)
    for batch in batch_sizes:
        runs = {"block": [], "full": []}
        for r in range(rounds):
            for canvas in ("block", "full") if r % 2 == 0 else ("full", "block"):
                runs[canvas].append(run_canvas(net, canvas, batch, prompt_len, max_tokens, steps))
        ratios = [f["tokens_per_s"] / b["tokens_per_s"] for b, f in zip(runs["block"], runs["full"])]
        report[f"batch_{batch}"] = {
            **{canvas: {"tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in done), 2),
                        "steps": done[0]["steps"]} for canvas, done in runs.items()},
            "full_over_block": round(statistics.median(ratios), 3),
            "full_over_block_spread": round(max(ratios) - min(ratios), 3)}
    return report
