"""`dllm-serve bench d2f` and `bench adapters` on small shapes: what they report holds together."""

from cli_help import assert_help_explains_every_option
from tools.bench.adapters import bench_adapters
from tools.bench.d2f import bench_d2f


def test_blocks_decoded_together_take_fewer_forwards_than_one_block_at_a_time(capsys):
    report = bench_d2f(batch_sizes=(2,), rounds=1, requests=4, d_model=64, layers=1, block_length=8, max_tokens=32)
    random, tiny = report["random"]["batch_2"], report["tiny"]["batch_2"]
    # random weights: only the complete blocks' forced picks fill, one a block a step
    assert random["plain"]["tokens_per_forward"] == 1.0 and random["plain"]["forwards_per_request"] == 32
    assert random["d2f"]["forwards_per_request"] < 32 and random["d2f"]["tokens_per_forward"] > 1.0
    assert 0 <= tiny["d2f"]["request_accuracy"] <= 1 and tiny["plain"]["tokens_per_forward"] > 1.0
    assert_help_explains_every_option(capsys, ("bench", "d2f"), 10, ("block_add_threshold", "tiny"))


def test_the_adapters_bench_compares_each_way_with_the_plain_engine(capsys):
    report = bench_adapters(batch_sizes=(1, 2), rank=4, adapters=2, prompt_len=8, max_tokens=16, steps=4, rounds=1,
                            d_model=64, layers=1, heads=1, mlp=128, vocab=300)
    entry = report["batch_2"]
    assert set(entry["rounds"]) == {"plain", "base_rows", "one_adapter", "mixed"}
    assert all(entry[f"{way}_over_plain"] > 0 for way in ("base_rows", "one_adapter", "mixed"))
    assert_help_explains_every_option(capsys, ("bench", "adapters"), 8, ("rank", "base model"))
