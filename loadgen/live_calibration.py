"""`dllm-serve calibrate`: measure the simulator's calibration on a live cluster.

The bench's calibration (`dllm-serve bench engine --calibration`) times the engine alone
on a quiet machine. A live replica runs slower than that: its engine thread shares the
interpreter with the replica's event loop and the CPU with Serve's proxy and the ingress,
and each request also spends time outside the engine (HTTP, proxy, ingress, routing,
streaming back). So `dllm-serve calibrate` measures on the live cluster, under Poisson
load at ``rate`` for ``duration_s`` (the engine then steps at many batch sizes):

* step cost: the replica's busy-step periods (wall clock between back-to-back steps, the
  contention included) give ``c0 + c1 * rows`` and ``step_cost_spread``;
* steps per block and blocks per request: the replica's finished requests;
* ``request_overhead_s``: each completed request's client latency minus the time it spent
  in the replica (``dllm.engine_s`` of its last chunk), as 100 equally likely values.

The replica's numbers come from ``GET /v1/dllm/calibration`` (one replica answers;
replicas are alike). The cluster should be otherwise idle while it runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import httpx
import numpy as np

from loadgen import client
from loadgen.arrivals import poisson_times, tiny_prompts, with_prompts
from loadgen.calibration import validate_calibration
from loadgen.records import OK, LoadgenError, Record
from loadgen.runner import Progress, run_open_loop

CALIBRATION_PATH = "/v1/dllm/calibration"


@dataclass(frozen=True)
class CalibrationPlan:
    rate: float = 12.0
    duration_s: float = 20.0
    seed: int = 0


async def fetch_replica_calibration(http: httpx.AsyncClient) -> dict:
    """The raw calibration one replica reports; ``LoadgenError`` if the server has none."""
    try:
        response = await http.get(CALIBRATION_PATH, timeout=30)
    except httpx.HTTPError as exc:
        raise LoadgenError(f"GET {CALIBRATION_PATH} failed: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise LoadgenError(f"GET {CALIBRATION_PATH} answered {response.status_code}: "
                           f"{client.error_message(response)} (is this a dllm-serve cluster?)")
    return response.json()


def request_overheads(records: list[Record], points: int = 100) -> list[float]:
    """Client latency minus engine time of the completed requests, as ``points`` equally
    likely values (midpoint quantiles), each >= 0."""
    gaps = [r.latency_s - r.engine_s for r in records if r.status == OK and r.engine_s is not None]
    if not gaps:
        raise LoadgenError("no completed request reported its engine time (dllm.engine_s); "
                           "is this a dllm-serve cluster?")
    return [max(0.0, round(float(g), 5)) for g in np.quantile(gaps, (np.arange(points) + 0.5) / points)]


async def calibrate(endpoint: client.Endpoint, plan: CalibrationPlan, quiet: bool = False) -> dict:
    """A validated calibration of the cluster behind ``endpoint`` (see the module doc)."""
    async with client.make_client(endpoint) as http:
        endpoint = replace(endpoint, model=endpoint.model or await client.first_model(http))
        times = poisson_times(plan.rate, plan.seed, plan.duration_s)
        arrivals = with_prompts(times, tiny_prompts(len(times), plan.seed))
        records = await run_open_loop(arrivals, lambda i, a, s: client.send(http, endpoint, i, a, s),
                                      None if quiet else Progress(len(arrivals), "calibration load "))
        raw = await fetch_replica_calibration(http)
    overheads = request_overheads(records)
    if raw.get("c0") is None:
        raise LoadgenError("the replica took no back-to-back steps; raise the calibration rate or duration")
    return validate_calibration({
        **raw, "request_overhead_s": overheads,
        "source": f"dllm-serve calibrate {endpoint.url}: {len(arrivals)} requests at {plan.rate:g}/s "
                  f"(median overhead {statistics.median(overheads) * 1e3:.1f} ms); {raw['source']}"})
