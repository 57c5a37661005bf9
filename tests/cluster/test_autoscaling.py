"""The step-debt autoscaling policy on synthetic Serve contexts."""

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingContext

from cluster.autoscaling import StepDebtPolicy, desired_replicas
from cluster.config import SLO_FLOOR_S, SLO_MULTIPLE


def context(debts, rates, current=1, min_replicas=1, max_replicas=4):
    deployment = DeploymentID(name="EngineReplica", app_name="dllm")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=deployment) for i in range(len(debts))]
    metrics = {"step_debt": dict(zip(replicas, debts)), "row_steps_per_s": dict(zip(replicas, rates))}
    return AutoscalingContext(
        deployment_id=deployment, deployment_name="EngineReplica", app_name="dllm",
        current_num_replicas=current, target_num_replicas=current, running_replicas=replicas,
        total_num_requests=0, total_queued_requests=0, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=min_replicas, capacity_adjusted_max_replicas=max_replicas,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=None)


def test_scales_up_on_step_debt():
    # 2 replicas owe 9000 row-steps at 500/s each: 9000 / (500 * 4 s) -> 5, capped at 4
    desired, state = StepDebtPolicy(target_drain_s=4.0)(context([6000, 3000], [500, 500], current=2))
    assert desired == 4 and state["step_debt"] == 9000


def test_scales_to_what_the_debt_needs():
    desired, _ = StepDebtPolicy(target_drain_s=4.0)(context([3000, 2000], [500, 500], current=2))
    assert desired == 3  # 5000 / 2000 per replica


def test_scales_down_to_min_when_idle():
    desired, _ = StepDebtPolicy(target_drain_s=4.0)(context([0, 0, 0], [500, 500, 500], current=3))
    assert desired == 1


def test_keeps_current_without_measurements():
    desired, _ = StepDebtPolicy(target_drain_s=4.0)(context([], [], current=2))
    assert desired == 2


@pytest.mark.parametrize("debts,rates,current,low,high,expected", [
    ([100], [100], 1, 2, 5, 2),  # never below min
    ([10**9], [100], 1, 1, 3, 3),  # never above max
    ([400], [100], 1, 1, 8, 1),  # 400 row-steps drain in 4 s on one replica
    ([401], [100], 1, 1, 8, 2),
])
def test_desired_replicas_bounds(debts, rates, current, low, high, expected):
    assert desired_replicas(debts, rates, current, 4.0, low, high) == expected


def test_drains_at_the_full_batch_rate_where_replicas_report_it():
    # measured at a light batch: 100 row-steps/s; at full batch: 400 -> 1600 / (400 * 4 s) = 1
    ctx = context([1600], [100], current=1)
    ctx.aggregated_metrics["drain_row_steps_per_s"] = {r: 400.0 for r in ctx.aggregated_metrics["step_debt"]}
    desired, _ = StepDebtPolicy(target_drain_s=4.0)(ctx)
    assert desired == 1


def test_target_derived_from_the_slo_the_replicas_measure():
    ctx = context([4000, 4000], [500, 500], current=2, max_replicas=8)
    ctx.aggregated_metrics["longest_request_s"] = {r: 8.0 for r in ctx.aggregated_metrics["step_debt"]}
    desired, state = StepDebtPolicy(target_drain_s=None)(ctx)
    assert state["target_drain_s"] == SLO_MULTIPLE * 8.0 / 2 == 8.0
    assert desired == 2  # 8000 / (500 * 8 s)
    _, state = StepDebtPolicy(target_drain_s=None)(context([0], [500]))
    assert state["target_drain_s"] == SLO_FLOOR_S / 2  # nothing measured yet
