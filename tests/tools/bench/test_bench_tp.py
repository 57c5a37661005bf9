"""`bench tp` on a small random LLaDA: the same steps at both sizes, their time split."""

import pytest

from tools.bench.tp import bench_tp


@pytest.mark.bench
def test_the_step_splits_into_compute_collectives_and_host_at_each_size():
    report = bench_tp(sizes=(1, 2), batch_sizes=(2,), d_model=64, layers=2, heads=4, mlp=128, vocab=64,
                      max_tokens=32, rounds=1)
    alone, split = report["tp1_batch2"], report["tp2_batch2"]
    assert alone["steps"] == split["steps"] == 4  # one block of 32 in 4 fixed steps
    assert alone["collectives_ms"] == 0 and split["collectives_ms"] > 0 and 0 < split["collectives_share"] < 1
    for run in (alone, split):
        parts = run["compute_ms"] + run["collectives_ms"] + run["host_ms"]
        assert parts == pytest.approx(run["step_ms"], abs=0.01)
