"""`dllm-serve loadgen`: options, the run plan, and the report."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

from loadgen import client
from loadgen.arrivals import (CHAT_WORKLOAD, MAX_REQUESTS, WORKLOADS, chat_arrivals, load_trace, poisson_times,
                              with_prompts)
from loadgen.records import Arrival, LoadgenError, Record
from loadgen.report import format_summary, format_sweep
from loadgen.loops import Progress, run_open_loop
from loadgen.stats import summarize
from replicas.tiny.task import MAX_TOKENS as TINY_MAX_TOKENS

DESCRIPTION = """\
Open-loop load against an OpenAI-compatible endpoint: requests leave at Poisson arrival
times (--rate, or each rate of --sweep) or at the timestamps of a trace (--trace), each at
its planned time whether or not earlier ones have finished. Every request streams
(SSE, stream_options.include_usage) and is recorded: planned and actual send time, status
(ok / refused with 429 and Retry-After / error with its message), TTFB (time to the first
chunk that carries text, i.e. the first committed block), end-to-end latency, output tokens.

Output tokens come from the final usage chunk when the server sends one (dllm-serve does),
else they are the non-whitespace characters of the streamed text: exact for the tiny
model's character tokenizer, an approximation for other models ("tokens from" says which).

The report: counts (sent = completed + refused + errors), p50/p90/p99 of TTFB and latency
of completed requests, throughput (completed requests and output tokens per second of the
measured duration, from the first send to the last completion) and goodput (completed
requests within --slo-latency/--slo-ttfb per second of the same duration)."""

EPILOG = """\
examples:
  dllm-serve loadgen --rate 5 --duration 30
  dllm-serve loadgen --sweep 2,4,8 --requests 100 --slo-latency 10 --plot sweep.png
  dllm-serve loadgen --trace trace.jsonl --json --records > run.json
trace lines: {"timestamp": seconds from the start, "prompt": "...", "max_tokens": 112}
(max_tokens may be left out: --max-tokens applies).
exit status: 0; 1 when no request completed; 2 on bad input or an unreachable endpoint."""


def positive_number(kind, zero_ok: bool = False):
    """An argparse type: a ``kind`` number above 0 (``zero_ok``: or 0)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'0 or more' if zero_ok else 'positive'}, got {text}")
        return value
    return parse


def rate_list(text: str) -> list[float]:
    return [positive_number(float)(item) for item in text.split(",") if item.strip()]


def add_endpoint_options(parser, url_help: str = "base URL of the OpenAI-compatible server",
                         max_tokens_help: str = "") -> None:
    """--url, --model, --api-key and --max-tokens: the endpoint and requests every load
    command sends (``parser``: a parser or an argument group)."""
    parser.add_argument("--url", default="http://127.0.0.1:8000", help=f"{url_help} (default http://127.0.0.1:8000)")
    parser.add_argument("--model", help="model name (default: the first that GET /v1/models lists)")
    parser.add_argument("--api-key", help="send 'Authorization: Bearer KEY'")
    parser.add_argument("--max-tokens", type=positive_number(int), default=TINY_MAX_TOKENS, metavar="N",
                        help=f"max_tokens of each request (default {TINY_MAX_TOKENS}{max_tokens_help})")


def endpoint_from_args(args, **fields) -> client.Endpoint:
    """The ``client.Endpoint`` of ``add_endpoint_options``' options and ``fields``."""
    if not args.url.startswith(("http://", "https://")):
        raise LoadgenError(f"--url must start with http:// or https://, got {args.url!r}")
    return client.Endpoint(url=args.url.rstrip("/"), model=args.model, max_tokens=args.max_tokens,
                           api_key=args.api_key, **fields)


def run_command(command: str, work: Callable[[], int]) -> int:
    """``work()``'s exit status; 2 with a message on a LoadgenError (bad input, unreachable
    endpoint), 130 on Ctrl-C."""
    try:
        return work()
    except LoadgenError as exc:
        print(f"dllm-serve {command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ndllm-serve {command}: interrupted", file=sys.stderr)
        return 130


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_loadgen_parser(commands) -> None:
    """Add the `loadgen` subcommand and its options to ``commands`` (argparse subparsers)."""
    parser = commands.add_parser(
        "loadgen", help="open-loop Poisson or trace load against an OpenAI-compatible endpoint; SLO report",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    load = parser.add_argument_group("arrivals (one of --rate, --sweep, --trace)")
    kind = load.add_mutually_exclusive_group(required=True)
    kind.add_argument("--rate", type=positive_number(float), metavar="R", help="Poisson arrivals at R requests per second")
    kind.add_argument("--sweep", type=rate_list, metavar="R1,R2,...",
                      help="run each rate in turn (same bounds each) and print one row per rate")
    kind.add_argument("--trace", metavar="FILE.jsonl", help="replay the arrivals of a JSONL trace (see below)")
    load.add_argument("--duration", type=positive_number(float), metavar="S",
                      help="send for S seconds (a trace: only its first S seconds)")
    load.add_argument("--requests", type=positive_number(int), metavar="N",
                      help="send N requests (per rate); --rate/--sweep need --duration or --requests")
    load.add_argument("--max-requests", type=positive_number(int), default=MAX_REQUESTS, metavar="N",
                      help=f"hard cap on requests per run, whatever the other bounds (default {MAX_REQUESTS})")
    load.add_argument("--timeout", type=positive_number(float), default=120.0, metavar="S",
                      help="give up on a request after S seconds; it counts as an error (default 120)")
    load.add_argument("--seed", type=int, default=0, help="seed of the arrival times and prompts (default 0)")

    body = parser.add_argument_group("requests")
    add_endpoint_options(body, max_tokens_help=", room for the tiny task's longest answer; a trace line's "
                                               "max_tokens wins")
    body.add_argument("--chat", action="store_true",
                      help="use /v1/chat/completions (the prompt as one user message; with --workload chat, the "
                           "chat's user and assistant messages) instead of /v1/completions")
    body.add_argument("--prompt", metavar="TEXT",
                      help="send this prompt every time (default: seeded prompts of the --workload)")
    body.add_argument("--workload", choices=sorted([*WORKLOADS, CHAT_WORKLOAD]), default="tiny",
                      help="the prompts: 'tiny', the tiny model's task drawn like its held-out set; 'shared-prefix', "
                           "the same 4 puzzles first in every prompt (a shared system prompt), then 1 or 2 of "
                           "the request's own; 'chat', multi-turn chats whose every turn sends the chat so far "
                           "(earlier messages and answers) and a new message, sent once the previous turn "
                           "has ended. The report gives the prefix cache's hit rate (default tiny)")
    body.add_argument("--prefix-groups", type=positive_number(int), default=1, metavar="N",
                      help="shared-prefix: N different shared beginnings, taken in turn (default 1)")
    body.add_argument("--turns", type=positive_number(int), default=3, metavar="N",
                      help="chat: turns per chat (default 3, what fits the tiny model's 512 positions)")
    body.add_argument("--open-chats", type=positive_number(int), default=8, metavar="N",
                      help="chat: chats open at a time; a chat's next turn comes N arrivals after its "
                           "previous one (default 8)")
    body.add_argument("--algorithm", help="dLLM extension: the denoise algorithm of every request "
                                          "(e.g. low_confidence, fast_dllm_threshold)")
    body.add_argument("--extra", type=_json_object, metavar="JSON", default={},
                      help='more body fields for every request, e.g. \'{"algorithm_params": {"steps": 16}}\'')

    out = parser.add_argument_group("report")
    out.add_argument("--slo-latency", type=positive_number(float), metavar="S",
                     help="goodput counts completed requests with latency <= S seconds")
    out.add_argument("--slo-ttfb", type=positive_number(float), metavar="S",
                     help="goodput counts completed requests with TTFB <= S seconds")
    out.add_argument("--json", action="store_true", help="print the report as one JSON object")
    out.add_argument("--records", action="store_true", help="with --json: include every request's record")
    out.add_argument("--plot", metavar="OUT.png",
                     help="write a figure: latency CDF and latency over time (with --sweep: p50/p99 latency "
                          "and goodput against offered rate)")
    out.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    parser.set_defaults(func=run_loadgen)


def _workload_options(args) -> dict:
    return {"groups": args.prefix_groups} if args.workload == "shared-prefix" else {}


def _plan(args) -> list[tuple[float | None, list[Arrival]]]:
    """(offered rate, arrivals) for each run; validates the bounds and the trace."""
    if args.trace:
        if args.prompt:
            raise LoadgenError("--prompt and --trace exclude each other: the trace carries the prompts")
        arrivals = load_trace(args.trace, args.duration, args.requests, args.max_requests)
        span = arrivals[-1].time_s
        return [(len(arrivals) / span if span > 0 else None, arrivals)]
    plan = []
    for rate in args.sweep or [args.rate]:
        times = poisson_times(rate, args.seed, args.duration, args.requests, args.max_requests)
        if len(times) == args.max_requests and (args.requests is None or args.requests > args.max_requests):
            print(f"note: capped at --max-requests {args.max_requests}", file=sys.stderr)
        if args.workload == CHAT_WORKLOAD and not args.prompt:
            plan.append((rate, chat_arrivals(times, args.seed, args.turns, args.open_chats)))
            continue
        prompts = [args.prompt] if args.prompt else WORKLOADS[args.workload](len(times), args.seed,
                                                                            **_workload_options(args))
        plan.append((rate, with_prompts(times, prompts)))
    return plan


def _check_options(args) -> None:
    if args.records and not args.json:
        raise LoadgenError("--records goes with --json")
    if args.plot:
        from loadgen.plot import pyplot

        pyplot()
        if not Path(args.plot).resolve().parent.is_dir():
            raise LoadgenError(f"--plot: the folder of {args.plot} does not exist")


async def _drive(endpoint: client.Endpoint, plan, quiet: bool) -> tuple[client.Endpoint, list[list[Record]]]:
    async with client.make_client(endpoint) as http:
        listed = await client.first_model(http)  # also checks the URL (and key) before any load
        endpoint = replace(endpoint, model=endpoint.model or listed)
        send = partial(client.send, http, endpoint)
        results = []
        for rate, arrivals in plan:
            label = "" if len(plan) == 1 else f"rate {rate:g}/s "
            results.append(await run_open_loop(arrivals, send, None if quiet else Progress(len(arrivals), label)))
    return endpoint, results


def _output(args, endpoint: client.Endpoint, plan, results: list[list[Record]]) -> list[dict]:
    """Print the report (and write the plot); returns the summaries."""
    summaries = [summarize(records, rate, args.slo_latency, args.slo_ttfb)
                 for (rate, _), records in zip(plan, results)]
    target = {"url": endpoint.url, "model": endpoint.model, "api": endpoint.path}
    title = f"{endpoint.model} at {endpoint.url}{endpoint.path}"
    if args.json:
        if args.records:
            for summary, records in zip(summaries, results):
                summary["records"] = [r.to_dict() for r in records]
        print(json.dumps({**target, "sweep": summaries} if args.sweep else {**target, **summaries[0]}))
    else:
        print(f"target           {title}")
        print(format_sweep(summaries) if args.sweep else format_summary(summaries[0]))
    if args.plot:
        from loadgen.plot import plot_run, plot_sweep

        if args.sweep:
            plot_sweep(summaries, args.plot, title)
        else:
            plot_run(results[0], args.plot, title)
    return summaries


def run_loadgen(args) -> int:
    """Run the load described by ``args``. Exit status: 0, 1 when no request completed,
    2 (with a message) on bad input or an unreachable endpoint."""
    def work() -> int:
        _check_options(args)
        plan = _plan(args)
        extra = {**args.extra, **({"algorithm": args.algorithm} if args.algorithm else {})}
        endpoint = endpoint_from_args(args, chat=args.chat, extra=extra, timeout_s=args.timeout)
        endpoint, results = asyncio.run(_drive(endpoint, plan, args.quiet))
        summaries = _output(args, endpoint, plan, results)
        if not any(summary["completed"] for summary in summaries):
            print("dllm-serve loadgen: no request completed (see the errors in the report)", file=sys.stderr)
            return 1
        return 0

    return run_command("loadgen", work)
