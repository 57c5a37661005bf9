"""``dllm-serve bench d2f``: D2F's pipelined decoding against plain block decoding, on the
same checkpoint, engine and rule.

*Plain* is the ``d2f`` rule with ``block_add_threshold: 1``: a block joins only once the
one before it is decoded, so a row decodes one block at a time (each step fills the masked
positions above ``skip_threshold``, or the most confident one). *D2F* is the same rule with
the thresholds given: blocks join early and decode together. Two checkpoints:

* ``tiny``: the shipped trained tiny model (block-causal), its held-out Sudoku requests;
  its confident tokens make the thresholds bite, and its accuracy is reported (it was not
  trained to see half-decoded blocks before it, as D2F's adapter is);
* ``random``: a random LLaDA (``--d-model``, ``--layers``) served as D2F's LLaDA is
  (block-causal, the prompt one block): flat random distributions pass no threshold, so
  only the forced picks of complete blocks fill: D2F's overlap is ``decoded_token_threshold``'s.

Per batch size (one closed batch, both settings in alternating order for ``rounds``
rounds, medians): forwards per request (its steps), tokens per forward (a request's
tokens over its forwards) and throughput (every answer's tokens over the batch's seconds).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from replicas.engine import Engine, EngineConfig
from replicas.messages import SamplingParams
from replicas.models import load_model, load_tokenizer
from replicas.tiny import task
from tools.bench.canvas import IdsOnly, random_llada
from tools.bench.device import BenchDevice
from tools.bench.evaluation import score

SETTINGS = ("plain", "d2f")


def _run(engine: Engine, prompts: list, params: SamplingParams) -> tuple[list, float]:
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    return outputs, time.perf_counter() - start


def _figures(outputs: list, seconds: float) -> dict:
    tokens = sum(o.completion_tokens for o in outputs)
    return {"forwards_per_request": statistics.mean(o.steps for o in outputs),
            "tokens_per_forward": tokens / sum(o.steps for o in outputs), "tokens_per_s": tokens / seconds}


def _compare(engine_for, prompts: list, params: dict[str, SamplingParams], batch_sizes, rounds: int,
             graded=None) -> dict:
    report = {}
    for batch in batch_sizes:
        engine = engine_for(batch)
        engine.generate(prompts[:1], params["plain"])  # warm-up
        runs = {setting: [] for setting in SETTINGS}
        for r in range(rounds):
            for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                outputs, seconds = _run(engine, prompts, params[setting])
                runs[setting].append((_figures(outputs, seconds), outputs))
        entry = {}
        for setting, done in runs.items():
            figures = {key: round(statistics.median(f[key] for f, _ in done), 3) for key in done[0][0]}
            if graded is not None:
                figures["request_accuracy"] = round(graded(done[0][1]), 3)
            entry[setting] = figures
        entry["d2f_over_plain_tokens_per_s"] = round(statistics.median(
            d[0]["tokens_per_s"] / p[0]["tokens_per_s"] for p, d in zip(runs["plain"], runs["d2f"])), 3)
        report[f"batch_{batch}"] = entry
    return report


def bench_d2f(batch_sizes=(1, 16), rounds: int = 3, requests: int = 32, thresholds: dict | None = None,
              checkpoints=("tiny", "random"), d_model: int = 512, layers: int = 8, block_length: int = 32,
              max_tokens: int = 128, device: str = "cpu", dtype: str | None = None) -> dict:
    place = BenchDevice(device, dtype)
    thresholds = {"block_add_threshold": 0.1, "decoded_token_threshold": 0.5, "skip_threshold": 0.9,
                  **(thresholds or {})}
    report = {"thresholds": thresholds, "rounds": rounds, **place.report()}

    def params(max_tokens: int, ignore_eos: bool) -> dict[str, SamplingParams]:
        plain = {**thresholds, "block_add_threshold": 1.0}
        return {setting: SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, algorithm="d2f",
                                        algorithm_params=values)
                for setting, values in (("plain", plain), ("d2f", thresholds))}

    if "tiny" in checkpoints:
        net, tokenizer = load_model("tiny"), load_tokenizer("tiny")
        held_out = list(task.heldout_requests()[:requests])
        report["tiny"] = _compare(lambda batch: Engine(net, tokenizer, EngineConfig(max_batch=batch, device=device,
                                                                                   dtype=dtype)),
                                  [r.prompt for r in held_out], params(task.MAX_TOKENS, False), batch_sizes, rounds,
                                  graded=lambda outputs: score(held_out, outputs)["request_accuracy"])
    if "random" in checkpoints:
        net = random_llada(d_model=d_model, layers=layers, heads=max(1, d_model // 64), mlp=int(d_model * 2.75),
                           vocab=32000, device=device, dtype=place.torch_dtype)
        net.spec = dataclasses.replace(net.spec, attention="block_causal_whole_prompt", block_length=block_length)
        prompts = [[1 + (i * 37 + r * 101) % 30000 for i in range(64)] for r in range(requests)]
        report["random"] = _compare(
            lambda batch: Engine(net, IdsOnly(), place.engine_config(net.spec, max_batch=batch, fdfo_fill_hold=False,
                                                                     max_model_len=512)),
            prompts, params(max_tokens, True), batch_sizes, rounds)
    return report
