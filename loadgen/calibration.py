"""Step-cost and step-count calibration: what the simulator and the fill-timeout rule need.

A calibration is one JSON object::

    {"c0": 0.004,                  # seconds per step, fixed part (dispatch overhead)
     "c1": 0.0003,                 # seconds per step per row in the batch
     "max_batch": 16,              # rows per step of the measured engine
     "steps_per_block": {"2": 0.70, "3": 0.12, ...},   # P(a block takes s steps)
     "blocks_per_request": {"2": 0.17, ...},           # P(a request has k blocks)
     "step_cost_spread": [0.8, 0.9, 1.0, 1.3],   # optional, default [1.0]
     "request_overhead_s": [0.03, 0.04, 0.06],  # optional, default 0
     "source": "free text: where the numbers come from"}

so one step of a batch of b rows costs ``c0 + c1 * b`` seconds times a multiplier drawn
from ``step_cost_spread`` (equally likely values: how real steps scatter around the fit).
Distributions are stored normalized, keys are positive integers (JSON strings on disk).
``request_overhead_s`` (a number or equally likely values) is the time a request spends
outside the engine (HTTP, proxy, ingress, routing, streaming back), drawn per request and
added to its simulated latency and TTFB. `dllm-serve bench engine` measures the engine
alone and leaves both optional fields at their defaults; `dllm-serve calibrate` measures
them on a live cluster.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from replicas.cost_model import cost_spread, fit_step_cost

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


def validate_calibration(raw: Mapping) -> dict:
    """A checked, normalized copy of ``raw``; ``ValueError`` naming the first bad field."""
    if not isinstance(raw, Mapping):
        raise ValueError("calibration: expected a JSON object")
    missing = [k for k in ("c0", "c1", "max_batch", "steps_per_block", "blocks_per_request") if k not in raw]
    if missing:
        raise ValueError(f"calibration: missing {', '.join(missing)}")
    try:
        c0, c1, max_batch = float(raw["c0"]), float(raw["c1"]), raw["max_batch"]
    except (TypeError, ValueError):
        raise ValueError("calibration: c0 and c1 must be numbers") from None
    if not (np.isfinite(c0) and np.isfinite(c1)) or c0 < 0 or c1 < 0 or c0 + c1 <= 0:
        raise ValueError(f"calibration: need c0, c1 >= 0 and c0 + c1 > 0, got c0={c0}, c1={c1}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"calibration: max_batch must be an integer >= 1, got {max_batch!r}")
    spread = _values(raw.get("step_cost_spread", [1.0]), "step_cost_spread", positive=True)
    overhead = _values(raw.get("request_overhead_s", 0.0), "request_overhead_s", positive=False)
    return {"c0": c0, "c1": c1, "max_batch": max_batch, "step_cost_spread": spread, "request_overhead_s": overhead,
            "steps_per_block": _distribution(raw["steps_per_block"], "steps_per_block"),
            "blocks_per_request": _distribution(raw["blocks_per_request"], "blocks_per_request"),
            "source": str(raw.get("source", ""))}


def fit_calibration(step_records: Iterable[tuple[int, float]], block_steps: Iterable[int],
                    blocks_per_request: Iterable[int], max_batch: int, source: str = "fit") -> dict:
    """A calibration from an engine run: per-step (rows, seconds), steps of every committed
    block, and blocks of every finished request."""
    step_records = list(step_records)
    c0, c1 = fit_step_cost(step_records)
    return validate_calibration({
        "c0": c0, "c1": c1, "max_batch": max_batch, "step_cost_spread": cost_spread(step_records, c0, c1),
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
