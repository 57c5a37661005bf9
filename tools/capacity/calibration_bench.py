"""`dllm-serve bench calibration`: does the simulator predict the live cluster?

Calibrates on the live cluster (`tools.capacity.live_calibration`, by default at a light
and a heavy load); for each compared rate, sends a Poisson load of the same number of
requests (other arrivals and prompts than any calibration's) to the cluster and runs the
simulator on the same arrival times. By default it calibrates before the first rate and
after each, and predicts each rate from the two calibrations on either side of it (half
the draws each), because step costs drift on a shared machine and no model of the engine
can predict that; a drift that is steady over one rate's span cancels
(``recalibrate=False`` calibrates once, first, to see the drift). The prediction is for
the load that was sent, so a burst that happens to come live is in the prediction too,
and the same-arrivals comparison removes the p99's swing from one arrival sequence to the
next from the ratio. Each prediction pools ``SIM_DRAWS`` simulator runs (other draws of
blocks, steps and step costs). Prints p50/p99 latency of both and their ratios side by side.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from loadgen import client
from loadgen.arrivals import poisson_times, tiny_prompts, with_prompts
from tools.capacity import simulator
from tools.capacity.calibration import Calibration
from tools.capacity.live_calibration import CalibrationPlan, calibrate, measure_load
from loadgen.stats import summarize

TOLERANCE = 0.2  # the simulator "holds" when every predicted percentile is within 20 %
SIM_DRAWS = 10


def _ratio(predicted: float | None, measured: float | None) -> float | None:
    return round(predicted / measured, 3) if predicted is not None and measured else None


def predict(calibrations: list[Calibration], arrival_times: list[float], policy: str, replicas: int, seed: int,
            draws: int = SIM_DRAWS) -> dict:
    """p50/p99 latency the simulator predicts for requests arriving at ``arrival_times``:
    ``draws`` runs, each with its own draws of blocks, steps and step costs, taking the
    ``calibrations`` in turn, pooled."""
    latency = np.concatenate([
        simulator.simulate(cal, simulator.trace_workload(cal, arrival_times, seed + draw), policy,
                           replicas=replicas).latency
        for draw, cal in zip(range(draws), itertools.cycle(calibrations))])
    done = latency[~np.isnan(latency)]
    return {f"latency_p{q}_s": float(np.percentile(done, q)) for q in (50, 99)}


def compare_row(rate: float, live: dict, simulated: dict, replayed: dict, measured: dict) -> dict:
    """Live p50/p99 latency at one rate against the prediction (``sim``) and against the
    simulator fed this run's own measured costs (``replay``), with their ratios to live;
    ``measured``: the step cost and request overhead measured during the run (drift)."""
    row = {"rate": rate, "live_completed": live["completed"], "live_refused": live["refused"],
           "measured_c0_s": measured["c0"], "measured_c1_s": measured["c1"],
           "measured_overhead_p50_s": float(np.median(measured["request_overhead_s"]))}
    for q in (50, 99):
        row[f"live_p{q}_s"] = live["latency_s"][f"p{q}"]
        for name, summary in (("sim", simulated), ("replay", replayed)):
            row[f"{name}_p{q}_s"] = summary[f"latency_p{q}_s"]
            row[f"{name}_over_live_p{q}"] = _ratio(summary[f"latency_p{q}_s"], row[f"live_p{q}_s"])
    return row


def holds(rows: list[dict], name: str = "sim", tolerance: float = TOLERANCE) -> bool:
    ratios = [row[f"{name}_over_live_p{q}"] for row in rows for q in (50, 99)]
    return all(r is not None and abs(r - 1) <= tolerance for r in ratios)


async def bench_calibration(endpoint: client.Endpoint, plan: CalibrationPlan, rates: list[float],
                            requests: int, policy: str = "fdfo", recalibrate: bool = True,
                            quiet: bool = False) -> dict:
    """``recalibrate``: calibrate before the first rate and after each (each rate is predicted
    from the calibrations on either side of it); else once, first."""
    calibrations, rows = [], []

    async def calibrate_next() -> None:
        calibrations.append(await calibrate(endpoint, replace(plan, seed=plan.seed + 2 * len(calibrations)), quiet))

    await calibrate_next()
    async with client.make_client(endpoint) as http:
        endpoint = replace(endpoint, model=endpoint.model or await client.first_model(http))
        for index, rate in enumerate(rates):
            seed = plan.seed + 2 * index + 1  # other arrivals and prompts than any calibration's
            times = poisson_times(rate, seed, count=requests)
            arrivals = with_prompts(times, tiny_prompts(len(times), seed))
            own, _, records = await measure_load(http, endpoint, rate, arrivals, plan.replicas,
                                                 None if quiet else f"rate {rate:g}/s ")
            if recalibrate:
                await calibrate_next()
            around = list(range(len(calibrations)))[-2:] if recalibrate else [0]
            predicted = predict([calibrations[i] for i in around], times, policy, plan.replicas, seed)
            replayed = predict([calibrations[0].replaced(load_points=[own])], times, policy, plan.replicas, seed)
            rows.append({**compare_row(rate, summarize(records, rate), predicted, replayed, own),
                         "calibrations": around})
    return {"calibrations": [c.source for c in calibrations], "policy": policy, "replicas": plan.replicas,
            "rows": rows, "tolerance": TOLERANCE, "holds": holds(rows), "replay_holds": holds(rows, "replay")}


def format_comparison(result: dict) -> str:
    lines = [f"calibration {index}: {source}" for index, source in enumerate(result["calibrations"])]
    lines += ["sim: predicted for the same arrival times from the calibrations in column cal; "
             "replay: fed the costs measured during that rate's own run",
             f"{'cal':>3} {'rate/s':>7} {'live p50':>9} {'sim':>6} {'ratio':>6} {'replay':>7} {'ratio':>6} "
             f"{'live p99':>9} {'sim':>6} {'ratio':>6} {'replay':>7} {'ratio':>6}"]
    for row in result["rows"]:
        cells = [f"{'+'.join(map(str, row['calibrations'])):>3} {row['rate']:>7g}"]
        for q in (50, 99):
            cells.append(f"{row[f'live_p{q}_s']:>9.3f} {row[f'sim_p{q}_s']:>6.3f} {row[f'sim_over_live_p{q}']:>6.2f} "
                         f"{row[f'replay_p{q}_s']:>7.3f} {row[f'replay_over_live_p{q}']:>6.2f}")
        lines.append(" ".join(cells))
    for name, key in (("prediction", "holds"), ("replay", "replay_holds")):
        verdict = "holds" if result[key] else "does NOT hold"
        lines.append(f"{name} {verdict} (every ratio within {result['tolerance']:.0%} of 1)")
    return "\n".join(lines)
