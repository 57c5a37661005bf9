"""`dllm-serve bench calibration`: does the simulator predict the live cluster?

Calibrates once on the live cluster (`loadgen.live_calibration`, by default at a light and
a heavy load), then for each compared rate runs a Poisson load of the same number of
requests (so every p99 rests on as many; other arrivals and prompts than the
calibration's) against the cluster and through the simulator, and prints the p50/p99
latency of both and their ratios side by side.
"""

from __future__ import annotations

from dataclasses import replace

from loadgen import client, simulator
from loadgen.arrivals import poisson_times, tiny_prompts, with_prompts
from loadgen.live_calibration import CalibrationPlan, calibrate
from loadgen.runner import Progress, run_open_loop
from loadgen.stats import summarize

TOLERANCE = 0.2  # the simulator "holds" when every predicted percentile is within 20 %


def _ratio(predicted: float | None, measured: float | None) -> float | None:
    return round(predicted / measured, 3) if predicted is not None and measured else None


def compare_row(rate: float, live: dict, simulated: dict) -> dict:
    """Live and simulated p50/p99 latency at one rate, with simulated/live ratios."""
    row = {"rate": rate, "live_completed": live["completed"], "live_refused": live["refused"]}
    for q in (50, 99):
        measured, predicted = live["latency_s"][f"p{q}"], simulated[f"latency_p{q}_s"]
        row[f"live_p{q}_s"] = measured
        row[f"sim_p{q}_s"] = predicted
        row[f"sim_over_live_p{q}"] = _ratio(predicted, measured)
    return row


def holds(rows: list[dict], tolerance: float = TOLERANCE) -> bool:
    ratios = [row[f"sim_over_live_p{q}"] for row in rows for q in (50, 99)]
    return all(r is not None and abs(r - 1) <= tolerance for r in ratios)


async def bench_calibration(endpoint: client.Endpoint, plan: CalibrationPlan, rates: list[float],
                            requests: int, policy: str = "fdfo", sim_requests: int = 4000,
                            quiet: bool = False) -> dict:
    calibration = await calibrate(endpoint, plan, quiet)
    rows = []
    async with client.make_client(endpoint) as http:
        endpoint = replace(endpoint, model=endpoint.model or await client.first_model(http))
        seed = plan.seed + 1  # other arrivals and prompts than the calibration's
        for rate in rates:
            times = poisson_times(rate, seed, count=requests)
            arrivals = with_prompts(times, tiny_prompts(len(times), seed))
            records = await run_open_loop(arrivals, lambda i, a, s: client.send(http, endpoint, i, a, s),
                                          None if quiet else Progress(len(arrivals), f"rate {rate:g}/s "))
            predicted = simulator.summarize(simulator.run(calibration, policy, rate, sim_requests, seed,
                                                          replicas=plan.replicas))
            rows.append(compare_row(rate, summarize(records, rate), predicted))
    return {"calibration": calibration, "policy": policy, "replicas": plan.replicas, "rows": rows,
            "tolerance": TOLERANCE, "holds": holds(rows)}


def format_comparison(result: dict) -> str:
    lines = [f"calibration: {result['calibration']['source']}",
             f"{'rate/s':>7} {'live p50':>9} {'sim p50':>8} {'ratio':>6} {'live p99':>9} {'sim p99':>8} {'ratio':>6}"]
    for row in result["rows"]:
        lines.append(f"{row['rate']:>7g} {row['live_p50_s']:>9.3f} {row['sim_p50_s']:>8.3f} "
                     f"{row['sim_over_live_p50']:>6.2f} {row['live_p99_s']:>9.3f} {row['sim_p99_s']:>8.3f} "
                     f"{row['sim_over_live_p99']:>6.2f}")
    verdict = "holds" if result["holds"] else "does NOT hold"
    lines.append(f"calibration {verdict} (every ratio within {result['tolerance']:.0%} of 1)")
    return "\n".join(lines)
