"""Online estimates behind the fill timeouts."""

import time

import pytest

from replicas.cost_model import (RATE_WINDOW_S, REFIT_EVERY_STEPS, DrainModel, OnlineCostModel,
                                 fit_step_cost_with_prefill, mean_steps)
from replicas.engine import WARM_UP_SWEEPS
from replicas.messages import SamplingParams
from replicas.telemetry.monitor import ReplicaMonitor
from replicas.telemetry.reports import ReplicaStats


def test_step_cost_is_fitted_by_least_squares():
    model = OnlineCostModel(max_batch=16)
    for rows in (1, 2, 4, 8, 16) * 3:
        model.observe_step(rows, 0.002 + 0.0005 * rows, ())
    c0, c1 = model.step_cost()
    assert c0 == pytest.approx(0.002) and c1 == pytest.approx(0.0005)


def test_prompt_pages_get_their_own_cost_and_leave_the_rows_cost_alone():
    """Steps that also compute prompt pages (prefill) cost c2 more per page; the per-row
    cost stays the denoising's, and a page's cost in row-steps is c2 at the drain rate."""
    model = OnlineCostModel(max_batch=16)
    for rows, pages in [(1, 0), (4, 3), (8, 0), (16, 7), (2, 12), (12, 1)] * 3:
        model.observe_step(rows, 0.002 + 0.0005 * rows + 0.0003 * pages, (), prompt_pages=pages)
    drain = model.drain_model()
    assert (drain.c0, drain.c1, drain.c2) == (pytest.approx(0.002), pytest.approx(0.0005), pytest.approx(0.0003))
    assert drain.page_row_steps(16) == pytest.approx(0.0003 * 16 / (0.002 + 0.0005 * 16))
    full_batch_only = OnlineCostModel(max_batch=16)
    for pages in (0, 5, 2, 9) * 4:  # one batch size: c0 and c1 cannot be told apart, c2 can
        full_batch_only.observe_step(16, 0.01 + 0.0004 * pages, (), prompt_pages=pages)
    drain = full_batch_only.drain_model()
    assert (drain.c0, drain.c1, drain.c2) == (pytest.approx(0.01), 0.0, pytest.approx(0.0004))
    assert DrainModel.from_stats(ReplicaStats(**drain.as_stats())) == drain


def test_the_step_cost_is_refitted_once_enough_new_steps_have_come():
    model = OnlineCostModel(max_batch=16)
    model.observe_step(4, 0.01, ())
    assert model.step_cost() == (0.01, 0.0)  # one batch size: everything is c0
    for _ in range(REFIT_EVERY_STEPS - 1):
        model.observe_step(16, 0.05, ())
    assert model.step_cost() == (0.01, 0.0)  # the fit of a moment ago
    model.observe_step(16, 0.05, ())
    c0, c1 = model.step_cost()
    assert c1 > 0 and c0 + 16 * c1 == pytest.approx(0.05, rel=0.01)  # the steps since, in the fit
    model.forget()
    assert model.step_cost() == (0.0, 0.0)


def test_arrival_rate_counts_recent_arrivals_only():
    """Arrivals are observed in the order they came (the engine's inbox order)."""
    now = [100.0]
    model = OnlineCostModel(max_batch=16, clock=lambda: now[0])
    model.observe_arrival(now[0] - 10 * RATE_WINDOW_S)  # long ago: not counted
    for i in range(10):
        model.observe_arrival(now[0] - 1 + i * 0.1)  # 10 arrivals in the last second
    assert model.arrival_rate() == pytest.approx(10 / RATE_WINDOW_S)
    now[0] += RATE_WINDOW_S - 0.55  # the first five are older than the window now
    assert model.arrival_rate() == pytest.approx(5 / RATE_WINDOW_S)


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


def test_drain_model_rates_grow_with_the_batch_up_to_what_was_measured():
    model = OnlineCostModel(max_batch=16)
    assert model.drain_model() is None and model.request_alone_s(4) is None
    for rows in (1, 2, 4, 8) * 3:
        model.observe_step(rows, 0.002 + 0.0005 * rows, (2, 3))
    drain = model.drain_model()
    assert drain.measured_rows == 8 and drain.max_batch == 16
    assert drain.rate(1) == pytest.approx(1 / 0.0025)
    assert drain.rate() == drain.rate(8) == pytest.approx(8 / 0.006)  # never extrapolated past 8 rows
    assert DrainModel.from_stats(ReplicaStats(**drain.as_stats())) == drain
    assert DrainModel.from_stats(ReplicaStats()) is None
    # the longest request alone: blocks x mean steps per block x a full batch's step
    assert model.request_alone_s(10) == pytest.approx(10 * 2.5 * (0.002 + 0.0005 * 16))


def test_mean_steps():
    assert mean_steps({}) is None
    assert mean_steps({2: 3, 4: 1}) == 2.5


def test_monitor_reports_the_drain_model_and_longest_request():
    model = OnlineCostModel(max_batch=16)
    monitor = ReplicaMonitor(500.0, cost_model=model, longest_blocks=31)
    stats = monitor.routing_stats()
    assert stats["drain_row_steps_per_s"] == 500.0 and "c0" not in stats and "longest_request_s" not in stats
    for rows in (4, 16) * 4:
        model.observe_step(rows, 0.007 + 0.002 * rows, (2,))
    monitor.request_started("r", cost=390.0)
    stats = monitor.routing_stats()
    assert stats["drain_row_steps_per_s"] == pytest.approx(16 / 0.039)
    assert stats["predicted_drain_s"] == pytest.approx(390 / stats["drain_row_steps_per_s"])
    assert stats["longest_request_s"] == pytest.approx(31 * 2 * 0.039)
    assert DrainModel.from_stats(ReplicaStats(**stats)) == model.drain_model()
    scaling = monitor.autoscaling_stats()
    assert scaling["drain_row_steps_per_s"] == stats["drain_row_steps_per_s"]
    assert scaling["longest_request_s"] == stats["longest_request_s"]


def test_warm_up_keeps_the_fastest_steps_of_its_sweeps(make_engine):
    """A replica warms up while the rest of the cluster starts: steps the other processes
    slow down (here: one whole sweep, 0.1 s a forward) must not reach the first report's fit."""
    engine = make_engine(max_batch=2)
    generate, calls, slowed = engine.generate, [], []

    def first_sweep_slowed(prompts, params, on_step=None):
        calls.append(len(prompts))
        slowed[:] = [2 <= len(calls) <= 3]  # after the set-up batch: the sweep's batches of 1 and 2 rows
        try:
            return generate(prompts, params, on_step)
        finally:
            slowed[:] = [False]

    engine.generate = first_sweep_slowed
    hook = engine.model.register_forward_pre_hook(lambda *_: time.sleep(0.1) if slowed[0] else None)
    try:
        engine.warm_up()
    finally:
        hook.remove()
    assert calls == [1] + [1, 2] * 3
    model = engine.cost_model.drain_model()
    assert model.step_s(1) < 0.025 and model.step_s(2) < 0.025  # with the slowed sweep: >= 0.033


def test_the_warm_ups_blocks_stand_in_for_real_ones_until_a_real_block_commits(make_engine):
    """Admission charges a request by the steps per block its replicas report: from the
    first report on, the warm-up's measured ones rather than the algorithm's worst case."""
    engine = make_engine(max_batch=2)
    assert engine.cost_model.steps_per_block_counts() == {}
    engine.warm_up()
    prior = engine.cost_model.steps_per_block_counts()
    assert sum(prior.values()) == WARM_UP_SWEEPS * (1 + 2)  # each sweep: batches of 1 and 2 one-block requests
    assert engine.cost_model.request_alone_s(4) is not None  # the derived SLO is known before any request
    engine.generate(["abc"], SamplingParams(max_tokens=2 * engine.block_length, ignore_eos=True))
    real = engine.cost_model.steps_per_block_counts()
    assert sum(real.values()) == 2  # the request's two blocks, nothing of the warm-up's


def test_a_step_without_prompt_work_is_never_fitted_free():
    """Steps whose time follows their prompt units almost alone (as on a busy machine) once
    gave the fit of prompt units only, which priced a step that computes no prompt at
    nothing (and the simulator's calibration refused the fit)."""
    records = [(1, 1, 0.00022), (4, 2, 0.0022), (2, 1, 0.00044), (13, 6, 0.00515), (1, 6, 0.00587),
               (14, 10, 0.01015), (4, 16, 0.01665), (6, 0, 0.00015)]
    c0, c1, c2 = fit_step_cost_with_prefill(records)
    assert all(c0 + c1 * rows + c2 * units > 0 for rows, units, _ in records)
