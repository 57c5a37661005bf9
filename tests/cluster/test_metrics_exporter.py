"""The exporter turns replica reports into Prometheus series."""

import argparse
import json
import re
import time

from prometheus_client import generate_latest

from cluster.cli import cmd_status
from cluster.http_tally import Tally
from cluster.metrics import METRICS, MetricsExporter
from replicas.telemetry.monitor import ReplicaMonitor
from replicas.telemetry.step_stats import StepStats


def sample(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{labels}}} not exported")


def test_report_becomes_series():
    monitor = ReplicaMonitor(initial_row_steps_per_s=100.0)
    for _ in range(3):
        monitor.on_step(StepStats(batch_size=4, active_rows=4, num_tokens=64, forward_s=0.009, step_s=0.01,
                                  waiting=2, running=4, blocks_committed=1, block_steps=(3,)))
    monitor.set_gauges(waiting=2, running=4, free_pages=90, total_pages=100, quality_level=2)
    monitor.request_started("a", cost=50, quality_level=1)  # degraded by the load knob
    monitor.request_progressed("a", 20)
    monitor.request_started("b", cost=10)
    monitor.request_finished("b", "stop", latency_s=0.5, time_to_first_block_s=0.1, output_tokens=16)
    exporter = MetricsExporter()
    exporter.push_replica("r1", monitor.report())
    exporter.push_ingress("i1", {"admitted": 1, "rejected": {"step_capacity": 1}, "failovers": 0, "outstanding": 5.0,
                                  "cpu_s": 0.5})
    text = generate_latest(exporter.registry).decode()
    assert sample(text, "dllm_steps_total", 'replica="r1"') == 3
    assert sample(text, "dllm_step_debt", 'replica="r1"') == 30  # 50 - 20; b has ended
    assert sample(text, "dllm_step_queue_length", 'replica="r1"') == 2
    assert sample(text, "dllm_free_pages", 'replica="r1"') == 90
    assert sample(text, "dllm_quality_level", 'replica="r1"') == 2
    assert sample(text, "dllm_requests_degraded_total", 'replica="r1"') == 1
    assert abs(sample(text, "dllm_compute_ratio", 'replica="r1"') - 0.9) < 1e-9
    assert sample(text, "dllm_dispatch_overhead_seconds_count", 'replica="r1"') == 3
    assert sample(text, "dllm_requests_total", 'finish_reason="stop",replica="r1"') == 1
    assert sample(text, "dllm_request_latency_seconds_count", 'replica="r1"') == 1
    assert sample(text, "dllm_admitted_total") == 1
    assert sample(text, "dllm_rejected_total", 'reason="step_capacity"') == 1
    assert sample(text, "dllm_replicas") == 1
    assert exporter.cluster_view()["r1"]["step_debt"] == 30
    # a second report only adds what happened since the first
    exporter.push_replica("r1", monitor.report())
    assert sample(generate_latest(exporter.registry).decode(), "dllm_steps_total", 'replica="r1"') == 3
    for spec in METRICS:
        assert f"# HELP {spec.name}" in text


def test_calibration_records_reach_the_exporter_per_replica_and_window():
    monitor = ReplicaMonitor(initial_row_steps_per_s=100.0)
    step = dict(active_rows=2, num_tokens=32, forward_s=0.009, step_s=0.01, waiting=0, running=2)
    monitor.request_started("a", cost=10)
    monitor.on_step(StepStats(batch_size=2, blocks_committed=0, block_steps=(), prefix_units=7, **step))
    monitor.on_step(StepStats(batch_size=2, blocks_committed=1, block_steps=(2,), **step), 0.012)
    monitor.request_finished("a", "stop", 0.1, 0.05, 16, blocks=1)
    exporter = MetricsExporter()
    exporter.push_replica("r1", monitor.report())
    exporter.push_replica("r2", ReplicaMonitor(100.0).report())
    summary = exporter.calibration(window_s=60)
    assert summary["r1"] == {"step_periods": [(2, 0, 0.012)], "steps_per_block": {2: 1}, "blocks_per_request": {1: 1},
                             "prefix_units": 7, "requests_started": 1}
    assert summary["r2"]["step_periods"] == [] and summary["r2"]["requests_started"] == 0
    exporter.push_replica("r1", monitor.report())  # nothing new: the records are not counted twice
    assert exporter.calibration(window_s=60)["r1"]["prefix_units"] == 7
    time.sleep(0.05)
    assert exporter.calibration(window_s=0.01)["r1"]["step_periods"] == []  # older than the window


def test_prefix_cache_totals_become_counters_of_what_is_new():
    monitor = ReplicaMonitor(initial_row_steps_per_s=100.0)
    exporter = MetricsExporter()
    for looked_up, hit, cached in ((10, 4, 6), (30, 20, 9)):
        monitor.set_gauges(cached_pages=cached, prefix_pages_looked_up=looked_up, prefix_pages_hit=hit,
                           prefix_tokens_hit=16 * hit, prefix_evictions=1)
        exporter.push_replica("r1", monitor.report())
    text = generate_latest(exporter.registry).decode()
    assert sample(text, "dllm_prefix_pages_looked_up_total", 'replica="r1"') == 30
    assert sample(text, "dllm_prefix_pages_hit_total", 'replica="r1"') == 20
    assert sample(text, "dllm_prefix_tokens_hit_total", 'replica="r1"') == 320
    assert sample(text, "dllm_prefix_evictions_total", 'replica="r1"') == 1
    assert sample(text, "dllm_cached_pages", 'replica="r1"') == 9
    assert exporter.cluster_view()["r1"]["prefix_pages_hit"] == 20


def kv_pool_exporter() -> MetricsExporter:
    """An exporter that heard from two replicas: r1 has 100 usable pages, 30 held by
    requests and 20 in the prefix cache (5 of them held: 70 held by no request), a pool of
    1.5 GiB and max_model_len 4096; r2 has not reported its pool yet."""
    monitor = ReplicaMonitor(initial_row_steps_per_s=100.0)
    monitor.set_gauges(free_pages=70, total_pages=100, cached_pages=20, kv_cache_bytes=3 * 2**29, max_model_len=4096)
    exporter = MetricsExporter()
    exporter.push_replica("r1", monitor.report())
    exporter.push_replica("r2", ReplicaMonitor(initial_row_steps_per_s=100.0).report())
    return exporter


def test_the_kv_pool_becomes_its_usage_prefix_cache_share_and_size():
    """Usage counts the cached pages no request holds as free (vLLM's kv_cache_usage_perc);
    the prefix cache's share counts all its pages."""
    text = generate_latest(kv_pool_exporter().registry).decode()
    assert sample(text, "dllm_kv_cache_usage", 'replica="r1"') == 0.3
    assert sample(text, "dllm_prefix_cache_share", 'replica="r1"') == 0.2
    assert sample(text, "dllm_kv_cache_bytes", 'replica="r1"') == 3 * 2**29
    assert sample(text, "dllm_max_model_len", 'replica="r1"') == 4096
    assert sample(text, "dllm_total_pages", 'replica="r1"') == 100
    assert sample(text, "dllm_kv_cache_usage", 'replica="r2"') == 0 == sample(text, "dllm_prefix_cache_share", 'replica="r2"')


def test_dllm_serve_status_shows_each_replicas_kv_pool(monkeypatch, capsys):
    exporter = kv_pool_exporter()
    monkeypatch.setattr("cluster.app.cluster_status",
                        lambda address: {"applications": {}, "replicas": exporter.cluster_view()})
    assert cmd_status(argparse.Namespace(address="auto", json=False)) == 0
    table = capsys.readouterr().out
    assert re.search(r"^KV pool\s+pages\s+size\s+usage\s+prefix cache\s+max_model_len$", table, re.M), table
    assert re.search(r"^r1\s+100\s+1\.5 GiB\s+30\.0%\s+20\.0%\s+4096$", table, re.M), table
    assert re.search(r"^r2\s+0\s+0\.0 MiB\s+0\.0%\s+0\.0%\s+0$", table, re.M), table
    assert cmd_status(argparse.Namespace(address="auto", json=True)) == 0
    r1 = json.loads(capsys.readouterr().out)["replicas"]["r1"]
    assert (r1["total_pages"], r1["kv_cache_bytes"], r1["max_model_len"]) == (100, 3 * 2**29, 4096)
    assert (r1["kv_cache_usage"], r1["prefix_cache_share"]) == (0.3, 0.2)


def test_the_ingress_http_tally_becomes_a_counter_and_a_histogram_of_what_is_new():
    """``cluster.http_tally`` counts responses as the ingress's app sends them; two ingress
    replicas' totals add up, and a report sent again adds nothing."""
    tally = Tally()
    for status, seconds in ((200, 0.003), (200, 0.2), (429, 0.001), (500, 100.0)):
        tally.add(status, seconds)
    assert tally.buckets[0] == 2 and tally.buckets[-1] == 1  # <= 5 ms, and beyond the last bound
    report = tally.report()
    exporter = MetricsExporter()
    for ingress in ("i1", "i1", "i2"):
        exporter.push_ingress(ingress, report)
    text = generate_latest(exporter.registry).decode()
    assert sample(text, "dllm_http_responses_total", 'code="200"') == 4
    assert sample(text, "dllm_http_responses_total", 'code="429"') == 2
    assert sample(text, "dllm_http_response_seconds_count") == 8
    assert sample(text, "dllm_http_response_seconds_bucket", 'le="0.005"') == 4
    assert sample(text, "dllm_http_response_seconds_bucket", 'le="0.25"') == 6
    assert abs(sample(text, "dllm_http_response_seconds_sum") - 2 * 100.204) < 1e-9


def test_error_events_inside_streams_become_a_counter_by_status():
    """``dllm_stream_errors_total``: the statuses of a stream's own failures are there at 0
    before the first (an alert's rate sees the first one), then the ingress replicas'
    totals add up and a report sent again adds nothing."""
    exporter = MetricsExporter()
    text = generate_latest(exporter.registry).decode()
    assert [sample(text, "dllm_stream_errors_total", f'code="{code}"') for code in ("500", "503", "504")] == [0] * 3
    for ingress, errors in (("i1", {"504": 2}), ("i1", {"504": 2}), ("i2", {"500": 1, "504": 1})):
        exporter.push_ingress(ingress, {"stream_errors": errors})
    text = generate_latest(exporter.registry).decode()
    assert sample(text, "dllm_stream_errors_total", 'code="504"') == 3
    assert sample(text, "dllm_stream_errors_total", 'code="500"') == 1
