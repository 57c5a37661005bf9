"""The `dllm-serve` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from algorithms import available_algorithms


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="checkpoint directory, or 'tiny' for the embedded model (default)")
    parser.add_argument("--mode", choices=["fdfo", "sync", "static"], default="fdfo",
                        help="scheduler mode (default fdfo)")
    parser.add_argument("--max-batch", type=int, default=16, help="rows per step (default 16)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")


def _engine_config(args):
    from replicas.engine import EngineConfig

    return EngineConfig(mode=args.mode, max_batch=args.max_batch, device=args.device, dtype=args.dtype)


def _algorithm_params(args) -> dict:
    params = {}
    for item in args.param or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"dllm-serve: --param expects KEY=VALUE, got {item!r}")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    if args.threshold is not None:
        params["threshold"] = args.threshold
    return params


def cmd_generate(args) -> int:
    from replicas.async_engine import AsyncEngine
    from replicas.engine import Engine
    from replicas.request import SamplingParams

    engine = Engine.from_pretrained(args.model, _engine_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, stop=tuple(args.stop or ()),
                            algorithm=args.algorithm, algorithm_params=_algorithm_params(args))
    engine.make_request(args.prompt, params)  # validate before starting the loop

    async def run() -> None:
        runner = AsyncEngine(engine)
        text = []
        try:
            async for output in runner.generate(args.prompt, params):
                text.append(output.new_text)
                if args.stream:
                    print(output.new_text, end="\n" if output.finished else " | ", flush=True)
                if output.finished:
                    if not args.stream:
                        print("".join(text))
                    print(f"[{output.finish_reason.value}; {output.num_output_tokens} tokens, "
                          f"{output.num_steps} steps, steps per block {output.block_steps}]", file=sys.stderr)
        finally:
            runner.shutdown()

    asyncio.run(run())
    return 0


def cmd_train_tiny(args) -> int:
    from replicas.tiny.train import train_tiny

    train_tiny(args.output, max_minutes=args.minutes, seed=args.seed)
    return 0


def cmd_eval_tiny(args) -> int:
    from replicas.evaluation import evaluate_tiny

    report = evaluate_tiny(args.model, modes=args.modes, batch_sizes=args.batch_sizes,
                           num_requests=args.requests, algorithm=args.algorithm)
    print(json.dumps(report, indent=2) if args.json else report_table(report))
    return 0


def report_table(report: dict) -> str:
    from replicas.evaluation import format_report

    return format_report(report)


def cmd_bench(args) -> int:
    from replicas.bench import bench_engine

    result = bench_engine(args.model, num_requests=args.requests, max_batch=args.max_batch)
    print(json.dumps(result, indent=2 if not args.json else None))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dllm-serve",
        description="Serve masked diffusion language models with a block-granular FDFO engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate offline with the engine (no cluster)")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--algorithm", choices=available_algorithms(), default=None,
                     help="denoise algorithm (default: the engine's, low_confidence)")
    gen.add_argument("--threshold", type=float, default=None, help="confidence threshold of the algorithm")
    gen.add_argument("--param", action="append", metavar="KEY=VALUE",
                     help="another algorithm parameter (repeatable), e.g. --param temperature=0.7")
    gen.add_argument("--max-tokens", type=int, default=128, help="output token limit (default 128)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--stream", action="store_true", help="print each block as it commits")
    _engine_options(gen)
    gen.set_defaults(func=cmd_generate)

    train = commands.add_parser("train-tiny", help="train the embedded tiny model (<= 10 min on 2 CPU cores)")
    train.add_argument("--output", required=True, help="directory to write the checkpoint to")
    train.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget (default 8)")
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(func=cmd_train_tiny)

    ev = commands.add_parser("eval-tiny", help="accuracy and steps-per-block histogram of the tiny model")
    ev.add_argument("--model", default="tiny")
    ev.add_argument("--modes", nargs="+", default=["fdfo", "sync"], choices=["fdfo", "sync", "static"])
    ev.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    ev.add_argument("--requests", type=int, default=300, help="held-out requests (default 300)")
    ev.add_argument("--algorithm", choices=available_algorithms(), default="low_confidence")
    ev.add_argument("--json", action="store_true", help="print JSON")
    ev.set_defaults(func=cmd_eval_tiny)

    bench = commands.add_parser("bench", help="benchmarks that print ratios measured side by side")
    bench.add_argument("target", choices=["engine"], help="engine: fdfo vs sync vs static on one workload")
    bench.add_argument("--model", default="tiny")
    bench.add_argument("--requests", type=int, default=256, help="closed batch size (default 256)")
    bench.add_argument("--max-batch", type=int, default=16)
    bench.add_argument("--json", action="store_true", help="one JSON object on one line")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from replicas.models import CheckpointError
    from replicas.request import RequestError

    try:
        return args.func(args)
    except (CheckpointError, RequestError, ValueError) as exc:
        print(f"dllm-serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
