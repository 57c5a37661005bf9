"""`dllm-serve calibrate`: measure the simulator's calibration on a live cluster.

The bench's calibration (`dllm-serve bench engine --calibration`) times the engine alone
on a quiet machine. A live replica runs slower than that: its engine thread shares the
interpreter with the replica's event loop and the CPU with Serve's proxy and the ingress,
and each request also spends time outside the engine (HTTP, proxy, ingress, routing,
streaming back). So `dllm-serve calibrate` measures on the live cluster, under Poisson load at each of
``rates`` for ``duration_s`` (the engine then steps at many batch sizes), one load point
per rate:

* step cost: the replica's busy-step periods (wall clock between back-to-back steps, the
  contention included) give ``c0 + c1 * rows + prefill_s * starting requests``, fitted
  over all loads at once with c0 per load (`replicas.cost_model.fit_step_cost_by_load`),
  and ``step_cost_spread`` and ``step_cost_path`` per load;
* ``request_overhead_s``: each completed request's client latency minus the time it spent
  in the replica (``dllm.engine_s`` of its last chunk), as 100 equally likely values;
* steps per block and blocks per request: the replica's finished requests, all rates pooled.

Step costs and overheads grow with load when the serving path shares the replica's CPU,
so measure at a low and a high rate: the simulator interpolates between load points.
The replicas' numbers come from ``GET /v1/dllm/calibration?window_s=`` each load's span
(the metrics actor keeps every replica's records), pooled. The cluster should be
otherwise idle.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from loadgen import client
from loadgen.arrivals import poisson_times, tiny_prompts, with_prompts
from tools.capacity.calibration import LOAD_FIELDS, Calibration
from tools.capacity.step_cost import step_calibration
from loadgen.records import OK, LoadgenError, Record
from loadgen.loops import Progress, run_open_loop
from replicas.cost_model import fit_step_cost_by_load

CALIBRATION_PATH = "/v1/dllm/calibration"
REPORT_LAG_S = 2.0  # replicas report every stats_period_s (0.5 s by default)


@dataclass(frozen=True)
class CalibrationPlan:
    rates: tuple[float, ...] = (4.0, 16.0)  # requests per second to the whole cluster
    duration_s: float = 45.0  # of arrivals, per rate
    seed: int = 0
    replicas: int = 1  # serving, so that a load point's rate is per replica


async def fetch_calibration(http: client.HttpClient, window_s: float) -> dict:
    """What every replica measured in the last ``window_s`` seconds; ``LoadgenError`` if
    the server has no such endpoint."""
    try:
        response = await http.get(CALIBRATION_PATH, params={"window_s": window_s}, timeout_s=30)
    except client.HttpError as exc:
        raise LoadgenError(f"GET {CALIBRATION_PATH} failed: {type(exc).__name__}: {exc}") from None
    if response.status != 200:
        raise LoadgenError(f"GET {CALIBRATION_PATH} answered {response.status}: "
                           f"{client.error_message(response)} (is this a dllm-serve cluster?)")
    return response.json()


def pool_reports(answer: dict) -> dict:
    """The replicas' reports as one: step periods and counts pooled, the step cost fitted."""
    reports = list(answer["replicas"].values())
    periods = [tuple(p) for report in reports for p in report["step_periods"]]
    if not periods:
        raise LoadgenError("no replica took two steps back to back; calibrate at higher rates")
    started = sum(report["requests_started"] for report in reports)
    units_per_request = sum(report["prefix_units"] for report in reports) / max(1, started)
    counts = {name: sum((Counter({int(k): v for k, v in report[name].items()}) for report in reports), Counter())
              for name in ("steps_per_block", "blocks_per_request")}
    return {**step_calibration(periods, units_per_request), **counts, "max_batch": answer["max_batch"],
            "replicas_stepping": sum(1 for report in reports if report["step_periods"]),
            "step_periods": periods, "prefix_units_per_request": units_per_request}


def request_overheads(records: list[Record], points: int = 100) -> list[float]:
    """Client latency minus engine time of the completed requests, as ``points`` equally
    likely values (midpoint quantiles), each >= 0."""
    gaps = [r.latency_s - r.engine_s for r in records if r.status == OK and r.engine_s is not None]
    if not gaps:
        raise LoadgenError("no completed request reported its engine time (dllm.engine_s); "
                           "is this a dllm-serve cluster?")
    return [max(0.0, round(float(g), 5)) for g in np.quantile(gaps, (np.arange(points) + 0.5) / points)]


async def measure_load(http: client.HttpClient, endpoint: client.Endpoint, rate: float, arrivals: list,
                       replicas: int, label: str | None) -> tuple[dict, dict, list[Record]]:
    """Send ``arrivals``; returns the load point measured meanwhile (at ``rate`` / replicas),
    the pooled replica reports and the client's records."""
    started = time.monotonic()
    records = await run_open_loop(arrivals, lambda i, a, s: client.send(http, endpoint, i, a, s),
                                  None if label is None else Progress(len(arrivals), label))
    await asyncio.sleep(REPORT_LAG_S)  # the replicas' last records reach the metrics actor
    pooled = pool_reports(await fetch_calibration(http, time.monotonic() - started))
    point = {"rate": rate / replicas, **{k: pooled[k] for k in LOAD_FIELDS if k != "request_overhead_s"},
             "request_overhead_s": request_overheads(records)}
    return point, pooled, records


async def calibrate(endpoint: client.Endpoint, plan: CalibrationPlan, quiet: bool = False) -> Calibration:
    """A validated calibration of the cluster behind ``endpoint`` (see the module doc)."""
    points, loads, steps, blocks, heard = [], [], Counter(), Counter(), 0
    async with client.make_client(endpoint) as http:
        endpoint = replace(endpoint, model=endpoint.model or await client.first_model(http))
        for rate in plan.rates:
            times = poisson_times(rate, plan.seed, plan.duration_s)
            arrivals = with_prompts(times, tiny_prompts(len(times), plan.seed))
            point, pooled, _ = await measure_load(http, endpoint, rate, arrivals, plan.replicas,
                                                  None if quiet else f"calibration at {rate:g}/s ")
            points.append(point)
            loads.append(pooled)
            steps.update(pooled["steps_per_block"])
            blocks.update(pooled["blocks_per_request"])
            heard = max(heard, pooled["replicas_stepping"])
    c0s, c1, c2 = fit_step_cost_by_load([load["step_periods"] for load in loads])
    for point, load, c0 in zip(points, loads, c0s):
        point.update(step_calibration(load["step_periods"], load["prefix_units_per_request"], cost=(c0, c1, c2)))
    described = ", ".join(f"{p['rate']:g}/s: c0 {p['c0'] * 1e3:.1f} ms, c1 {p['c1'] * 1e3:.2f} ms, "
                          f"overhead {statistics.median(p['request_overhead_s']) * 1e3:.0f} ms" for p in points)
    return Calibration.of({
        **points[0], "max_batch": pooled["max_batch"], "steps_per_block": steps, "blocks_per_request": blocks,
        "load_points": points,
        "source": f"dllm-serve calibrate {endpoint.url}, {plan.replicas} replica(s) ({heard} stepping), "
                  f"per replica {described}"})
