"""GPU checks: the flash-attention backend against SDPA, and engine step timings of a
1B-class random model at batch 1/8/16/32 (forward, host overhead, compute ratio). The GPU
checks are skipped without CUDA; the timing report's code also runs on a small CPU model.

    python tests/gpu/check_cuda.py      # prints a JSON report
    python -m pytest tests/gpu -q       # the same checks as tests
"""

import json
import statistics
import sys
import time

import pytest
import torch

from replicas.attention import BatchLayout, flash_available, paged_context
from tools.bench.canvas import IdsOnly
from replicas.engine import Engine, EngineConfig
from replicas.models.sdar import SDARForCausalLM
from replicas.models.transformer import QwenStyleConfig
from replicas.messages import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PAGE = 32
BATCH_SIZES = (1, 8, 16, 32)


def random_layout(units_per_row=(3, 1, 5, 2), pages=64, generator=None):
    """Rows whose last unit is a whole block and earlier units full or partial pages."""
    unit_start, cache_positions, key_cache_positions, key_valid = [0], [], [], []
    free = torch.randperm(pages - 1, generator=generator) + 1
    width = max(units_per_row) * PAGE
    for row, units in enumerate(units_per_row):
        row_pages = free[:units].tolist()
        free = free[units:]
        for u in range(units):
            count = PAGE if u == units - 1 else int(torch.randint(1, PAGE + 1, (1,), generator=generator))
            unit_start.append(unit_start[-1] + count)
            cache_positions += [row_pages[u] * PAGE + o for o in range(count)]
            row_positions = [p * PAGE + o for p in row_pages for o in range(PAGE)]
            key_cache_positions.append(row_positions + [0] * (width - len(row_positions)))
            key_valid.append([i < (u + 1) * PAGE for i in range(width)])
    return BatchLayout(torch.tensor(unit_start), torch.tensor(cache_positions), torch.tensor(key_cache_positions),
                       torch.tensor(key_valid))


def compare_backends(heads=16, kv_heads=4, dim=128, dtype=torch.bfloat16) -> float:
    generator = torch.Generator().manual_seed(0)
    layout = random_layout(generator=generator)
    tokens, pages = int(layout.span_start[-1]), 64
    k_cache = [torch.randn(pages * PAGE, kv_heads, dim, dtype=dtype, device="cuda")]
    v_cache = [torch.randn(pages * PAGE, kv_heads, dim, dtype=dtype, device="cuda")]
    q = torch.randn(tokens, heads, dim, dtype=dtype, device="cuda")
    k = torch.randn(tokens, kv_heads, dim, dtype=dtype, device="cuda")
    v = torch.randn(tokens, kv_heads, dim, dtype=dtype, device="cuda")
    sdpa = paged_context("sdpa", layout, k_cache, v_cache, PAGE).attend(0, q, k, v)
    flash = paged_context("flash", layout, k_cache, v_cache, PAGE).attend(0, q, k, v)
    return float((sdpa.float() - flash.float()).abs().max())


def sdar_model(device: str, hidden: int = 2048, layers: int = 28, heads: int = 16, kv_heads: int = 8,
               intermediate: int = 6144, head_dim: int = 128) -> SDARForCausalLM:
    """Random weights in SDAR's format; the defaults are Qwen3-1.7B's shape (SDAR-1.7B)."""
    config = QwenStyleConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim, rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=True,
                             architectures=("SDARForCausalLM",))
    with torch.device(device):
        return SDARForCausalLM(config)


def time_steps(net, device: str, backend: str = "auto", batch_sizes=BATCH_SIZES, prompt_len: int = 256,
               blocks: int = 5) -> dict:
    """Engine steps at each batch size (every request a ``prompt_len`` prompt and ``blocks``
    blocks of 4 forwards, all submitted at once): medians of the forward of the steps that
    only denoise (every row on its active block, nothing else), of every step's forward,
    host overhead (step minus forward) and step, and the compute ratio (forward / step time)."""
    results = {}
    for batch in (batch_sizes[0], *batch_sizes):  # the first run warms up (kernels, allocator)
        engine = Engine(net, IdsOnly(), EngineConfig(
            device=device, max_batch=batch, attention_backend=backend, max_model_len=1024, fdfo_fill_hold=False,
            algorithm="fixed_steps", algorithm_params={"steps": 4}))
        params = SamplingParams(max_tokens=blocks * engine.block_length, ignore_eos=True)
        for r in range(batch):
            engine.add_request([100 + (i * 31 + r) % 5000 for i in range(prompt_len)], params)
        steps = []
        while engine.has_work():
            stats = engine.step()
            if stats is not None:
                steps.append(stats)
        denoise = [s.forward_s for s in steps if s.num_tokens == batch * engine.block_length] or [0.0]
        results[batch] = {
            "denoise_forward_ms_p50": round(1e3 * statistics.median(denoise), 3),
            "forward_ms_p50": round(1e3 * statistics.median(s.forward_s for s in steps), 3),
            "host_overhead_ms_p50": round(1e3 * statistics.median(s.overhead_s for s in steps), 3),
            "step_ms_p50": round(1e3 * statistics.median(s.step_s for s in steps), 3),
            "compute_ratio": round(sum(s.forward_s for s in steps) / sum(s.step_s for s in steps), 3),
            "steps": len(steps),
        }
    return results


@needs_cuda
@pytest.mark.skipif(not flash_available(), reason="needs vllm-flash-attn")
def test_flash_matches_sdpa():
    assert compare_backends() < 2e-2


@needs_cuda
def test_one_b_step_timings():
    timings = time_steps(sdar_model("cuda").to(torch.bfloat16), "cuda")
    assert set(timings) == set(BATCH_SIZES) and all(t["steps"] > 0 for t in timings.values())


def test_step_timing_report_runs_on_cpu():
    """The report the GPU run prints, from a small model on the CPU."""
    net = sdar_model("cpu", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, head_dim=16)
    timings = time_steps(net, "cpu", batch_sizes=(1, 4), prompt_len=20, blocks=2)
    assert set(timings) == {1, 4}
    for t in timings.values():
        assert t["steps"] >= 2 * 4 and 0 < t["compute_ratio"] <= 1
        assert 0 < t["forward_ms_p50"] <= t["step_ms_p50"] and t["host_overhead_ms_p50"] > 0
        assert t["denoise_forward_ms_p50"] > 0


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    report = {"device": torch.cuda.get_device_name(), "flash_available": flash_available()}
    if flash_available():
        report["flash_vs_sdpa_max_abs_diff"] = compare_backends()
    started = time.perf_counter()
    net = sdar_model("cuda").to(torch.bfloat16)
    for backend in ("sdpa", "flash") if flash_available() else ("sdpa",):
        report[f"steps_{backend}"] = time_steps(net, "cuda", backend)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
