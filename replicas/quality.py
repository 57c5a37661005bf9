"""The load knob: run the requests that allow it at a lower confidence bar while the replica
is behind, instead of letting its queue grow.

The ladder is configured (``QualityLevel``: an algorithm's parameters and the accuracy they
were measured to lose, mildest first, e.g. from `dllm-serve bench quality`); a level that
loses more than the accuracy budget is never used. A replica whose predicted drain time
(its step debt over its drain rate) exceeds ``raise_at`` x the SLO moves one level down
the ladder; one whose prediction is under ``lower_at`` x the SLO moves one level back up.
Each move holds for ``hold_s`` at least, so the level does not flap with every arrival.

A request that allows it (``SamplingParams.adaptive``) and runs the level's algorithm
starts with the level's parameters on top of its own; a request that asks for fixed
quality never changes. A request keeps the level it started with.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from replicas.messages import SamplingParams


@dataclass(frozen=True)
class QualityLevel:
    algorithm: str  # the algorithm whose requests this level changes
    params: dict[str, Any]  # its parameters at this level, e.g. {"threshold": 0.9}
    accuracy_loss: float  # points below the default setting, as measured
    step_ratio: float = 1.0  # its steps per block over the default setting's, as measured


class QualityKnob:
    def __init__(self, levels: Sequence[QualityLevel], slo_s: float, accuracy_budget: float = 1.0,
                 raise_at: float = 0.8, lower_at: float = 0.4, hold_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 <= lower_at < raise_at:
            raise ValueError(f"lower_at ({lower_at}) must be below raise_at ({raise_at})")
        self.levels = [level for level in levels if level.accuracy_loss <= accuracy_budget]
        self.slo_s = slo_s
        self.raise_at, self.lower_at, self.hold_s = raise_at, lower_at, hold_s
        self.clock = clock
        self.level = 0  # 0: the default setting; n: ``levels[n - 1]``
        self._moved_at = -float("inf")
        self._lock = threading.Lock()  # arrivals and the stats thread both observe

    def __getstate__(self) -> dict:  # built by the cluster, sent to each replica
        return {name: value for name, value in vars(self).items() if name != "_lock"}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state, _lock=threading.Lock())

    def observe(self, predicted_drain_s: float) -> int:
        """Move a level if the prediction says so and the last move has held; the level."""
        with self._lock:
            now = self.clock()
            if now - self._moved_at < self.hold_s:
                return self.level
            if predicted_drain_s > self.raise_at * self.slo_s and self.level < len(self.levels):
                self.level, self._moved_at = self.level + 1, now
            elif predicted_drain_s < self.lower_at * self.slo_s and self.level > 0:
                self.level, self._moved_at = self.level - 1, now
            return self.level

    def apply(self, params: SamplingParams, algorithm: str) -> tuple[SamplingParams, int]:
        """``params`` of a request running ``algorithm`` at the current level, and the level
        it runs at (0: unchanged)."""
        if not (params.adaptive and self.level):
            return params, 0
        level = self.levels[self.level - 1]
        if level.algorithm != algorithm:
            return params, 0
        return replace(params, algorithm_params={**params.algorithm_params, **level.params}), self.level
