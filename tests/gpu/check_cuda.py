"""GPU checks: the flash-attention backend against SDPA, and forward timings of a
1B-class random model at batch 1/8/32. Skipped without CUDA.

    python tests/gpu/check_cuda.py      # prints a JSON report
    python -m pytest tests/gpu -q       # the same checks as tests
"""

import json
import sys
import time

import pytest
import torch

from replicas.attention import BatchLayout, flash_available, paged_context
from replicas.engine import Engine, EngineConfig
from replicas.models.sdar import SDARForCausalLM
from replicas.models.transformer import QwenStyleConfig
from replicas.request import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PAGE = 32


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
    tokens, pages = int(layout.unit_start[-1]), 64
    k_cache = [torch.randn(pages * PAGE, kv_heads, dim, dtype=dtype, device="cuda")]
    v_cache = [torch.randn(pages * PAGE, kv_heads, dim, dtype=dtype, device="cuda")]
    q = torch.randn(tokens, heads, dim, dtype=dtype, device="cuda")
    k = torch.randn(tokens, kv_heads, dim, dtype=dtype, device="cuda")
    v = torch.randn(tokens, kv_heads, dim, dtype=dtype, device="cuda")
    sdpa = paged_context("sdpa", layout, k_cache, v_cache, PAGE).attend(0, q, k, v)
    flash = paged_context("flash", layout, k_cache, v_cache, PAGE).attend(0, q, k, v)
    return float((sdpa.float() - flash.float()).abs().max())


class IdsOnly:
    """The engine decodes committed blocks; random weights have no text worth decoding."""

    def decode(self, ids, **kwargs) -> str:
        return ""


def one_b_model() -> SDARForCausalLM:
    """Qwen3-1.7B-like shape (SDAR-1.7B), random weights."""
    config = QwenStyleConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                             max_position_embeddings=4096, tie_word_embeddings=True, architectures=("SDARForCausalLM",))
    with torch.device("cuda"):
        net = SDARForCausalLM(config).to(torch.bfloat16)
    return net


def time_forwards(backend: str, batch_sizes=(1, 8, 32), prompt_len=256, steps=20) -> dict:
    """Median forward time of denoise-only steps (every row on its active block)."""
    net = one_b_model()
    results = {}
    for batch in batch_sizes:
        engine = Engine(net, IdsOnly(), EngineConfig(
            device="cuda", max_batch=batch, attention_backend=backend, max_model_len=1024,
            algorithm="fixed_steps", algorithm_params={"steps": 4}))
        prompts = [[100 + (i * 31 + r) % 5000 for i in range(prompt_len)] for r in range(batch)]
        params = SamplingParams(max_tokens=4 * steps, ignore_eos=True)
        forward_s = []
        for prompt in prompts:
            engine.add_request(prompt, params)
        while engine.has_work():
            stats = engine.step()
            if stats is not None and stats.num_tokens == batch * engine.block_length:
                forward_s.append(stats.forward_s)
        results[batch] = {"denoise_forward_ms_median": 1000 * sorted(forward_s)[len(forward_s) // 2],
                          "steps": len(forward_s)}
    return results


@pytest.mark.skipif(not flash_available(), reason="needs vllm-flash-attn")
def test_flash_matches_sdpa():
    assert compare_backends() < 2e-2


def test_one_b_forward_timings():
    timings = time_forwards("auto")
    assert all(t["steps"] > 0 for t in timings.values())


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    report = {"device": torch.cuda.get_device_name(), "flash_available": flash_available()}
    if flash_available():
        report["flash_vs_sdpa_max_abs_diff"] = compare_backends()
    started = time.perf_counter()
    for backend in ("sdpa", "flash") if flash_available() else ("sdpa",):
        report[f"forward_{backend}"] = time_forwards(backend)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
