"""What replicas and ingress replicas say of themselves, as typed records (no torch).

They cross processes as plain dicts (Serve's routing-stats hook and Ray calls carry
those); each side builds the record from the dict once, where it arrives, and reads
fields, never keys. Missing fields take their defaults, so a report from an older
replica still reads; a field the record does not know is refused at the producer.

* ``ReplicaStats``: a replica's load, step-cost model, KV pool and identity; sent to Serve's
  router (``record_routing_stats``) and with every push to the metrics actor.
* ``ReplicaView``: the same, with its age, as the metrics actor hands it to the ingresses.
* ``IngressReport``: an ingress replica's totals since it started, once per stats period.

One staleness rule for all of them: ``stale_after_s``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

MIN_STALE_S = 10.0  # stats older than this (or 20 stats periods, if longer) no longer count


def stale_after_s(stats_period_s: float) -> float:
    """How old a replica's or an ingress's last report may be and still count (for routing,
    admission and the metrics actor alike): 20 stats periods, at least MIN_STALE_S (a busy
    machine skips a few periods)."""
    return max(MIN_STALE_S, 20 * stats_period_s)


class ReplicaStats(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # who
    replica: str = ""
    pid: int = 0
    node: str = ""
    failing_steps: int = 0  # engine steps failed in a row (the router ranks such a replica last)
    stats_time: float | None = None  # time.time() when taken
    # load: row-steps owed by its live requests, and how fast it works them off
    step_debt: float = 0.0
    live_requests: int = 0
    row_steps_per_s: float = 0.0  # measured over recent steps
    drain_row_steps_per_s: float = 0.0  # at full batch, from the step-cost model
    predicted_drain_s: float = 0.0
    # the step-cost model c0 + c1 * rows + c2 * prompt pages (``replicas.cost_model.DrainModel``), once measured
    c0: float | None = None
    c1: float | None = None
    c2: float | None = None
    max_batch: int | None = None
    measured_rows: int | None = None
    longest_request_s: float | None = None  # the longest request alone, once measured
    steps_per_block: dict[int, float] = {}  # histogram {steps: blocks}
    # CPU seconds in forwards and in engine steps since the replica started
    forward_cpu_s: float = 0.0
    step_cpu_s: float = 0.0
    # queues and pages
    waiting: int = 0
    running: int = 0
    free_pages: int = 0  # held by no request: unused, or cached and unreferenced
    total_pages: int = 0  # usable by requests
    kv_cache_bytes: int = 0  # the pool's K and V tensors (the scratch page's included)
    max_model_len: int = 0  # the longest prompt + output (tokens) it serves
    # the prefix cache (``replicas.prefix_cache``): pages in it now; totals since the start
    cached_pages: int = 0
    prefix_pages_looked_up: int = 0
    prefix_pages_hit: int = 0
    prefix_tokens_hit: int = 0
    prefix_evictions: int = 0
    quality_level: int = 0  # the load knob's level now (``replicas.quality``; 0: the default)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_pages_hit / self.prefix_pages_looked_up if self.prefix_pages_looked_up else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Share of the usable pages held by requests (a cached page no request holds counts
        as free), as vLLM's ``kv_cache_usage_perc``."""
        return (self.total_pages - self.free_pages) / self.total_pages if self.total_pages else 0.0

    @property
    def prefix_cache_share(self) -> float:
        """Share of the usable pages in the prefix cache (held by requests or not)."""
        return self.cached_pages / self.total_pages if self.total_pages else 0.0

    @property
    def drain_rate(self) -> float:
        """Row-steps per second it drains at: the full-batch model's, else the measured."""
        return max(self.drain_row_steps_per_s or self.row_steps_per_s, 1e-9)


class ReplicaView(ReplicaStats):
    age_s: float = 0.0  # seconds since the metrics actor last heard from the replica


# upper bounds (seconds) of the buckets of an ingress's HTTP response times; the last is +inf
HTTP_SECONDS_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


class IngressReport(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    admitted: int = 0
    rejected: dict[str, int] = {}  # by reason
    failovers: int = 0
    outstanding: float = 0.0  # row-steps admitted and not yet released
    prediction_bias: float = 1.0  # what admitted answers took against their predictions (``AdmissionController``)
    cpu_s: float = 0.0  # the process's CPU time since it started
    in_flight: int = 0
    draining: bool = False  # it has stopped admitting
    # every HTTP response it sent: counts by status code, and by time taken (one count per
    # HTTP_SECONDS_BOUNDS bucket, not cumulative) with their sum in seconds
    responses: dict[str, int] = {}
    response_buckets: list[int] = []
    response_seconds: float = 0.0
    stream_errors: dict[str, int] = {}  # error events that ended streams sent as 200, by the status they stand for
