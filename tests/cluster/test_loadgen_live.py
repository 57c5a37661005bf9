"""`dllm-serve loadgen`, `calibrate` and `bench calibration` (the real CLI, in a subprocess)
against a real `dllm-serve up`: the session's shared cluster of two replicas
(tests/conftest.py)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from loadgen.arrivals import poisson_times
from tools.capacity.calibration import load_calibration

RATE, DURATION_S, SEED = 8.0, 6.0, 3
REPLICAS = 2  # the shared cluster's


def key_args(cluster) -> list[str]:
    return ["--api-key", cluster.api_key]


def test_loadgen_report_is_consistent(cluster, tmp_path):
    plot = tmp_path / "run.png"
    run = subprocess.run(
        [sys.executable, "-m", "tools.cli", "loadgen", "--url", cluster.base_url, *key_args(cluster),
         "--rate", str(RATE),
         "--duration", str(DURATION_S), "--seed", str(SEED), "--timeout", "60", "--slo-latency", "5",
         "--json", "--records", "--plot", str(plot)],
        capture_output=True, timeout=150)  # bytes: text mode would turn the progress line's \r into \n
    stderr = run.stderr.decode()
    assert run.returncode == 0, stderr[-3000:]
    report = json.loads(run.stdout)
    records = report.pop("records")

    assert report["model"] == "tiny" and report["offered_rate"] == RATE
    assert report["sent"] == len(records) == len(poisson_times(RATE, SEED, DURATION_S)) > 0
    assert report["sent"] == report["completed"] + report["refused"] + report["errors"]
    assert report["errors"] == 0, report["top_errors"]
    assert report["completed"] > 0 and report["tokens_from"] == ["usage"]
    for key in ("ttfb_s", "latency_s"):
        values = report[key]
        assert 0 < values["p50"] <= values["p90"] <= values["p99"] <= values["max"], (key, values)
    done = [r for r in records if r["status"] == "ok"]
    assert all(0 < r["ttfb_s"] <= r["latency_s"] and r["output_tokens"] > 0 and r["steps"] > 0 for r in done)
    assert all(0 < r["engine_s"] < r["latency_s"] for r in done)
    assert report["ttfb_s"]["p50"] <= report["latency_s"]["p50"]

    duration = max(r["sent_s"] + r["latency_s"] for r in done) - min(r["sent_s"] for r in records)
    assert report["duration_s"] == pytest.approx(duration, rel=0.05)
    assert report["throughput_rps"] == pytest.approx(report["completed"] / duration, rel=0.05)
    assert report["goodput_rps"] <= report["throughput_rps"]
    assert report["output_tokens"] == sum(r["output_tokens"] for r in done)
    # open loop: every request left close to its planned time
    assert max(r["sent_s"] - r["planned_s"] for r in records) < 0.5

    assert "\r" in stderr and f"sent {report['sent']}/{report['sent']}" in stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cli(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_calibrate_measures_the_live_cluster(cluster, tmp_path):
    out = tmp_path / "live.json"
    run = _cli("calibrate", "--url", cluster.base_url, *key_args(cluster), "--rates", "4,12", "--duration", "3", "--seed", "1",
               "--replicas", str(REPLICAS), "--out", str(out), "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    cal = load_calibration(out)
    assert cal.c0 + cal.c1 * cal.max_batch > 0 and cal.max_batch == 16
    assert len(cal.step_cost_spread) == 100 and np.mean(cal.step_cost_spread) == pytest.approx(1, rel=0.5)
    overheads = cal.request_overhead_s
    assert len(overheads) == 100 and 0 <= min(overheads) <= max(overheads) < 5
    assert set(cal.blocks_per_request) <= set(range(2, 8))  # 1-6 grids + the EOS block
    assert min(cal.steps_per_block) >= 1 and max(cal.steps_per_block) <= 17  # fused commit: 1 to L
    assert f"{REPLICAS} replica(s) (" in cal.source
    assert [p.rate for p in cal.load_points] == [4 / REPLICAS, 12 / REPLICAS]
    for point in cal.load_points:
        assert point.c0 + point.c1 > 0 and len(point.request_overhead_s) == 100
    assert cal.prefill_s > 0  # every request computes a 7-page prompt
    low, high = cal.at_rate(4 / REPLICAS), cal.at_rate(12 / REPLICAS)
    assert low.c0 == cal.load_points[0].c0 and high.c1 == cal.load_points[1].c1


def test_bench_calibration_prints_both_sides(cluster):
    run = _cli("bench", "calibration", "--url", cluster.base_url, *key_args(cluster),
               "--calibration-rates", "4,12",
               "--duration", "2",
               "--rates", "8", "--rate-requests", "12", "--replicas", str(REPLICAS),
               "--json", "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert [row["rate"] for row in result["rows"]] == [8.0]
    # calibrated before the rate and after it, the rate predicted from both
    assert [row["calibrations"] for row in result["rows"]] == [[0, 1]] and len(result["calibrations"]) == 2
    for row in result["rows"]:
        assert row["live_completed"] > 0 and row["live_refused"] == 0
        for q in (50, 99):
            for name in ("sim", "replay"):
                assert row[f"{name}_over_live_p{q}"] == pytest.approx(row[f"{name}_p{q}_s"] / row[f"live_p{q}_s"],
                                                                      abs=1e-3)
    for name, key in (("sim", "holds"), ("replay", "replay_holds")):
        assert result[key] == all(abs(row[f"{name}_over_live_p{q}"] - 1) <= 0.2 for row in result["rows"]
                                  for q in (50, 99))


def test_a_chats_later_turns_find_their_history_in_the_prefix_cache(cluster):
    """`--workload chat`: each later turn sends its chat so far, whose prompt and answer pages
    the replica cached when the previous turn ran (the tiny prompt is 7 whole pages); the
    router sends it to that replica."""
    times = poisson_times(RATE, SEED, count=18)
    run = subprocess.run(
        [sys.executable, "-m", "tools.cli", "loadgen", "--url", cluster.base_url, *key_args(cluster), "--workload", "chat",
         "--turns", "3", "--open-chats", "3", "--rate", str(RATE), "--requests", str(len(times)),
         "--seed", str(SEED), "--timeout", "60", "--json", "--records", "--quiet"], capture_output=True, timeout=150)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    report = json.loads(run.stdout)
    records = report["records"]
    assert report["completed"] == len(records) == 18, report["top_errors"]
    later = [r for r in records if r["index"] % 9 >= 3]  # chats of 3 turns, 3 at a time
    assert all(r["cached_tokens"] >= 112 for r in later), [r["cached_tokens"] for r in later]
    assert all(r["prompt_tokens"] > 112 for r in later)  # the chat so far, and a new message
    assert report["prefix_hit_rate"] > 0.4


def test_bench_soak_reads_each_engine_replica_sends_every_kind_and_finds_the_cluster_at_rest(cluster):
    """A short soak: both engine replicas' memory sampled, every kind of request answered,
    and afterwards nothing held: no request, page or admission charge."""
    from loadgen.soak import KINDS

    run = subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench", "soak", "--url", cluster.base_url, *key_args(cluster),
         "--metrics-url", cluster.metrics_url, "--duration", "6", "--clients", "9", "--sample-every", "1"],
        capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    engines = [name for name in report["processes"] if name.startswith("engine ")]
    assert len(engines) == REPLICAS and report["samples"] >= 3
    assert {name.split()[0] for name in report["processes"]} >= {"engine", "ingress", "controller", "metrics"}
    for process in report["processes"].values():
        assert 30 < process["after_first_minute_mib"] <= process["max_mib"] and process["end_over_first_minute"] > 0
    answered = {kind: sum(n for outcome, n in outcomes.items() if outcome in ("200", "429", "504", "dropped"))
                for kind, outcomes in report["requests"].items() if kind != "bad"}
    assert set(answered) | {"bad"} == set(KINDS) and all(answered.values()), report["requests"]
    assert set(report["requests"]["bad"]) == {"400"} and report["requests"]["body_dropped"].get("dropped")
    assert "500" not in json.dumps(report["requests"])
    assert report["at_rest"]["clean"] and not report["at_rest"]["held"]
