"""Online estimates behind the fill timeouts."""

import time

import pytest

from replicas.cost_model import RATE_WINDOW_S, OnlineCostModel


def test_step_cost_is_fitted_by_least_squares():
    model = OnlineCostModel(max_batch=16)
    for rows in (1, 2, 4, 8, 16) * 3:
        model.observe_step(rows, 0.002 + 0.0005 * rows, ())
    c0, c1 = model.step_cost()
    assert c0 == pytest.approx(0.002) and c1 == pytest.approx(0.0005)


def test_arrival_rate_counts_recent_arrivals_only():
    model = OnlineCostModel(max_batch=16)
    now = time.monotonic()
    for i in range(10):
        model.observe_arrival(now - i * 0.1)  # 10 arrivals in the last second
    model.observe_arrival(now - 10 * RATE_WINDOW_S)  # long ago: not counted
    assert model.arrival_rate() == pytest.approx(10 / RATE_WINDOW_S)


def test_fill_timeout_needs_estimates_and_is_bounded():
    model = OnlineCostModel(max_batch=8)
    assert model.fill_timeout() == 0.0  # nothing observed yet
    now = time.monotonic()
    for i in range(20):
        model.observe_arrival(now - i * 0.05)  # ~10 per second
    for rows in (1, 4, 8) * 5:
        model.observe_step(rows, 0.01 + 0.001 * rows, (2, 3))
    for blocks in (1, 2, 3):
        model.observe_finished(blocks)
    tau = model.fill_timeout()
    assert 0.0 <= tau <= 2 * 7 / model.arrival_rate()  # at most twice the expected fill time


def test_fdfo_hold_only_with_expected_arrivals():
    model = OnlineCostModel(max_batch=16)
    model.observe_step(4, 0.05, ())
    assert model.fdfo_hold(4) == 0.0  # no arrivals seen: never wait
    now = time.monotonic()
    for i in range(200):
        model.observe_arrival(now - i * 0.005)
    assert model.fdfo_hold(4) > 0.0
    assert model.fdfo_hold(16) == 0.0  # a full batch never waits
