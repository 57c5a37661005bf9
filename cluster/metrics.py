"""The metrics actor: replicas push step statistics, Prometheus scrapes them.

``METRICS`` is the single list of what is exported (the README documents each entry and
a test keeps the two in agreement). ``MetricsExporter`` is plain Python and holds the
prometheus_client registry; ``MetricsActor`` is the named Ray actor that owns one and
serves it over HTTP on its own port.

The actor is detached and restarts when it dies (``cluster.app.start_metrics_actor``): its
state starts afresh (replicas push deltas, so counters restart from zero, which Prometheus
reads as a counter reset; ingress replicas push totals, so theirs come back whole) and its
HTTP server binds the same port again. No request waits on it: every caller bounds its
calls (the ingress by ``ingress.metrics_timeout_s``, a replica keeps at most one push in
flight).

It also carries the one cluster-wide order the ingress replicas obey: draining (`dllm-serve
up` on SIGTERM), returned with every ``ingress_sync`` answer.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, make_wsgi_app
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from replicas.telemetry.calibration_log import CalibrationLog
from replicas.telemetry.reports import HTTP_SECONDS_BOUNDS, MIN_STALE_S, IngressReport, ReplicaStats

ACTOR_NAME = "dllm-metrics"
ACTOR_NAMESPACE = "dllm"
BIND_RETRY_S = 30.0  # a restarted actor waits this long at most for its port to be free

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# the statuses a stream's own failures end with (internal error, replica failed, timeout): their
# counters start at 0, so that the first one is an increase to a rule's rate()
_STREAM_FAILURES = ("500", "503", "504")
_STEPS_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as exported (counters get the _total suffix in the exposition)
    kind: type
    help: str
    labels: tuple[str, ...] = ("replica",)
    buckets: tuple[float, ...] | None = None
    slo_bound: bool = False  # the latency SLO is one of its bucket bounds (the alert rules read it: cluster.alerts)


class SummedHistogram:
    """A histogram fed with bucket counts (what the ingress replicas measured) rather than
    observations; ``buckets`` end with +inf."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = (),
                 registry: CollectorRegistry | None = None, buckets: tuple[float, ...] = (float("inf"),)):
        self.name, self.documentation, self.bounds = name, documentation, buckets
        self.counts = [0] * len(buckets)
        self.seconds = 0.0
        if registry is not None:
            registry.register(self)

    def add(self, counts: list[int], seconds: float) -> None:
        """Add new counts per bucket (an ingress's growth since its last report; none from a
        report without them)."""
        if len(counts) == len(self.counts):
            self.counts = [mine + max(0, new) for mine, new in zip(self.counts, counts)]
            self.seconds += max(0.0, seconds)

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, self.counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family.add_metric([], buckets, self.seconds)
        yield family


METRICS = (
    MetricSpec("dllm_step_queue_length", Gauge, "Requests waiting in a replica's engine queue for a batch row"),
    MetricSpec("dllm_running_requests", Gauge, "Requests holding a batch row (prefilling or denoising)"),
    MetricSpec("dllm_step_debt", Gauge, "Row-steps a replica still owes its live requests (admission cost minus steps taken)"),
    MetricSpec("dllm_predicted_drain_seconds", Gauge, "Step debt divided by the drain rate at full batch (fitted step cost)"),
    MetricSpec("dllm_row_steps_per_second", Gauge, "Measured rows advanced per second of engine time"),
    MetricSpec("dllm_dispatch_overhead_seconds", Histogram, "Engine step time outside the model forward (scheduling, tensor building, commit)", buckets=_OVERHEAD_BUCKETS),
    MetricSpec("dllm_compute_ratio", Gauge, "Model forward time / engine step time over the last report window"),
    MetricSpec("dllm_steps_total", Counter, "Denoise steps (forwards) run"),
    MetricSpec("dllm_forward_seconds_total", Counter, "Seconds spent in model forwards"),
    MetricSpec("dllm_forward_cpu_seconds_total", Counter, "CPU seconds of the engine thread in model forwards"),
    MetricSpec("dllm_step_cpu_seconds_total", Counter, "CPU seconds of the engine thread in engine steps (forwards included)"),
    MetricSpec("dllm_replica_cpu_seconds_total", Counter, "CPU seconds used by an engine replica's process (forwards included)"),
    MetricSpec("dllm_step_seconds_total", Counter, "Seconds spent in engine steps"),
    MetricSpec("dllm_batch_size", Histogram, "Rows per step", buckets=_BATCH_BUCKETS),
    MetricSpec("dllm_tokens_forwarded_total", Counter, "New tokens fed to forwards (prompt chunks and blocks)"),
    MetricSpec("dllm_output_tokens_total", Counter, "Output tokens returned to clients"),
    MetricSpec("dllm_blocks_committed_total", Counter, "Blocks committed"),
    MetricSpec("dllm_steps_per_block", Histogram, "Forwards a block took until it committed", buckets=_STEPS_BUCKETS),
    MetricSpec("dllm_requests_total", Counter, "Requests ended, by finish reason (stop, length, timeout, abort, error)", ("replica", "finish_reason")),
    MetricSpec("dllm_request_latency_seconds", Histogram, "End-to-end request latency inside the replica", buckets=_LATENCY_BUCKETS, slo_bound=True),
    MetricSpec("dllm_time_to_first_block_seconds", Histogram, "Time from arrival at the replica to the first committed block", buckets=_LATENCY_BUCKETS),
    MetricSpec("dllm_free_pages", Gauge, "KV pages held by no request (a page holds one block): unused, or cached and unreferenced"),
    MetricSpec("dllm_total_pages", Gauge, "KV pages usable by requests"),
    MetricSpec("dllm_cached_pages", Gauge, "KV pages in the prefix cache (held by requests or not)"),
    MetricSpec("dllm_kv_cache_usage", Gauge, "Share of the usable KV pages held by requests (0-1; a cached page no request holds counts as free), as vLLM's kv_cache_usage_perc"),
    MetricSpec("dllm_prefix_cache_share", Gauge, "Share of the usable KV pages in the prefix cache (0-1; held by requests or not)"),
    MetricSpec("dllm_kv_cache_bytes", Gauge, "Bytes of the KV pool's K and V tensors"),
    MetricSpec("dllm_max_model_len", Gauge, "The longest prompt + output (tokens) a replica serves"),
    MetricSpec("dllm_prefix_pages_looked_up_total", Counter, "Prompt (prefix) pages of admitted requests looked up in the prefix cache"),
    MetricSpec("dllm_prefix_pages_hit_total", Counter, "Prefix pages found in the prefix cache (not computed again)"),
    MetricSpec("dllm_prefix_tokens_hit_total", Counter, "Prompt tokens whose KV came from the prefix cache"),
    MetricSpec("dllm_prefix_evictions_total", Counter, "Cached pages evicted to make room"),
    MetricSpec("dllm_quality_level", Gauge, "The load knob's level: adaptive requests run at the n-th degraded setting (0: the default; replicas.quality)"),
    MetricSpec("dllm_requests_degraded_total", Counter, "Requests started below the default quality by the load knob"),
    MetricSpec("dllm_admitted_total", Counter, "Requests admitted by the ingress", ()),
    MetricSpec("dllm_rejected_total", Counter, "Requests refused by the ingress, by reason", ("reason",)),
    MetricSpec("dllm_failovers_total", Counter, "Requests resumed on another replica after theirs failed", ()),
    MetricSpec("dllm_admission_outstanding", Gauge, "Row-steps admitted by the ingress replicas and not yet released", ()),
    MetricSpec("dllm_admission_prediction_bias", Gauge, "How much longer than admission predicted its answers took lately, the mean over the ingress replicas (1: as predicted; above 1, admission lengthens its predictions by it)", ()),
    MetricSpec("dllm_ingress_cpu_seconds_total", Counter, "CPU seconds used by the ingress replicas' processes", ()),
    MetricSpec("dllm_http_responses_total", Counter, "HTTP responses sent by the ingress replicas, by status code", ("code",)),
    MetricSpec("dllm_stream_errors_total", Counter, "Streams sent as 200 that ended in an error event, by the HTTP status of the error (internal error 500, replica failed 503, timeout 504, ...)", ("code",)),
    MetricSpec("dllm_http_response_seconds", SummedHistogram, "Time from a request's arrival at an ingress replica's app to its response's last byte", (), buckets=HTTP_SECONDS_BOUNDS),
    MetricSpec("dllm_replicas", Gauge, "Replicas that reported recently (replicas.telemetry.reports.stale_after_s: 10 s or 20 stats periods)", ()),
)


def bucket_bounds(spec: MetricSpec, slo_latency_s: float | None) -> tuple[float, ...]:
    """A histogram's bucket bounds, the SLO among them where it has ``slo_bound``."""
    extra = {slo_latency_s} if spec.slo_bound and slo_latency_s else set()
    return tuple(sorted({*spec.buckets, *extra}))


# gauge name -> field (or property) of the replica's routing stats (``ReplicaStats``)
_GAUGE_SOURCES = {
    "dllm_step_queue_length": "waiting",
    "dllm_running_requests": "running",
    "dllm_step_debt": "step_debt",
    "dllm_predicted_drain_seconds": "predicted_drain_s",
    "dllm_row_steps_per_second": "row_steps_per_s",
    "dllm_free_pages": "free_pages",
    "dllm_total_pages": "total_pages",
    "dllm_cached_pages": "cached_pages",
    "dllm_kv_cache_usage": "kv_cache_usage",
    "dllm_prefix_cache_share": "prefix_cache_share",
    "dllm_kv_cache_bytes": "kv_cache_bytes",
    "dllm_max_model_len": "max_model_len",
    "dllm_quality_level": "quality_level",
}
# counter name -> key of the replica's routing stats holding its total since the start
_TOTAL_SOURCES = {
    "dllm_prefix_pages_looked_up_total": "prefix_pages_looked_up",
    "dllm_prefix_pages_hit_total": "prefix_pages_hit",
    "dllm_prefix_tokens_hit_total": "prefix_tokens_hit",
    "dllm_prefix_evictions_total": "prefix_evictions",
}

# counter name -> field of an ``IngressReport`` holding its totals by label (reason or code)
_LABELLED_INGRESS_TOTALS = {
    "dllm_rejected_total": "rejected",
    "dllm_http_responses_total": "responses",
    "dllm_stream_errors_total": "stream_errors",
}


class MetricsExporter:
    def __init__(self, stale_after_s: float = MIN_STALE_S, slo_latency_s: float | None = None):
        """A replica or ingress silent for ``stale_after_s`` (``replicas.telemetry.reports.stale_after_s``) is gone;
        ``slo_latency_s`` is a bucket bound of the ``slo_bound`` histograms."""
        self.stale_after_s = stale_after_s
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.metrics = {}
        for spec in METRICS:
            kwargs = {"buckets": bucket_bounds(spec, slo_latency_s)} if spec.buckets else {}
            self.metrics[spec.name] = spec.kind(spec.name, spec.help, spec.labels, registry=self.registry, **kwargs)
        self._last_seen: dict[str, float] = {}
        self._views: dict[str, ReplicaStats] = {}
        self._calibration: dict[str, CalibrationLog] = {}
        self._ingress: dict[str, tuple[float, IngressReport]] = {}  # ingress id -> (last seen, last report)
        self.metrics["dllm_admitted_total"].inc(0)
        self.metrics["dllm_failovers_total"].inc(0)
        for code in _STREAM_FAILURES:
            self.metrics["dllm_stream_errors_total"].labels(code).inc(0)
        self.metrics["dllm_replicas"].set(0)
        self.draining = False
        self._started = time.monotonic()

    def push_replica(self, replica: str, report: dict) -> None:
        """Add one replica report (see ``replicas.telemetry.monitor.ReplicaMonitor.report``)."""
        m = self.metrics
        self._last_seen[replica] = time.monotonic()
        last = self._views.get(replica, ReplicaStats())
        stats = self._views[replica] = ReplicaStats.model_validate(report["gauges"])
        for name, key in _TOTAL_SOURCES.items():  # totals since the replica started: count what is new
            m[name].labels(replica).inc(max(0, getattr(stats, key) - getattr(last, key)))
        self._calibration.setdefault(replica, CalibrationLog()).extend(report["calibration"])
        for name, key in _GAUGE_SOURCES.items():
            m[name].labels(replica).set(getattr(stats, key))
        for name, key in (("dllm_steps_total", "steps"), ("dllm_forward_seconds_total", "forward_s"),
                          ("dllm_forward_cpu_seconds_total", "forward_cpu_s"), ("dllm_replica_cpu_seconds_total", "cpu_s"),
                          ("dllm_step_cpu_seconds_total", "step_cpu_s"),
                          ("dllm_step_seconds_total", "step_s"), ("dllm_tokens_forwarded_total", "tokens"),
                          ("dllm_output_tokens_total", "output_tokens"), ("dllm_blocks_committed_total", "blocks"),
                          ("dllm_requests_degraded_total", "degraded")):
            m[name].labels(replica).inc(report[key])
        if report["step_s"] > 0:
            m["dllm_compute_ratio"].labels(replica).set(report["forward_s"] / report["step_s"])
        for name, key in (("dllm_dispatch_overhead_seconds", "overheads_s"), ("dllm_batch_size", "batch_sizes"),
                          ("dllm_steps_per_block", "block_steps"), ("dllm_request_latency_seconds", "latencies_s"),
                          ("dllm_time_to_first_block_seconds", "time_to_first_block_s")):
            histogram = m[name].labels(replica)
            for value in report[key]:
                histogram.observe(value)
        for reason, count in report["finished"].items():
            m["dllm_requests_total"].labels(replica, reason).inc(count)
        self._prune()

    def push_ingress(self, ingress: str, report: dict) -> None:
        """Add one ingress replica's totals (``cluster.ingress.Ingress.ingress_report``):
        counters grow by what is new since its last report, the outstanding gauge is the
        sum over live ingress replicas."""
        m = self.metrics
        report = IngressReport.model_validate(report)
        last = self._ingress[ingress][1] if ingress in self._ingress else IngressReport()
        m["dllm_admitted_total"].inc(max(0, report.admitted - last.admitted))
        m["dllm_failovers_total"].inc(max(0, report.failovers - last.failovers))
        for name, field in _LABELLED_INGRESS_TOTALS.items():
            before = getattr(last, field)
            for label, count in getattr(report, field).items():
                m[name].labels(label).inc(max(0, count - before.get(label, 0)))
        # the first report of an ingress also counts its start-up
        m["dllm_ingress_cpu_seconds_total"].inc(max(0.0, report.cpu_s - last.cpu_s))
        before = last.response_buckets or [0] * len(report.response_buckets)
        m["dllm_http_response_seconds"].add([new - old for new, old in zip(report.response_buckets, before)],
                                            report.response_seconds - last.response_seconds)
        self._ingress[ingress] = (time.monotonic(), report)
        self._prune()

    def ingress_sync(self, ingress: str, report: dict) -> dict:
        """An ingress's one call per stats period: its report in; out, the replicas' stats
        (``cluster_view``) and whether to stop admitting (``draining``)."""
        self.push_ingress(ingress, report)
        return {"replicas": self.cluster_view(), "draining": self.draining,
                "ingresses": max(1, len(self._live_ingresses()))}

    def drain(self) -> dict:
        """Order every ingress replica to stop admitting (they learn it with their next
        ``ingress_sync``) and say how far the drain is: live ingress replicas, how many of
        them have reported that they stopped admitting, their requests in flight, their
        admission charges outstanding, and this actor's age (one restarted meanwhile has
        heard from every ingress only after a stats period). Idempotent: `dllm-serve up`
        calls it until drained, so an actor restarted meanwhile gets the order again."""
        self.draining = True
        self._prune()
        now = time.monotonic()
        live = self._live_ingresses()
        return {"ingresses": len(live), "stopped": sum(1 for r in live if r.draining),
                "in_flight": sum(r.in_flight for r in live),
                "outstanding": sum(r.outstanding for r in live), "age_s": now - self._started}

    def _live_ingresses(self) -> list[IngressReport]:
        """The last reports of the ingress replicas heard from within ``stale_after_s``."""
        now = time.monotonic()
        return [report for seen, report in self._ingress.values() if now - seen <= self.stale_after_s]

    def cluster_view(self) -> dict[str, dict]:
        """Latest routing stats per live replica, with their age in seconds."""
        self._prune()
        now = time.monotonic()
        return {r: {**stats.model_dump(), "age_s": now - self._last_seen[r]} for r, stats in self._views.items()}

    def calibration(self, window_s: float) -> dict[str, dict]:
        """What each live replica measured in the last ``window_s`` seconds, for
        `dllm-serve calibrate` (see ``replicas.telemetry.calibration_log``)."""
        self._prune()
        since = time.time() - window_s
        return {replica: log.summary(since) for replica, log in self._calibration.items()}

    def _prune(self) -> None:
        now = time.monotonic()
        for replica in [r for r, t in self._last_seen.items() if now - t > self.stale_after_s]:
            del self._last_seen[replica], self._views[replica], self._calibration[replica]
            for name in _GAUGE_SOURCES:
                self.metrics[name].remove(replica)
        self.metrics["dllm_replicas"].set(len(self._last_seen))
        # an ingress silent for stale_after_s is gone; its last totals stay, so a late report adds nothing twice
        live = self._live_ingresses()
        self.metrics["dllm_admission_outstanding"].set(sum(r.outstanding for r in live))
        if live:
            self.metrics["dllm_admission_prediction_bias"].set(sum(r.prediction_bias for r in live) / len(live))


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - scrapes are not logged
        pass


class _MetricsServer(ThreadingWSGIServer):
    """The scrape endpoint's server: SO_REUSEADDR, so that a restarted actor binds its port
    again even while connections of the dead one linger in TIME_WAIT."""

    allow_reuse_address = True
    daemon_threads = True


def serve_metrics(registry: CollectorRegistry, host: str, port: int,
                  retry_s: float = BIND_RETRY_S) -> _MetricsServer:
    """Serve ``registry`` on ``host:port`` from a daemon thread. A port still held (the
    process of the actor this one replaces may not have let go yet) is tried again every
    0.1 s for ``retry_s`` seconds."""

    class server_class(_MetricsServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    deadline = time.monotonic() + retry_s
    while True:
        try:
            server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
            break
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
    threading.Thread(target=server.serve_forever, name="dllm-metrics-http", daemon=True).start()
    return server


class MetricsActor(MetricsExporter):
    """Run as a named Ray actor: serves the registry on ``host:port`` from a thread."""

    def __init__(self, host: str, port: int, stale_after_s: float = MIN_STALE_S, slo_latency_s: float | None = None):
        super().__init__(stale_after_s, slo_latency_s)
        self.address = f"http://{host}:{port}/metrics"
        self._server = serve_metrics(self.registry, host, port)

    def ready(self) -> str:
        return self.address

    def close(self) -> None:
        """Stop serving and free the port (an actor that is killed frees it by exiting)."""
        self._server.shutdown()
        self._server.server_close()
