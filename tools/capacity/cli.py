"""The capacity commands: `dllm-serve simulate` (the cluster simulator), `dllm-serve calibrate`
(measure its calibration on a live cluster) and `dllm-serve bench calibration` (the simulator
against the live cluster)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from loadgen.arrivals import load_trace
from tools.capacity import simulator as sim
from tools.capacity.calibration import DEFAULT_CALIBRATION, load_calibration, save_calibration
from tools.capacity.calibration_bench import bench_calibration, format_comparison
from tools.capacity.live_calibration import CalibrationPlan, calibrate
from loadgen.cli import add_endpoint_options, endpoint_from_args, positive_number, rate_list, run_command
from loadgen.records import LoadgenError
from replicas.batching import MODES
from replicas.request_cost import SLO_HEADROOM


def _target_options(parser: argparse.ArgumentParser, rates_flag: str) -> None:
    add_endpoint_options(parser, url_help="base URL of a running dllm-serve cluster")
    parser.add_argument("--replicas", type=positive_number(int), default=1,
                        help="replicas serving (default 1): load points are per replica")
    parser.add_argument(rates_flag, dest="calibration_rates", type=rate_list, default=[4.0, 16.0],
                        metavar="R1,R2,...",
                        help="calibration loads: Poisson arrivals per second to the cluster, one load point each "
                             "(default 4,16: a light and a heavy load; the simulator interpolates between them)")
    parser.add_argument("--duration", type=positive_number(float), default=45.0, metavar="S",
                        help="seconds of arrivals per calibration load (default 45)")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals and prompts (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def add_calibrate_parser(commands) -> None:
    """The `calibrate` subcommand."""
    cal = commands.add_parser(
        "calibrate", help="measure the simulator's calibration on a running cluster",
        description="Send Poisson load (tiny-task prompts) at each of --rates to a running dllm-serve cluster "
                    "and write the calibration `dllm-serve simulate --calibration` reads: per rate, the step "
                    "cost c0 + c1*rows + prefill_s*starting requests and its spread from a replica's "
                    "back-to-back steps, and the request path's overhead (client latency minus engine time); "
                    "steps per block and blocks per request pooled. Run it on an otherwise idle cluster.")
    _target_options(cal, "--rates")
    cal.add_argument("--out", required=True, metavar="FILE", help="write the calibration JSON here")
    cal.set_defaults(func=run_calibrate)


def add_bench_calibration_parser(targets) -> None:
    """`bench calibration` (``targets``: the subparsers of `bench`)."""
    bench = targets.add_parser(
        "calibration", help="does the simulator predict the live cluster? p50/p99 side by side",
        description="Calibrate on a running cluster (as `dllm-serve calibrate`); at each of --rates, run "
                    "the same Poisson load live and in the simulator (on the same arrival times) and print "
                    "p50/p99 latency of both with their ratios; the calibration holds when every ratio is within "
                    "20%% of 1.")
    _target_options(bench, "--calibration-rates")
    bench.add_argument("--rates", type=rate_list, default=[5.0, 10.0, 15.0], metavar="R1,R2,...",
                       help="arrival rates to compare (default 5,10,15; below saturation, where one run's p99 is stable)")
    bench.add_argument("--rate-requests", type=positive_number(int), default=800, metavar="N",
                       help="Poisson arrivals per compared rate (default 800: a p99 needs many requests)")
    bench.add_argument("--calibrate-once", action="store_true",
                       help="calibrate once, before the first rate (default: also after each rate, and predict "
                            "each rate from the calibrations on either side of it, because step costs drift "
                            "on a shared machine)")
    bench.add_argument("--policy", choices=MODES, default="fdfo", help="the replicas' mode (default fdfo)")
    bench.add_argument("--json", action="store_true", help="one JSON object")
    bench.set_defaults(func=run_bench_calibration)


def _plan(args) -> CalibrationPlan:
    return CalibrationPlan(tuple(args.calibration_rates), args.duration, args.seed, args.replicas)


def run_calibrate(args) -> int:
    def work() -> int:
        calibration = asyncio.run(calibrate(endpoint_from_args(args), _plan(args), args.quiet))
        save_calibration(calibration, args.out)
        print(f"wrote {args.out}: {calibration.source}")
        return 0

    return run_command("calibrate", work)


def run_bench_calibration(args) -> int:
    def work() -> int:
        result = asyncio.run(bench_calibration(endpoint_from_args(args), _plan(args), args.rates, args.rate_requests,
                                               args.policy, recalibrate=not args.calibrate_once,
                                               quiet=args.quiet))
        print(json.dumps(result) if args.json else format_comparison(result))
        return 0

    return run_command("bench calibration", work)


_SIM_COLUMNS = {
    "sweep": ["policy", "rate", "completed", "refused", "latency_mean_s", "latency_p50_s", "latency_p90_s",
              "latency_p99_s", "ttfb_p50_s", "throughput_rps", "goodput_rps", "slo_attainment", "fill_timeout_s",
              "degraded"],
    "max_rate": ["policy", "replicas", "max_rate"],
    "replicas": ["policy", "rate", "replicas"],
    "tau": ["rate", "analytic_tau_s", "best_tau_s", "analytic_latency_s", "best_latency_s", "gap_percent"],
}


def run_simulate(args) -> int:
    """`dllm-serve simulate`; bad input raises ValueError (the caller prints it)."""
    rates = args.sweep or ([args.rate] if args.rate is not None else [])
    if any(not r > 0 for r in rates):
        raise ValueError("arrival rates must be > 0 requests per second")
    if (args.find_max_rate or args.find_replicas or args.max_step_debt == "slo" or args.quality_steps) \
            and args.slo_latency is None:
        raise ValueError("--find-max-rate, --find-replicas, --max-step-debt slo and --quality-steps need --slo-latency")
    if args.quality_steps and not all(0 < r <= 1 for r in args.quality_steps):
        raise ValueError("--quality-steps ratios must be in (0, 1]: a level takes at most the default's steps")
    if args.plot and (args.find_max_rate or args.find_replicas or args.tau_table or args.trace):
        raise ValueError("--plot draws a rate sweep: use it with --rate/--sweep only")
    if args.calibration:
        cal = load_calibration(args.calibration)
    else:
        cal = DEFAULT_CALIBRATION
        print("note: built-in calibration (the tiny model on a 2-core CPU, illustrative); "
              "pass --calibration FILE to plan for your engine", file=sys.stderr)
    debt = args.max_step_debt
    if debt == "slo":
        debt = cal.max_batch / (cal.c0 + cal.c1 * cal.max_batch) * args.slo_latency * SLO_HEADROOM
    elif debt is not None:
        try:
            debt = float(debt)
        except ValueError:
            raise ValueError(f"--max-step-debt expects a number of row-steps or 'slo', got {debt!r}") from None
    options = {"fill_timeout": args.fill_timeout, "fdfo_fill_hold": args.fdfo_hold, "max_step_debt": debt}
    if args.quality_steps:
        options["knob"] = sim.KnobModel(tuple(args.quality_steps), args.slo_latency)
    common = {"requests": args.requests, "seed": args.seed}
    slo = {"slo_latency": args.slo_latency, "attainment": args.slo_attainment}
    if args.tau_table:
        kind = "tau"
        rows = sim.tau_table(cal, rates or [f * sim.fixed_fill_capacity(cal) for f in (0.1, 0.3, 0.5, 0.7, 0.9)],
                             **common)
    elif args.find_max_rate:
        kind = "max_rate"
        rows = [{"policy": p, "replicas": args.replicas,
                 "max_rate": sim.find_max_rate(cal, p, **slo, **common, replicas=args.replicas, **options)}
                for p in args.policy]
    elif args.find_replicas:
        if len(rates) != 1:
            raise ValueError("--find-replicas needs one --rate")
        kind = "replicas"
        rows = [{"policy": p, "rate": rates[0],
                 "replicas": sim.find_replicas(cal, p, rates[0], **slo, **common, **options)}
                for p in args.policy]
    elif args.trace:
        kind = "sweep"
        try:
            times = [arrival.time_s for arrival in load_trace(args.trace, max_count=10 ** 7)]
        except LoadgenError as exc:
            raise ValueError(str(exc)) from None
        workload = sim.trace_workload(cal, times, args.seed)
        rows = sim.compare(cal, workload, args.policy, args.slo_latency, replicas=args.replicas, **options)
    else:
        if not rates:
            raise ValueError("give --rate R, --sweep R1 R2 ... (requests per second) or --trace FILE, "
                             "or a --find-* question")
        kind = "sweep"
        rows = sim.sweep(cal, args.policy, rates, slo_latency=args.slo_latency, replicas=args.replicas,
                         **common, **options)
        if args.plot:
            sim.plot_sweep(rows, args.plot, args.slo_latency)
    if args.json:
        print(json.dumps({"calibration": cal.model_dump(mode="json", exclude_none=True), kind: rows}))
    else:
        print(f"calibration: {cal.source or args.calibration}; per replica: fixed_fill capacity "
              f"{sim.fixed_fill_capacity(cal):.4g} req/s, throughput bound {sim.throughput_bound(cal):.4g} req/s")
        print(sim.format_rows(rows, _SIM_COLUMNS[kind]))
    return 0


def add_simulate_parser(commands) -> None:
    """The `simulate` subcommand."""
    parser = commands.add_parser(
        "simulate", help="discrete-event simulation of the cluster for capacity planning",
        description="Simulate N replicas behind step-aware admission and drain-time routing under Poisson "
                    "arrivals, with step costs and step counts from a calibration. Prints latency/TTFB "
                    "percentiles, throughput and goodput per policy and rate (--rate/--sweep), the largest "
                    "rate within an SLO (--find-max-rate), the replicas a rate needs (--find-replicas), or "
                    "the analytic fixed_fill timeout against a simulated sweep (--tau-table).")
    parser.add_argument("--calibration", metavar="FILE",
                     help="calibration JSON (c0, c1, max_batch, steps_per_block, blocks_per_request), e.g. "
                          "written by `dllm-serve bench`; default: a built-in one measured on the tiny model")
    parser.add_argument("--policy", nargs="+", choices=MODES, default=list(MODES),
                     help="scheduler policies to simulate (default: all)")
    parser.add_argument("--replicas", type=int, default=1, help="replicas in the cluster (default 1)")
    parser.add_argument("--rate", type=float, help="arrival rate, requests per second (whole cluster)")
    parser.add_argument("--sweep", type=float, nargs="+", metavar="RATE", help="several arrival rates, one run each")
    parser.add_argument("--trace", metavar="FILE",
                     help="replay the arrival times of a loadgen JSONL trace ({\"timestamp\", ...} per line) "
                          "instead of Poisson arrivals")
    parser.add_argument("--requests", type=int, default=5000, help="requests per run (default 5000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of arrivals and step counts (default 0)")
    parser.add_argument("--slo-latency", type=float, metavar="S", help="latency SLO in seconds (goodput, searches)")
    parser.add_argument("--slo-attainment", type=float, default=0.99, metavar="F",
                     help="fraction of requests that must meet the SLO, refused ones counted as misses (default 0.99)")
    parser.add_argument("--find-max-rate", action="store_true", help="per policy: the largest rate that meets the SLO")
    parser.add_argument("--find-replicas", action="store_true",
                     help="per policy: the fewest replicas for --rate within the SLO")
    parser.add_argument("--tau-table", action="store_true",
                     help="analytic fixed_fill timeout vs the best simulated one at --sweep rates "
                          "(default: 10..90%% of one replica's fixed_fill capacity)")
    parser.add_argument("--fill-timeout", type=float, metavar="S",
                     help="fixed_fill timeout in seconds (default: the analytic optimum at each replica's rate)")
    parser.add_argument("--fdfo-hold", action=argparse.BooleanOptionalAction, default=True,
                        help="fdfo holds under-filled steps for arrivals by the fill-hold rule, as the engine does "
                             "(default: on)")
    parser.add_argument("--max-step-debt", metavar="ROW_STEPS|slo",
                     help="admission: row-steps the cluster may owe per replica, or 'slo' for full-batch drain "
                          f"rate x --slo-latency x {SLO_HEADROOM:g} (admission.slo_headroom's default) "
                          "(default: admit everything)")
    parser.add_argument("--quality-steps", type=float, nargs="+", metavar="RATIO",
                        help="the load knob on every replica (replicas.quality, its default bands and hold): one "
                             "ratio per level of its steps per block to the default setting's (e.g. from `dllm-serve "
                             "bench quality`: 0.935 0.82 for thresholds 0.8 and 0.5 of the tiny model); every request "
                             "allows it; needs --slo-latency")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.add_argument("--plot", metavar="PNG", help="write mean and p99 latency vs rate per policy (with --sweep)")
    parser.set_defaults(func=run_simulate)
