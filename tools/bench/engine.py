"""`dllm-serve bench engine`: fdfo vs sync vs static, side by side on one closed workload,
interleaved in rounds, each measured against its own zero-overhead ideal."""

from __future__ import annotations

import gc
import hashlib
import statistics
import time
from collections.abc import Callable

import numpy as np
from torch import nn

from tools.bench.closed_batch_model import ClosedRequest, closed_batch_seconds
from tools.bench.device import BenchDevice, synchronize
from tools.bench.evaluation import score, tiny_params
from tools.bench.prefix import random_sdar
from tools.bench.replayed_forward import PacedReplay, RecordedForward, ReplayDiverged
from replicas.cost_model import fit_step_cost
from replicas.engine import Engine, EngineConfig
from replicas.gc_freeze import settle_after_start_up
from replicas.models import load_model, load_tokenizer
from replicas.tiny import task

BENCH_SEED = 7
BENCH_MODES = ("fdfo", "sync", "static")
SEPARATE_KV = "fdfo_separate_kv_write"  # fdfo with one more forward per block to write its KV
# blank-count weights (0..12 blanks) per workload: "hard" has 8 to 12 blanks a puzzle
WORKLOADS = {"default": None, "hard": np.array([0] * 8 + [1] * 5, dtype=float)}
REPLAYS = 3  # replays of the recorded fdfo run (``replayed_host_ms_per_step_p50_at_full_batch``)


def run_closed_batch(engine: Engine, prompts: list, params) -> tuple[list, list, float]:
    """Submit everything at once, step until done; returns outputs, step stats, wall seconds.
    An earlier run's engine is cyclic garbage: it is collected before the clock starts, not
    in the middle of this run. The clock starts and stops with the device idle (on CUDA,
    the engine's set-up, e.g. its pool's zeros, is queued work)."""
    steps = []
    gc.collect()
    synchronize(engine.config.device)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, on_step=steps.append)
    synchronize(engine.config.device)
    return outputs, steps, time.perf_counter() - start


def token_hash(outputs: list) -> str:
    """The first 16 hex digits of a SHA-256 over every request's committed token ids, in
    order: equal hashes mean a change to the engine left its tokens alone."""
    digest = hashlib.sha256()
    for output in outputs:
        digest.update(np.asarray(output.token_ids, dtype=np.int64).tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]


def tokens_per_row_forward(output_tokens: int, steps) -> float:
    """Committed tokens per row-forward (rows in a forward, idle rows included), rounded."""
    return round(output_tokens / sum(s.batch_size for s in steps), 3)


def fit_forward_cost(steps) -> tuple[float, float]:
    """``(c0, c1)`` of ``forward seconds = c0 + c1 * tokens`` over step stats, both >= 0."""
    return fit_step_cost((s.num_tokens, s.forward_s) for s in steps)


def bench_engine(model: str = "tiny", num_requests: int = 256, max_batch: int = 16, rounds: int = 3,
                 workload: str = "default", on_fdfo_run: Callable[[list, list], None] | None = None,
                 device: str = "cpu", dtype: str | None = None, paced_by: dict | None = None) -> dict:
    """Tokens per second of each mode on the same heterogeneous tiny-task workload.

    The default workload mixes 1 to 6 puzzles per request with 0 to 12 blanks per puzzle,
    so requests end at different blocks and blocks take different numbers of steps;
    ``hard`` has 8 to 12 blanks a puzzle. The configurations run interleaved, ``rounds``
    times (fdfo, sync, static, fdfo with a separate KV-write forward per block, fdfo, ...),
    and each ratio is the median of its per-round values, reported with their spread
    (max - min): a machine whose speed drifts during the run moves a whole round alike.
    A closed batch has no arrivals to wait for, so fdfo does not hold steps for them.
    Once the model is loaded the process's heap is settled as a serving replica's is
    (``replicas.gc_freeze``: a process-wide ``gc.freeze``), so no full collection lands in a run.

    The engine gets the prompts as token ids, as a replica gets them from the ingress.
    ``compute_ratio``: fdfo's forward seconds over its wall seconds (median over rounds).

    ``replayed_host_ms_per_step_p50_at_full_batch``: fdfo's host time per step at full
    batch when its recorded logits are replayed instead of running the forward
    (``tools.bench.replayed_forward``): the host time with the forward off the host's
    cores and caches, as on an accelerator (median of ``REPLAYS`` replays).

    ``token_hash``: each mode's committed tokens (``token_hash``), to compare across changes.

    ``tokens_per_forward``: committed tokens per row-forward (rows in a forward, idle rows
    included). ``ideal_fdfo_over_*``: the ratio with zero host overhead, from each mode's
    own measured steps per block (``tools.bench.closed_batch_model``) and a forward cost
    ``c0 + c1 * tokens`` fitted to the run's forwards; ``efficiency_vs_ideal``: measured /
    ideal. ``on_fdfo_run(step_stats, outputs)`` receives the first fdfo run (e.g. to fit
    a calibration).

    The engine runs on ``device`` in ``dtype`` (None: bfloat16 on CUDA, float32 on a CPU),
    with the KV pool ``max_batch`` requests of the model's length need on any device.
    ``paced_by``: ``random_sdar``'s shape (e.g. ``hidden=2048, layers=28, heads=16,
    vocab=151936``: SDAR-1.7B's) for a random model whose forward runs in the model's place
    (``PacedReplay``): each configuration's run is recorded once with the model, then every
    timed run replays it paced by that forward, so the modes make the model's steps and
    tokens (its accuracy and histograms) at a model of that size's cost.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {sorted(WORKLOADS)}")
    place = BenchDevice(device, dtype)
    requests = task.make_requests(num_requests, BENCH_SEED, blank_weights=WORKLOADS[workload])
    net, tokenizer = load_model(model, place.torch_dtype, device), load_tokenizer(model)
    pacer = None if paced_by is None else random_sdar(**paced_by, device=device, dtype=place.torch_dtype)
    settle_after_start_up()  # as a serving replica does: no full collection traverses start-up's objects
    params = tiny_params()
    configs = {mode: place.engine_config(net.spec, mode=mode, max_batch=max_batch, fdfo_fill_hold=False)
               for mode in BENCH_MODES}
    configs[SEPARATE_KV] = place.engine_config(net.spec, max_batch=max_batch, fdfo_fill_hold=False,
                                               fused_commit=False)
    warm_up = Engine(net, tokenizer, configs["fdfo"])
    # token ids, as a replica gets them from the ingress: tokenizing is not the engine's work
    prompts = warm_up.encode([r.prompt for r in requests])
    run_closed_batch(warm_up, prompts[:max_batch], params)
    recorded: dict[str, tuple[RecordedForward, list]] = {}  # paced: each configuration's recording and outputs
    if pacer is not None:  # the pacer's warm-up, then the recordings
        warm_up_recording, _ = _record(net, tokenizer, configs["fdfo"], prompts[:max_batch], params)
        run_closed_batch(Engine(PacedReplay(warm_up_recording, pacer), tokenizer, configs["fdfo"]), prompts[:max_batch],
                         params)
        recorded = {label: _record(net, tokenizer, config, prompts, params) for label, config in configs.items()}
    runs: dict[str, list[dict]] = {label: [] for label in configs}
    for round_index in range(rounds):
        for label, config in configs.items():
            runner = net if pacer is None else PacedReplay(recorded[label][0], pacer)
            outputs, steps, wall = run_closed_batch(Engine(runner, tokenizer, config), prompts, params)
            if pacer is not None:
                _check_replayed(outputs, recorded[label][1])
            if label == "fdfo" and round_index == 0 and on_fdfo_run is not None:
                on_fdfo_run(steps, outputs)
            runs[label].append({"outputs": outputs, "steps": steps, "wall": wall, **score(requests, outputs)})

    result: dict = {"workload": workload, "requests": num_requests, "max_batch": max_batch, "rounds": rounds,
                    "accuracy": {}, "token_hash": {}, "tokens_per_forward": {}, "forwards_per_block_histogram": {}, **place.report()}
    if pacer is not None:
        result["paced_by"] = {**paced_by, "parameters": sum(p.numel() for p in pacer.parameters())}
    for label, label_runs in runs.items():
        first = label_runs[0]
        result[f"{label}_tokens_per_s"] = round(statistics.median(_tokens_per_s(r) for r in label_runs), 1)
        result[f"{label}_seconds"] = round(statistics.median(r["wall"] for r in label_runs), 2)
        result[f"{label}_steps"] = len(first["steps"])
        result["accuracy"][label] = round(first["request_accuracy"], 4)
        result["token_hash"][label] = token_hash(first["outputs"])
        result["tokens_per_forward"][label] = tokens_per_row_forward(first["output_tokens"], first["steps"])
        result["forwards_per_block_histogram"][label] = first["steps_per_block_histogram"]
    fdfo = runs["fdfo"]
    steps = [s for r in fdfo for s in r["steps"]]
    result["compute_ratio"] = round(statistics.median(sum(s.forward_s for s in r["steps"]) / r["wall"] for r in fdfo), 3)
    result["overhead_ms_per_step_p50"] = round(statistics.median(s.overhead_s for s in steps) * 1e3, 3)
    result["forward_ms_per_step_p50"] = round(statistics.median(s.forward_s for s in steps) * 1e3, 3)
    result["overhead_ms_per_step_p50_at_full_batch"] = round(statistics.median(
        [s.overhead_s for s in steps if s.batch_size == max_batch] or [0.0]) * 1e3, 3)
    recording, recorded_outputs = recorded.get("fdfo") or _record(net, tokenizer, configs["fdfo"], prompts, params)
    replayed = recording if pacer is None else PacedReplay(recording, pacer, run_pacer=False)
    result["replayed_host_ms_per_step_p50_at_full_batch"] = round(
        _replayed_host_s(replayed, recording, recorded_outputs, tokenizer, configs["fdfo"], prompts, params) * 1e3, 3)
    result["fused_commit_speedup"], result["fused_commit_speedup_spread"] = _median_ratio(fdfo, runs[SEPARATE_KV])

    c0, c1 = fit_forward_cost([s for label_runs in runs.values() for s in label_runs[0]["steps"]])
    result["forward_cost_fit_ms"] = {"c0": round(c0 * 1e3, 3), "c1_per_token": round(c1 * 1e3, 5)}
    block_length = net.spec.block_length
    ideal_tokens_per_s = {
        mode: runs[mode][0]["output_tokens"] / closed_batch_seconds(
            mode, max_batch, [ClosedRequest(o.prompt_tokens, o.block_steps) for o in runs[mode][0]["outputs"]],
            block_length, c0, c1)
        for mode in BENCH_MODES}
    result["efficiency_vs_ideal"] = {}
    for baseline in ("sync", "static"):
        ratio, spread = _median_ratio(fdfo, runs[baseline])
        ideal = ideal_tokens_per_s["fdfo"] / ideal_tokens_per_s[baseline]
        result[f"fdfo_over_{baseline}"], result[f"fdfo_over_{baseline}_spread"] = ratio, spread
        result[f"ideal_fdfo_over_{baseline}"] = round(ideal, 2)
        result["efficiency_vs_ideal"][f"fdfo_over_{baseline}"] = round(ratio / ideal, 3)
    return result


def _record(net: nn.Module, tokenizer, config: EngineConfig, prompts: list, params) -> tuple[RecordedForward, list]:
    """A recording of ``net``'s run of ``prompts`` under ``config``, and the run's outputs."""
    recording = RecordedForward(net)
    outputs, _, _ = run_closed_batch(Engine(recording, tokenizer, config), prompts, params)
    return recording, outputs


def _check_replayed(replayed: list, recorded: list) -> None:
    if [o.token_ids for o in replayed] != [o.token_ids for o in recorded]:
        raise ReplayDiverged("a replay committed other tokens than the recorded run")


def _replayed_host_s(replayed: nn.Module, recording: RecordedForward, recorded: list, tokenizer,
                     config: EngineConfig, prompts: list, params) -> float:
    """Median over ``REPLAYS`` runs of ``replayed`` (a replay of ``recording``, whose run gave
    ``recorded``) of their steps' host time (step less forward) at full batch; raises
    ``ReplayDiverged`` unless each replay gives the recorded run's tokens."""
    host = []
    for _ in range(REPLAYS):
        recording.replay()
        outputs, steps, _ = run_closed_batch(Engine(replayed, tokenizer, config), prompts, params)
        _check_replayed(outputs, recorded)
        host.append(statistics.median([s.overhead_s for s in steps if s.batch_size == config.max_batch] or [0.0]))
    return statistics.median(host)


def _tokens_per_s(run: dict) -> float:
    return run["output_tokens"] / run["wall"]


def _median_ratio(runs: list[dict], baselines: list[dict]) -> tuple[float, float]:
    """Median and spread (max - min) of the per-round tokens/s ratios."""
    ratios = [_tokens_per_s(run) / _tokens_per_s(base) for run, base in zip(runs, baselines)]
    return round(statistics.median(ratios), 2), round(max(ratios) - min(ratios), 2)
