"""Step-aware admission: charge each request its cost in row-steps, refuse beyond capacity.

A request's cost is blocks x steps per block, where steps per block is the algorithm's
worst case or, if configured, a high quantile of the steps per block the replicas have
measured. The cluster may owe at most ``capacity`` row-steps: per replica, either a
configured bound or its measured drain rate x the SLO latency (what it can finish in
time). A request that does not fit is refused at once (429) with ``Retry-After`` =
the time the cluster needs to drain the excess. An idle cluster always admits, so a
request larger than the capacity still runs. Charged costs are released as the
request's steps are taken and in full when it ends.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from cluster.config import AdmissionSettings
from replicas.limits import request_cost, steps_quantile

LIVE_AFTER_S = 10.0  # replica stats older than this are ignored


@dataclass(frozen=True)
class Decision:
    admitted: bool
    retry_after_s: int = 0


class AdmissionController:
    def __init__(self, settings: AdmissionSettings, slo_latency_s: float, min_replicas: int):
        self.settings = settings
        self.slo_latency_s = slo_latency_s
        self.min_replicas = min_replicas
        self.outstanding = 0.0
        self.view: dict[str, dict] = {}

    def update_view(self, view: dict[str, dict]) -> None:
        """Latest routing stats per replica (from the metrics actor)."""
        self.view = {r: v for r, v in view.items() if v.get("age_s", 0) <= LIVE_AFTER_S}

    def steps_per_block(self, worst_case: int) -> float:
        quantile = self.settings.cost_quantile
        if quantile is None:
            return worst_case
        merged: Counter = Counter()
        for stats in self.view.values():
            merged.update({int(k): v for k, v in stats.get("steps_per_block", {}).items()})
        measured = steps_quantile(merged, quantile)
        return worst_case if measured is None else min(measured, worst_case)

    def cost(self, max_tokens: int, block_length: int, worst_case_steps_per_block: int) -> float:
        return request_cost(max_tokens, block_length, self.steps_per_block(worst_case_steps_per_block))

    def _rates(self) -> list[float]:
        rates = [v.get("row_steps_per_s", self.settings.initial_row_steps_per_s) for v in self.view.values()]
        missing = max(0, self.min_replicas - len(rates))
        return rates + [self.settings.initial_row_steps_per_s] * missing

    def capacity(self) -> float:
        rates = self._rates()
        if self.settings.max_step_debt_per_replica is not None:
            return self.settings.max_step_debt_per_replica * len(rates)
        return sum(rates) * self.slo_latency_s

    def try_admit(self, cost: float) -> Decision:
        if not self.settings.enabled or self.outstanding <= 0:
            self.outstanding += cost
            return Decision(True)
        excess = self.outstanding + cost - self.capacity()
        if excess <= 0:
            self.outstanding += cost
            return Decision(True)
        return Decision(False, max(1, math.ceil(excess / sum(self._rates()))))

    def release(self, amount: float) -> None:
        self.outstanding = max(0.0, self.outstanding - amount)


class Charge:
    """One admitted request's cost: released as its steps are taken and in full when it
    ends. ``close`` is idempotent and also runs when the charge is garbage collected, so
    a response that is never streamed (client gone before the first byte) cannot leak it."""

    def __init__(self, controller: AdmissionController, cost: float):
        self.controller = controller
        self.cost = cost
        self.released = 0.0

    def progress(self, steps: int) -> None:
        amount = min(self.cost, steps) - self.released
        if amount > 0:
            self.controller.release(amount)
            self.released += amount

    def close(self) -> None:
        self.progress(math.inf)

    __del__ = close
