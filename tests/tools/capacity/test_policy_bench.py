"""`bench policies` measures every policy on one arrival schedule and reports fdfo's ratios."""

import pytest

from tools.capacity.policy_bench import bench_policies
from replicas.batching import MODES as POLICIES


@pytest.mark.bench
def test_policy_report_is_complete_and_consistent():
    result = bench_policies("tiny", num_requests=16, rate=20.0, max_batch=8, slo_latency_s=5.0)
    assert set(result["policies"]) == set(POLICIES) == {"static", "sync", "fixed_fill", "fdfo"}
    for stats in result["policies"].values():
        assert 0 < stats["ttfb_p50_s"] <= stats["latency_p50_s"] <= stats["latency_p99_s"]
        assert stats["goodput_per_s"] > 0
    fdfo = result["policies"]["fdfo"]
    for policy, ratios in result["fdfo_over"].items():
        other = result["policies"][policy]
        assert ratios["p99_latency_speedup"] == pytest.approx(other["latency_p99_s"] / fdfo["latency_p99_s"], abs=0.01)
        assert ratios["goodput_ratio"] == pytest.approx(fdfo["goodput_per_s"] / other["goodput_per_s"], abs=0.01)
