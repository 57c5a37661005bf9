"""`dllm-serve calibrate` and `dllm-serve bench calibration`: the simulator against a live cluster."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from loadgen import client
from loadgen.calibration import save_calibration
from loadgen.calibration_bench import bench_calibration, format_comparison
from loadgen.cli import positive_number, rate_list
from loadgen.live_calibration import CalibrationPlan, calibrate
from loadgen.records import LoadgenError
from loadgen.simulator import POLICIES
from replicas.evaluation import TINY_MAX_TOKENS


def _target_options(parser: argparse.ArgumentParser, rates_flag: str) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="base URL of a running dllm-serve cluster (default http://127.0.0.1:8000)")
    parser.add_argument("--api-key", help="send 'Authorization: Bearer KEY'")
    parser.add_argument("--model", help="model name (default: the first that GET /v1/models lists)")
    parser.add_argument("--max-tokens", type=positive_number(int), default=TINY_MAX_TOKENS, metavar="N",
                        help=f"max_tokens of each request (default {TINY_MAX_TOKENS})")
    parser.add_argument("--replicas", type=positive_number(int), default=1,
                        help="replicas serving (default 1): load points are per replica")
    parser.add_argument(rates_flag, dest="calibration_rates", type=rate_list, default=[4.0, 16.0],
                        metavar="R1,R2,...",
                        help="calibration loads: Poisson arrivals per second to the cluster, one load point each "
                             "(default 4,16: a light and a heavy load; the simulator interpolates between them. "
                             "Near saturation a 30 s estimate of the fixed step cost swung by 30%% between runs)")
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
                       help="arrival rates to compare (default 5,10,15: about 25-75%% of one tiny-model replica's "
                            "capacity on a 2-core machine; nearer saturation one run's p99 swings by 25%%)")
    bench.add_argument("--rate-requests", type=positive_number(int), default=800, metavar="N",
                       help="Poisson arrivals per compared rate (default 800: a p99 needs many requests)")
    bench.add_argument("--calibrate-once", action="store_true",
                       help="calibrate once, before the first rate (default: also after each rate, and predict "
                            "each rate from the calibrations on either side of it, because a shared machine's "
                            "step costs drift within minutes)")
    bench.add_argument("--policy", choices=POLICIES, default="fdfo", help="the replicas' mode (default fdfo)")
    bench.add_argument("--json", action="store_true", help="one JSON object")
    bench.set_defaults(func=run_bench_calibration)


def _endpoint(args) -> client.Endpoint:
    if not args.url.startswith(("http://", "https://")):
        raise LoadgenError(f"--url must start with http:// or https://, got {args.url!r}")
    return client.Endpoint(url=args.url.rstrip("/"), model=args.model, max_tokens=args.max_tokens,
                           api_key=args.api_key)


def _plan(args) -> CalibrationPlan:
    return CalibrationPlan(tuple(args.calibration_rates), args.duration, args.seed, args.replicas)


def _run(command: str, work) -> int:
    try:
        return work()
    except LoadgenError as exc:
        print(f"dllm-serve {command}: error: {exc}", file=sys.stderr)
        return 2


def run_calibrate(args) -> int:
    def work() -> int:
        calibration = asyncio.run(calibrate(_endpoint(args), _plan(args), args.quiet))
        save_calibration(calibration, args.out)
        print(f"wrote {args.out}: {calibration['source']}")
        return 0

    return _run("calibrate", work)


def run_bench_calibration(args) -> int:
    def work() -> int:
        result = asyncio.run(bench_calibration(_endpoint(args), _plan(args), args.rates, args.rate_requests,
                                               args.policy, recalibrate=not args.calibrate_once,
                                               quiet=args.quiet))
        print(json.dumps(result) if args.json else format_comparison(result))
        return 0

    return _run("bench calibration", work)
