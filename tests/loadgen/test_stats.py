"""Percentiles, the run summary, its report and its plots, on synthetic records."""

import random

import numpy as np
import pytest

from loadgen.plot import plot_run, plot_sweep
from loadgen.records import ERROR, OK, REFUSED, Record
from loadgen.report import format_summary, format_sweep
from loadgen.stats import distribution, percentile, summarize


def synthetic_records(n: int = 200, seed: int = 0) -> list[Record]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        planned = i * 0.1
        sent = planned + rng.uniform(0, 0.002)
        status = rng.choices([OK, REFUSED, ERROR], weights=[8, 1, 1])[0]
        latency = rng.uniform(0.05, 3.0) if status == OK else rng.uniform(0.001, 0.01)
        records.append(Record(
            index=i, planned_s=planned, sent_s=sent, status=status, latency_s=latency,
            ttfb_s=latency * rng.uniform(0.1, 1.0) if status == OK else None,
            output_tokens=rng.randint(16, 112) if status == OK else 0,
            tokens_from="usage" if status == OK else None,
            error=None if status == OK else f"boom {i % 3}"))
    return records


@pytest.mark.parametrize("q", [0, 1, 37.5, 50, 90, 99, 100])
def test_percentile_matches_linear_interpolation(q):
    values = [random.Random(1).expovariate(1) for _ in range(101)] + [0.5, 7.0]
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert distribution([]) == {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}


def test_summary_counts_percentiles_and_rates():
    records = synthetic_records()
    s = summarize(records, offered_rate=10.0, slo_latency_s=1.0, slo_ttfb_s=0.5)
    done = [r for r in records if r.status == OK]
    assert s["sent"] == len(records) == s["completed"] + s["refused"] + s["errors"]
    assert s["completed"] == len(done) and s["refused"] == sum(r.status == REFUSED for r in records)
    for key in ("ttfb_s", "latency_s"):
        d = s[key]
        assert d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert s["latency_s"]["max"] == max(r.latency_s for r in done)  # completed requests only
    duration = max(r.sent_s + r.latency_s for r in done) - records[0].sent_s
    assert s["duration_s"] == pytest.approx(duration)
    assert s["throughput_rps"] == pytest.approx(len(done) / duration)
    assert s["output_tokens_per_s"] == pytest.approx(sum(r.output_tokens for r in done) / duration)
    good = [r for r in done if r.latency_s <= 1.0 and r.ttfb_s <= 0.5]
    assert 0 < s["good"] == len(good) < len(done)
    assert s["goodput_rps"] == pytest.approx(len(good) / duration)
    assert s["max_send_lag_s"] <= 0.002 and s["achieved_rate"] == pytest.approx(10, rel=0.01)
    assert sum(s["top_errors"].values()) == s["errors"] and set(s["top_errors"]) <= {"boom 0", "boom 1", "boom 2"}


def test_goodput_without_slo_is_throughput_and_empty_run_is_zero():
    records = synthetic_records(50)
    s = summarize(records, 10.0)
    assert s["goodput_rps"] == s["throughput_rps"] and s["good"] == s["completed"]
    refused = [Record(index=0, planned_s=0, sent_s=0, status=REFUSED, latency_s=0.01, retry_after_s=2.0)]
    empty = summarize(refused, 1.0)
    assert (empty["completed"], empty["duration_s"], empty["throughput_rps"], empty["goodput_rps"]) == (0, 0, 0, 0)
    assert empty["latency_s"]["p50"] is None
    assert "refused 1" in format_summary(empty)


def test_report_tables():
    s = summarize(synthetic_records(), 10.0, slo_latency_s=1.0)
    text = format_summary(s)
    assert f"sent {s['sent']} = completed {s['completed']} + refused {s['refused']} + errors {s['errors']}" in text
    assert f"{s['latency_s']['p99']:.3f}" in text and "within latency <= 1 s" in text
    sweep = format_sweep([s, summarize(synthetic_records(seed=1), 20.0, slo_latency_s=1.0)])
    lines = sweep.splitlines()
    assert len(lines) == 4 and lines[1].split()[0] == "10.00" and lines[2].split()[0] == "20.00"


def test_plots_are_pngs(tmp_path):
    records = synthetic_records()
    plot_run(records, str(tmp_path / "run.png"), "synthetic")
    summaries = [summarize(synthetic_records(seed=k), rate) for k, rate in enumerate((5.0, 10.0, 20.0))]
    plot_sweep(summaries, str(tmp_path / "sweep.png"), "synthetic")
    for name in ("run.png", "sweep.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_prefix_hit_rate_counts_the_answers_that_say():
    records = [Record(index=i, planned_s=i, sent_s=i, status=OK, latency_s=0.1, prompt_tokens=p, cached_tokens=c)
               for i, (p, c) in enumerate([(100, 60), (50, 0), (80, None), (None, None)])]
    summary = summarize(records, 1.0)
    assert summary["prefix_hit_rate"] == pytest.approx(60 / 150)
    assert "prefix cache     40.0% of prompt tokens were cached" in format_summary(summary)
    assert summarize(records[2:], 1.0)["prefix_hit_rate"] is None
    assert "prefix cache" not in format_summary(summarize(records[2:], 1.0))
