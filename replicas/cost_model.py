"""Online estimates of what the fill-timeout rule needs: arrival rate, step cost, step counts.

* arrival rate λ: arrivals in the last ``RATE_WINDOW_S`` seconds (so it decays to 0 when
  arrivals stop, e.g. at the tail of a closed batch, and nothing waits for them);
* step cost c0 + c1·b + c2·p: non-negative least squares over recent steps' (rows b,
  prompt pages computed p, step seconds), so that prefill is a cost of its own, not an
  average folded into the rows' (admission charges a prompt's uncached pages at c2);
  the offline fits of the simulator's calibration (per load) are here too;
* steps per block and blocks per request: counts since start (the replica's one count
  of steps per block: its monitor reports ``steps_per_block_counts``; until a real block
  has committed, the warm-up's counts, ``prior_steps_per_block``).

``DrainModel`` is what admission, routing and autoscaling predict with: the step cost fit,
the batch it may be trusted up to, and the drain rate it implies.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from replicas.fill_timeout import fdfo_hold, optimal_fill_timeout
from replicas.telemetry.reports import ReplicaStats


RATE_WINDOW_S = 2.0


def fit_step_cost(step_records: Iterable[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(c0, c1)`` of ``step_seconds ≈ c0 + c1 * batch_size``, both >= 0.

    With a single batch size the split is unknowable: everything goes to c0. A negative
    coefficient is clipped to 0 and the other refitted alone.
    """
    data = np.asarray(list(step_records), dtype=float).reshape(-1, 2)
    if len(data) == 0:
        raise ValueError("fit: no step records")
    b, t = data[:, 0], data[:, 1]
    if np.any(b < 1) or not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError("fit: step records need batch_size >= 1 and finite step_seconds >= 0")
    if np.ptp(b) == 0:
        return float(t.mean()), 0.0
    c1, c0 = np.polyfit(b, t, 1)
    if c1 < 0:
        return float(t.mean()), 0.0
    if c0 < 0:
        return 0.0, float((b * t).sum() / (b * b).sum())
    return float(c0), float(c1)


def fit_step_cost_with_prefill(step_records: Iterable[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Non-negative least squares ``(c0, c1, c2)`` of
    ``step_seconds ≈ c0 + c1 * rows + c2 * prompt_units``."""
    (c0,), c1, c2 = fit_step_cost_by_load([step_records])
    return c0, c1, c2


def fit_step_cost_by_load(loads: Sequence[Iterable[tuple[int, int, float]]]) -> tuple[list[float], float, float]:
    """Non-negative least squares of ``step_seconds ≈ c0[load] + c1 * rows + c2 * prompt_units``
    over (rows, prompt units, seconds) of steps measured at several loads: one fixed cost
    per load, per-row and per-prompt-unit costs shared. The shared terms are compute;
    what the serving path takes from the engine grows with load and lands in each load's
    c0 (a light load alone has few steps with many rows and splits c0 and c1 poorly).
    With few terms the exact answer is the best fit, over the subsets of terms (the fixed
    costs all in or all out), whose coefficients are all >= 0; a subset without the fixed
    costs and the rows (prompt units alone) is no candidate: it would price a step that
    computes no prompt at nothing."""
    groups = [np.asarray(list(records), dtype=float).reshape(-1, 3) for records in loads]
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError("fit: no step records")
    data = np.concatenate(groups)
    load = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    terms = np.column_stack([load == k for k in range(len(groups))] + [data[:, 0], data[:, 1]]).astype(float)
    seconds = data[:, 2]
    fixed, rows, units = list(range(len(groups))), len(groups), len(groups) + 1
    best = (np.inf, np.array([g[:, 2].mean() for g in groups] + [0.0, 0.0]))
    for subset in (fixed + [rows, units], fixed + [rows], fixed + [units], [rows, units], fixed, [rows]):
        coef = np.linalg.lstsq(terms[:, subset], seconds, rcond=None)[0]
        residual = float(((terms[:, subset] @ coef - seconds) ** 2).sum())
        if np.all(coef >= 0) and residual < best[0] - 1e-15:
            full = np.zeros(terms.shape[1])
            full[subset] = coef
            best = (residual, full)
    return [float(c) for c in best[1][:rows]], float(best[1][rows]), float(best[1][units])


def fit_online_step_cost(step_records: Iterable[tuple[int, int, float]]) -> tuple[float, float, float]:
    """``(c0, c1, c2)`` of ``step seconds ≈ c0 + c1 * rows + c2 * prompt pages`` over a
    replica's recent steps (``fit_step_cost_with_prefill``), but where every step had the
    same rows the split between c0 and c1 is unknowable and c1 is 0 (as ``fit_step_cost``)."""
    data = np.asarray(list(step_records), dtype=float).reshape(-1, 3)
    if len(data) == 0:
        raise ValueError("fit: no step records")
    if np.ptp(data[:, 0]) == 0:
        data = np.column_stack([np.zeros(len(data)), data[:, 1:]])
    terms = np.column_stack([np.ones(len(data)), data[:, :2]])
    coef = np.linalg.lstsq(terms, data[:, 2], rcond=None)[0]
    if np.all(coef >= 0):  # the usual case, and then the best non-negative fit: no subsets to try
        return float(coef[0]), float(coef[1]), float(coef[2])
    return fit_step_cost_with_prefill(data)


@dataclass(frozen=True)
class DrainModel:
    """A replica's step cost ``c0 + c1 * rows`` seconds, fitted on batches of up to
    ``measured_rows`` rows, with at most ``max_batch`` rows per step, and ``c2`` seconds
    more for each prompt page a step computes (prefill; a page the prefix cache holds is
    not computed).

    ``rate(rows)`` is the row-steps per second drained at that batch, rows / step seconds;
    it grows with the batch (c0 is shared). It never extrapolates past ``measured_rows``:
    a fit of light-load steps cannot tell c1 from c0 (all of one batch size gives c1 = 0),
    and a full batch would look far faster than it is.
    """

    c0: float
    c1: float
    max_batch: int
    measured_rows: int
    c2: float = 0.0

    def page_row_steps(self, rows: int | None = None) -> float:
        """What computing one prompt page costs, in row-steps at ``rows`` rows: the page's
        seconds at that batch's drain rate (admission charges a prompt's uncached pages so)."""
        return self.c2 * self.rate(rows)

    def step_s(self, rows: int) -> float:
        return self.c0 + self.c1 * max(1, min(rows, self.max_batch))

    def rate(self, rows: int | None = None) -> float:
        """Row-steps per second at ``rows`` rows (default: a full batch)."""
        rows = max(1, min(self.max_batch if rows is None else rows, self.max_batch, self.measured_rows))
        return rows / max(self.step_s(rows), 1e-9)

    def as_stats(self) -> dict:
        return {"c0": self.c0, "c1": self.c1, "c2": self.c2, "max_batch": self.max_batch,
                "measured_rows": self.measured_rows}

    @classmethod
    def from_stats(cls, stats: ReplicaStats) -> "DrainModel | None":
        """The model in a replica's routing stats, or None when it has not measured one."""
        if stats.c0 is None:
            return None
        return cls(stats.c0, stats.c1, stats.max_batch, stats.measured_rows, stats.c2 or 0.0)


def mean_steps(counts: Mapping[int, float]) -> float | None:
    """Mean of a steps-per-block histogram {steps: count}; None when it is empty."""
    total = sum(counts.values())
    return sum(int(k) * v for k, v in counts.items()) / total if total > 0 else None


REFIT_EVERY_STEPS = 16


class OnlineCostModel:
    def __init__(self, max_batch: int, window: int = 512, clock: Callable[[], float] = time.monotonic):
        self.max_batch = max_batch
        self.clock = clock  # the clock arrivals are timed on
        self._lock = threading.Lock()
        self._arrivals: deque[float] = deque(maxlen=window)
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)  # (rows, prompt pages, seconds)
        self._steps_seen = 0
        self._fit: tuple[int, tuple[float, float, float]] | None = None  # (steps seen then, (c0, c1, c2))
        self.steps_per_block: Counter = Counter()
        self.blocks_per_request: Counter = Counter()
        self._prior_steps_per_block: Counter = Counter()  # the warm-up's, until real blocks are counted

    def observe_arrival(self, at: float) -> None:
        with self._lock:
            self._arrivals.append(at)

    def observe_step(self, rows: int, seconds: float, block_steps: tuple[int, ...], prompt_pages: int = 0) -> None:
        """``prompt_pages``: the prompt pages the step computed (prefill)."""
        with self._lock:
            self._steps.append((rows, prompt_pages, seconds))
            self._steps_seen += 1
            counts = self.steps_per_block
            for steps in block_steps:  # not Counter.update: 12 against 8 us a step after a forward
                counts[steps] += 1

    def forget(self, steps: bool = True) -> None:
        """Drop the counts (a warm-up's requests say nothing of real ones), and the step
        records too unless ``steps`` is False."""
        with self._lock:
            self._arrivals.clear()
            self.steps_per_block.clear()
            self.blocks_per_request.clear()
            if steps:
                self._steps.clear()
                self._fit = None

    def prior_steps_per_block(self, counts: Mapping[int, int]) -> None:
        """Steps per block to report until a real block commits (the warm-up's blocks: what
        the model measured on this machine, where the algorithm's worst case is all that is
        known otherwise)."""
        with self._lock:
            self._prior_steps_per_block = Counter(counts)

    def observe_finished(self, blocks: int) -> None:
        with self._lock:
            self.blocks_per_request[blocks] += 1

    def steps_per_block_counts(self) -> dict[int, int]:
        """{steps: blocks committed after that many steps} since start (a copy); before any,
        the prior (``prior_steps_per_block``)."""
        with self._lock:
            return dict(self.steps_per_block or self._prior_steps_per_block)

    def arrival_rate(self) -> float:
        """Arrivals per second over the last ``RATE_WINDOW_S`` seconds (arrivals come in
        time order: older ones are dropped from the front, not counted at every step)."""
        since = self.clock() - RATE_WINDOW_S
        arrivals = self._arrivals
        while arrivals and arrivals[0] < since:  # in arrival order: the old ones are on the left
            arrivals.popleft()
        return len(arrivals) / RATE_WINDOW_S

    def step_cost(self) -> tuple[float, float]:
        """(c0, c1) of step seconds = c0 + c1 x rows (+ c2 x prompt pages, ``drain_model``)
        over the recent steps, refitted once ``REFIT_EVERY_STEPS`` steps have come since the
        last fit (an under-filled fdfo step asks every time, and one more step of a window of
        hundreds moves the fit by nothing: a fit per step cost about as much CPU as the rest
        of the scheduler)."""
        return self._step_cost()[:2]

    def _step_cost(self) -> tuple[float, float, float]:
        if not self._steps:
            return 0.0, 0.0, 0.0
        if self._fit is None or self._steps_seen - self._fit[0] >= REFIT_EVERY_STEPS:
            self._fit = self._steps_seen, fit_online_step_cost(self._steps)
        return self._fit[1]

    def drain_model(self) -> DrainModel | None:
        """The step cost over the recent steps as a ``DrainModel``; None before any step."""
        with self._lock:
            if not self._steps:
                return None
            c0, c1, c2 = self._step_cost()
            measured = max(rows for rows, _, _ in self._steps)
        return DrainModel(c0, c1, self.max_batch, measured, c2)

    def request_alone_s(self, blocks: int) -> float | None:
        """Seconds a request of ``blocks`` blocks takes at full batch, with the mean measured
        steps per block; None until a step and a block have been measured."""
        model = self.drain_model()
        steps = mean_steps(self.steps_per_block_counts())
        if model is None or steps is None:
            return None
        return blocks * steps * model.step_s(self.max_batch)

    def fill_timeout(self) -> float:
        """The analytic fixed-fill timeout for the current estimates (0 while nothing is known)."""
        with self._lock:
            rate = self.arrival_rate()
            c0, c1 = _rounded(self.step_cost())
            steps = _probabilities(self.steps_per_block)
            blocks = _probabilities(self.blocks_per_request)
        if rate <= 0 or not steps or not blocks:
            return 0.0
        return optimal_fill_timeout(rate, self.max_batch, c0, c1, steps, blocks)

    def fdfo_hold(self, rows: int) -> float:
        """How long an under-filled FDFO step may wait for an arrival."""
        with self._lock:
            rate = self.arrival_rate()
            c0, c1 = self.step_cost()
        return fdfo_hold(rate, rows, self.max_batch, c0, c1)


def _rounded(cost: tuple[float, float]) -> tuple[float, float]:
    """Three significant digits, so that the analytic model's cache is hit."""
    return tuple(float(f"{c:.3g}") for c in cost)


def _probabilities(counts: Counter) -> dict[int, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {}
