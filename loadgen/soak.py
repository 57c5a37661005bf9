"""`dllm-serve bench soak`: does a local cluster's engine replica keep its memory under a
long mixed load?

--clients concurrent clients send requests back to back for --duration seconds, each in
turn one of ``KINDS``: a streamed answer, a whole answer, a whole answer with logprobs
(20 alternatives), one with stop strings, one with a short deadline (``deadline_s``:
refused where admission predicts more, else it finishes or ends at it), a stream the client drops
after its first block, two choices (n 2), a bad request (400), and a body the client leaves
half sent. Every --sample-every seconds the resident set (VmRSS) of each process of the
cluster serving the URL (the Ray workers that the raylet of the process listening on the
URL's port started, by their titles: engine and ingress replicas, proxy, controller, metrics
actor) is read from /proc. The report: each one's resident memory after the first minute
(the warm state) and at the end, their ratio, the highest, and the requests by kind and
outcome, and each one's growth over the second half of the run (MiB an hour); a run of 10
minutes or more names the processes that grow (``GROWTH_PER_HOUR``) and exits with 1. After
the load, the cluster must come to rest within a minute (``AT_REST``, read from --metrics-url):
no request running or waiting, no step debt, no page held (the prefix cache's references at
zero) and no admission charge; what it still holds is reported, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from loadgen.arrivals import tiny_prompts
from loadgen.cli import LoadgenError, add_endpoint_options, positive_number, run_command
from loadgen.overload import cluster_cpu, serving_raylet

KINDS = ("stream", "whole", "logprobs", "stop", "deadline", "dropped", "n2", "bad", "body_dropped")
# what a cluster at rest holds (the metrics endpoint's gauges; per replica where labelled):
# no request running or waiting, no step debt, every page free (a cached page no request
# holds counts as free: the prefix cache's references are zero), no admission charge
AT_REST = {"dllm_running_requests": "running requests", "dllm_step_queue_length": "waiting requests",
           "dllm_step_debt": "step debt", "dllm_admission_outstanding": "admission charge"}
SETTLE_S = 60.0  # how long the cluster may take to come to rest after the load
# refused (429) where admission predicts more, else ended by it (finish_reason "timeout", or 504
# before any token) or answered in time
DEADLINE_S = 0.5
WARM_S = 60.0  # the first minute: start-up allocations, caches and the allocator's pools settle
# A process grows when, over the second half of a run of at least JUDGED_AFTER_S, its resident
# memory rises faster than GROWTH_PER_HOUR of its size an hour (least squares). Bounded caches
# (the metrics actor's calibration log) fill in the first minutes; a leak keeps its slope.
JUDGED_AFTER_S = 600.0
GROWTH_PER_HOUR = 0.05


def cluster_processes(port: int, proc: Path = Path("/proc")) -> dict[int, str]:
    """pid -> role of the processes of the local cluster serving on ``port`` (engine
    replicas, ingress replicas, proxy, controller, metrics actor; ``overload.ROLES``)."""
    raylet = serving_raylet(port, proc)
    if raylet is None:
        raise LoadgenError(f"no process here listens on port {port}: bench soak reads a local cluster's memory")
    return {pid: role for pid, (role, _) in sorted(cluster_cpu(raylet, proc).items())}


def resident_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:  # gone (a replica replaced)
        pass
    return None


def request_body(kind: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": kind in ("stream", "dropped")}
    if kind == "logprobs":
        body["logprobs"] = 20
    elif kind == "stop":
        body["stop"] = ["1", "\n"]
    elif kind == "deadline":
        body["deadline_s"] = DEADLINE_S
    elif kind == "n2":
        body["n"] = 2
    elif kind == "bad":
        body["max_tokens"] = -1
    return body


async def drop_mid_body(url: str, body: dict, headers: dict) -> str:
    """Send the request's headers and half its body, then close the connection."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Content-Type": "application/json"}.items())
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Length: {len(data)}\r\n"
                 f"{head}\r\n".encode() + data[: len(data) // 2])
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    return "dropped"


async def one_request(http: httpx.AsyncClient, kind: str, body: dict) -> str:
    """The outcome: the HTTP status, 'dropped' for a stream left after its first event or a
    body left half sent."""
    if kind == "body_dropped":
        return await drop_mid_body(str(http.base_url), body, dict(http.headers))
    if not body["stream"]:
        return str((await http.post("/v1/completions", json=body)).status_code)
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if kind == "dropped" and line.startswith("data: "):
                return "dropped"
    return str(response.status_code)


async def soak(url: str, model: str | None, api_key: str | None, duration_s: float, clients: int,
               sample_every_s: float, max_tokens: int, metrics_url: str | None = None, seed: int = 0) -> dict:
    port = urlsplit(url).port or 80
    roles = cluster_processes(port)
    pids = list(roles)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompts = itertools.cycle(tiny_prompts(500, seed))
    outcomes: dict[str, dict[str, int]] = {kind: {} for kind in KINDS}
    samples: list[tuple[float, dict[int, int | None]]] = []
    start = time.monotonic()
    deadline = start + duration_s
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        if model is None:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
        turns = itertools.count()

        async def client_loop() -> None:
            while time.monotonic() < deadline:
                kind = KINDS[next(turns) % len(KINDS)]
                try:
                    outcome = await one_request(http, kind, request_body(kind, model, next(prompts), max_tokens))
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                outcomes[kind][outcome] = outcomes[kind].get(outcome, 0) + 1

        async def sampler() -> None:
            while time.monotonic() < deadline:
                samples.append((time.monotonic() - start, {pid: resident_bytes(pid) for pid in pids}))
                await asyncio.sleep(sample_every_s)
            samples.append((time.monotonic() - start, {pid: resident_bytes(pid) for pid in pids}))

        await asyncio.gather(sampler(), *(client_loop() for _ in range(clients)))
        at_rest = await settled(http, metrics_url) if metrics_url else None
    return {**memory_report(samples, roles, outcomes, duration_s), "at_rest": at_rest}


def rest_problems(metrics_text: str) -> dict[str, float]:
    """What the cluster still holds, by gauge and replica (empty: at rest)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            values.setdefault(sample.name, {})[sample.labels.get("replica", "")] = sample.value
    problems = {f"{AT_REST[name]} {who}".strip(): value for name in AT_REST
                for who, value in values.get(name, {}).items() if value}
    for who, total in values.get("dllm_total_pages", {}).items():
        held = total - values.get("dllm_free_pages", {}).get(who, 0.0)
        if held:
            problems[f"pages held {who}"] = held
    return problems


async def settled(http: httpx.AsyncClient, metrics_url: str) -> dict:
    """Wait up to ``SETTLE_S`` for the cluster to come to rest; what it still held then."""
    started = time.monotonic()
    while True:
        problems = rest_problems((await http.get(metrics_url)).text)
        if not problems or time.monotonic() - started > SETTLE_S:
            return {"clean": not problems, "after_s": round(time.monotonic() - started, 1), "held": problems}
        await asyncio.sleep(1.0)


def memory_report(samples: list[tuple[float, dict[int, int | None]]], roles: dict[int, str],
                  outcomes: dict[str, dict[str, int]], duration_s: float) -> dict:
    """Per process ("role pid"): its resident memory after the first minute, at the end,
    their ratio, the highest, at the end of each minute (levelling off, or a leak's line) and
    its growth over the second half (MiB an hour); ``growing``: the processes that grow, in a
    run of ``JUDGED_AFTER_S`` or more."""
    mib = float(1 << 20)
    processes, growing = {}, []
    for pid, role in roles.items():
        series = [(t, rss[pid]) for t, rss in samples if rss.get(pid)]
        warm = [rss for t, rss in series if t >= min(WARM_S, duration_s / 2)]
        if not warm:
            continue
        minutes = {int(t // 60): rss for t, rss in series}  # the last reading of each minute
        processes[f"{role} {pid}"] = {"after_first_minute_mib": round(warm[0] / mib, 1), "end_mib": round(warm[-1] / mib, 1),
                              "max_mib": round(max(warm) / mib, 1), "end_over_first_minute": round(warm[-1] / warm[0], 4),
                              "by_minute_mib": [round(rss / mib, 1) for _, rss in sorted(minutes.items())]}
        late = [(t, rss) for t, rss in series if t >= duration_s / 2]
        per_hour = _slope(late) * 3600
        processes[f"{role} {pid}"]["second_half_growth_mib_per_hour"] = round(per_hour / mib, 1)
        if duration_s >= JUDGED_AFTER_S and per_hour > GROWTH_PER_HOUR * warm[-1]:
            growing.append(f"{role} {pid}")
    return {"duration_s": duration_s, "samples": len(samples), "processes": processes, "growing": growing,
            "requests": outcomes}


def _slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of ``points`` (0 for fewer than two)."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (y - mean_y) for t, y in points) / spread if spread else 0.0


def add_bench_soak_parser(targets) -> None:
    parser = targets.add_parser(
        "soak", help="a local cluster's processes' resident memory under a long mixed load, and nothing held after it",
        description=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: dllm-serve bench soak --url http://127.0.0.1:8000 --duration 600\n"
               "exit status: 0; 1 when a process's memory grows (runs of 10 minutes or more) or the cluster "
               "holds requests, pages or admission charges a minute after the load; 2 on bad input, an unreachable endpoint or no local cluster on the URL's port.")
    add_endpoint_options(parser)
    parser.add_argument("--duration", type=positive_number(float), default=600.0, metavar="S",
                        help="seconds of load (default 600)")
    parser.add_argument("--clients", type=positive_number(int), default=8, metavar="N",
                        help="concurrent clients, each sending its next request when its last one ends (default 8)")
    parser.add_argument("--sample-every", type=positive_number(float), default=5.0, metavar="S",
                        help="seconds between two readings of the replicas' memory (default 5)")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:9400/metrics",
                        help="the cluster's Prometheus endpoint, read after the load for what it still holds "
                             "(default http://127.0.0.1:9400/metrics; '' skips the check)")
    parser.set_defaults(func=lambda args: run_command("bench soak", lambda: _run(args)))


def _run(args) -> int:
    try:
        report = asyncio.run(soak(args.url.rstrip("/"), args.model, args.api_key, args.duration, args.clients,
                                  args.sample_every, args.max_tokens, args.metrics_url or None))
    except httpx.HTTPError as exc:
        raise LoadgenError(f"{args.url}: {exc}") from None
    print(json.dumps(report, indent=2))
    at_rest = report["at_rest"] is None or report["at_rest"]["clean"]
    return 0 if at_rest and not report["growing"] else 1
