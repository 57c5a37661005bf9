"""Discrete-event simulator of a dllm-serve cluster, for capacity planning.

N identical replicas sit behind the cluster's step-aware admission and drain-time router.
Each replica runs one scheduler policy with the engine's exact semantics (see
``replicas/scheduler.py``); a step of b rows costs ``c0 + c1 * b`` seconds and every
block of a request takes a number of steps drawn from the calibration:

* ``fdfo``: after every step done rows move on or leave and waiting requests fill free
  rows; optionally a step may be held to let arrivals join (``fdfo_hold``, the rule of
  ``replicas.fill_timeout.fdfo_hold``).
* ``sync``: the batch runs until every row's block is done (done rows still computed),
  then rows move on, finished ones leave and new ones join.
* ``static``: block rounds like ``sync``; new requests join only when the whole batch
  has finished (finished rows still computed until then).
* ``fixed_fill``: ``static``, but a batch starts only when ``max_batch`` requests wait
  or the oldest has waited the fill timeout τ (default: the analytic τ).

Modelled as in the cluster: a request is charged ``max blocks x steps-per-block
quantile`` row-steps at admission, released as its rows advance and in full when it
ends; admission refuses when the cluster's outstanding charge would pass
``max_step_debt`` per replica (an idle cluster always admits); routing sends to the
replica with the least step debt (all replicas drain at the same rate, so least debt is
least predicted drain time), ties in turn. Simplifications: prefill is fused with the
first block's step, a replica's debt drops when a step or round starts, arrival
knowledge is exact (fdfo hold and analytic τ use the true per-replica rate).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from loadgen.calibration import validate_calibration
from replicas.fill_timeout import batch_capacity, fdfo_hold, optimal_fill_timeout

POLICIES = ("static", "sync", "fixed_fill", "fdfo")
_DENOISE, _BLOCK_DONE, _FINISHED = 0, 1, 2


# ---- workloads -------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Requests in arrival order: arrival seconds, blocks, and steps of every block."""

    arrival: np.ndarray  # float [n], sorted
    blocks: np.ndarray  # int [n]
    steps: np.ndarray  # int [n, max blocks]; steps[i, j] for j < blocks[i]

    @property
    def rate(self) -> float:
        """Mean arrival rate (requests per second) over the arrival span."""
        n = len(self.arrival)
        span = self.arrival[-1] - self.arrival[0] if n > 1 else 0.0
        return (n - 1) / span if span > 0 else 0.0


def _draw(rng: np.random.Generator, dist: Mapping[int, float], size) -> np.ndarray:
    levels = np.fromiter(dist, dtype=np.int64)
    return rng.choice(levels, size=size, p=np.fromiter(dist.values(), dtype=float))


def trace_workload(calibration: Mapping, arrival_times, seed: int = 0) -> Workload:
    """Requests at the given arrival times with blocks and steps drawn from the calibration."""
    cal = validate_calibration(calibration)
    arrival = np.sort(np.asarray(arrival_times, dtype=float))
    if arrival.ndim != 1 or len(arrival) == 0 or not np.all(np.isfinite(arrival)):
        raise ValueError("a workload needs at least one finite arrival time")
    rng = np.random.default_rng([seed, 1])
    blocks = _draw(rng, cal["blocks_per_request"], len(arrival))
    steps = _draw(rng, cal["steps_per_block"], (len(arrival), max(cal["blocks_per_request"])))
    return Workload(arrival, blocks, steps)


def poisson_workload(calibration: Mapping, rate: float, requests: int, seed: int = 0) -> Workload:
    """``requests`` Poisson arrivals of ``rate`` per second. The same seed gives the same
    requests at every rate (gaps are unit-rate draws scaled by 1/rate)."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"the arrival rate must be a positive number, got {rate}")
    if requests < 1:
        raise ValueError(f"need at least one request, got {requests}")
    gaps = np.random.default_rng([seed, 0]).exponential(1.0, requests)
    return trace_workload(calibration, np.cumsum(gaps) / rate, seed)


# ---- one replica -------------------------------------------------------------------------
class _Ledger:
    """What the run records, shared by the replicas: per-request times and charges."""

    def __init__(self, workload: Workload, cost: float):
        n = len(workload.arrival)
        self.arrival = workload.arrival.tolist()
        self.blocks = workload.blocks.tolist()
        self.steps = workload.steps.tolist()
        self.cost = cost
        self.charge = [0.0] * n
        self.outstanding = 0.0
        self.ttfb = [math.nan] * n
        self.finish = [math.nan] * n
        self.replica = [-1] * n

    def release(self, replica: _Replica, req: int, steps: float) -> None:
        amount = min(self.charge[req], steps)
        self.charge[req] -= amount
        replica.debt -= amount
        self.outstanding -= amount


class _Replica:
    """One engine: a FIFO queue and rows ``[request, block, steps left, state]``."""

    def __init__(self, ledger: _Ledger, policy: str, max_batch: int, c0: float, c1: float,
                 fill_timeout: float, hold_rate: float | None):
        self.ledger = ledger
        self.policy = policy
        self.max_batch = max_batch
        self.c0, self.c1 = c0, c1
        self.fill_timeout = fill_timeout
        self.hold_rate = hold_rate
        self.queue: deque[int] = deque()
        self.rows: list[list[int]] = []
        self.free_at = 0.0  # end of the step or round in progress
        self.hold_from: float | None = None  # fdfo: start of the current hold
        self.debt = 0.0

    def enqueue(self, req: int) -> None:
        self.queue.append(req)
        self.debt += self.ledger.cost
        self.ledger.charge[req] = self.ledger.cost
        self.ledger.outstanding += self.ledger.cost

    def decide(self, now: float, next_arrival: float) -> float:
        """Act at ``now`` (the replica is not in a step); returns when to act next."""
        round_over = self._end_round()
        if self.queue and self._admission_open(now, round_over):
            while self.queue and len(self.rows) < self.max_batch:
                req = self.queue.popleft()
                self.rows.append([req, 0, self.ledger.steps[req][0], _DENOISE])
        if not self.rows:
            if self.queue and self.policy == "fixed_fill":
                return self.ledger.arrival[self.queue[0]] + self.fill_timeout
            return math.inf
        if self.hold_rate is not None:
            if self.hold_from is None:
                self.hold_from = now
            hold = fdfo_hold(self.hold_rate, len(self.rows), self.max_batch, self.c0, self.c1)
            if now < self.hold_from + hold:
                return self.hold_from + hold
            self.hold_from = None
        return self._run(now, next_arrival)

    def _end_round(self) -> bool:
        """Advance done rows and release finished ones where the policy allows."""
        rows = self.rows
        if self.policy != "fdfo" and any(r[3] == _DENOISE for r in rows):
            return False
        keep_finished = self.policy in ("static", "fixed_fill")
        kept = []
        for row in rows:
            if row[3] == _BLOCK_DONE:
                row[1] += 1
                row[2] = self.ledger.steps[row[0]][row[1]]
                row[3] = _DENOISE
            elif row[3] == _FINISHED and not keep_finished:
                continue
            kept.append(row)
        if keep_finished and all(r[3] == _FINISHED for r in kept):
            kept = []
        self.rows = kept
        return True

    def _admission_open(self, now: float, round_over: bool) -> bool:
        if self.policy == "fdfo":
            return True
        if self.policy == "sync":
            return round_over
        if self.rows:
            return False
        if self.policy == "static" or len(self.queue) >= self.max_batch:
            return True
        return now >= self.ledger.arrival[self.queue[0]] + self.fill_timeout

    def _run(self, now: float, next_arrival: float) -> float:
        """Run the next steps with the rows fixed: one step for fdfo (as many as nothing can
        change: until the first block ends or the next arrival), a whole round otherwise."""
        ledger, rows = self.ledger, self.rows
        step = self.c0 + self.c1 * len(rows)
        active = [r for r in rows if r[3] == _DENOISE]
        if self.policy != "fdfo":
            count = max(r[2] for r in active)
        elif len(rows) == self.max_batch or self.hold_rate is None:
            count = min(r[2] for r in active)
            if len(rows) < self.max_batch and next_arrival < now + count * step:
                count = max(1, math.ceil((next_arrival - now) / step))
        else:
            count = 1
        for row in active:
            req, block = row[0], row[1]
            taken = min(row[2], count)
            row[2] -= taken
            ledger.release(self, req, taken)
            if row[2] == 0:
                done_at = now + taken * step
                if block == 0:
                    ledger.ttfb[req] = done_at - ledger.arrival[req]
                if block == ledger.blocks[req] - 1:
                    ledger.finish[req] = done_at
                    ledger.release(self, req, math.inf)
                    row[3] = _FINISHED
                else:
                    row[3] = _BLOCK_DONE
        self.free_at = now + count * step
        return self.free_at


# ---- the cluster ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SimResult:
    arrival: np.ndarray
    latency: np.ndarray  # seconds, nan if refused
    ttfb: np.ndarray  # time to the first committed block, nan if refused
    refused: np.ndarray  # bool
    replica: np.ndarray  # int, -1 if refused
    fill_timeout: float | None  # the τ fixed_fill used


def admission_cost(calibration: Mapping, quantile: float = 1.0) -> float:
    """Row-steps charged per request: most blocks x the quantile of steps per block."""
    cal = validate_calibration(calibration)
    levels = np.fromiter(cal["steps_per_block"], dtype=float)
    cdf = np.cumsum(np.fromiter(cal["steps_per_block"].values(), dtype=float))
    steps = levels[min(np.searchsorted(cdf, quantile - 1e-12), len(levels) - 1)]
    return max(cal["blocks_per_request"]) * float(steps)


def simulate(calibration: Mapping, workload: Workload, policy: str, replicas: int = 1,
             fill_timeout: float | None = None, fdfo_fill_hold: bool = False,
             max_step_debt: float | None = None, cost_quantile: float = 1.0) -> SimResult:
    """Run ``workload`` through ``replicas`` replicas of ``policy``.

    ``fill_timeout``: fixed_fill's τ in seconds (None: the analytic τ at the per-replica
    rate). ``fdfo_fill_hold``: fdfo holds under-filled steps by the fill-hold rule.
    ``max_step_debt``: row-steps the cluster may owe per replica (None: admit all).
    """
    cal = validate_calibration(calibration)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if replicas < 1:
        raise ValueError(f"need at least one replica, got {replicas}")
    if fill_timeout is not None and not fill_timeout >= 0:
        raise ValueError(f"the fill timeout must be >= 0 seconds, got {fill_timeout}")
    rate = workload.rate / replicas
    args = (cal["max_batch"], cal["c0"], cal["c1"], cal["steps_per_block"], cal["blocks_per_request"])
    tau = None
    if policy == "fixed_fill":
        tau = optimal_fill_timeout(rate, *args) if fill_timeout is None else fill_timeout
    hold_rate = rate if policy == "fdfo" and fdfo_fill_hold else None
    ledger = _Ledger(workload, admission_cost(cal, cost_quantile))
    fleet = [_Replica(ledger, policy, cal["max_batch"], cal["c0"], cal["c1"], tau or 0.0, hold_rate)
             for _ in range(replicas)]
    limit = math.inf if max_step_debt is None else max_step_debt * replicas
    wake = [math.inf] * replicas  # when each replica acts next
    events: list[tuple[float, int]] = []
    turn = 0

    def act_until(t: float, next_arrival: float) -> None:
        while events and events[0][0] <= t:
            when, i = heapq.heappop(events)
            if when == wake[i]:
                wake[i] = fleet[i].decide(when, next_arrival)
                if wake[i] < math.inf:
                    heapq.heappush(events, (wake[i], i))

    arrivals = ledger.arrival
    for req, t in enumerate(arrivals):
        act_until(t, t)
        if ledger.outstanding > 1e-9 and ledger.outstanding + ledger.cost > limit:
            continue
        least = min(r.debt for r in fleet)
        tied = [i for i, r in enumerate(fleet) if r.debt <= least + 1e-9]
        target = tied[turn % len(tied)]
        turn += 1
        fleet[target].enqueue(req)
        ledger.replica[req] = target
        if fleet[target].free_at <= t and wake[target] != t:
            wake[target] = t
            heapq.heappush(events, (t, target))
        nxt = arrivals[req + 1] if req + 1 < len(arrivals) else math.inf
        act_until(t, nxt)
    act_until(math.inf, math.inf)
    replica = np.asarray(ledger.replica)
    return SimResult(workload.arrival, np.asarray(ledger.finish) - workload.arrival, np.asarray(ledger.ttfb),
                     replica < 0, replica, tau)
