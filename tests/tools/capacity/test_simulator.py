"""The cluster simulator: engine semantics, sanity, searches, calibration files, CLI."""

import inspect
import json

import numpy as np
import pytest

from tools.cli import main
from tools.capacity.calibration import (DEFAULT_CALIBRATION, LoadCosts, fit_calibration,
                                          load_calibration, save_calibration)
from tools.capacity.simulator import (CalibratedSteps, KnobModel, Workload, find_max_rate, find_replicas, fixed_fill_capacity,
                                        poisson_workload, run, simulate, slo_attainment, summarize, throughput_bound,
                                        trace_workload)
from tools.capacity.step_cost import step_calibration
from replicas.batching import MODES
from replicas.cost_model import fit_step_cost, fit_step_cost_by_load, fit_step_cost_with_prefill
from replicas.engine import EngineConfig

CAL = DEFAULT_CALIBRATION
NO_HOLD = {"fdfo_fill_hold": False}  # these tests were written for fdfo without the fill hold


def _workload(arrival, blocks, steps) -> Workload:
    return Workload(np.array(arrival, float), np.array(blocks), np.array(steps))


# ---- engine semantics on a hand-checked example ----------------------------------------------
# a step of b rows costs 1 + b seconds; A: blocks of 3 and 1 steps, B: one block of 1 step
# (both at t=0), C: one block of 1 step at t=0.5; two rows.
HAND = {"c0": 1.0, "c1": 1.0, "max_batch": 2, "steps_per_block": {1: 1.0}, "blocks_per_request": {1: 1.0}}
HAND_WORK = _workload([0.0, 0.0, 0.5], [2, 1, 1], [[3, 1], [1, 0], [1, 0]])
HAND_LATENCY = {
    # steps [0,3] A+B (B done), [3,6] A+C (C joins at once, done), [6,8] A (block 1 of A starts), [8,10] A
    "fdfo": [10.0, 3.0, 5.5],
    # round of 3 steps with A+B [0,9] (B done at 3), then A's 2nd block + C [9,12]
    "sync": [12.0, 3.0, 11.5],
    # A+B: round 1 [0,9], round 2 with B idle [9,12]; then C alone [12,14]
    "static": [12.0, 3.0, 13.5],
    "fixed_fill": [12.0, 3.0, 13.5],
}


@pytest.mark.parametrize("policy", MODES)
def test_policies_follow_the_engine_semantics(policy):
    result = simulate(HAND, HAND_WORK, policy, fill_timeout=0.0, **NO_HOLD)
    assert result.latency.tolist() == HAND_LATENCY[policy]


def test_fdfo_holds_under_filled_steps_by_default_as_the_engine_does():
    assert EngineConfig().fdfo_fill_hold and inspect.signature(simulate).parameters["fdfo_fill_hold"].default
    # 4 arrivals/s: A alone may wait 1 + 1 - 1/4 = 1.75 s for company before each of its steps
    # from t=6 on: [7.75, 9.75] ends its 1st block, [11.5, 13.5] its 2nd
    assert simulate(HAND, HAND_WORK, "fdfo").latency.tolist() == [13.5, 3.0, 5.5]


def test_fixed_fill_waits_for_a_full_batch_or_the_timeout():
    work = _workload([0.0, 1.0, 10.0], [1, 1, 1], [[1], [1], [1]])
    result = simulate(HAND, work, "fixed_fill", fill_timeout=2.0)
    # the 2nd arrival fills the batch at t=1: one step of 2 rows; the 3rd waits out its timeout
    assert result.latency.tolist() == [4.0, 3.0, 4.0]


# ---- sanity ------------------------------------------------------------------------------------
def test_at_batch_one_every_policy_gives_the_same_latencies():
    single = CAL.replaced(max_batch=1)
    work = poisson_workload(single, 0.8 * fixed_fill_capacity(single), 3000, seed=3)
    latencies = [simulate(single, work, policy).latency for policy in MODES]
    for other in latencies[1:]:
        np.testing.assert_allclose(other, latencies[0], rtol=1e-12)


def test_fdfo_beats_sync_beats_static_at_moderate_load():
    work = poisson_workload(CAL, 0.6 * fixed_fill_capacity(CAL), 5000, seed=4)
    mean = {p: np.mean(simulate(CAL, work, p, **NO_HOLD).latency) for p in ("fdfo", "sync", "static")}
    assert mean["fdfo"] < mean["sync"] < mean["static"]


def test_counts_add_up_and_times_are_consistent():
    result = run(CAL, "fdfo", 1.5 * throughput_bound(CAL), 3000, seed=5, max_step_debt=400.0, **NO_HOLD)
    summary = summarize(result, slo_latency=1.0)
    assert summary["completed"] + summary["refused"] == summary["offered"] == 3000
    done = ~result.refused
    assert np.all(np.isnan(result.latency[result.refused])) and not np.isnan(result.latency[done]).any()
    assert np.all(result.ttfb[done] <= result.latency[done]) and np.all(result.ttfb[done] > 0)
    assert summary["goodput_rps"] <= summary["throughput_rps"]
    assert summary["latency_p50_s"] <= summary["latency_p90_s"] <= summary["latency_p99_s"]


def test_refusals_only_beyond_capacity():
    over = poisson_workload(CAL, 3 * throughput_bound(CAL), 2000, seed=6)
    assert simulate(CAL, over, "fdfo", max_step_debt=500.0, **NO_HOLD).refused.sum() > 0
    assert simulate(CAL, over, "fdfo", **NO_HOLD).refused.sum() == 0  # no bound: everything is admitted
    light = poisson_workload(CAL, 0.2 * throughput_bound(CAL), 2000, seed=6)
    assert simulate(CAL, light, "fdfo", max_step_debt=500.0, **NO_HOLD).refused.sum() == 0


def test_the_load_knob_serves_more_under_overload_and_nothing_changes_under_light_load():
    slo = 2.0
    bound = CAL.max_batch / (CAL.c0 + CAL.c1 * CAL.max_batch) * slo  # admission as --max-step-debt slo
    knob = KnobModel((0.9, 0.6), slo_s=slo, hold_s=0.5)
    over = poisson_workload(CAL, 3 * throughput_bound(CAL), 3000, seed=6)
    plain, knobbed = (simulate(CAL, over, "fdfo", max_step_debt=bound, knob=k, **NO_HOLD) for k in (None, knob))
    assert plain.quality_level is None and set(np.unique(knobbed.quality_level)) >= {1, 2}
    plain_good, knob_good = (summarize(r, slo)["goodput_rps"] for r in (plain, knobbed))
    assert knob_good > 1.1 * plain_good and summarize(knobbed, slo)["degraded"] > 0
    light = poisson_workload(CAL, 0.3 * throughput_bound(CAL), 2000, seed=6)
    calm = simulate(CAL, light, "fdfo", max_step_debt=bound, knob=knob, **NO_HOLD)
    assert not calm.quality_level.any()


def test_routing_spreads_load_over_replicas():
    result = run(CAL, "sync", 3 * fixed_fill_capacity(CAL), 4000, seed=7, replicas=4)
    counts = np.bincount(result.replica, minlength=4)
    assert counts.min() > 0.2 * 4000


def test_same_seed_same_run_other_seed_other_run():
    first, again = (run(CAL, "fixed_fill", 5.0, 1000, seed=8).latency for _ in range(2))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, run(CAL, "fixed_fill", 5.0, 1000, seed=9).latency)


def test_find_max_rate_grows_with_the_slo():
    rates = [find_max_rate(CAL, "sync", slo, requests=1500, seed=10) for slo in (0.3, 0.6, 1.2)]
    assert 0 < rates[0] <= rates[1] <= rates[2] <= throughput_bound(CAL)
    assert slo_attainment(run(CAL, "sync", rates[1], 1500, seed=10), 0.6) >= 0.99


def test_find_replicas_is_the_least_that_meets_the_slo():
    rate = 2.5 * throughput_bound(CAL)
    needed = find_replicas(CAL, "fdfo", rate, 0.5, requests=2000, seed=11, **NO_HOLD)
    assert needed and needed >= 3
    work = poisson_workload(CAL, rate, 2000, seed=11)
    assert slo_attainment(simulate(CAL, work, "fdfo", replicas=needed, **NO_HOLD), 0.5) >= 0.99
    assert slo_attainment(simulate(CAL, work, "fdfo", replicas=needed - 1, **NO_HOLD), 0.5) < 0.99
    assert find_replicas(CAL, "static", rate, 0.05, requests=500, seed=11, max_replicas=4) is None


@pytest.mark.parametrize("bad", [
    dict(policy="lifo"), dict(policy="fdfo", replicas=0), dict(policy="fixed_fill", fill_timeout=-1.0),
    dict(policy="fdfo", max_step_debt=0.0)])
def test_bad_options_raise_value_error(bad):
    with pytest.raises(ValueError):
        simulate(CAL, poisson_workload(CAL, 1.0, 10), **bad)


# ---- calibration files -------------------------------------------------------------------------
def _steps(n: int, seed: int, factor=None) -> list[tuple[int, int, float]]:
    """Synthetic (rows, prompt units, seconds): 4 ms + 0.5 ms per row + 0.3 ms per prompt unit."""
    rng = np.random.default_rng(seed)
    rows, units = rng.integers(1, 17, n), rng.integers(0, 3, n) * 8
    seconds = (0.004 + 0.0005 * rows + 0.0003 * units) * (1.0 if factor is None else factor(rng, n))
    return list(zip(rows.tolist(), units.tolist(), seconds.tolist()))


def test_fit_recovers_step_cost_prefill_and_distributions():
    records = [(r, u, t + e) for (r, u, t), e in zip(_steps(500, 0), np.random.default_rng(9).normal(0, 1e-4, 500))]
    cal = fit_calibration(records, [2, 2, 3, 2], [1, 2, 2, 3], prefix_units_per_request=8, max_batch=16,
                          source="synthetic")
    assert cal.c0 == pytest.approx(0.004, abs=1e-4) and cal.c1 == pytest.approx(0.0005, abs=1e-5)
    assert cal.prefill_s == pytest.approx(8 * 0.0003, rel=0.02)
    assert cal.steps_per_block == {2: 0.75, 3: 0.25}
    assert cal.blocks_per_request == {1: 0.25, 2: 0.5, 3: 0.25}


def test_fit_measures_how_steps_scatter_around_the_fit():
    def one_in_ten_slow(rng, n):
        return np.where(rng.random(n) < 0.1, 3.0, 1.0)  # one step in ten takes three times as long

    records = _steps(4000, 1, one_in_ten_slow)
    c0, c1, c2 = fit_step_cost_with_prefill(records)
    spread = np.asarray(fit_calibration(records, [2], [1], 8, max_batch=16).step_cost_spread)
    assert len(spread) == 100 and np.all(np.diff(spread) >= 0)
    assert spread[90:].mean() / spread[:90].mean() == pytest.approx(3.0, rel=0.1)
    assert np.mean(spread * (c0 + c1 * 8 + c2 * 8)) == pytest.approx((0.004 + 0.0005 * 8 + 0.0003 * 8) * 1.2,
                                                                      rel=0.05)


def test_request_overhead_prefill_and_step_spread_enter_the_simulation():
    work = poisson_workload(CAL, 0.5 * throughput_bound(CAL), 2000, seed=5)
    plain = simulate(CAL, work, "fdfo", **NO_HOLD)
    shifted = simulate(CAL.replaced(request_overhead_s=0.25), work, "fdfo", **NO_HOLD)
    assert np.allclose(shifted.latency, plain.latency + 0.25) and np.allclose(shifted.ttfb, plain.ttfb + 0.25)
    drawn = simulate(CAL.replaced(request_overhead_s=[0.0, 1.0]), work, "fdfo", **NO_HOLD)
    assert set(np.round(drawn.latency - plain.latency, 9)) == {0.0, 1.0}
    jittery = simulate(CAL.replaced(step_cost_spread=[0.6] * 9 + [4.6]), work, "fdfo", **NO_HOLD)  # mean 1, rare slow steps
    assert np.percentile(jittery.latency, 99) > 1.2 * np.percentile(plain.latency, 99)
    assert np.array_equal(jittery.latency, simulate(CAL.replaced(step_cost_spread=[0.6] * 9 + [4.6]), work,
                                                    "fdfo", **NO_HOLD).latency)  # seeded
    alone = trace_workload(CAL, np.arange(200) * 10.0, seed=5)  # requests never overlap
    with_prefill = simulate(CAL.replaced(prefill_s=0.05), alone, "fdfo", **NO_HOLD).latency
    assert np.allclose(with_prefill, simulate(CAL, alone, "fdfo", **NO_HOLD).latency + 0.05)
    busy = simulate(CAL.replaced(prefill_s=0.05), work, "fdfo", **NO_HOLD).latency
    assert np.percentile(busy, 50) > np.percentile(plain.latency, 50) + 0.05  # others wait for the prompts too


def test_a_step_cost_path_is_played_in_order_and_keeps_the_spread():
    levels = np.array([0.1, 0.3, 0.6, 0.9] * 50)
    spread = CalibratedSteps(LoadCosts(c0=0.0, c1=1.0, step_cost_spread=[3.0, 0.5, 1.5, 1.0],
                                        step_cost_path=list(levels)), np.random.default_rng(1))
    ends = np.asarray(spread.step_ends(0.0, 1, 0, 2000))  # steps of one row: 1 s before the multiplier
    drawn = np.diff(np.concatenate([[0.0], ends]))
    assert [np.mean(np.isclose(drawn, v)) for v in (0.5, 1.0, 1.5, 3.0)] == pytest.approx([0.25] * 4)
    first = int(np.flatnonzero(np.isclose(drawn, 0.5))[0])  # from a random start, in the path's order
    assert drawn[first:first + 1996] == pytest.approx([0.5, 1.0, 1.5, 3.0] * 499)


def test_slow_steps_in_runs_make_the_tail_that_independent_draws_miss():
    work = poisson_workload(CAL, 0.6 * throughput_bound(CAL), 3000, seed=8)
    scattered = CAL.replaced(step_cost_spread=[0.5, 1.0, 1.5])
    independent = simulate(scattered, work, "fdfo", **NO_HOLD).latency
    runs = ([0.2] * 300 + [0.5] * 300 + [0.9] * 300) * 4  # the same levels, in runs of 300 steps
    in_runs = simulate(scattered.replaced(step_cost_path=runs), work, "fdfo", **NO_HOLD).latency
    assert np.percentile(in_runs, 99) > 1.2 * np.percentile(independent, 99)
    assert np.array_equal(in_runs, simulate(scattered.replaced(step_cost_path=runs), work, "fdfo", **NO_HOLD).latency)  # seeded


def test_step_calibration_keeps_the_multipliers_in_time_order():
    rng = np.random.default_rng(4)
    rows = rng.integers(1, 9, 3000)
    slow = np.repeat(rng.random(30) < 0.3, 100) * 1.0  # runs of 100 slow steps
    seconds = (0.004 + 0.001 * rows) * (1 + slow) * rng.uniform(0.9, 1.1, 3000)
    costs = step_calibration(list(zip(rows, np.zeros(3000), seconds)), 0.0, path_length=2000)
    path = np.asarray(costs["step_cost_path"])
    assert len(path) == 2000 and 0 < path.min() and path.max() < 1
    assert sorted(path) == pytest.approx((np.arange(2000) + 0.5) / 2000, abs=1e-4)  # ranks, each once
    multipliers = seconds[-2000:] / (costs["c0"] + costs["c1"] * rows[-2000:])
    assert np.array_equal(np.argsort(path), np.argsort(multipliers))  # the last steps' ranks, in time order
    assert np.corrcoef(path[:-10], path[10:])[0, 1] > 0.5  # the runs survive


def test_load_points_are_interpolated_in_the_rate_per_replica():
    light = {"rate": 2.0, "c0": 0.004, "c1": 0.001, "prefill_s": 0.002, "step_cost_spread": [0.8, 1.2],
             "request_overhead_s": [0.02, 0.04]}
    heavy = {"rate": 6.0, "c0": 0.008, "c1": 0.002, "step_cost_spread": [0.5, 1.5], "request_overhead_s": 0.1}
    cal = CAL.replaced(load_points=[heavy, light])
    assert cal.c0 == 0.004 and [p.rate for p in cal.load_points] == [2.0, 6.0]  # lowest rate on top
    middle = cal.at_rate(4.0)
    assert middle.c0 == pytest.approx(0.006) and middle.c1 == pytest.approx(0.0015)
    assert middle.prefill_s == pytest.approx(0.001)  # absent: 0
    assert middle.step_cost_spread == pytest.approx([0.65, 1.35])
    assert middle.request_overhead_s == pytest.approx([0.06, 0.07])
    assert cal.at_rate(0.5).c0 == 0.004 and cal.at_rate(50).c0 == 0.008  # clamped
    paths = CAL.replaced(load_points=[{**light, "step_cost_path": [0.1, 0.6]}, {**heavy, "step_cost_path": [0.9]}])
    assert paths.at_rate(3.9).step_cost_path == [0.1, 0.6] and paths.at_rate(4.1).step_cost_path == [0.9]
    work = poisson_workload(CAL, 8.0, 500, seed=2)
    flat = cal.at_rate(work.rate / 2).replaced(load_points=None)
    assert np.array_equal(simulate(cal, work, "fdfo", replicas=2).latency, simulate(flat, work, "fdfo", replicas=2).latency)


@pytest.mark.parametrize("points", [[], [{"c0": 1, "c1": 0}], [{"rate": 0, "c0": 1, "c1": 0}],
                                    [{"rate": 1, "c0": 1, "c1": 0}, {"rate": 1, "c0": 2, "c1": 0}], "x"])
def test_bad_load_points_raise(points):
    with pytest.raises(ValueError, match="load point|load_points"):
        CAL.replaced(load_points=points)


def test_fits_clip_negative_coefficients():
    assert fit_step_cost([(1, 0.5), (8, 0.1)]) == (pytest.approx(0.3), 0.0)  # cost falling with rows
    c0, c1 = fit_step_cost([(1, 0.1), (2, 0.3), (3, 0.5)])  # line through c0 < 0
    assert c0 == 0.0 and c1 == pytest.approx(2.2 / 14)
    assert fit_step_cost([(4, 0.2), (4, 0.4)]) == (pytest.approx(0.3), 0.0)  # one batch size: all fixed
    c0, c1, c2 = fit_step_cost_with_prefill([(1, 0, 0.5), (8, 0, 0.1), (1, 8, 0.9), (8, 8, 0.5)])
    assert c1 == 0.0 and c0 == pytest.approx(0.3) and c2 == pytest.approx(0.05)  # rows clipped, refitted


def test_a_fit_over_loads_shares_the_per_row_cost_and_keeps_a_fixed_cost_per_load():
    rng = np.random.default_rng(6)
    light = [(r, u, 0.004 + 0.002 * r + 0.001 * u + rng.normal(0, 0.001))
             for r, u in zip(rng.choice([1, 1, 1, 2], 400), rng.choice([0, 0, 7], 400))]  # rarely 2 rows
    heavy = [(r, u, 0.007 + 0.002 * r + 0.001 * u + rng.normal(0, 0.001))
             for r, u in zip(rng.integers(1, 17, 400), rng.choice([0, 7], 400))]
    (c0_light, c0_heavy), c1, c2 = fit_step_cost_by_load([light, heavy])
    assert c0_light == pytest.approx(0.004, abs=3e-4) and c0_heavy == pytest.approx(0.007, abs=3e-4)
    assert c1 == pytest.approx(0.002, abs=1e-4) and c2 == pytest.approx(0.001, abs=1e-4)
    assert fit_step_cost_by_load([light]) == ([fit_step_cost_with_prefill(light)[0]], *fit_step_cost_with_prefill(light)[1:])
    with pytest.raises(ValueError, match="no step records"):
        fit_step_cost_by_load([light, []])


def test_calibration_round_trip(tmp_path):
    path = tmp_path / "cal.json"
    save_calibration(CAL, path)
    on_disk = json.loads(path.read_text())
    assert set(on_disk) == {"c0", "c1", "max_batch", "steps_per_block", "blocks_per_request", "source",
                            "step_cost_spread", "step_cost_path", "request_overhead_s", "prefill_s"}
    loaded = load_calibration(path)
    assert loaded.c0 == CAL.c0 and loaded.steps_per_block.keys() == CAL.steps_per_block.keys()


@pytest.mark.parametrize("text", [
    "not json", "[]", '{"c0": 0.1}',
    '{"c0": -1, "c1": 0, "max_batch": 4, "steps_per_block": {"2": 1}, "blocks_per_request": {"1": 1}}',
    '{"c0": 0.1, "c1": 0, "max_batch": 0, "steps_per_block": {"2": 1}, "blocks_per_request": {"1": 1}}',
    '{"c0": 0.1, "c1": 0, "max_batch": 4, "steps_per_block": {"0": 1}, "blocks_per_request": {"1": 1}}',
    '{"c0": 0.1, "c1": 0, "max_batch": 4, "steps_per_block": {}, "blocks_per_request": {"1": 1}}',
    '{"c0": 0.1, "c1": 0, "max_batch": 4, "steps_per_block": {"2": 1}, "blocks_per_request": {"1": 1}, '
    '"step_cost_spread": [1, 0]}',
    '{"c0": 0.1, "c1": 0, "max_batch": 4, "steps_per_block": {"2": 1}, "blocks_per_request": {"1": 1}, '
    '"request_overhead_s": "fast"}',
    '{"c0": 0.1, "c1": 0, "max_batch": 4, "steps_per_block": {"2": 1}, "blocks_per_request": {"1": 1}, '
    '"step_cost_path": [0.5, 1.5]}',
    '{"c0": 0.1, "c1": 0, "max_batch": 4, "steps_per_block": {"2": 1}, "blocks_per_request": {"1": 1}, '
    '"step_cost_path": 0.5}'])
def test_bad_calibration_files_raise_value_error(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError):
        load_calibration(path)


# ---- the command line ----------------------------------------------------------------------------
def test_cli_sweep_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "latency.png"
    assert main(["simulate", "--sweep", "2", "6", "--policy", "fdfo", "static", "--requests", "400",
                 "--slo-latency", "1", "--json", "--plot", str(plot)]) == 0
    rows = json.loads(capsys.readouterr().out)["sweep"]
    assert [(r["policy"], r["rate"]) for r in rows] == [("fdfo", 2.0), ("static", 2.0), ("fdfo", 6.0), ("static", 6.0)]
    assert plot.stat().st_size > 0


def test_cli_replays_a_trace(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(f'{{"timestamp": {0.05 * i}, "prompt": "x"}}\n' for i in range(50)))
    assert main(["simulate", "--trace", str(trace), "--policy", "sync", "--json"]) == 0
    row, = json.loads(capsys.readouterr().out)["sweep"]
    assert row["completed"] == 50 and row["rate"] == pytest.approx(20.0)


def test_cli_find_replicas_table(capsys):
    assert main(["simulate", "--find-replicas", "--rate", "40", "--slo-latency", "0.5", "--policy", "fdfo",
                 "--requests", "600"]) == 0
    assert "replicas" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["simulate"], ["simulate", "--rate", "-2"], ["simulate", "--find-max-rate"],
    ["simulate", "--rate", "1", "--calibration", "/nonexistent.json"],
    ["simulate", "--rate", "1", "--max-step-debt", "lots"],
    ["simulate", "--find-replicas", "--sweep", "1", "2", "--slo-latency", "1"],
    ["simulate", "--trace", "/nonexistent.jsonl"], ["simulate", "--rate", "1", "--quality-steps", "0.9"],
    ["simulate", "--rate", "1", "--slo-latency", "1", "--quality-steps", "1.5"]])
def test_cli_bad_input_is_an_error_not_a_traceback(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "dllm-serve: error:" in err and "Traceback" not in err
