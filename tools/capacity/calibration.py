"""Step-cost and step-count calibration: what the simulator and the fill-timeout rule need.

A calibration is a ``Calibration`` (a pydantic model: the schema below is its fields,
checked once where one is read), on disk one JSON object::

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
engine as load grows. ``Calibration.at_rate(rate)`` interpolates them linearly in the
rate (clamped to the measured range; spreads and overheads quantile by quantile; a path
is taken from the nearer point), and the top-level values are those of the lowest rate.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from tools.capacity.step_cost import step_calibration


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a number, not true/false")
    return value


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else [value]


Number = Annotated[float, BeforeValidator(_not_bool), Field(ge=0, allow_inf_nan=False)]
Positive = Annotated[float, BeforeValidator(_not_bool), Field(gt=0, allow_inf_nan=False)]
Level = Annotated[float, BeforeValidator(_not_bool), Field(ge=0, le=1)]
# a number or a non-empty list of numbers: equally likely values
Values = Annotated[list[Number], BeforeValidator(_as_list), Field(min_length=1)]
PositiveValues = Annotated[list[Positive], BeforeValidator(_as_list), Field(min_length=1)]


class LoadCosts(BaseModel):
    """The step costs and request overheads measured at one load."""

    model_config = ConfigDict(frozen=True)  # fields it does not know (a newer file's) are left out

    c0: Number  # seconds per step, fixed part
    c1: Number  # seconds per step per row
    prefill_s: Number = 0.0  # seconds more per request whose prompt a step computes
    step_cost_spread: PositiveValues = [1.0]  # multipliers of the fit, equally likely
    step_cost_path: list[Level] = []  # the multipliers' ranks in time order (levels in [0, 1])
    request_overhead_s: Values = [0.0]  # seconds outside the engine per request, equally likely

    @model_validator(mode="after")
    def _some_cost(self):
        if self.c0 + self.c1 <= 0:
            raise ValueError(f"need c0 + c1 > 0, got c0={self.c0}, c1={self.c1}")
        return self


class LoadPoint(LoadCosts):
    rate: Positive  # arrivals per second per replica


LOAD_FIELDS = tuple(LoadCosts.model_fields)


def _distribution(raw: Mapping[int, Number]) -> dict[int, float]:
    """``{level: weight}`` normalized (levels >= 1, some weight > 0), sorted, zeros dropped."""
    if not raw:
        raise ValueError("must be a non-empty object {level: probability}")
    if min(raw) < 1:
        raise ValueError(f"levels must be >= 1, got {min(raw)}")
    total = sum(raw.values())
    if total <= 0:
        raise ValueError("has no positive weight")
    return {level: w / total for level, w in sorted(raw.items()) if w > 0}


class Calibration(LoadCosts):
    max_batch: Annotated[int, Field(ge=1, strict=True)]  # rows per step of the measured engine
    steps_per_block: dict[int, Number]  # P(a block takes s steps)
    blocks_per_request: dict[int, Number]  # P(a request has k blocks)
    load_points: list[LoadPoint] | None = None
    source: str = ""  # where the numbers come from

    _normalized = field_validator("steps_per_block", "blocks_per_request")(_distribution)

    @field_validator("load_points")
    @classmethod
    def _by_rate(cls, points: list[LoadPoint] | None) -> list[LoadPoint] | None:
        if points is None:
            return None
        if not points:
            raise ValueError("must be a non-empty list of load points")
        points = sorted(points, key=lambda p: p.rate)
        if len({p.rate for p in points}) != len(points):
            raise ValueError("two load points have the same rate")
        return points

    @model_validator(mode="after")
    def _lowest_rate_on_top(self):
        if not self.load_points:
            return self
        return self.model_copy(update=self.load_points[0].model_dump(include=set(LOAD_FIELDS)))

    @classmethod
    def of(cls, raw: "Calibration | Mapping") -> "Calibration":
        """``raw`` checked; ``ValueError`` naming the first bad field."""
        if isinstance(raw, Calibration):
            return raw
        if not isinstance(raw, Mapping):
            raise ValueError("calibration: expected a JSON object")
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = "".join(f"{'.' if i else ''}{part}" for i, part in enumerate(error["loc"]))
            raise ValueError(f"calibration: {where + ': ' if where else ''}{error['msg']}") from None

    def replaced(self, **changes) -> "Calibration":
        """This calibration with some fields changed, checked again."""
        return Calibration.of({**self.model_dump(), **changes})

    def at_rate(self, rate: float) -> "Calibration":
        """Its load-dependent fields at ``rate`` requests/s per replica (itself without load points)."""
        points = self.load_points
        if not points:
            return self
        rates = [p.rate for p in points]
        upper = min(max(int(np.searchsorted(rates, rate)), 1), len(points) - 1) if len(points) > 1 else 0
        low, high = points[max(upper - 1, 0)], points[upper]
        span = high.rate - low.rate
        weight = min(max((rate - low.rate) / span, 0.0), 1.0) if span > 0 else 0.0
        return self.model_copy(update={k: _interpolate(k, getattr(low, k), getattr(high, k), weight)
                                       for k in LOAD_FIELDS})

    def to_json(self) -> str:
        data = self.model_dump(mode="json", exclude_none=True)
        for name in ("steps_per_block", "blocks_per_request"):
            data[name] = {k: round(v, 6) for k, v in data[name].items()}
        return json.dumps(data, indent=2) + "\n"


# Measured on the embedded tiny model (low_confidence, fp32, one torch thread on a shared
# 2-core CPU; closed fdfo batches at max_batch 1..24, 2745 blocks, 400 requests). A
# stand-in until `dllm-serve bench` writes a calibration of the engine that will serve.
DEFAULT_CALIBRATION = Calibration(
    c0=0.0058, c1=0.0022, max_batch=16,
    steps_per_block={2: 0.718, 3: 0.121, 4: 0.068, 5: 0.038, 6: 0.028, 7: 0.014, 8: 0.007, 9: 0.005},
    blocks_per_request={2: 0.168, 3: 0.228, 4: 0.125, 5: 0.138, 6: 0.17, 7: 0.172},
    source="built-in default: the tiny model on a shared 2-core CPU (illustrative, not your engine)")


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


def fit_calibration(step_records: Iterable[tuple[int, int, float]], block_steps: Iterable[int],
                    blocks_per_request: Iterable[int], prefix_units_per_request: float, max_batch: int,
                    source: str = "fit") -> Calibration:
    """A calibration from an engine run: per-step (rows, prompt units, seconds), steps of
    every committed block, blocks of every finished request, mean prompt units per request."""
    return Calibration.of({
        **step_calibration(step_records, prefix_units_per_request), "max_batch": max_batch,
        "steps_per_block": Counter(int(s) for s in block_steps),
        "blocks_per_request": Counter(int(k) for k in blocks_per_request),
        "source": source})


def save_calibration(calibration: Calibration | Mapping, path: str | Path) -> None:
    Path(path).write_text(Calibration.of(calibration).to_json())


def load_calibration(path: str | Path) -> Calibration:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read calibration {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration {path} is not JSON: {exc.msg} (line {exc.lineno})") from None
    return Calibration.of(raw)
