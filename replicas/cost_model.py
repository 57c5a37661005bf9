"""Online estimates of what the fill-timeout rule needs: arrival rate, step cost, step counts.

* arrival rate λ: arrivals in the last ``RATE_WINDOW_S`` seconds (so it decays to 0 when
  arrivals stop, e.g. at the tail of a closed batch, and nothing waits for them);
* step cost c0 + c1·b: least squares over recent (rows, step seconds) pairs;
* steps per block and blocks per request: counts since start.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence

import numpy as np

from replicas.fill_timeout import fdfo_hold, optimal_fill_timeout


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
    c0. (At a light load few steps have many rows, so a fit of that load alone splits
    c0 and c1 poorly: c1 ranged 1.3-2.3 ms between runs at 4 req/s on the tiny model.)
    With few terms the exact answer is the best fit, over the subsets of terms (the fixed
    costs all in or all out), whose coefficients are all >= 0."""
    groups = [np.asarray(list(records), dtype=float).reshape(-1, 3) for records in loads]
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError("fit: no step records")
    data = np.concatenate(groups)
    load = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    terms = np.column_stack([load == k for k in range(len(groups))] + [data[:, 0], data[:, 1]]).astype(float)
    seconds = data[:, 2]
    fixed, rows, units = list(range(len(groups))), len(groups), len(groups) + 1
    best = (np.inf, np.array([g[:, 2].mean() for g in groups] + [0.0, 0.0]))
    for subset in (fixed + [rows, units], fixed + [rows], fixed + [units], [rows, units], fixed, [rows], [units]):
        coef = np.linalg.lstsq(terms[:, subset], seconds, rcond=None)[0]
        residual = float(((terms[:, subset] @ coef - seconds) ** 2).sum())
        if np.all(coef >= 0) and residual < best[0] - 1e-15:
            full = np.zeros(terms.shape[1])
            full[subset] = coef
            best = (residual, full)
    return [float(c) for c in best[1][:rows]], float(best[1][rows]), float(best[1][units])


def step_calibration(step_records: Iterable[tuple[int, int, float]], prompt_units_per_request: float,
                     points: int = 100, path_length: int = 8192,
                     cost: tuple[float, float, float] | None = None) -> dict:
    """The step-cost part of a simulator calibration from (rows, prompt units, seconds) of
    real steps in time order: ``c0 + c1 * rows`` per step, ``prefill_s`` more for each
    request whose prompt the step computes (``c2`` x its mean prompt units); ``cost``:
    these ``(c0, c1, c2)`` instead of a fit of these steps alone. Also
    ``step_cost_spread``: measured seconds over the fit as ``points`` equally likely
    multipliers (how much real steps scatter, e.g. when other processes take the CPU for a
    while), and ``step_cost_path``: the level (rank as a fraction in [0, 1)) of each of the
    last ``path_length`` steps' multipliers, in time order. Slow steps come in runs that
    last seconds (lag-10 correlation about 0.2 on a shared 2-core machine); the simulator
    replays this path so that the runs, which make the latency tail, keep their shape."""
    data = np.asarray(list(step_records), dtype=float).reshape(-1, 3)
    c0, c1, c2 = fit_step_cost_with_prefill(data) if cost is None else cost
    fitted = c0 + c1 * data[:, 0] + c2 * data[:, 1]
    if np.any(fitted <= 0):
        raise ValueError("step calibration: the fitted cost is not positive for every step")
    ratios = data[:, 2] / fitted
    spread = np.quantile(ratios, (np.arange(points) + 0.5) / points)
    return {"c0": c0, "c1": c1, "prefill_s": c2 * prompt_units_per_request,
            "step_cost_spread": [round(float(r), 4) for r in spread],
            "step_cost_path": rank_levels(ratios[-path_length:])}


def rank_levels(series: np.ndarray) -> list[float]:
    """Each value's rank as a level in [0, 1): (rank + 0.5) / n, to 4 decimals."""
    ranks = np.argsort(np.argsort(series, kind="stable"), kind="stable")
    return [round((int(r) + 0.5) / len(series), 4) for r in ranks]


class OnlineCostModel:
    def __init__(self, max_batch: int, window: int = 512):
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._arrivals: deque[float] = deque(maxlen=window)
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self.steps_per_block: Counter = Counter()
        self.blocks_per_request: Counter = Counter()

    def observe_arrival(self, at: float) -> None:
        with self._lock:
            self._arrivals.append(at)

    def observe_step(self, rows: int, seconds: float, block_steps: tuple[int, ...]) -> None:
        with self._lock:
            self._steps.append((rows, seconds))
            self.steps_per_block.update(block_steps)

    def observe_finished(self, blocks: int) -> None:
        with self._lock:
            self.blocks_per_request[blocks] += 1

    def arrival_rate(self) -> float:
        """Arrivals per second over the last ``RATE_WINDOW_S`` seconds."""
        since = time.monotonic() - RATE_WINDOW_S
        return sum(1 for t in self._arrivals if t >= since) / RATE_WINDOW_S

    def step_cost(self) -> tuple[float, float]:
        """(c0, c1) of step seconds = c0 + c1 x rows over the recent steps."""
        return fit_step_cost(self._steps) if self._steps else (0.0, 0.0)

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
