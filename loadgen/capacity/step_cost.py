"""Offline fits of the step cost ``c0 + c1 * rows + c2 * prompt units`` to measured steps.

The engine's own online fit (``c0 + c1 * rows`` over recent steps) is
``replicas.cost_model.fit_step_cost``; these fits build the simulator's calibration.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def fit_step_cost_with_prefill(step_records: Iterable[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Non-negative least squares ``(c0, c1, c2)`` of
    ``step_seconds ≈ c0 + c1 * rows + c2 * prefix_units``."""
    (c0,), c1, c2 = fit_step_cost_by_load([step_records])
    return c0, c1, c2


def fit_step_cost_by_load(loads: Sequence[Iterable[tuple[int, int, float]]]) -> tuple[list[float], float, float]:
    """Non-negative least squares of ``step_seconds ≈ c0[load] + c1 * rows + c2 * prefix_units``
    over (rows, prompt units, seconds) of steps measured at several loads: one fixed cost
    per load, per-row and per-prompt-unit costs shared. The shared terms are compute;
    what the serving path takes from the engine grows with load and lands in each load's
    c0 (a light load alone has few steps with many rows and splits c0 and c1 poorly).
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


def step_calibration(step_records: Iterable[tuple[int, int, float]], prefix_units_per_request: float,
                     points: int = 100, path_length: int = 8192,
                     cost: tuple[float, float, float] | None = None) -> dict:
    """The step-cost part of a simulator calibration from (rows, prompt units, seconds) of
    real steps in time order: ``c0 + c1 * rows`` per step, ``prefill_s`` more for each
    request whose prompt the step computes (``c2`` x its mean prompt units); ``cost``:
    these ``(c0, c1, c2)`` instead of a fit of these steps alone. Also
    ``step_cost_spread``: measured seconds over the fit as ``points`` equally likely
    multipliers (how much real steps scatter, e.g. when other processes take the CPU for a
    while), and ``step_cost_path``: the level (rank as a fraction in [0, 1)) of each of the
    last ``path_length`` steps' multipliers, in time order. Slow steps come in runs; the
    simulator replays this path so that the runs, which make the latency tail, keep their
    shape."""
    data = np.asarray(list(step_records), dtype=float).reshape(-1, 3)
    c0, c1, c2 = fit_step_cost_with_prefill(data) if cost is None else cost
    fitted = c0 + c1 * data[:, 0] + c2 * data[:, 1]
    if np.any(fitted <= 0):
        raise ValueError("step calibration: the fitted cost is not positive for every step")
    ratios = data[:, 2] / fitted
    spread = np.quantile(ratios, (np.arange(points) + 0.5) / points)
    return {"c0": c0, "c1": c1, "prefill_s": c2 * prefix_units_per_request,
            "step_cost_spread": [round(float(r), 4) for r in spread],
            "step_cost_path": rank_levels(ratios[-path_length:])}


def rank_levels(series: np.ndarray) -> list[float]:
    """Each value's rank as a level in [0, 1): (rank + 0.5) / n, to 4 decimals."""
    ranks = np.argsort(np.argsort(series, kind="stable"), kind="stable")
    return [round((int(r) + 0.5) / len(series), 4) for r in ranks]
