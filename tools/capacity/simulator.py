"""Discrete-event simulator of a dllm-serve cluster, for capacity planning.

N identical replicas sit behind the cluster's step-aware admission and drain-time router.
Each replica runs one scheduler mode and decides with the engine's own batching rules
(``replicas.batching``: round ends, admission, fixed_fill's fill wait, fdfo's hold), so it
makes the engine's decisions by construction. A step of b rows costs ``c0 + c1 * b``
seconds, plus ``prefill_s`` for each request whose prompt it computes (a request's first
step), and every block of a request takes a number of steps drawn from the calibration.
fdfo holds under-filled steps for arrivals by ``replicas.fill_timeout.fdfo_hold`` unless
``fdfo_fill_hold=False`` (as the engine); fixed_fill's timeout τ defaults to the analytic
one (``replicas.fill_timeout.optimal_fill_timeout``).

Modelled as in the cluster: a request is charged ``replicas.request_cost.request_cost`` (most
blocks x a steps-per-block quantile) row-steps at admission, released as its rows advance
and in full when it ends; admission refuses when the cluster's outstanding charge would
pass ``max_step_debt`` per replica (an idle cluster always admits); routing sends to the
replica with the least step debt (all replicas drain at the same rate, so least debt is
least predicted drain time), ties in turn. Each step's cost is multiplied by a draw from
the calibration's ``step_cost_spread`` (in the order of its ``step_cost_path`` when it
has one), and each request's latency and TTFB get a draw from its
``request_overhead_s`` (the request path outside the engine); with load points, these
are taken at the workload's mean arrival rate per replica. ``ReplayedSteps`` replays a
measured run's step costs instead. Simplifications: prefill is fused with the first
block's step, a replica's debt drops when a step or round starts, arrival knowledge is
exact (fdfo hold and analytic τ use the true per-replica rate).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tools.capacity.calibration import Calibration, LoadCosts
from replicas.batching import MODES, Phase, RowAction, SchedulerMode, batching_policy
from replicas.fill_timeout import batch_capacity, fdfo_hold, optimal_fill_timeout
from replicas.request_cost import request_cost, steps_quantile
from replicas.quality import QualityKnob, QualityLevel


# ---- workloads -------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Requests in arrival order: arrival seconds, blocks, and steps of every block."""

    arrival: np.ndarray  # float [n], sorted
    blocks: np.ndarray  # int [n]
    steps: np.ndarray  # int [n, max blocks]; steps[i, j] for j < blocks[i]
    seed: int = 0  # of the draws made while simulating (step-cost spread, request overhead)

    @property
    def rate(self) -> float:
        """Mean arrival rate (requests per second) over the arrival span."""
        n = len(self.arrival)
        span = self.arrival[-1] - self.arrival[0] if n > 1 else 0.0
        return (n - 1) / span if span > 0 else 0.0


def _draw(rng: np.random.Generator, dist: Mapping[int, float], size) -> np.ndarray:
    levels = np.fromiter(dist, dtype=np.int64)
    return rng.choice(levels, size=size, p=np.fromiter(dist.values(), dtype=float))


def trace_workload(calibration: Calibration | Mapping, arrival_times, seed: int = 0) -> Workload:
    """Requests at the given arrival times with blocks and steps drawn from the calibration."""
    cal = Calibration.of(calibration)
    arrival = np.sort(np.asarray(arrival_times, dtype=float))
    if arrival.ndim != 1 or len(arrival) == 0 or not np.all(np.isfinite(arrival)):
        raise ValueError("a workload needs at least one finite arrival time")
    rng = np.random.default_rng([seed, 1])
    blocks = _draw(rng, cal.blocks_per_request, len(arrival))
    steps = _draw(rng, cal.steps_per_block, (len(arrival), max(cal.blocks_per_request)))
    return Workload(arrival, blocks, steps, seed)


def poisson_workload(calibration: Calibration | Mapping, rate: float, requests: int, seed: int = 0) -> Workload:
    """``requests`` Poisson arrivals of ``rate`` per second. The same seed gives the same
    requests at every rate (gaps are unit-rate draws scaled by 1/rate)."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"the arrival rate must be a positive number, got {rate}")
    if requests < 1:
        raise ValueError(f"need at least one request, got {requests}")
    gaps = np.random.default_rng([seed, 0]).exponential(1.0, requests)
    return trace_workload(calibration, np.cumsum(gaps) / rate, seed)


# ---- step costs ------------------------------------------------------------------------
class StepCosts(Protocol):
    def step_ends(self, now: float, rows: int, starting: int, count: int,
                  until: float = math.inf) -> list[float]:
        """When each of ``count`` consecutive steps of ``rows`` rows ends, the first of them
        computing ``starting`` requests' prompts; fewer when one ends at or after ``until``
        (that one is the last)."""


def _cut(ends: list[float], until: float) -> list[float]:
    return ends[:bisect.bisect_left(ends, until) + 1]


class CalibratedSteps:
    """Step costs of a calibration: ``c0 + c1 * rows``, ``prefill_s`` more per starting
    request, times one of its equally likely ``step_cost_spread`` multipliers, drawn
    independently, or, given a ``step_cost_path`` (measured levels in time order), the
    value at the path's next level: the path is played from a random start and round
    again, so that slow steps come in runs as long as the measured ones."""

    def __init__(self, costs: LoadCosts, rng: np.random.Generator):
        self.c0, self.c1, self.prefill_s = costs.c0, costs.c1, costs.prefill_s
        self.multipliers = np.sort(np.asarray(costs.step_cost_spread, dtype=float))
        n = len(self.multipliers)
        path = np.asarray(costs.step_cost_path, dtype=float)
        self.path = np.minimum((path * n).astype(np.int64), n - 1)
        self.rng = rng
        self.position = int(rng.integers(len(self.path))) if len(self.path) else 0

    def step_ends(self, now: float, rows: int, starting: int, count: int, until: float = math.inf) -> list[float]:
        step, extra = self.c0 + self.c1 * rows, self.prefill_s * starting
        if len(self.multipliers) == 1:
            m = float(self.multipliers[0])
            return _cut([now + extra * m + k * step * m for k in range(1, count + 1)], until)
        if len(self.path):
            drawn = self.multipliers[self.path[(self.position + np.arange(count)) % len(self.path)]]
        else:
            drawn = self.multipliers[self.rng.integers(len(self.multipliers), size=count)]
        costs = step * drawn
        costs[0] += extra * drawn[0]
        ends = _cut((now + np.cumsum(costs)).tolist(), until)
        if len(self.path):
            self.position = (self.position + len(ends)) % len(self.path)
        return ends


class ReplayedSteps:
    """The step costs of a measured run, replayed: the k-th simulated step costs
    ``seconds[k]`` whatever its rows. ``taken`` records each step's (rows, starting
    requests), to set beside the measured run's."""

    def __init__(self, seconds: Sequence[float]):
        self.seconds = list(seconds)
        self.taken: list[tuple[int, int]] = []

    def step_ends(self, now: float, rows: int, starting: int, count: int, until: float = math.inf) -> list[float]:
        ends = []
        for k in range(count):
            if len(self.taken) == len(self.seconds):
                raise ValueError(f"the replay ran out of measured steps ({len(self.seconds)})")
            now += self.seconds[len(self.taken)]
            self.taken.append((rows, starting if k == 0 else 0))
            ends.append(now)
            if now >= until:
                break
        return ends


# ---- the load knob ---------------------------------------------------------------------------
@dataclass(frozen=True)
class KnobModel:
    """The load knob (``replicas.quality``) in the simulator: each replica moves a knob as
    the engine replica does, on its step debt over its full-batch drain rate, and a request
    that arrives while its replica's knob is at level n runs every block in
    ``step_ratios[n - 1]`` x the steps drawn for it (rounded at random to keep the mean;
    the ratio of the level's steps per block to the default's, e.g. from `dllm-serve bench
    quality`). Every request allows it; while every replica's knob is at level n or
    deeper, admission charges a request that ratio of its cost, as the ingress does."""

    step_ratios: tuple[float, ...]
    slo_s: float
    raise_at: float = 0.8
    lower_at: float = 0.4
    hold_s: float = 2.0

    def knob(self, clock: Callable[[], float]) -> QualityKnob:
        """A replica's knob, its levels the ratios (no algorithm, nothing lost: every level usable)."""
        levels = [QualityLevel("", {}, 0.0, ratio) for ratio in self.step_ratios]
        return QualityKnob(levels, self.slo_s, raise_at=self.raise_at, lower_at=self.lower_at, hold_s=self.hold_s,
                           clock=clock)


def _scaled(steps: list[int], ratio: float, rng: np.random.Generator) -> list[int]:
    """``steps`` x ``ratio``, each rounded up or down at random so that the mean is kept, at least 1."""
    scaled = np.asarray(steps, dtype=float) * ratio
    return np.maximum(1, np.floor(scaled + rng.random(len(steps)))).astype(int).tolist()


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
        self.level = [0] * n  # the load knob's level each request ran at


class _Replica:
    """One engine: a FIFO queue and rows ``[request, block, steps left, phase]``."""

    def __init__(self, ledger: _Ledger, mode: SchedulerMode, max_batch: int, fill_timeout: float,
                 hold: Callable[[int], float], steps: StepCosts):
        self.ledger = ledger
        self.policy = batching_policy(mode)
        self.max_batch = max_batch
        self.fill_timeout = fill_timeout
        self.hold = hold  # seconds an under-filled fdfo step may wait for arrivals, given its rows
        self.steps = steps
        self.queue: deque[int] = deque()
        self.rows: list[list] = []
        self.free_at = 0.0  # end of the step or round in progress
        self.hold_from: float | None = None  # fdfo: start of the current hold
        self.debt = 0.0

    def enqueue(self, req: int, cost: float) -> None:
        """Queue ``req``, charged ``cost`` row-steps."""
        self.queue.append(req)
        self.debt += cost
        self.ledger.charge[req] = cost
        self.ledger.outstanding += cost

    def decide(self, now: float, next_arrival: float) -> float:
        """Act at ``now`` (the replica is not in a step); returns when to act next."""
        actions = self.policy.end_of_round([row[3] for row in self.rows])
        if actions is not None:
            self._end_round(actions)
        if self.queue and self.policy.admits(len(self.rows), actions is not None):
            if self.policy.waits_to_fill(len(self.rows), len(self.queue), self.max_batch):
                deadline = self.ledger.arrival[self.queue[0]] + self.fill_timeout
                if now < deadline:
                    return deadline
            while self.queue and len(self.rows) < self.max_batch:
                req = self.queue.popleft()
                self.rows.append([req, 0, self.ledger.steps[req][0], Phase.DENOISE])
        if not self.rows:
            return math.inf
        hold = 0.0
        if self.policy.may_hold_for_arrivals(len(self.queue), len(self.rows), self.max_batch):
            hold = self.hold(len(self.rows))
            if self.hold_from is None:
                self.hold_from = now
            if now < self.hold_from + hold:
                return self.hold_from + hold
        self.hold_from = None
        return self._run(now, next_arrival, one_step=hold > 0)

    def _end_round(self, actions: list[RowAction]) -> None:
        kept = []
        for row, action in zip(self.rows, actions):
            if action is RowAction.RELEASE:
                continue
            if action is RowAction.ADVANCE:
                row[1] += 1
                row[2] = self.ledger.steps[row[0]][row[1]]
                row[3] = Phase.DENOISE
            kept.append(row)
        self.rows = kept

    def _run(self, now: float, next_arrival: float, one_step: bool) -> float:
        """Run the next steps with the rows fixed: a whole round, or for fdfo as many steps
        as nothing can change (until the first block ends, or an arrival could join), one
        while holding for arrivals."""
        ledger, rows = self.ledger, self.rows
        active = [r for r in rows if r[3] is Phase.DENOISE]
        until = math.inf
        if self.policy.mode is not SchedulerMode.FDFO:
            count = max(r[2] for r in active)
        elif one_step:
            count = 1
        else:
            count = min(r[2] for r in active)
            if len(rows) < self.max_batch:
                until = next_arrival
        starting = sum(1 for r in active if r[1] == 0 and r[2] == ledger.steps[r[0]][0])
        ends = self.steps.step_ends(now, len(rows), starting, count, until)
        count = len(ends)
        charge, released = ledger.charge, 0.0
        for row in active:
            req, block, left = row[0], row[1], row[2]
            taken = left if left < count else count
            row[2] = left - taken
            if left == taken:
                done_at = ends[taken - 1]
                if block == 0:
                    ledger.ttfb[req] = done_at - ledger.arrival[req]
                if block == ledger.blocks[req] - 1:
                    ledger.finish[req] = done_at
                    taken = charge[req]  # the rest of its charge
                    row[3] = Phase.FINISHED
                else:
                    row[3] = Phase.BLOCK_DONE
            taken = min(charge[req], taken)
            charge[req] -= taken
            released += taken
        self.debt -= released
        ledger.outstanding -= released
        self.free_at = ends[-1]
        return self.free_at


# ---- the cluster ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SimResult:
    """Per request, in arrival order."""

    arrival: np.ndarray
    latency: np.ndarray  # seconds, nan if refused
    ttfb: np.ndarray  # time to the first committed block, nan if refused
    refused: np.ndarray  # bool
    replica: np.ndarray  # int, -1 if refused
    fill_timeout: float | None  # the τ fixed_fill used
    quality_level: np.ndarray | None = None  # int: the load knob's level each request ran at (None: no knob)


def admission_cost(calibration: Calibration | Mapping, quantile: float = 1.0) -> float:
    """Row-steps charged per request: most blocks x the quantile of steps per block."""
    cal = Calibration.of(calibration)
    most_blocks = max(cal.blocks_per_request)
    return request_cost(most_blocks, 1, steps_quantile(cal.steps_per_block, quantile))  # blocks of one


def simulate(calibration: Calibration | Mapping, workload: Workload, policy: str, replicas: int = 1,
             fill_timeout: float | None = None, fdfo_fill_hold: bool = True,
             max_step_debt: float | None = None, cost_quantile: float = 1.0,
             step_costs: StepCosts | None = None, knob: KnobModel | None = None) -> SimResult:
    """Run ``workload`` through ``replicas`` replicas of scheduler mode ``policy``.

    ``fill_timeout``: fixed_fill's τ in seconds (None: the analytic τ at the per-replica
    rate). ``fdfo_fill_hold``: fdfo holds under-filled steps by the fill-hold rule (the
    engine's default). ``max_step_debt``: row-steps the cluster may owe per replica (None:
    admit all). ``step_costs``: where step costs come from (None: the calibration's, see
    ``CalibratedSteps``; ``ReplayedSteps`` replays a measured run). ``knob``: the load
    knob on every replica (None: none).
    """
    if policy not in MODES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(MODES)}")
    if replicas < 1:
        raise ValueError(f"need at least one replica, got {replicas}")
    if fill_timeout is not None and not fill_timeout >= 0:
        raise ValueError(f"the fill timeout must be >= 0 seconds, got {fill_timeout}")
    if max_step_debt is not None and not max_step_debt > 0:
        raise ValueError(f"the step-debt bound must be > 0 row-steps, got {max_step_debt}")
    mode = SchedulerMode(policy)
    rate = workload.rate / replicas
    cal = Calibration.of(calibration).at_rate(rate)
    max_batch, c0, c1 = cal.max_batch, cal.c0, cal.c1
    tau = None
    if mode is SchedulerMode.FIXED_FILL:
        tau = optimal_fill_timeout(rate, max_batch, c0, c1, cal.steps_per_block, cal.blocks_per_request) \
            if fill_timeout is None else fill_timeout

    def hold(rows: int) -> float:
        return fdfo_hold(rate, rows, max_batch, c0, c1) if fdfo_fill_hold else 0.0

    ledger = _Ledger(workload, admission_cost(cal, cost_quantile))
    rng = np.random.default_rng([workload.seed, 2])
    steps = CalibratedSteps(cal, rng) if step_costs is None else step_costs
    fleet = [_Replica(ledger, mode, max_batch, tau or 0.0, hold, steps) for _ in range(replicas)]
    limit = math.inf if max_step_debt is None else max_step_debt * replicas
    wake = [math.inf] * replicas  # when each replica acts next
    events: list[tuple[float, int]] = []
    turn = 0
    now = [0.0]  # the arrival being routed: the knobs' clock
    knobs = [knob.knob(lambda: now[0]) for _ in fleet] if knob else []
    drain_rate = max_batch / (c0 + c1 * max_batch)  # row-steps per second at full batch
    knob_rng = np.random.default_rng([workload.seed, 3])

    def act_before(t: float) -> None:
        """Every replica decision due before ``t`` (arrivals at t join decisions at t)."""
        while events and events[0][0] < t:
            when, i = heapq.heappop(events)
            if when == wake[i]:
                wake[i] = fleet[i].decide(when, t)
                if wake[i] < math.inf:
                    heapq.heappush(events, (wake[i], i))

    for req, t in enumerate(ledger.arrival):
        act_before(t)
        cost = ledger.cost
        if knobs:  # as the ingress charges: at the least degraded replica's level
            now[0] = t
            charged_at = min(knobs, key=lambda k: k.level)
            if charged_at.level:
                cost *= charged_at.levels[charged_at.level - 1].step_ratio
        if ledger.outstanding > 1e-9 and ledger.outstanding + cost > limit:
            continue
        least = min(r.debt for r in fleet)
        tied = [i for i, r in enumerate(fleet) if r.debt <= least + 1e-9]
        target = tied[turn % len(tied)]
        turn += 1
        if knobs:
            level = knobs[target].observe(fleet[target].debt / drain_rate)
            if level:
                ledger.steps[req] = _scaled(ledger.steps[req], knobs[target].levels[level - 1].step_ratio, knob_rng)
                ledger.level[req] = level
        fleet[target].enqueue(req, cost)
        ledger.replica[req] = target
        if fleet[target].free_at <= t and wake[target] != t:
            wake[target] = t
            heapq.heappush(events, (t, target))
    act_before(math.inf)
    replica = np.asarray(ledger.replica)
    overhead = rng.choice(cal.request_overhead_s, size=len(workload.arrival))
    return SimResult(workload.arrival, np.asarray(ledger.finish) - workload.arrival + overhead,
                     np.asarray(ledger.ttfb) + overhead, replica < 0, replica, tau,
                     np.asarray(ledger.level) if knob else None)


# ---- summaries -------------------------------------------------------------------------------
def slo_attainment(result: SimResult, slo_latency: float) -> float:
    """Fraction of offered requests (refused ones included) done within ``slo_latency``."""
    if not slo_latency > 0:
        raise ValueError(f"the latency SLO must be > 0 seconds, got {slo_latency}")
    return float(np.mean(np.nan_to_num(result.latency, nan=math.inf) <= slo_latency))


def summarize(result: SimResult, slo_latency: float | None = None) -> dict:
    """Counts, latency and TTFB percentiles (seconds), throughput and goodput (requests/s)."""
    done = ~np.isnan(result.latency)
    span = float(np.max(result.arrival[done] + result.latency[done]) - result.arrival[0]) if done.any() else 0.0
    summary = {"offered": len(result.arrival), "completed": int(done.sum()), "refused": int(result.refused.sum()),
               "fill_timeout_s": result.fill_timeout}
    for name, values in (("latency", result.latency[done]), ("ttfb", result.ttfb[done])):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_s"] = float(np.percentile(values, q)) if done.any() else None
        summary[f"{name}_mean_s"] = float(values.mean()) if done.any() else None
    summary["throughput_rps"] = summary["completed"] / span if span > 0 else 0.0
    if result.quality_level is not None:
        summary["degraded"] = int((result.quality_level[done] > 0).sum())
    if slo_latency is not None:
        summary["slo_attainment"] = slo_attainment(result, slo_latency)
        summary["goodput_rps"] = float((result.latency[done] <= slo_latency).sum()) / span if span > 0 else 0.0
    return summary


# ---- questions: sweeps and searches -------------------------------------------------------
def throughput_bound(calibration: Calibration | Mapping) -> float:
    """Requests per second no policy can beat on one replica: full batches every step."""
    cal = Calibration.of(calibration)
    row_steps = sum(k * p for k, p in cal.blocks_per_request.items()) * sum(
        s * p for s, p in cal.steps_per_block.items())
    return cal.max_batch / ((cal.c0 + cal.c1 * cal.max_batch) * row_steps)


def fixed_fill_capacity(calibration: Calibration | Mapping) -> float:
    """Requests per second of one replica running full batch-synchronous batches."""
    cal = Calibration.of(calibration)
    return batch_capacity(cal.max_batch, cal.c0, cal.c1, cal.steps_per_block, cal.blocks_per_request)


def run(calibration: Calibration | Mapping, policy: str, rate: float, requests: int = 4000, seed: int = 0,
        **options) -> SimResult:
    """Simulate ``requests`` Poisson arrivals at ``rate`` (options as for ``simulate``)."""
    return simulate(calibration, poisson_workload(calibration, rate, requests, seed), policy, **options)


def compare(calibration: Calibration | Mapping, workload: Workload, policies, slo_latency: float | None = None,
            rate: float | None = None, **options) -> list[dict]:
    """One summary per policy on the same workload, labelled with ``rate`` (default: the
    workload's mean arrival rate)."""
    label = workload.rate if rate is None else float(rate)
    return [{"policy": policy, "rate": label,
             **summarize(simulate(calibration, workload, policy, **options), slo_latency)}
            for policy in policies]


def sweep(calibration: Calibration | Mapping, policies, rates, requests: int = 4000, seed: int = 0,
          slo_latency: float | None = None, **options) -> list[dict]:
    """One summary per (rate, policy), the same requests at every rate."""
    return [row for rate in rates
            for row in compare(calibration, poisson_workload(calibration, rate, requests, seed), policies,
                               slo_latency, rate, **options)]


def _check_attainment(attainment: float) -> None:
    if not 0 < attainment <= 1:
        raise ValueError(f"the SLO attainment must be in (0, 1], got {attainment}")


def find_max_rate(calibration: Calibration | Mapping, policy: str, slo_latency: float, attainment: float = 0.99,
                  requests: int = 4000, seed: int = 0, tolerance: float = 0.01, **options) -> float:
    """Largest arrival rate (requests/s, to ``tolerance`` relative) at which at least
    ``attainment`` of the offered requests finish within ``slo_latency``; 0 if none does.
    Bisection below the fleet's throughput bound; a looser SLO never gives a lower rate."""
    _check_attainment(attainment)

    def meets(rate: float) -> bool:
        return slo_attainment(run(calibration, policy, rate, requests, seed, **options), slo_latency) >= attainment

    low, high = 0.0, throughput_bound(calibration) * options.get("replicas", 1)
    if meets(high):
        return high
    while high - low > tolerance * high:
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low


def find_replicas(calibration: Calibration | Mapping, policy: str, rate: float, slo_latency: float,
                  attainment: float = 0.99, requests: int = 4000, seed: int = 0,
                  max_replicas: int = 1024, **options) -> int | None:
    """Fewest replicas that keep ``attainment`` of requests within ``slo_latency`` at
    ``rate``; None if ``max_replicas`` do not."""
    _check_attainment(attainment)
    workload = poisson_workload(calibration, rate, requests, seed)

    def meets(replicas: int) -> bool:
        result = simulate(calibration, workload, policy, replicas=replicas, **options)
        return slo_attainment(result, slo_latency) >= attainment

    low, high = 0, max(1, math.ceil(rate / throughput_bound(calibration)))  # low fails (or is 0)
    while not meets(high):
        if high >= max_replicas:
            return None
        low, high = high, min(2 * high, max_replicas)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if meets(middle) else (middle, high)
    return high


def tau_table(calibration: Calibration | Mapping, rates, requests: int = 20000, seed: int = 0,
              grid: int = 10) -> list[dict]:
    """Analytic fill timeout against the best of a simulated sweep, one row per rate:
    rate, analytic τ, best simulated τ, mean latency at each, and the gap in percent.
    The sweep tries τ = 0 and ``grid`` geometric steps from a tenth of a single
    request's service to twice the expected fill time (B−1)/λ."""
    cal = Calibration.of(calibration)
    single = 1.0 / batch_capacity(1, cal.c0, cal.c1, cal.steps_per_block, cal.blocks_per_request)
    rows = []
    for rate in rates:
        workload = poisson_workload(cal, rate, requests, seed)

        def mean_latency(tau: float | None) -> tuple[float, float]:
            result = simulate(cal, workload, "fixed_fill", fill_timeout=tau)
            return result.fill_timeout, float(np.nanmean(result.latency))

        analytic, at_analytic = mean_latency(None)
        top = max(2 * (cal.max_batch - 1) / rate, 2 * single)
        swept = [mean_latency(tau) for tau in [0.0, *np.geomspace(single / 10, top, grid)]]
        best, at_best = min(swept, key=lambda item: item[1])
        rows.append({"rate": float(rate), "analytic_tau_s": analytic, "best_tau_s": best,
                     "analytic_latency_s": at_analytic, "best_latency_s": at_best,
                     "gap_percent": 100 * (at_analytic / at_best - 1)})
    return rows


def plot_sweep(rows: list[dict], path: str, slo_latency: float | None = None) -> None:
    """Mean and p99 latency against arrival rate, one colour per policy (PNG)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(row["policy"] for row in rows):
        mine = [row for row in rows if row["policy"] == policy]
        rates = [r["rate"] for r in mine]
        line, = ax.plot(rates, [r["latency_mean_s"] for r in mine], marker="o", label=f"{policy} mean")
        ax.plot(rates, [r["latency_p99_s"] for r in mine], ls="--", color=line.get_color(), label=f"{policy} p99")
    if slo_latency is not None:
        ax.axhline(slo_latency, color="black", lw=0.8, label="SLO")
    ax.set(xlabel="arrival rate (requests/s)", ylabel="latency (s)", yscale="log", title="simulated latency vs load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_rows(rows: list[dict], columns: list[str]) -> str:
    """A plain text table of ``columns`` of ``rows`` (numbers to 4 significant digits)."""
    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    table = [columns] + [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(text.rjust(w) for text, w in zip(line, widths)) for line in table)
