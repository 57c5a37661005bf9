"""`bench engine` and `bench forward` on a device: --device and --dtype on the command line,
the refusal of a device this machine lacks, and on the CPU the path a CUDA run takes (the
models built on the device in bfloat16, the engine's forwards paced by a larger model)."""

import json
import subprocess
import sys

import pytest
import torch

from tools.cli import main
from tools.bench.engine import bench_engine
from tools.bench.forward import ARCHITECTURES, bench_forward
from tools.bench.prefix import random_sdar

PACER = dict(hidden=64, layers=2, heads=4, vocab=1000)
SMALL = {"llada": dict(d_model=64, layers=2, heads=4, mlp=176), "sdar": dict(hidden=64, layers=2, heads=4, vocab=1000)}
ENGINE_REPORT = {  # what the report held before it said where it ran
    "workload", "requests", "max_batch", "rounds", "accuracy", "tokens_per_forward", "forwards_per_block_histogram",
    *(f"{label}_{what}" for label in ("fdfo", "sync", "static", "fdfo_separate_kv_write")
      for what in ("tokens_per_s", "seconds", "steps")),
    "compute_ratio", "overhead_ms_per_step_p50", "forward_ms_per_step_p50", "overhead_ms_per_step_p50_at_full_batch",
    "replayed_host_ms_per_step_p50_at_full_batch", "fused_commit_speedup", "fused_commit_speedup_spread",
    "forward_cost_fit_ms", "efficiency_vs_ideal", "fdfo_over_sync", "fdfo_over_sync_spread", "ideal_fdfo_over_sync",
    "fdfo_over_static", "fdfo_over_static_spread", "ideal_fdfo_over_static"}
WHERE = {"device": "cpu", "device_name": "cpu", "dtype": "float32"}
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_the_benches_import_neither_the_cluster_nor_ray():
    """A GPU machine without the server's packages imports and calls them."""
    code = ("import sys\nimport tools.bench.engine, tools.bench.forward\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'fastapi', 'httpx', 'cluster'}))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


@no_cuda
@pytest.mark.parametrize("bench", ["engine", "forward"])
def test_device_cuda_without_cuda_is_a_message_and_a_non_zero_exit(bench, capsys):
    assert main(["bench", bench, "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("dllm-serve: error: --device cuda: no CUDA device is available here")
    assert "Traceback" not in captured.err and captured.out == ""
    with pytest.raises(ValueError, match="no CUDA device"):
        {"engine": bench_engine, "forward": bench_forward}[bench](device="cuda")


@pytest.mark.bench
def test_bench_engine_on_the_cpu_device_reports_as_before(capsys):
    assert main(["bench", "engine", "--device", "cpu", "--requests", "8", "--max-batch", "4", "--rounds", "1",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == ENGINE_REPORT | set(WHERE) | {"token_hash"}  # each mode's, to compare tokens across changes
    assert {key: report[key] for key in WHERE} == WHERE and report["fdfo_tokens_per_s"] > 0


@pytest.mark.bench
def test_a_paced_bench_engine_makes_the_models_steps_at_the_pacers_cost():
    """The CUDA run's path on the CPU (bfloat16, paced by a random SDAR): every mode makes
    the steps and tokens of the model's own run."""
    own = bench_engine("tiny", num_requests=12, max_batch=4, rounds=1, dtype="bfloat16")
    paced = bench_engine("tiny", num_requests=12, max_batch=4, rounds=1, dtype="bfloat16", paced_by=PACER)
    assert paced["dtype"] == own["dtype"] == "bfloat16" and "paced_by" not in own
    assert paced["paced_by"] == {**PACER, "parameters": paced["paced_by"]["parameters"]}
    assert paced["paced_by"]["parameters"] > 64 * 1000  # the embedding alone
    for key in ("accuracy", "tokens_per_forward", "forwards_per_block_histogram", "fdfo_steps", "sync_steps",
                "static_steps", "fdfo_separate_kv_write_steps"):
        assert paced[key] == own[key], key
    assert paced["replayed_host_ms_per_step_p50_at_full_batch"] > 0 and 0 < paced["compute_ratio"] <= 1


@pytest.mark.bench
def test_bench_forward_runs_in_bfloat16_on_the_cpu_device(capsys):
    report = bench_forward(batch_sizes=(2,), prompt_len=32, max_tokens=64, steps=2, rounds=1, device="cpu",
                           dtype="bfloat16", **SMALL)
    assert {key: report[key] for key in WHERE} == {**WHERE, "dtype": "bfloat16"}
    for name in ARCHITECTURES:
        assert report[name]["batch_2"]["forwards"] == 2 * 2 and report[name]["batch_2"]["reference_ms_per_forward"] > 0
    assert main(["bench", "forward", "--architectures", "sdar", "--batch-sizes", "1", "--d-model", "64", "--layers",
                 "1", "--heads", "2", "--vocab", "500", "--max-tokens", "32", "--prompt-len", "8", "--rounds", "1",
                 "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {key: report[key] for key in WHERE} == WHERE
    shaped = random_sdar(hidden=64, layers=1, heads=2, vocab=500)  # --heads and --vocab reached the model
    assert report["sdar"]["parameters"] == sum(p.numel() for p in shaped.parameters())
