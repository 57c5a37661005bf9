"""Everything this project checks on a GPU, in one command from a clone's root (under 10
minutes on one H200; nothing to install beyond torch, transformers, safetensors, tokenizers,
numpy, pydantic and pytest):

    python tests/gpu/run_all.py [--out DIR] [--only serve,bench]   # on CUDA
    python tests/gpu/run_all.py --dry-run                           # the same steps on the CPU, tiny shapes

1. ``tests`` — the CUDA tests (``tests/gpu/check_cuda.py`` under pytest).
2. ``serve`` — a random checkpoint of each architecture with a published 1B-class shape
   (SDAR-1.7B's exactly; LLaDA, Dream and LLaDA2.0-MoE cut to 1-2 B) written in its on-disk
   format, loaded by the engine with its KV pool sized from memory (``memory_utilization``'s
   default, 0.9) and ``max_batch`` 64, then a closed batch of 64 requests and one long prompt:
   the pool (pages, GiB, max_model_len, the profiled step's peak), load and warm-up seconds,
   tokens/s, compute ratio, host time per step, and the device's peak memory against the budget.
3. ``steps`` — engine step timings of SDAR-1.7B at batch 1/8/16/32 (``check_cuda.time_steps``).
4. ``bench`` — ``bench forward``, ``bench engine`` and ``bench d2f`` on the device.

Prints one table at the end; each section's figures also go to ``DIR/report.json`` as soon
as they are measured (a run cut short keeps what it had). A section that fails is reported
with its error and the others still run; the exit status is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "replicas" / "models"), str(ROOT / "tests" / "gpu")]

import torch  # noqa: E402

from checkpoint_builders import SDAR_1_7B, TINY, Dims, write_checkpoint  # noqa: E402
from replicas.engine import Engine, EngineConfig  # noqa: E402
from replicas.messages import SamplingParams  # noqa: E402

# 1B-class shapes with each family's ids and context length
LLADA_1B = Dims(vocab=126464, hidden=2048, heads=16, kv_heads=16, head_dim=128, ffn=5632, layers=16,
                max_positions=4096, mask_id=126336, eos_id=126081, pad_id=126337, weight_scale=0.02)
DREAM_1_5B = Dims(vocab=151936, hidden=1536, heads=12, kv_heads=2, head_dim=128, ffn=8960, layers=28,
                  max_positions=131072, mask_id=151666, eos_id=151643, pad_id=151665, weight_scale=0.02)
LLADA2_MOE_1B = Dims(vocab=157184, hidden=2048, heads=16, kv_heads=4, head_dim=128, ffn=5120, layers=8,
                     experts=32, expert_ffn=512, max_positions=32768, mask_id=156895, eos_id=156892,
                     pad_id=156893, weight_scale=0.02)
SHAPES = {"SDARForCausalLM": SDAR_1_7B, "LLaDAModelLM": LLADA_1B, "DreamModel": DREAM_1_5B,
          "LLaDA2MoeModelLM": LLADA2_MOE_1B}
BLOCK_CAUSAL = ("SDARForCausalLM", "LLaDA2MoeModelLM")  # their configs carry no mask id
SECTIONS = ("tests", "serve", "steps", "bench")
GiB = float(1 << 30)


class Run:
    """The device, the shapes, and the report written as it grows."""

    def __init__(self, dry: bool, out: Path, architectures: list[str]):
        self.dry = dry
        self.architectures = architectures
        self.device = "cpu" if dry else "cuda"
        self.out = out
        self.report: dict = {"device": "cpu (dry run)" if dry else torch.cuda.get_device_name(),
                             "torch": torch.__version__, "sections": {}}
        if not dry:
            self.report["device_memory_gib"] = round(torch.cuda.mem_get_info()[1] / GiB, 1)
        out.mkdir(parents=True, exist_ok=True)

    def record(self, section: str, key: str, value) -> None:
        self.report["sections"].setdefault(section, {})[key] = value
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2, default=str))
        print(f"[{section}] {key}: {json.dumps(value, default=str)}", flush=True)

    def free(self) -> None:
        gc.collect()
        if not self.dry:
            torch.cuda.empty_cache()


# ---- 1. the CUDA tests -----------------------------------------------------------------------
def run_tests(run: Run) -> None:
    command = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "gpu" / "check_cuda.py"), "-q", "--noconftest",
               "-o", "addopts=", "-p", "no:cacheprovider", "-k", "not one_b_step_timings"]  # section 3 times it
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    run.record("tests", "pytest", {"exit": done.returncode, "summary": done.stdout.strip().splitlines()[-1:]})
    if done.returncode not in (0, 5):
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])


# ---- 2. serving random checkpoints with the pool sized from memory ----------------------------
TEXT = "The quick brown fox jumps over the lazy dog; 0123456789. "


def prompt(length: int) -> str:
    """A text prompt of ``length`` tokens (the checkpoints' tokenizers read a character a token)."""
    return (TEXT * (1 + length // len(TEXT)))[:length]


def serve_checkpoint(run: Run, arch: str, folder: Path) -> dict:
    dims = TINY if run.dry else SHAPES[arch]
    rows = 8 if run.dry else 64
    started = time.perf_counter()
    path = write_checkpoint(folder / arch, arch, dims=dims, dtype=torch.float32 if run.dry else torch.bfloat16,
                            device=run.device)
    written = time.perf_counter() - started
    overrides = {"mask_token_id": dims.mask_id, "eos_token_id": dims.eos_id} if arch in BLOCK_CAUSAL else {}
    started = time.perf_counter()
    # a CPU (the dry run) sizes the pool by measuring too: the path CUDA takes by default
    engine = Engine.from_pretrained(str(path), EngineConfig(device=run.device, max_batch=rows, model_overrides=overrides,
                                                            memory_utilization=0.5 if run.dry else None))
    loaded = time.perf_counter() - started
    started = time.perf_counter()
    engine.warm_up()
    warmed = time.perf_counter() - started
    if not run.dry:
        torch.cuda.reset_peak_memory_stats()
    steps = []
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    started = time.perf_counter()
    longest = 64 if run.dry else 1000
    answers = engine.generate([prompt(16 + i * 97 % longest) for i in range(rows)], params, on_step=steps.append)
    batch_s = time.perf_counter() - started
    room = engine.shape.max_model_len - params.max_tokens - 2 * engine.block_length
    started = time.perf_counter()
    [long_answer] = engine.generate([prompt(min(room, 400 if run.dry else 16000))], params)
    long_s = time.perf_counter() - started
    memory = engine.memory
    figures = {
        "params_b": round(sum(p.numel() for p in engine.model.parameters()) / 1e9, 2),
        "write_s": round(written, 1), "load_s": round(loaded, 1), "warm_up_s": round(warmed, 1),
        "pool_pages": memory.num_pages, "pool_gib": round(memory.pool_bytes / GiB, 2),
        "page_kib": memory.page_bytes / 1024, "max_model_len": memory.max_model_len, "cut_from": memory.cut_from,
        "weights_gib": round(memory.weights_bytes / GiB, 2),
        "step_peak_gib": None if memory.step_peak_bytes is None else round(memory.step_peak_bytes / GiB, 2),
        "budget": memory.budget,
        "batch": rows, "tokens_per_s": round(sum(len(a.token_ids) for a in answers) / batch_s, 1),
        "steps": len(steps), "compute_ratio": round(sum(s.forward_s for s in steps) / sum(s.step_s for s in steps), 3),
        "host_ms_p50": round(1e3 * statistics.median(s.overhead_s for s in steps), 3),
        "forward_ms_p50": round(1e3 * statistics.median(s.forward_s for s in steps), 3),
        "finished": sorted({a.finish_reason for a in answers}),
        "long_prompt_tokens": long_answer.prompt_tokens, "long_prompt_s": round(long_s, 2),
        "long_finish": long_answer.finish_reason,
    }
    if not run.dry:
        total = torch.cuda.mem_get_info()[1]
        figures["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 1)
        figures["budget_gib"] = round(0.9 * total / GiB, 1)
    bad = [a.error for a in (*answers, long_answer) if a.error]
    if bad or figures["finished"] != ["length"]:
        raise RuntimeError(f"{arch}: answers ended {figures['finished']}: {bad[:2]}")
    del engine, answers
    run.free()
    return figures


def run_serve(run: Run) -> None:
    with tempfile.TemporaryDirectory(prefix="dllm-gpu-") as folder:
        failed = []
        for arch in run.architectures:
            try:
                run.record("serve", arch, serve_checkpoint(run, arch, Path(folder)))
            except Exception as exc:
                run.record("serve", arch, {"error": f"{type(exc).__name__}: {exc}"})
                traceback.print_exc()
                failed.append(arch)
                run.free()
            for leftover in Path(folder).glob(f"{arch}/*.safetensors"):
                leftover.unlink()
        if failed:
            raise RuntimeError(f"failed: {failed}")


# ---- 3. step timings ----------------------------------------------------------------------------
def run_steps(run: Run) -> None:
    import check_cuda

    if run.dry:
        net = check_cuda.sdar_model("cpu", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, head_dim=16)
        run.record("steps", "sdpa", check_cuda.time_steps(net, "cpu", batch_sizes=(1, 4), prompt_len=20, blocks=2))
        return
    net = check_cuda.sdar_model("cuda").to(torch.bfloat16)
    run.record("steps", "sdpa", check_cuda.time_steps(net, "cuda", "sdpa"))
    del net
    run.free()


# ---- 4. the benches -----------------------------------------------------------------------------
SDAR_BENCH = dict(hidden=2048, layers=28, heads=16, vocab=151936)  # SDAR-1.7B (random_sdar derives the rest)
LLADA_BENCH = dict(d_model=2048, layers=16, heads=16, mlp=5632)  # LLADA_1B's shape


def run_bench(run: Run) -> None:
    """``bench forward`` (project against reference forward, 1B-class LLaDA and SDAR),
    ``bench engine`` (fdfo / sync / static on the tiny task, each forward paced by
    SDAR-1.7B's, see ``tools.bench.engine``) and ``bench d2f`` (D2F's pipelined decoding
    against one block at a time, a 1B-class random LLaDA), on the device."""
    from tools.bench.d2f import bench_d2f
    from tools.bench.engine import bench_engine
    from tools.bench.forward import bench_forward

    if run.dry:
        run.record("bench", "forward", bench_forward(("llada", "sdar"), (1, 2), rounds=1, prompt_len=16, max_tokens=64,
                                                     llada=dict(d_model=64, layers=2, heads=4, mlp=128),
                                                     sdar=dict(hidden=64, layers=2, heads=4, vocab=512)))
        run.free()
        run.record("bench", "engine", bench_engine(num_requests=32, max_batch=8, rounds=1,
                                                   paced_by=dict(hidden=64, layers=2, heads=4, vocab=512)))
        run.record("bench", "d2f", bench_d2f((1, 4), rounds=1, requests=4, checkpoints=("random",), d_model=64,
                                             layers=1, block_length=8, max_tokens=32))
        return
    run.record("bench", "forward", bench_forward(("llada", "sdar"), (1, 8, 32), rounds=2, device="cuda",
                                                 llada=LLADA_BENCH, sdar=SDAR_BENCH))
    run.free()
    run.record("bench", "engine", bench_engine(max_batch=64, rounds=2, device="cuda", paced_by=SDAR_BENCH))
    run.free()
    run.record("bench", "d2f", bench_d2f((1, 32), rounds=1, requests=32, checkpoints=("random",),
                                         d_model=LLADA_BENCH["d_model"], layers=LLADA_BENCH["layers"], max_tokens=64,
                                         device="cuda"))
    run.free()


RUNNERS = {"tests": run_tests, "serve": run_serve, "steps": run_steps, "bench": run_bench}


def table(report: dict) -> str:
    """One line per figure: section, item, value."""
    lines = [f"device: {report['device']}  torch {report['torch']}"]
    for section, items in report["sections"].items():
        for item, value in items.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in value.items())
            lines.append(f"{section:<7} {item:<18} {value}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with tiny shapes")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-report")),
                        help="folder for report.json (default: $OUT, else ./gpu-report)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    parser.add_argument("--architectures", default=",".join(SHAPES),
                        help=f"the checkpoints section 'serve' writes and serves, of {','.join(SHAPES)}")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("run_all: no CUDA device (use --dry-run for the CPU)", file=sys.stderr)
        return 2
    run = Run(args.dry_run, args.out, args.architectures.split(","))
    failed = []
    for section in args.only.split(","):
        started = time.perf_counter()
        try:
            RUNNERS[section](run)
        except Exception as exc:
            failed.append(section)
            run.record(section, "error", f"{type(exc).__name__}: {exc}"[:3000])
            traceback.print_exc()
        run.record(section, "seconds", round(time.perf_counter() - started, 1))
    print(table(run.report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
