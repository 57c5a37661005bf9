"""`dllm-serve bench forward`: its reference forward computes what the models compute, and
the bench times the same shapes on both sides."""

import pytest
import torch
from cli_help import assert_help_explains_every_option

from tools.bench.forward import ARCHITECTURES, bench_forward, project_forwards, reference_logits
from replicas.attention import DenseAttentionContext

SMALL = {"llada": dict(d_model=64, layers=2, heads=4, mlp=176),  # LLaDA's vocabulary: its mask id is in it
         "sdar": dict(hidden=64, layers=2, heads=4, vocab=1000)}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_the_reference_forward_gives_the_models_logits(name):
    build, canvas = ARCHITECTURES[name]
    net = build(**SMALL[name], seed=3)
    length, block = 80, net.spec.block_length
    ids = torch.randint(0, net.shape.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(length)
    page = positions // block
    mask = torch.ones(length, length, dtype=torch.bool) if canvas == "full" else page[None, :] <= page[:, None]
    with torch.inference_mode():
        ours = net(ids, positions.expand(2, length), DenseAttentionContext(mask.expand(2, 1, length, length)))
    reference = reference_logits(net, ids, None if canvas == "full" else block)
    torch.testing.assert_close(reference, ours, rtol=1e-5, atol=1e-5)
    if canvas == "block":  # the mask matters: attending to later blocks changes the logits
        assert not torch.allclose(reference_logits(net, ids, None), ours, atol=1e-3)


def test_without_a_cache_each_forward_feeds_the_rows_whole_sequence():
    build, _ = ARCHITECTURES["sdar"]
    net = build(**SMALL["sdar"])
    block = net.spec.block_length
    forwards = project_forwards(net, "block", batch=2, prompt_len=block, max_tokens=2 * block, steps=3)
    assert [length for *_, length in forwards] == [2 * block] * 3 + [3 * block] * 3  # prompt + blocks so far
    assert all(seconds > 0 and reference is None for seconds, reference, _ in forwards)


@pytest.mark.bench
def test_bench_forward_reports_a_ratio_per_architecture_and_batch():
    from tools.cli import main

    report = bench_forward(batch_sizes=(1, 2), prompt_len=32, max_tokens=64, steps=2, rounds=2, **SMALL)
    for name in ARCHITECTURES:
        for batch in (1, 2):
            entry = report[name][f"batch_{batch}"]
            assert entry["forwards"] == 2 * 2  # two blocks of two forwards
            assert entry["project_over_reference"] > 0 and entry["reference_ms_per_forward"] > 0
            low, high = entry["project_over_reference_quartiles"]
            assert low <= entry["project_over_reference"] <= high
    assert main(["bench", "forward", "--architectures", "sdar", "--batch-sizes", "1", "--d-model", "64",
                 "--layers", "1", "--max-tokens", "32", "--prompt-len", "8", "--rounds", "1", "--json"]) == 0


def test_bench_forward_help_explains_every_option(capsys):
    assert_help_explains_every_option(capsys, ("bench", "forward"), 8, ("reference", "KV cache", "quartiles"))
