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
from loadgen.live_calibration import CalibrationPlan, calibrate, measure_load
from loadgen.stats import summarize

TOLERANCE = 0.2  # the simulator "holds" when every predicted percentile is within 20 %


def _ratio(predicted: float | None, measured: float | None) -> float | None:
    return round(predicted / measured, 3) if predicted is not None and measured else None


def compare_row(rate: float, live: dict, simulated: dict, replayed: dict) -> dict:
    """Live p50/p99 latency at one rate against the prediction (``sim``) and against the
    simulator fed this run's own measured costs (``replay``), with their ratios to live."""
    row = {"rate": rate, "live_completed": live["completed"], "live_refused": live["refused"]}
    for q in (50, 99):
        measured = live["latency_s"][f"p{q}"]
        row[f"live_p{q}_s"] = measured
        for name, summary in (("sim", simulated), ("replay", replayed)):
            row[f"{name}_p{q}_s"] = summary[f"latency_p{q}_s"]
            row[f"{name}_over_live_p{q}"] = _ratio(summary[f"latency_p{q}_s"], measured)
    return row


def holds(rows: list[dict], name: str = "sim", tolerance: float = TOLERANCE) -> bool:
    ratios = [row[f"{name}_over_live_p{q}"] for row in rows for q in (50, 99)]
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
            own, _, records = await measure_load(http, endpoint, rate, arrivals, plan.replicas,
                                                 None if quiet else f"rate {rate:g}/s ")

            def simulated(cal: dict) -> dict:
                return simulator.summarize(simulator.run(cal, policy, rate, sim_requests, seed,
                                                         replicas=plan.replicas))

            rows.append(compare_row(rate, summarize(records, rate), simulated(calibration),
                                    simulated({**calibration, "load_points": [own]})))
    return {"calibration": calibration, "policy": policy, "replicas": plan.replicas, "rows": rows,
            "tolerance": TOLERANCE, "holds": holds(rows), "replay_holds": holds(rows, "replay")}


def format_comparison(result: dict) -> str:
    lines = [f"calibration: {result['calibration']['source']}",
             "sim: predicted from the calibration; replay: fed the costs measured during that rate's own run",
             f"{'rate/s':>7} {'live p50':>9} {'sim':>6} {'ratio':>6} {'replay':>7} {'ratio':>6} "
             f"{'live p99':>9} {'sim':>6} {'ratio':>6} {'replay':>7} {'ratio':>6}"]
    for row in result["rows"]:
        cells = [f"{row['rate']:>7g}"]
        for q in (50, 99):
            cells.append(f"{row[f'live_p{q}_s']:>9.3f} {row[f'sim_p{q}_s']:>6.3f} {row[f'sim_over_live_p{q}']:>6.2f} "
                         f"{row[f'replay_p{q}_s']:>7.3f} {row[f'replay_over_live_p{q}']:>6.2f}")
        lines.append(" ".join(cells))
    for name, key in (("prediction", "holds"), ("replay", "replay_holds")):
        verdict = "holds" if result[key] else "does NOT hold"
        lines.append(f"{name} {verdict} (every ratio within {result['tolerance']:.0%} of 1)")
    return "\n".join(lines)
