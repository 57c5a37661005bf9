"""`dllm-serve bench quality`: the sweep's table on the trained tiny model and on random weights."""

from tools.bench.quality import bench_quality, bench_quality_random, format_quality, plot_quality, sweep


def test_a_lower_bar_commits_more_tokens_per_forward_and_the_table_compares_with_the_default(tmp_path):
    report = bench_quality(num_requests=32, rounds=2, settings=sweep((0.95, 0.3), (1.0,)))
    default, low, factor = report["settings"]
    assert report["default"] == "low_confidence threshold=0.95" and default["threshold"] == 0.95
    assert (default["throughput_vs_default"], default["accuracy_points_vs_default"],
            default["forwards_saved_vs_default"]) == (1.0, 0.0, 0.0)
    assert low["tokens_per_forward"] > default["tokens_per_forward"] and low["steps"] < default["steps"]
    assert 0 < low["forwards_saved_vs_default"] < 1 and low["steps_per_block"] < default["steps_per_block"]
    assert low["accuracy_points_vs_default"] == round((low["request_accuracy"] - default["request_accuracy"]) * 100, 2)
    assert factor["algorithm"] == "fast_dllm_factor" and factor["factor"] == 1.0
    assert all(row["tokens_per_s"] > 0 and 0 <= row["request_accuracy"] <= 1 for row in report["settings"])
    table = format_quality(report).splitlines()
    assert len(table) == 4 and table[1].startswith("low_confidence threshold=0.95") and "fast_dllm_factor" in table[3]
    plot_quality(report, str(tmp_path / "quality.png"))
    assert (tmp_path / "quality.png").stat().st_size > 1000


def test_on_random_weights_only_tokens_per_forward_are_reported():
    report = bench_quality_random("sdar", num_requests=2, prompt_len=16, max_tokens=32, max_batch=2,
                                  settings=sweep((0.9,), (8.0,)), hidden=64, layers=1, heads=2, vocab=512)
    threshold, factor = report["settings"]
    assert "request_accuracy" not in threshold and "tokens_per_s" not in threshold
    # no random guess is 90% sure: one mask a forward, 16 in the first block (SDAR aligns it to the
    # prompt, whose last 16 ids fill its head) and 32 in the second
    assert report["block_length"] == 32 and threshold["steps_per_block"] == (16 + 32) / 2
    assert factor["steps_per_block"] < 24 / 4  # a factor of 8 passes ranks 1 to 7 at least
    assert factor["tokens_per_forward"] > threshold["tokens_per_forward"]
    assert len(format_quality(report).splitlines()) == 3
