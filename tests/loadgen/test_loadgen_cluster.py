"""`dllm-serve loadgen` (the real CLI, in a subprocess) against a real `dllm-serve up`."""

import json
import subprocess
import sys

import pytest

from loadgen.arrivals import poisson_times

RATE, DURATION_S, SEED = 8.0, 6.0, 3


def test_loadgen_report_is_consistent(tiny_cluster, tmp_path):
    plot = tmp_path / "run.png"
    run = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "loadgen", "--url", tiny_cluster.base_url, "--rate", str(RATE),
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
