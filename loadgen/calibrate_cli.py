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


def _target_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="base URL of a running dllm-serve cluster (default http://127.0.0.1:8000)")
    parser.add_argument("--api-key", help="send 'Authorization: Bearer KEY'")
    parser.add_argument("--model", help="model name (default: the first that GET /v1/models lists)")
    parser.add_argument("--max-tokens", type=positive_number(int), default=TINY_MAX_TOKENS, metavar="N",
                        help=f"max_tokens of each request (default {TINY_MAX_TOKENS})")
    parser.add_argument("--rate", type=positive_number(float), default=12.0, metavar="R",
                        help="calibration load: Poisson arrivals per second (default 12; pick a rate the "
                             "cluster serves comfortably, so steps run at many batch sizes)")
    parser.add_argument("--duration", type=positive_number(float), default=20.0, metavar="S",
                        help="calibration load: seconds of arrivals (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals and prompts (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def add_calibrate_parser(commands) -> None:
    """The `calibrate` subcommand."""
    cal = commands.add_parser(
        "calibrate", help="measure the simulator's calibration on a running cluster",
        description="Send Poisson load (tiny-task prompts) to a running dllm-serve cluster and write the "
                    "calibration `dllm-serve simulate --calibration` reads: step cost c0 + c1*rows and its "
                    "spread from a replica's back-to-back steps, steps per block, blocks per request, and "
                    "the request path's overhead (client latency minus engine time). Run it on an otherwise "
                    "idle cluster.")
    _target_options(cal)
    cal.add_argument("--out", required=True, metavar="FILE", help="write the calibration JSON here")
    cal.set_defaults(func=run_calibrate)


def add_bench_calibration_parser(targets) -> None:
    """`bench calibration` (``targets``: the subparsers of `bench`)."""
    bench = targets.add_parser(
        "calibration", help="does the simulator predict the live cluster? p50/p99 side by side",
        description="Calibrate on a running cluster (as `dllm-serve calibrate`), then at each of --rates run "
                    "the same Poisson load live and in the simulator and print p50/p99 latency of both with "
                    "their ratios; the calibration holds when every ratio is within 20%% of 1.")
    _target_options(bench)
    bench.add_argument("--rates", type=rate_list, default=[6.0, 12.0, 18.0], metavar="R1,R2,...",
                       help="arrival rates to compare (default 6,12,18)")
    bench.add_argument("--rate-duration", type=positive_number(float), default=25.0, metavar="S",
                       help="seconds of arrivals per compared rate (default 25)")
    bench.add_argument("--policy", choices=POLICIES, default="fdfo", help="the replicas' mode (default fdfo)")
    bench.add_argument("--replicas", type=positive_number(int), default=1, help="replicas serving (default 1)")
    bench.add_argument("--json", action="store_true", help="one JSON object")
    bench.set_defaults(func=run_bench_calibration)


def _endpoint(args) -> client.Endpoint:
    if not args.url.startswith(("http://", "https://")):
        raise LoadgenError(f"--url must start with http:// or https://, got {args.url!r}")
    return client.Endpoint(url=args.url.rstrip("/"), model=args.model, max_tokens=args.max_tokens,
                           api_key=args.api_key)


def _run(command: str, work) -> int:
    try:
        return work()
    except LoadgenError as exc:
        print(f"dllm-serve {command}: error: {exc}", file=sys.stderr)
        return 2


def run_calibrate(args) -> int:
    def work() -> int:
        plan = CalibrationPlan(args.rate, args.duration, args.seed)
        calibration = asyncio.run(calibrate(_endpoint(args), plan, args.quiet))
        save_calibration(calibration, args.out)
        print(f"wrote {args.out}: c0 {calibration['c0'] * 1e3:.2f} ms, c1 {calibration['c1'] * 1e3:.3f} ms/row; "
              f"{calibration['source']}")
        return 0

    return _run("calibrate", work)


def run_bench_calibration(args) -> int:
    def work() -> int:
        plan = CalibrationPlan(args.rate, args.duration, args.seed)
        result = asyncio.run(bench_calibration(_endpoint(args), plan, args.rates, args.rate_duration,
                                               args.policy, args.replicas, quiet=args.quiet))
        print(json.dumps(result) if args.json else format_comparison(result))
        return 0

    return _run("bench calibration", work)
