"""The analytic fill timeout (replicas.fill_timeout) against the best one the simulator finds."""

import pytest

from tools.capacity.calibration import DEFAULT_CALIBRATION, Calibration
from tools.capacity.simulator import fixed_fill_capacity, tau_table
from replicas.fill_timeout import modelled_mean_latency

TINY = DEFAULT_CALIBRATION  # step cost grows with rows, heterogeneous steps
DISPATCH = Calibration.of({  # step cost is all dispatch, nearly uniform steps: filling can pay
    "c0": 0.02, "c1": 0.0, "max_batch": 2, "steps_per_block": {4: 0.9, 5: 0.1},
    "blocks_per_request": {1: 0.8, 2: 0.2}, "source": "test"})
LOADS = (0.1, 0.5, 0.8)  # fractions of the fixed_fill capacity at full batches: light, half, near saturation


def _args(cal):
    return cal.max_batch, cal.c0, cal.c1, cal.steps_per_block, cal.blocks_per_request


@pytest.mark.bench
@pytest.mark.parametrize("cal", [TINY, DISPATCH], ids=["tiny", "dispatch-bound"])
def test_analytic_tau_is_within_5_percent_of_the_best_simulated(cal):
    capacity = fixed_fill_capacity(cal)
    for load in LOADS:
        # near saturation latency means wander: more requests there keep the comparison stable
        row, = tau_table(cal, [load * capacity], requests=int(1000 / (1 - load)), seed=1, grid=8)
        assert row["gap_percent"] <= 5.0, row
        modelled = modelled_mean_latency([row["analytic_tau_s"]], row["rate"], *_args(cal))[0]
        assert modelled == pytest.approx(row["analytic_latency_s"], rel=0.1), row  # the model itself is close
