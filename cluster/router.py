"""Serve request router: send each request to the replica that will drain first, or to
the one that holds its prompt's prefix if that one drains nearly as soon.

A replica's predicted drain time is its step debt divided by its drain rate at full batch
(``drain_row_steps_per_s``, the rate admission predicts with), from the routing stats
Serve collects every ``stats_period_s``. Between two collections the router adds the
cost of what it routed itself, so a burst does not all land on the replica that looked
idlest at the last collection. Replicas whose stats are missing or stale come next, where
Serve picks the shortest queue. The replicas whose engine steps are failing (from their
stats) or that just failed a request in this process (``avoid``, told by
``cluster.failover``) are offered only when no other replica is up: a request, a resumed
one above all, waits for room on a healthy replica rather than spill onto one that fails
it at once (and so always has room).

Prefix affinity: the router remembers which replica it last sent each prompt page
(``GenerateRequest.prefix_hashes``, bounded, least recently used first out); a request
goes to the replica that was sent its longest prefix, whose prefix cache likely holds it,
unless that replica's predicted drain time is more than ``prefix_affinity_s`` above the
soonest one's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from replicas.messages import GenerateRequest
from replicas.telemetry.reports import MIN_STALE_S, ReplicaStats

MAX_REMEMBERED_PAGES = 200_000  # prefix hashes a router keeps (a few MB)
# a request for an adapter goes to a replica that holds it when that one drains within this of the
# soonest (loading an adapter takes the time of reading it; queueing behind others may take longer)
ADAPTER_AFFINITY_S = 2.0
T = TypeVar("T")
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


class PrefixMemory:
    """Which replica was last sent each prompt page (by its ``page_hashes``), the least
    recently sent forgotten first beyond ``capacity`` pages."""

    def __init__(self, capacity: int = MAX_REMEMBERED_PAGES):
        self.capacity = capacity
        self._replica: OrderedDict[int, str] = OrderedDict()

    def record(self, hashes: tuple[int, ...], replica: str) -> None:
        for page in hashes:
            self._replica[page] = replica
            self._replica.move_to_end(page)
        while len(self._replica) > self.capacity:
            self._replica.popitem(last=False)

    def holder(self, hashes: tuple[int, ...]) -> str | None:
        """The replica last sent the longest of these prefixes, if any was sent."""
        pages = self.known_pages(hashes)
        return self._replica[hashes[pages - 1]] if pages else None

    def known_pages(self, hashes: tuple[int, ...]) -> int:
        """How many first pages of these the longest prefix that was sent has (a page's hash
        covers the pages before it)."""
        for pages in range(len(hashes), 0, -1):
            if hashes[pages - 1] in self._replica:
                return pages
        return 0


def affinity_first(fresh: list[tuple[float, str, T]], holder: str | None, slack_s: float) -> list[T]:
    """The replicas of ``fresh`` (predicted drain, id, replica) soonest drain first, but the
    ``holder`` of the request's prefix first when it drains within ``slack_s`` of the soonest."""
    ranked = sorted(fresh, key=lambda item: item[0])
    near = [item for item in ranked if item[1] == holder and item[0] <= ranked[0][0] + slack_s]
    if near:
        ranked.remove(near[0])
        ranked.insert(0, near[0])
    return [replica for _, _, replica in ranked]


def holders_first(ranked: list[tuple[float, T]], holds: Callable[[T], bool], slack_s: float) -> list[T]:
    """The replicas of ``ranked`` (predicted drain, replica; in the order to try), those that
    ``holds`` (a request's adapter) and drain within ``slack_s`` of the soonest moved to the
    front: a replica that must load the adapter first is tried first only when those are busier."""
    soonest = min((drain for drain, _ in ranked), default=0.0)
    near = [replica for drain, replica in ranked if holds(replica) and drain <= soonest + slack_s]
    return near + [replica for _, replica in ranked if replica not in near]


def ranks_for_serve(ranked: list[T], stale: list[T], failing: list[T]) -> list[list[T]]:
    """Serve's ranks (it tries each in turn, and waits and asks again when all are full):
    each ``ranked`` replica on its own, then the ``stale`` ones together; the ``failing``
    ones only when there is no other."""
    ranks = [[replica] for replica in ranked] + ([stale] if stale else [])
    return ranks or ([failing] if failing else [])


class DrainTimeRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, stale_after_s: float = MIN_STALE_S, prefix_affinity_s: float = 0.0, **kwargs) -> None:
        self.stale_after_s = stale_after_s
        self.prefix_affinity_s = prefix_affinity_s
        self.prefixes = PrefixMemory()
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
        holder = self.prefixes.holder(_prefix_hashes(pending_request))
        ranked = affinity_first([(drain, replica.replica_id.unique_id, replica) for drain, replica in fresh],
                                holder, self.prefix_affinity_s)
        adapter = _adapter(pending_request)
        if adapter is not None:
            drains = {replica.replica_id: drain for drain, replica in fresh}
            ranked = holders_first([(drains[replica.replica_id], replica) for replica in ranked],
                                   lambda replica: adapter in replica.multiplexed_model_ids, ADAPTER_AFFINITY_S)
        return ranks_for_serve(ranked, [replica for _, replica in stale], failing)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self.prefixes.record(_prefix_hashes(pending_request), replica_id.unique_id)
        cost = _request_cost(pending_request)
        replica = next((r for r in self.curr_replicas.values() if r.replica_id == replica_id), None)
        if replica is None or not cost:
            return
        stats_time = self.stats(replica).stats_time
        seen_at, routed = self._routed_since_stats.get(replica_id.unique_id, (stats_time, 0.0))
        if seen_at != stats_time:
            routed = 0.0
        self._routed_since_stats[replica_id.unique_id] = (stats_time, routed + cost)


def _job(pending_request: PendingRequest | None) -> GenerateRequest | None:
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], GenerateRequest):
        return None
    return pending_request.args[0]


def _request_cost(pending_request: PendingRequest | None) -> float:
    job = _job(pending_request)
    return (job.cost or 0.0) if job is not None else 0.0


def _adapter(pending_request: PendingRequest | None) -> str | None:
    job = _job(pending_request)
    return job.adapter if job is not None else None


def _prefix_hashes(pending_request: PendingRequest | None) -> tuple[int, ...]:
    job = _job(pending_request)
    return job.prefix_hashes if job is not None else ()
