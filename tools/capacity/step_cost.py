"""The simulator's step-cost calibration from measured steps.

The fits themselves (``c0 + c1 * rows + c2 * prompt units``, non-negative, per load or
not) are the engine's, ``replicas.cost_model``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from replicas.cost_model import fit_step_cost_with_prefill


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
