"""Step-cost and step-count calibration: what the simulator and the fill-timeout rule need.

A calibration is one JSON object::

    {"c0": 0.004,                  # seconds per step, fixed part (dispatch overhead)
     "c1": 0.0003,                 # seconds per step per row in the batch
     "prefill_s": 0.002,           # optional: seconds more for a step that computes a prompt
     "max_batch": 16,              # rows per step of the measured engine
     "steps_per_block": {"2": 0.70, "3": 0.12, ...},   # P(a block takes s steps)
     "blocks_per_request": {"2": 0.17, ...},           # P(a request has k blocks)
     "step_cost_spread": [0.8, 0.9, 1.0, 1.3],   # optional, default [1.0]
     "step_cost_path": [0.51, 0.93, 0.88, 0.12, ...],  # optional, default none
     "request_overhead_s": [0.03, 0.04, 0.06],  # optional, default 0
     "load_points": [{"rate": 4, "c0": ..., "c1": ..., "prefill_s": ..., "step_cost_spread": [...],
                      "request_overhead_s": [...]}, {"rate": 20, ...}],     # optional
     "source": "free text: where the numbers come from"}

so one step of a batch of b rows, k of them starting (their prompts computed in it), costs
``c0 + c1 * b + prefill_s * k`` seconds times a multiplier drawn from ``step_cost_spread``
(equally likely values: how real steps scatter around the fit). Without a
``step_cost_path`` the multipliers are drawn independently; with one (levels in [0, 1],
the measured multipliers' ranks in time order) the simulator plays it, from a random
start and round again, and each step takes the multiplier at its level: slow steps then
come in runs as long as the measured ones.
Distributions are stored normalized, keys are positive integers (JSON strings on disk).
``request_overhead_s`` (a number or equally likely values) is the time a request spends
outside the engine (HTTP, proxy, ingress, routing, streaming back), drawn per request and
added to its simulated latency and TTFB. `dllm-serve bench engine` measures the engine
alone and leaves the optional fields at their defaults; `dllm-serve calibrate` measures
them on a live cluster.

``load_points`` (optional) hold the step costs and overheads measured at several arrival
rates per replica, because on a shared machine the serving path takes CPU from the
engine as load grows. ``at_rate(calibration, rate)`` interpolates them linearly in the
rate (clamped to the measured range; spreads and overheads quantile by quantile; a path
is taken from the nearer point), and the top-level values are those of the lowest rate.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from loadgen.capacity.step_cost import step_calibration

# Measured on the embedded tiny model (low_confidence, fp32, one torch thread on a shared
# 2-core CPU; closed fdfo batches at max_batch 1..24, 2745 blocks, 400 requests). A
# stand-in until `dllm-serve bench` writes a calibration of the engine that will serve.
DEFAULT_CALIBRATION = {
    "c0": 0.0058,
    "c1": 0.0022,
    "max_batch": 16,
    "steps_per_block": {2: 0.718, 3: 0.121, 4: 0.068, 5: 0.038, 6: 0.028, 7: 0.014, 8: 0.007, 9: 0.005},
    "blocks_per_request": {2: 0.168, 3: 0.228, 4: 0.125, 5: 0.138, 6: 0.17, 7: 0.172},
    "source": "built-in default: the tiny model on a shared 2-core CPU (illustrative, not your engine)",
}


def _distribution(raw: Mapping, name: str) -> dict[int, float]:
    """Validate and normalize ``{level: weight}`` (keys may be JSON strings)."""
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(f"calibration: {name} must be a non-empty object {{level: probability}}")
    out = {}
    for key, weight in raw.items():
        try:
            level, weight = int(key), float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"calibration: {name} has a bad entry {key!r}: {weight!r}") from None
        if level < 1 or not weight >= 0 or not np.isfinite(weight):
            raise ValueError(f"calibration: {name} needs levels >= 1 and finite weights >= 0, got {key!r}: {weight!r}")
        out[level] = out.get(level, 0.0) + weight
    total = sum(out.values())
    if total <= 0:
        raise ValueError(f"calibration: {name} has no positive weight")
    return {level: w / total for level, w in sorted(out.items()) if w > 0}


def _values(raw, name: str, positive: bool) -> list[float]:
    """A number or a non-empty list of numbers, all finite and > 0 (or >= 0), as a list."""
    items = raw if isinstance(raw, (list, tuple)) else [raw]
    try:
        values = [float(v) for v in items if not isinstance(v, bool)]
    except (TypeError, ValueError):
        values = []
    bound = "> 0" if positive else ">= 0"
    if (not values or len(values) != len(items) or not all(np.isfinite(values))
            or any(v <= 0 if positive else v < 0 for v in values)):
        raise ValueError(f"calibration: {name} must be a number or a non-empty list of numbers {bound}")
    return values


LOAD_FIELDS = ("c0", "c1", "prefill_s", "step_cost_spread", "step_cost_path", "request_overhead_s")


def _number(raw: Mapping, name: str, default: float | None = None) -> float:
    """``raw[name]`` as a finite number >= 0 (``default`` when absent, if given)."""
    if name not in raw and default is not None:
        return default
    value = raw.get(name)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"calibration: {name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not np.isfinite(number) or number < 0:
        raise ValueError(f"calibration: {name} must be a finite number >= 0, got {value!r}")
    return number


def _load_fields(raw: Mapping) -> dict:
    """The load-dependent fields of a calibration or of one of its load points, checked."""
    c0, c1 = _number(raw, "c0"), _number(raw, "c1")
    if c0 + c1 <= 0:
        raise ValueError(f"calibration: need c0 + c1 > 0, got c0={c0}, c1={c1}")
    path = raw.get("step_cost_path", [])
    if not isinstance(path, (list, tuple)) or (path and not all(0 <= v <= 1 for v in _values(
            path, "step_cost_path", positive=False))):
        raise ValueError("calibration: step_cost_path must be a list of levels in [0, 1]")
    return {"c0": c0, "c1": c1, "prefill_s": _number(raw, "prefill_s", 0.0),
            "step_cost_spread": _values(raw.get("step_cost_spread", [1.0]), "step_cost_spread", positive=True),
            "step_cost_path": [float(v) for v in path],
            "request_overhead_s": _values(raw.get("request_overhead_s", 0.0), "request_overhead_s",
                                          positive=False)}


def _load_points(raw) -> list[dict]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError("calibration: load_points must be a non-empty list of objects")
    points = []
    for index, point in enumerate(raw):
        if not isinstance(point, Mapping):
            raise ValueError("calibration: every load point must be an object with a rate")
        try:
            rate = _number(point, "rate")
            if rate <= 0:
                raise ValueError(f"calibration: rate must be > 0, got {rate}")
            points.append({"rate": rate, **_load_fields(point)})
        except ValueError as exc:
            raise ValueError(str(exc).replace("calibration: ", f"calibration: load point {index}: ", 1)) from None
    points.sort(key=lambda p: p["rate"])
    if len({p["rate"] for p in points}) != len(points):
        raise ValueError("calibration: two load points have the same rate")
    return points


def validate_calibration(raw: Mapping) -> dict:
    """A checked, normalized copy of ``raw``; ``ValueError`` naming the first bad field."""
    if not isinstance(raw, Mapping):
        raise ValueError("calibration: expected a JSON object")
    missing = [k for k in ("c0", "c1", "max_batch", "steps_per_block", "blocks_per_request") if k not in raw]
    if missing:
        raise ValueError(f"calibration: missing {', '.join(missing)}")
    max_batch = raw["max_batch"]
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"calibration: max_batch must be an integer >= 1, got {max_batch!r}")
    checked = {**_load_fields(raw), "max_batch": max_batch,
               "steps_per_block": _distribution(raw["steps_per_block"], "steps_per_block"),
               "blocks_per_request": _distribution(raw["blocks_per_request"], "blocks_per_request"),
               "source": str(raw.get("source", ""))}
    if raw.get("load_points") is not None:
        checked["load_points"] = _load_points(raw["load_points"])
        checked.update({k: checked["load_points"][0][k] for k in LOAD_FIELDS})
    return checked


def _interpolate(name: str, low, high, weight: float):
    """Linear interpolation of numbers, or of equally likely values quantile by quantile;
    a path (a sequence, not a distribution) is the nearer point's."""
    if name == "step_cost_path":
        return low if weight < 0.5 else high
    if isinstance(low, list):
        points = max(len(low), len(high))
        grid = (np.arange(points) + 0.5) / points
        low, high = np.quantile(low, grid, method="inverted_cdf"), np.quantile(high, grid, method="inverted_cdf")
        return ((1 - weight) * low + weight * high).tolist()
    return (1 - weight) * low + weight * high


def at_rate(calibration: Mapping, rate: float) -> dict:
    """The calibration with its load-dependent fields at ``rate`` requests/s per replica
    (unchanged when it has no load points)."""
    cal = validate_calibration(calibration)
    points = cal.get("load_points")
    if not points:
        return cal
    rates = [p["rate"] for p in points]
    upper = min(max(int(np.searchsorted(rates, rate)), 1), len(points) - 1) if len(points) > 1 else 0
    low, high = points[max(upper - 1, 0)], points[upper]
    span = high["rate"] - low["rate"]
    weight = min(max((rate - low["rate"]) / span, 0.0), 1.0) if span > 0 else 0.0
    return {**cal, **{k: _interpolate(k, low[k], high[k], weight) for k in LOAD_FIELDS}}


def fit_calibration(step_records: Iterable[tuple[int, int, float]], block_steps: Iterable[int],
                    blocks_per_request: Iterable[int], prefix_units_per_request: float, max_batch: int,
                    source: str = "fit") -> dict:
    """A calibration from an engine run: per-step (rows, prompt units, seconds), steps of
    every committed block, blocks of every finished request, mean prompt units per request."""
    return validate_calibration({
        **step_calibration(step_records, prefix_units_per_request), "max_batch": max_batch,
        "steps_per_block": Counter(int(s) for s in block_steps),
        "blocks_per_request": Counter(int(k) for k in blocks_per_request),
        "source": source})


def save_calibration(calibration: Mapping, path: str | Path) -> None:
    checked = validate_calibration(calibration)
    for name in ("steps_per_block", "blocks_per_request"):
        checked[name] = {str(k): round(v, 6) for k, v in checked[name].items()}
    Path(path).write_text(json.dumps(checked, indent=2) + "\n")


def load_calibration(path: str | Path) -> dict:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read calibration {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration {path} is not JSON: {exc.msg} (line {exc.lineno})") from None
    return validate_calibration(raw)
