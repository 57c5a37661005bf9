"""Serve autoscaling policy on step debt: enough replicas to drain it within the target time.

Replicas drain at their rate at full batch (``drain_row_steps_per_s``: max_batch /
(c0 + c1·max_batch) from their step-cost fit, the rate admission predicts with; see
``replicas.cost_model.DrainModel``), or the rate measured at their current batch where
they report no fit.
"""

from __future__ import annotations

import math

from cluster.config import SLOSettings


def desired_replicas(step_debts: list[float], row_steps_per_s: list[float], current: int,
                     target_drain_s: float, min_replicas: int, max_replicas: int) -> int:
    """Replicas needed so the cluster's step debt drains in ``target_drain_s``.

    Each replica drains ``row_steps_per_s`` (the mean over replicas); with no
    measurement yet, keep the current count.
    """
    if not row_steps_per_s:
        return max(min_replicas, min(max_replicas, current))
    per_replica = sum(row_steps_per_s) / len(row_steps_per_s) * target_drain_s
    needed = math.ceil(sum(step_debts) / per_replica) if per_replica > 0 else current
    return max(min_replicas, min(max_replicas, needed))


class StepDebtPolicy:
    """``AutoscalingPolicy(policy_function=StepDebtPolicy, policy_kwargs={...})``: Serve
    calls it with an ``AutoscalingContext`` whose ``aggregated_metrics`` hold the replicas'
    ``record_autoscaling_stats`` (step_debt, drain_row_steps_per_s or row_steps_per_s,
    longest_request_s).

    ``target_drain_s`` None: half the SLO derived from the replicas' ``longest_request_s``
    (``SLOSettings.latency_for``), as admission derives it."""

    def __init__(self, target_drain_s: float | None):
        self.target_drain_s = target_drain_s

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        debts = list((metrics.get("step_debt") or {}).values())
        rates = list((metrics.get("drain_row_steps_per_s") or metrics.get("row_steps_per_s") or {}).values())
        target = self.target_drain_s or SLOSettings().latency_for((metrics.get("longest_request_s") or {}).values()) / 2
        desired = desired_replicas(debts, rates, ctx.target_num_replicas, target,
                                   ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas)
        return desired, {"step_debt": sum(debts), "desired": desired, "target_drain_s": target}
