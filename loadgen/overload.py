"""`dllm-serve bench overload`: does a cluster hold its goodput when more arrives than it serves?

First, on a local cluster, --idle-duration seconds with no request: each process's CPU at
rest. Then the capacity: a closed loop of --clients concurrent clients for --capacity-duration
seconds, each sending its next request as soon as its last one ends; its completed requests
per second are the capacity. Then open-loop Poisson arrivals at each multiple of it in
--loads (1x, 2x, 3x), --duration seconds each. Per phase: goodput (completed requests within
the latency SLO per second) and its ratio to the capacity, refusals (429) and how fast they
came back, admitted latency, the request path's overhead (client latency minus the engine
time the server reports as dllm.engine_s), and CPU time by process role, read from
/proc/<pid>/stat before and after each phase (n/a for a remote URL): the ingress replicas,
Serve's proxy, HAProxy and its manager actor, the Serve controller and the metrics actor
(together: the control plane), the engine replicas (and, apart, their CPU outside their
engine steps, in the steps outside the model forwards, and in the forwards, from the
forward_cpu_s and step_cpu_s the server reports in GET /health), and this client. The processes are the Ray workers, by their titles
(ray::ServeReplica...Ingress, ray::ProxyActor, ...), that the same raylet started as the
process listening on the URL's port (HAProxy's: its manager's), so other local clusters do
not count. CPU per admitted and per refused request: a least-squares fit of each phase's
CPU to its admitted and refused counts and its seconds over all phases (the idle phase
sends nothing, the closed loop refuses nothing, the overload phases mostly refuse).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from loadgen import client
from loadgen.arrivals import poisson_times, with_prompts
from loadgen.cli import add_endpoint_options, endpoint_from_args, positive_number, rate_list, run_command
from loadgen.records import OK, REFUSED, Record
from loadgen.report import format_table, number
from loadgen.loops import Progress, run_closed_loop, run_open_loop
from loadgen.stats import percentile, summarize

# role -> what the command line of its processes contains (Ray titles a worker "ray::<class>[.<method>]")
RAY_ROLES = {
    "ingress": ("ray::ServeReplica", "Ingress"),
    "proxy": ("ray::ProxyActor",),
    "haproxy_manager": ("ray::HAProxyManager",),
    "controller": ("ray::ServeController",),
    "metrics": ("ray::MetricsActor",),
    "engine": ("ray::ServeReplica", "EngineReplica"),
}
HAPROXY = "haproxy"  # the binary Serve's HAProxyManager runs: its child, not the raylet's
ROLES = (*RAY_ROLES, HAPROXY)
CONTROL_PLANE = tuple(r for r in ROLES if r != "engine")
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}
HEALTH_PATH = "/health"  # dllm-serve's ingress says its slo_latency_s there
DEFAULT_SLO_S = 5.0
PROMPTS = 1000  # distinct tiny-task prompts, cycled


@dataclass(frozen=True)
class OverloadPlan:
    clients: int = 12  # closed-loop clients of the capacity phase
    idle_s: float = 5.0  # seconds with no request first (a local cluster's CPU at rest; 0: none)
    capacity_s: float = 15.0
    loads: tuple[float, ...] = (1.0, 2.0, 3.0)  # multiples of the capacity
    duration_s: float = 20.0  # of Poisson arrivals per load
    slo_latency_s: float | None = None  # None: the server's, else DEFAULT_SLO_S
    seed: int = 0
    prompt: str | None = None  # None: tiny-task prompts


# ---- control-plane CPU from /proc ----------------------------------------------------------
def parse_stat(stat: str, ticks_per_s: float) -> tuple[int, float]:
    """(parent pid, utime + stime in seconds) of a ``/proc/<pid>/stat`` line: fields 4, 14
    and 15, counted after the command name's closing parenthesis (the name may hold spaces
    and parentheses)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks_per_s


def _pids(proc: Path) -> list[Path]:
    return [entry for entry in proc.iterdir() if entry.name.isdigit()]


def _listening_sockets(port: int, proc: Path) -> set[str]:
    """``socket:[inode]`` of the TCP sockets listening on ``port`` (state 0A in /proc/net/tcp*)."""
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for fields in map(str.split, lines):
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(f"socket:[{fields[9]}]")
    return found


def _cmdline(entry: Path) -> str:
    return (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def listening_process(port: int, proc: Path = Path("/proc")) -> tuple[int, str] | None:
    """(pid, command line) of the process listening on ``port`` here, or None."""
    sockets = _listening_sockets(port, proc)
    for entry in _pids(proc) if sockets else ():
        try:
            if any(os.readlink(fd) in sockets for fd in (entry / "fd").iterdir()):
                return int(entry.name), _cmdline(entry)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return None


def serving_raylet(port: int, proc: Path = Path("/proc")) -> int | None:
    """The Ray raylet that started the process listening on ``port`` (Serve's proxy: its
    parent; HAProxy: its manager actor's parent): the processes of that cluster are its
    children, those of other local clusters are not. None when no process here listens on
    ``port``."""
    listener = listening_process(port, proc)
    try:
        if listener is not None:
            parent = parse_stat((proc / str(listener[0]) / "stat").read_text(), 1)[0]
            if is_haproxy(listener[1]):
                parent = parse_stat((proc / str(parent) / "stat").read_text(), 1)[0]
            return parent
    except OSError:  # gone meanwhile
        pass
    return None


def is_haproxy(cmdline: str) -> bool:
    """Whether a command line runs an HAProxy binary (not a Ray worker named after one)."""
    return not cmdline.startswith("ray::") and "haproxy" in cmdline.split(" ", 1)[0]


def cluster_cpu(raylet: int, proc: Path = Path("/proc"),
                ticks_per_s: float | None = None) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of the processes of ``ROLES`` that the raylet
    ``raylet`` started (HAProxy: that its HAProxyManager started)."""
    ticks = ticks_per_s or os.sysconf("SC_CLK_TCK")
    found, haproxies = {}, {}
    for entry in _pids(proc):
        try:
            cmdline = _cmdline(entry)
            role = next((r for r, words in RAY_ROLES.items() if all(w in cmdline for w in words)), None)
            if role is None and is_haproxy(cmdline):
                role = HAPROXY
            if role is not None:
                parent, seconds = parse_stat((entry / "stat").read_text(), ticks)
                (haproxies if role == HAPROXY else found)[int(entry.name)] = (role, seconds, parent)
        except OSError:  # the process ended meanwhile
            continue
    ours = {pid: (role, seconds) for pid, (role, seconds, parent) in found.items() if parent == raylet}
    managers = {pid for pid, (role, _) in ours.items() if role == "haproxy_manager"}
    ours.update({pid: (role, seconds) for pid, (role, seconds, parent) in haproxies.items() if parent in managers})
    return ours


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two snapshots; a process that started in between counts
    from zero, one that ended is missing from ``after`` and not counted."""
    spent = dict.fromkeys(ROLES, 0.0)
    for pid, (role, seconds) in after.items():
        spent[role] += seconds - before.get(pid, (role, 0.0))[1]
    return spent


def local_port(url: str) -> int | None:
    """The port of ``url`` when its host is this machine, else None."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host in LOCAL_HOSTS or host.startswith("127."):
        return parts.port or (443 if parts.scheme == "https" else 80)
    return None


# ---- the report of one phase ----------------------------------------------------------------
# the other entries of a phase's ``cpu_s``: the engines' CPU in forwards and in whole steps, the client's
ENGINE_FORWARD, ENGINE_STEPS, CLIENT = "engine_forward", "engine_steps", "client"


def phase_report(label: str, records: list[Record], offered_rate: float | None, slo_latency_s: float,
                 cpu_s: dict[str, float] | None, correct: Callable[[Record], bool] | None = None) -> dict:
    """What one phase showed; ``cpu_s``: CPU seconds per role of ``ROLES``, ``ENGINE_FORWARD``,
    ``ENGINE_STEPS`` and ``CLIENT`` (None: not measured); ``correct``: whether a completed
    request's answer is right (None: not graded)."""
    summary = summarize(records, offered_rate, slo_latency_s)
    answered = [r for r in records if r.status == OK]
    refused = [r.latency_s for r in records if r.status == REFUSED]
    path = [r.latency_s - r.engine_s for r in records if r.status == OK and r.engine_s is not None]
    return {
        "load": label,
        **{key: summary[key] for key in ("offered_rate", "sent", "completed", "refused", "errors",
                                         "duration_s", "throughput_rps", "good", "goodput_rps", "top_errors")},
        "refused_latency_s": {"p50": percentile(refused, 50), "p99": percentile(refused, 99)},
        "admitted_latency_s": {"p50": summary["latency_s"]["p50"], "p99": summary["latency_s"]["p99"]},
        "path_overhead_p50_s": percentile(path, 50),
        "accuracy": sum(map(correct, answered)) / len(answered) if correct and answered else None,
        "degraded": sum(1 for r in answered if r.quality_level),
        "cpu_s": cpu_s,
        "control_plane_cpu_s_per_request": (sum(cpu_s[r] for r in CONTROL_PLANE) / len(records)
                                            if cpu_s and records else None),
        "engine_serving_cpu_s_per_admitted": (_engine_serving(cpu_s) / summary["completed"]
                                              if cpu_s and summary["completed"] else None),
    }


def _engine_serving(cpu_s: dict[str, float]) -> float:
    """The engine replicas' CPU outside their model forwards."""
    return max(0.0, cpu_s["engine"] - cpu_s[ENGINE_FORWARD])


ENGINE_PARTS = {  # how the engine replicas' CPU outside their forwards splits
    "engine_outside_forwards": _engine_serving,
    "engine_outside_steps": lambda c: c["engine"] - c[ENGINE_STEPS],  # Serve's wrapper, queues, chunks, reports
    "engine_host_in_steps": lambda c: c[ENGINE_STEPS] - c[ENGINE_FORWARD],  # scheduling, algorithms, commits
}


def cpu_per_outcome(phases: list[dict]) -> dict[str, dict[str, float]] | None:
    """CPU per admitted and per refused request, and per second whatever the load (timers,
    reports, Serve's own loops), for the control plane, each of its roles, the engines
    outside their forwards and the client: least squares of each phase's CPU on its
    completed and refused counts and the seconds it was measured over (the idle phase,
    with no request, ties the per-second figure to what the processes spend at rest).
    None without three measured phases whose mixes differ."""
    measured = [p for p in phases if p["cpu_s"]]
    columns = np.array([[p["completed"], p["refused"], p["cpu_window_s"]] for p in measured], dtype=float)
    if len(measured) < 3 or np.linalg.matrix_rank(columns) < 3:
        return None
    groups = {"control_plane": lambda c: sum(c[r] for r in CONTROL_PLANE), **ENGINE_PARTS,
              CLIENT: lambda c: c[CLIENT],
              **{role: (lambda c, role=role: c[role]) for role in CONTROL_PLANE}}
    fit = {}
    for name, of in groups.items():
        (admitted, refused, per_s), *_ = np.linalg.lstsq(
            columns, np.array([of(p["cpu_s"]) for p in measured]), rcond=None)
        fit[name] = {"admitted": float(admitted), "refused": float(refused), "per_second": float(per_s)}
    return fit


async def server_figure(http: client.HttpClient, key: str) -> float | None:
    """A figure the server says in GET /health (``slo_latency_s``, ``forward_cpu_s``), if any."""
    try:
        value = (await http.get(HEALTH_PATH)).json().get(key)
    except (*client.HttpError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value >= 0 else None


async def server_slo(http: client.HttpClient) -> float | None:
    """The latency SLO the server says it admits for, if any."""
    value = await server_figure(http, "slo_latency_s")
    return value if value else None


REPORT_SETTLE_S = 1.5  # replicas report their forward and step CPU once per stats period: wait for the last report


async def _measured(label: str, offered_rate: float | None, run: Awaitable[list[Record]], slo_latency_s: float,
                    raylet: int | None, http: client.HttpClient,
                    correct: Callable[[Record], bool] | None = None) -> dict:
    """Run one phase; CPU is measured when ``raylet`` is known and has such processes: the
    processes' and the reported forward CPU once the phase's last reports are in."""
    before = {} if raylet is None else cluster_cpu(raylet)
    engine = {ENGINE_FORWARD: "forward_cpu_s", ENGINE_STEPS: "step_cpu_s"}  # as /health says them
    reported = {part: await server_figure(http, key) or 0.0 for part, key in engine.items()}
    client_cpu, started = time.process_time(), time.monotonic()
    records = await run
    cpu_s = None
    if before:
        client_cpu = time.process_time() - client_cpu
        await asyncio.sleep(REPORT_SETTLE_S)
        cpu_s = {**cpu_delta(before, cluster_cpu(raylet)), CLIENT: client_cpu}
        for part, key in engine.items():
            cpu_s[part] = max(0.0, (await server_figure(http, key) or 0.0) - reported[part])
    report = phase_report(label, records, offered_rate, slo_latency_s, cpu_s, correct)
    report["cpu_window_s"] = time.monotonic() - started  # what the CPU figures cover
    return report


IDLE = "idle"  # the phase with no request


async def _nothing_for(seconds: float) -> list[Record]:
    """A phase that sends nothing for ``seconds``."""
    await asyncio.sleep(seconds)
    return []


def graded_tiny_prompts(seed: int) -> tuple[list[str], Callable[[Record], bool]]:
    """``PROMPTS`` prompts of the tiny model's task, and whether a record's answer is right
    (a record's index picks its prompt: the loops cycle through them)."""
    from replicas.tiny import task

    requests = task.make_requests(PROMPTS, seed)

    def correct(record: Record) -> bool:
        return all(task.grade(requests[record.index % len(requests)], record.text))
    return [request.prompt for request in requests], correct


async def bench_overload(endpoint: client.Endpoint, plan: OverloadPlan, quiet: bool = False) -> dict:
    """The closed-loop capacity, then each load; stops after the closed loop if it completed nothing."""
    async with client.make_client(endpoint) as http:
        listed = await client.first_model(http)  # also checks the URL (and key) before any load
        endpoint = replace(endpoint, model=endpoint.model or listed)
        server = await server_slo(http)  # what the server admits to
        slo, slo_from = plan.slo_latency_s, "--slo-latency"
        if slo is None:
            slo, slo_from = server, "the server"
        if slo is None:
            slo, slo_from = DEFAULT_SLO_S, "default"
        port = local_port(endpoint.url)
        raylet = None if port is None else serving_raylet(port)
        prompts, correct = ([plan.prompt], None) if plan.prompt else graded_tiny_prompts(plan.seed)
        send = partial(client.send, http, endpoint)

        def progress(label: str, total: int | None) -> Progress | None:
            return None if quiet else Progress(total, f"{label} ")

        phases = []
        if raylet is not None and plan.idle_s > 0:  # CPU is measured: first at rest
            phases.append(await _measured(IDLE, None, _nothing_for(plan.idle_s), slo, raylet, http))
        closed = f"closed x{plan.clients}"
        phases.append(await _measured(closed, None, run_closed_loop(prompts, send, plan.clients, plan.capacity_s,
                                                                    progress(closed, None)), slo, raylet, http,
                                      correct))
        capacity = phases[-1]["throughput_rps"]
        for load in plan.loads if capacity > 0 else ():
            rate = load * capacity
            arrivals = with_prompts(poisson_times(rate, plan.seed, plan.duration_s), prompts)
            label = f"{load:g}x"
            phases.append(await _measured(label, rate, run_open_loop(arrivals, send, progress(label, len(arrivals))),
                                          slo, raylet, http, correct))
    for phase in phases:
        phase["goodput_over_capacity"] = phase["goodput_rps"] / capacity if capacity > 0 and phase["sent"] else None
    return {"url": endpoint.url, "model": endpoint.model, "api": endpoint.path, "stream": endpoint.stream,
            "quality": endpoint.extra.get("quality"),
            "slo_latency_s": slo, "server_slo_latency_s": server,
            "slo_from": slo_from, "clients": plan.clients, "capacity_s": plan.capacity_s,
            "duration_s": plan.duration_s, "capacity_rps": capacity, "phases": phases,
            "cpu": _cpu_note(port, raylet, phases), "cpu_per_outcome_s": cpu_per_outcome(phases)}


def _cpu_note(port: int | None, raylet: int | None, phases: list[dict]) -> str:
    if port is None:
        return "n/a: not a local URL"
    if raylet is None:
        return f"n/a: no process on this machine listens on port {port}"
    if all(p["cpu_s"] is None for p in phases):
        return "n/a: no Ray ingress, proxy or metrics actor process beside the one on that port"
    return "measured from /proc"


def _ms(seconds: float | None) -> str:
    return number(None if seconds is None else seconds * 1000, ".1f")


_COLUMNS = (  # header, width, value of a phase report
    ("load", 11, lambda p: p["load"]),
    ("offered/s", 10, lambda p: number(p["offered_rate"], ".2f")),
    ("sent", 6, lambda p: str(p["sent"])),
    ("ok", 6, lambda p: str(p["completed"])),
    ("429", 6, lambda p: str(p["refused"])),
    ("err", 5, lambda p: str(p["errors"])),
    ("goodput/s", 10, lambda p: f"{p['goodput_rps']:.2f}"),
    ("good/cap", 9, lambda p: number(p["goodput_over_capacity"], ".2f")),
    ("429 p50 ms", 11, lambda p: _ms(p["refused_latency_s"]["p50"])),
    ("429 p99 ms", 11, lambda p: _ms(p["refused_latency_s"]["p99"])),
    ("ok p50 s", 9, lambda p: number(p["admitted_latency_s"]["p50"], ".2f")),
    ("ok p99 s", 9, lambda p: number(p["admitted_latency_s"]["p99"], ".2f")),
    ("path p50 ms", 12, lambda p: _ms(p["path_overhead_p50_s"])),
    ("cp ms/req", 10, lambda p: _ms(p["control_plane_cpu_s_per_request"])),
    ("eng ms/ok", 10, lambda p: _ms(p["engine_serving_cpu_s_per_admitted"])),
    ("acc %", 7, lambda p: number(None if p["accuracy"] is None else 100 * p["accuracy"], ".1f")),
    ("degraded", 9, lambda p: str(p["degraded"])),
)


def _slo_mismatch(result: dict) -> str:
    """A warning when the server admits to another SLO than the goodput counts against."""
    server = result.get("server_slo_latency_s")
    if server is None or abs(server - result["slo_latency_s"]) < 1e-9:
        return ""
    return (f"; WARNING: the server admits to {server:g} s, so admitted requests may take up to that "
            f"(start it with --set slo.latency_s={result['slo_latency_s']:g} to compare like with like)")


def format_overload(result: dict) -> str:
    lines = [f"target      {result['model']} at {result['url']}{result['api']}"
             f" ({'streamed' if result['stream'] else 'whole answers'}"
             f"{', quality ' + result['quality'] if result['quality'] else ''})",
             f"SLO         latency <= {result['slo_latency_s']:g} s (from {result['slo_from']})"
             + _slo_mismatch(result),
             f"capacity    {result['capacity_rps']:.2f} req/s completed by {result['clients']} closed-loop clients "
             f"in {result['capacity_s']:g} s; loads: Poisson for {result['duration_s']:g} s each",
             *format_table(result["phases"], _COLUMNS),
             "goodput: completed within the SLO per second; good/cap: goodput / capacity; ok: admitted (200) "
             "latency;",
             "path: client latency - dllm.engine_s; cp: control-plane CPU (all but the engines and the client) per "
             "request sent; eng: engine CPU outside the forwards per admitted request "
             f"(CPU {result['cpu']});",
             "acc: answers all right (tiny-task prompts); degraded: answers the server's load knob ran below the "
             "default quality"]
    fit = result["cpu_per_outcome_s"]
    if fit:
        lines.append("CPU ms per admitted request / per refused request / per second at any load "
                     "(least squares over the phases):")
        lines += [f"  {name:<24} {_ms(split['admitted']):>7} / {_ms(split['refused']):>6} / "
                  f"{_ms(split['per_second'])}" for name, split in fit.items()]
    lines += [f"error       {p['load']}: {count} x {message}" for p in result["phases"]
              for message, count in p["top_errors"].items()]
    return "\n".join(lines)


# ---- the command ------------------------------------------------------------------------------
def add_bench_overload_parser(targets) -> None:
    """`bench overload` (``targets``: the subparsers of `bench`)."""
    parser = targets.add_parser(
        "overload", help="goodput, refusals and control-plane CPU at 1x, 2x, 3x the measured capacity",
        description=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: dllm-serve bench overload --url http://127.0.0.1:8000 --duration 20\n"
               "exit status: 0; 1 when the closed loop completed no request; 2 on bad input or an "
               "unreachable endpoint.")
    add_endpoint_options(parser)
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="ask for whole answers (stream: false) instead of streamed blocks")
    parser.add_argument("--quality", choices=["fixed", "adaptive"],
                        help="send dllm.quality: 'adaptive' lets the server's load knob run requests at a lower "
                             "confidence bar when it is behind (default: the server's quality.default)")
    parser.add_argument("--prompt", metavar="TEXT",
                        help="send this prompt every time (default: seeded prompts of the tiny model's task)")
    parser.add_argument("--idle-duration", type=positive_number(float, zero_ok=True), default=OverloadPlan.idle_s,
                        metavar="S",
                        help=f"on a local cluster, seconds with no request before the closed loop: each process's "
                             f"CPU at rest, a row of the CPU fit that measures its per-second figure (default "
                             f"{OverloadPlan.idle_s:g}; 0: none)")
    parser.add_argument("--clients", type=positive_number(int), default=OverloadPlan.clients, metavar="N",
                        help=f"concurrent clients of the closed loop that measures the capacity "
                             f"(default {OverloadPlan.clients})")
    parser.add_argument("--capacity-duration", type=positive_number(float), default=OverloadPlan.capacity_s,
                        metavar="S", help=f"seconds of the closed loop (default {OverloadPlan.capacity_s:g})")
    parser.add_argument("--loads", type=rate_list, default=list(OverloadPlan.loads), metavar="F1,F2,...",
                        help="offered loads as multiples of the capacity, one Poisson phase each (default 1,2,3)")
    parser.add_argument("--duration", type=positive_number(float), default=OverloadPlan.duration_s, metavar="S",
                        help=f"seconds of Poisson arrivals per load (default {OverloadPlan.duration_s:g})")
    parser.add_argument("--slo-latency", type=positive_number(float), metavar="S",
                        help=f"goodput counts completed requests with latency <= S seconds (default: the "
                             f"server's slo_latency_s from GET {HEALTH_PATH}, else {DEFAULT_SLO_S:g})")
    parser.add_argument("--timeout", type=positive_number(float), default=60.0, metavar="S",
                        help="give up on a request after S seconds; it counts as an error (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times and prompts (default 0)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    parser.set_defaults(func=run_bench_overload)


def run_bench_overload(args) -> int:
    def work() -> int:
        extra = {"quality": args.quality} if args.quality else {}
        endpoint = endpoint_from_args(args, timeout_s=args.timeout, stream=args.stream, extra=extra)
        plan = OverloadPlan(args.clients, args.idle_duration, args.capacity_duration, tuple(args.loads),
                            args.duration, args.slo_latency, args.seed, args.prompt)
        result = asyncio.run(bench_overload(endpoint, plan, args.quiet))
        print(json.dumps(result) if args.json else format_overload(result))
        if result["capacity_rps"] <= 0:
            print("dllm-serve bench overload: the closed loop completed no request (see its errors)",
                  file=sys.stderr)
            return 1
        return 0

    return run_command("bench overload", work)
