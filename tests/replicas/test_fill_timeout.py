"""The fill-timeout rules (replicas.fill_timeout): the analytic τ, its edge cases, the fdfo hold."""

import math
import time

import numpy as np
import pytest

from tools.capacity.calibration import DEFAULT_CALIBRATION, Calibration
from replicas.fill_timeout import (batch_capacity, fdfo_hold, modelled_mean_latency,
                                   optimal_fill_timeout)

TINY = DEFAULT_CALIBRATION  # step cost grows with rows, heterogeneous steps
DISPATCH = Calibration(  # step cost is all dispatch, nearly uniform steps: filling can pay
    c0=0.02, c1=0.0, max_batch=2, steps_per_block={4: 0.9, 5: 0.1}, blocks_per_request={1: 0.8, 2: 0.2})
LOADS = (0.1, 0.3, 0.5, 0.7, 0.9)  # fractions of the fixed_fill capacity at full batches


def _args(cal):
    return cal.max_batch, cal.c0, cal.c1, cal.steps_per_block, cal.blocks_per_request


def fixed_fill_capacity(cal) -> float:
    return batch_capacity(*_args(cal))


def test_filling_pays_only_near_saturation_when_dispatch_dominates():
    capacity = fixed_fill_capacity(DISPATCH)
    taus = [optimal_fill_timeout(load * capacity, *_args(DISPATCH)) for load in LOADS]
    assert taus[:3] == [0.0, 0.0, 0.0] and taus[-1] > 0
    assert all(optimal_fill_timeout(load * fixed_fill_capacity(TINY), *_args(TINY)) == 0.0 for load in LOADS)


def test_waiting_only_adds_latency_at_light_load():
    latency = modelled_mean_latency([0.0, 0.01, 0.05, 0.2], 0.5, *_args(TINY))
    assert np.all(np.diff(latency) > 0)


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan, math.inf, 1e-12])
def test_no_wait_without_arrivals_to_wait_for(rate):
    assert optimal_fill_timeout(rate, *_args(TINY)) == 0.0


def test_degenerate_inputs_give_zero():
    _, c0, c1, steps, blocks = _args(TINY)
    assert optimal_fill_timeout(5.0, 1, c0, c1, steps, blocks) == 0.0  # a batch of one is always full
    assert optimal_fill_timeout(5.0, 16, c0, c1, {}, blocks) == 0.0
    assert optimal_fill_timeout(5.0, 16, c0, c1, steps, {}) == 0.0
    assert optimal_fill_timeout(5.0, 16, 0.0, 0.0, steps, blocks) == 0.0  # free steps: nothing to amortize


def test_overload_is_capped_and_finite():
    huge = optimal_fill_timeout(1e9, *_args(DISPATCH))
    at_cap = optimal_fill_timeout(0.95 * fixed_fill_capacity(DISPATCH), *_args(DISPATCH))
    assert huge == at_cap and 0 < huge < math.inf
    assert np.isinf(modelled_mean_latency([0.0], 2 * fixed_fill_capacity(TINY), *_args(TINY))).all()


def test_repeated_calls_are_fast():
    args = _args(TINY)
    optimal_fill_timeout(7.3, *args)
    start = time.perf_counter()
    for _ in range(200):
        optimal_fill_timeout(7.3 * (1 + 1e-4 * np.random.rand()), *args)  # same 2% rate bucket
    assert (time.perf_counter() - start) / 200 < 1e-3


def test_batch_capacity_of_deterministic_work():
    # 3 blocks of 4 steps: a batch of b runs 12 steps whatever b is
    assert batch_capacity(8, 0.01, 0.001, {4: 1.0}, {3: 1.0}) == pytest.approx(8 / (0.018 * 12))
    assert batch_capacity(8, 0.0, 0.0, {4: 1.0}, {3: 1.0}) == math.inf


def test_batch_capacity_of_one_is_mean_work():
    _, c0, c1, steps, blocks = _args(TINY)
    work = sum(k * p for k, p in blocks.items()) * sum(s * p for s, p in steps.items())
    assert 1 / batch_capacity(1, c0, c1, steps, blocks) == pytest.approx((c0 + c1) * work)


def test_fdfo_hold_rule():
    c0, c1, batch = 0.02, 0.001, 8
    assert fdfo_hold(100.0, 1, batch, c0, c1) == pytest.approx(c0 + c1 - 1 / 100.0)
    assert fdfo_hold(100.0, 0, batch, c0, c1) == 0.0  # nothing to run is idling, not holding
    assert fdfo_hold(100.0, batch, batch, c0, c1) == 0.0  # no free row
    assert fdfo_hold(0.0, 1, batch, c0, c1) == 0.0
    assert fdfo_hold(math.nan, 1, batch, c0, c1) == 0.0
    assert fdfo_hold(40.0, 2, batch, c0, c1) == 0.0  # fewer arrivals per step than ready rows
    for rows in range(1, batch):
        assert 0.0 <= fdfo_hold(1e6, rows, batch, c0, c1) <= c0 + c1 * rows  # never more than one step
