"""Serve request router: send each request to the replica that will drain first.

A replica's predicted drain time is its step debt divided by its drain rate at full batch
(``drain_row_steps_per_s``, the rate admission predicts with), from the routing stats
Serve collects every ``stats_period_s``. Between two collections the router adds the
cost of what it routed itself, so a burst does not all land on the replica that looked
idlest at the last collection. Replicas whose stats are missing or stale come next, where
Serve picks the shortest queue; last come the replicas whose engine steps are failing
(from their stats) or that just failed a request in this process (``avoid``, told by
``cluster.failover``), so a resumed request goes elsewhere while another replica can take it.
"""

from __future__ import annotations

import time

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from replicas.messages import GenerateRequest
from replicas.reports import MIN_STALE_S, ReplicaStats

_avoid_until: dict[str, float] = {}  # replica id -> until when (monotonic) to rank it last


def avoid(replica_id: str, for_s: float) -> None:
    """Rank ``replica_id`` last in this process's routers for the next ``for_s`` seconds."""
    _avoid_until[replica_id] = time.monotonic() + for_s


def _avoided(replica_id: str) -> bool:
    until = _avoid_until.get(replica_id)
    if until is None:
        return False
    if until < time.monotonic():
        del _avoid_until[replica_id]
        return False
    return True


class DrainTimeRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, stale_after_s: float = MIN_STALE_S, **kwargs) -> None:
        self.stale_after_s = stale_after_s
        self._routed_since_stats: dict[str, tuple[float, float]] = {}  # replica -> (stats_time, cost)
        self._parsed: dict[str, tuple[dict, ReplicaStats]] = {}  # replica -> (Serve's dict, its record)

    def stats(self, replica: RunningReplica) -> ReplicaStats:
        """The replica's last routing stats (``record_routing_stats``), read once per collection."""
        raw = replica.routing_stats or {}
        key = replica.replica_id.unique_id
        cached = self._parsed.get(key)
        if cached is None or cached[0] is not raw:
            cached = self._parsed[key] = (raw, ReplicaStats.model_validate(raw))
        return cached[1]

    def predicted_drain_s(self, replica: RunningReplica) -> float | None:
        stats = self.stats(replica)
        if stats.stats_time is None or time.time() - stats.stats_time > self.stale_after_s:
            return None
        seen_at, routed = self._routed_since_stats.get(replica.replica_id.unique_id, (stats.stats_time, 0.0))
        if seen_at != stats.stats_time:
            routed = 0.0
        return (stats.step_debt + routed) / stats.drain_rate

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        fresh, stale, failing = [], [], []
        for replica in candidate_replicas:
            if _avoided(replica.replica_id.unique_id) or self.stats(replica).failing_steps:
                failing.append(replica)
                continue
            drain = self.predicted_drain_s(replica)
            (stale if drain is None else fresh).append((drain, replica))
        ranks = [[replica] for _, replica in sorted(fresh, key=lambda item: item[0])]
        return [rank for rank in (*ranks, [replica for _, replica in stale], failing) if rank]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        cost = _request_cost(pending_request)
        replica = next((r for r in self.curr_replicas.values() if r.replica_id == replica_id), None)
        if replica is None or not cost:
            return
        stats_time = self.stats(replica).stats_time
        seen_at, routed = self._routed_since_stats.get(replica_id.unique_id, (stats_time, 0.0))
        if seen_at != stats_time:
            routed = 0.0
        self._routed_since_stats[replica_id.unique_id] = (stats_time, routed + cost)


def _request_cost(pending_request: PendingRequest | None) -> float:
    if pending_request is None or not pending_request.args:
        return 0.0
    job = pending_request.args[0]
    return (job.cost or 0.0) if isinstance(job, GenerateRequest) else 0.0
