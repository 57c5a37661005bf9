"""The `dllm-serve` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import threading

import yaml

from algorithms import available_algorithms
from replicas.batching import SchedulerMode

MODES = [mode.value for mode in SchedulerMode]


def _engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="checkpoint directory, or 'tiny' for the embedded model (default)")
    parser.add_argument("--mode", choices=MODES, default="fdfo",
                        help="scheduler mode (default fdfo)")
    parser.add_argument("--max-batch", type=int, default=16, help="rows per step (default 16)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    _model_options(parser)


def _model_options(parser: argparse.ArgumentParser) -> None:
    """Loading options shared by `generate` and `up`."""
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="weights and KV dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--lora", metavar="DIR", help="PEFT LoRA adapter merged into the weights at load")
    parser.add_argument("--kv-cache", choices=["prefix", "none"],
                        help="'none' recomputes everything every step (exact for LLaDA/Dream, slow)")
    parser.add_argument("--attention-backend", choices=["auto", "sdpa", "flash"],
                        help="attention kernel (default auto: vllm-flash-attn on CUDA when installed)")


def _engine_config(args):
    from replicas.engine import EngineConfig

    options = {k: getattr(args, k) for k in ("dtype", "lora", "kv_cache", "attention_backend")
               if getattr(args, k) is not None}
    return EngineConfig(mode=args.mode, max_batch=args.max_batch, device=args.device, **options)


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


def _calibration_writer(path: str | None, max_batch: int):
    """A callback that fits the simulator's calibration to the fdfo run and saves it."""
    if path is None:
        return None
    from loadgen.calibration import fit_calibration, save_calibration

    def write(steps, outputs) -> None:
        calibration = fit_calibration(
            [(s.batch_size, s.prompt_units, s.step_s) for s in steps], [n for o in outputs for n in o.block_steps],
            [len(o.block_steps) for o in outputs], sum(s.prompt_units for s in steps) / len(outputs),
            max_batch, source="dllm-serve bench engine")
        save_calibration(calibration, path)

    return write


def cmd_bench(args) -> int:
    if args.target == "engine":
        from replicas.bench import bench_engine

        result = bench_engine(args.model, num_requests=args.requests, max_batch=args.max_batch,
                              on_fdfo_run=_calibration_writer(args.calibration, args.max_batch))
    else:
        from loadgen.policy_bench import bench_policies

        result = bench_policies(args.model, num_requests=args.requests, load=args.load, rate=args.rate,
                                max_batch=args.max_batch, slo_latency_s=args.slo_latency, seed=args.seed,
                                fill_timeout_s=args.fill_timeout)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def cmd_loadgen(args) -> int:
    from loadgen.cli import run_loadgen

    return run_loadgen(args)


_SIM_COLUMNS = {
    "sweep": ["policy", "rate", "completed", "refused", "latency_mean_s", "latency_p50_s", "latency_p90_s",
              "latency_p99_s", "ttfb_p50_s", "throughput_rps", "goodput_rps", "slo_attainment", "fill_timeout_s"],
    "max_rate": ["policy", "replicas", "max_rate"],
    "replicas": ["policy", "rate", "replicas"],
    "tau": ["rate", "analytic_tau_s", "best_tau_s", "analytic_latency_s", "best_latency_s", "gap_percent"],
}


def cmd_simulate(args) -> int:
    from loadgen import simulator as sim
    from loadgen.arrivals import load_trace
    from loadgen.calibration import DEFAULT_CALIBRATION, load_calibration, validate_calibration
    from loadgen.records import LoadgenError

    rates = args.sweep or ([args.rate] if args.rate is not None else [])
    if any(not r > 0 for r in rates):
        raise ValueError("arrival rates must be > 0 requests per second")
    if (args.find_max_rate or args.find_replicas or args.max_step_debt == "slo") and args.slo_latency is None:
        raise ValueError("--find-max-rate, --find-replicas and --max-step-debt slo need --slo-latency")
    if args.plot and (args.find_max_rate or args.find_replicas or args.tau_table or args.trace):
        raise ValueError("--plot draws a rate sweep: use it with --rate/--sweep only")
    if args.calibration:
        cal = load_calibration(args.calibration)
    else:
        cal = validate_calibration(DEFAULT_CALIBRATION)
        print("note: built-in calibration (the tiny model on a 2-core CPU, illustrative); "
              "pass --calibration FILE to plan for your engine", file=sys.stderr)
    debt = args.max_step_debt
    if debt == "slo":
        debt = cal["max_batch"] / (cal["c0"] + cal["c1"] * cal["max_batch"]) * args.slo_latency
    elif debt is not None:
        try:
            debt = float(debt)
        except ValueError:
            raise ValueError(f"--max-step-debt expects a number of row-steps or 'slo', got {debt!r}") from None
    options = {"fill_timeout": args.fill_timeout, "fdfo_fill_hold": args.fdfo_hold, "max_step_debt": debt}
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
        print(json.dumps({"calibration": cal, kind: rows}))
    else:
        print(f"calibration: {cal['source'] or args.calibration}; per replica: fixed_fill capacity "
              f"{sim.fixed_fill_capacity(cal):.4g} req/s, throughput bound {sim.throughput_bound(cal):.4g} req/s")
        print(sim.format_rows(rows, _SIM_COLUMNS[kind]))
    return 0


def _simulate_parser(commands) -> None:
    from loadgen.simulator import POLICIES

    sim = commands.add_parser(
        "simulate", help="discrete-event simulation of the cluster for capacity planning",
        description="Simulate N replicas behind step-aware admission and drain-time routing under Poisson "
                    "arrivals, with step costs and step counts from a calibration. Prints latency/TTFB "
                    "percentiles, throughput and goodput per policy and rate (--rate/--sweep), the largest "
                    "rate within an SLO (--find-max-rate), the replicas a rate needs (--find-replicas), or "
                    "the analytic fixed_fill timeout against a simulated sweep (--tau-table).")
    sim.add_argument("--calibration", metavar="FILE",
                     help="calibration JSON (c0, c1, max_batch, steps_per_block, blocks_per_request), e.g. "
                          "written by `dllm-serve bench`; default: a built-in one measured on the tiny model")
    sim.add_argument("--policy", nargs="+", choices=POLICIES, default=list(POLICIES),
                     help="scheduler policies to simulate (default: all)")
    sim.add_argument("--replicas", type=int, default=1, help="replicas in the cluster (default 1)")
    sim.add_argument("--rate", type=float, help="arrival rate, requests per second (whole cluster)")
    sim.add_argument("--sweep", type=float, nargs="+", metavar="RATE", help="several arrival rates, one run each")
    sim.add_argument("--trace", metavar="FILE",
                     help="replay the arrival times of a loadgen JSONL trace ({\"timestamp\", ...} per line) "
                          "instead of Poisson arrivals")
    sim.add_argument("--requests", type=int, default=5000, help="requests per run (default 5000)")
    sim.add_argument("--seed", type=int, default=0, help="random seed of arrivals and step counts (default 0)")
    sim.add_argument("--slo-latency", type=float, metavar="S", help="latency SLO in seconds (goodput, searches)")
    sim.add_argument("--slo-attainment", type=float, default=0.99, metavar="F",
                     help="fraction of requests that must meet the SLO, refused ones counted as misses (default 0.99)")
    sim.add_argument("--find-max-rate", action="store_true", help="per policy: the largest rate that meets the SLO")
    sim.add_argument("--find-replicas", action="store_true",
                     help="per policy: the fewest replicas for --rate within the SLO")
    sim.add_argument("--tau-table", action="store_true",
                     help="analytic fixed_fill timeout vs the best simulated one at --sweep rates "
                          "(default: 10..90%% of one replica's fixed_fill capacity)")
    sim.add_argument("--fill-timeout", type=float, metavar="S",
                     help="fixed_fill timeout in seconds (default: the analytic optimum at each replica's rate)")
    sim.add_argument("--fdfo-hold", action="store_true", help="fdfo holds under-filled steps by the fill-hold rule")
    sim.add_argument("--max-step-debt", metavar="ROW_STEPS|slo",
                     help="admission: row-steps the cluster may owe per replica, or 'slo' for full-batch drain "
                          "rate x --slo-latency (default: admit everything)")
    sim.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    sim.add_argument("--plot", metavar="PNG", help="write mean and p99 latency vs rate per policy (with --sweep)")
    sim.set_defaults(func=cmd_simulate)


_UP_SHORTCUTS = {  # flag dest -> config key
    "model": "model", "port": "port", "metrics_port": "metrics_port", "host": "host",
    "max_batch": "replica.max_batch", "mode": "replica.mode", "algorithm": "algorithm.name",
    "min_replicas": "autoscaling.min_replicas", "max_replicas": "autoscaling.max_replicas",
    "api_key": "api_key", "dtype": "replica.dtype", "lora": "replica.lora", "kv_cache": "replica.kv_cache",
    "attention_backend": "replica.attention_backend",
}


def _parse_set(items: list[str] | None) -> dict:
    overrides = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"dllm-serve: --set expects KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


def up_config(args):
    from cluster.config import load_config

    overrides = _parse_set(args.set)
    if args.replicas is not None:
        overrides["autoscaling.min_replicas"] = overrides["autoscaling.max_replicas"] = args.replicas
    for dest, key in _UP_SHORTCUTS.items():
        value = getattr(args, dest)
        if value is not None:
            overrides[key] = value
    return load_config(args.config, overrides)


# a 4x4 Sudoku on the tiny model's canvas (see README); any text works for other models
_EXAMPLE_PROMPT = "1.3. ..2. 4... .1.4 " + " ".join(["----"] * 24)


def _check_model_default_algorithm(config, spec) -> None:
    """``algorithm.params`` without ``algorithm.name`` apply to the model's own default."""
    from algorithms import AlgorithmError, get_algorithm
    from cluster.config import ConfigError

    if config.algorithm.name is None:
        try:
            get_algorithm(spec.default_algorithm).make_params(
                {**spec.default_algorithm_params, **config.algorithm.params})
        except AlgorithmError as exc:
            raise ConfigError(f"algorithm.params (for the model's default {spec.default_algorithm}): {exc}") from None


def cmd_up(args) -> int:
    from cluster.app import check_ports_free, deploy, shutdown

    from replicas.models import check_checkpoint

    config = up_config(args)
    replica = config.replica
    spec = check_checkpoint(config.model, replica.lora, replica.model_overrides)  # before any process starts
    _check_model_default_algorithm(config, spec)
    if args.address is None:  # a local cluster: its ports must be free
        check_ports_free(config)
    stop = threading.Event()
    print(f"starting dllm-serve: model {config.model_name}, {config.autoscaling.min_replicas}"
          f"-{config.autoscaling.max_replicas} replica(s), mode {config.replica.mode.value}", flush=True)
    try:
        metrics_url = deploy(config, args.address)
        # after ray.init, which installs handlers of its own: SIGTERM and SIGINT (even when
        # started in the background, where SIGINT arrives ignored) both stop cleanly
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        base = f"http://{config.host}:{config.port}"
        auth = f" -H 'Authorization: Bearer {config.api_key.get_secret_value()}'" if config.api_key else ""
        print(f"OpenAI API: {base}/v1\nmetrics:    {metrics_url}\ntry:\n"
              f"  curl {base}/v1/completions -H 'Content-Type: application/json'{auth} "
              f"-d '{{\"model\": \"{config.model_name}\", \"prompt\": \"{_EXAMPLE_PROMPT}\", \"max_tokens\": 32}}'\n"
              f"ready; Ctrl-C stops", flush=True)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        shutdown(config)
    return 0


def cmd_status(args) -> int:
    from cluster.app import cluster_status

    status = cluster_status(args.address)
    if args.json:
        print(json.dumps(status, indent=2, default=str))
        return 0
    for name, app in status["applications"].items():
        print(f"application {name}: {app['status']} {app['message']}".rstrip())
        for deployment, info in app["deployments"].items():
            print(f"  {deployment}: {info['status']} replicas {info['replicas']}")
    if not status["applications"]:
        print("no Serve application is running")
    print(f"{'replica':<12}{'running':>8}{'waiting':>8}{'free pages':>12}{'step debt':>11}{'drain s':>9}{'row-steps/s':>13}")
    for replica, view in sorted(status["replicas"].items()):
        print(f"{replica:<12}{view['running']:>8}{view['waiting']:>8}{view['free_pages']:>7}/{view['total_pages']:<4}"
              f"{view['step_debt']:>11.0f}{view['predicted_drain_s']:>9.2f}{view['row_steps_per_s']:>13.0f}")
    return 0


def cmd_render(args) -> int:
    from cluster.config import load_config
    from cluster.render import render_k8s

    text = render_k8s(load_config(args.config, _parse_set(args.set)), args.config)
    if args.output:
        with open(args.output, "w") as out:
            out.write(text)
    else:
        sys.stdout.write(text)
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
    ev.add_argument("--modes", nargs="+", default=["fdfo", "sync"], choices=MODES)
    ev.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    ev.add_argument("--requests", type=int, default=300, help="held-out requests (default 300)")
    ev.add_argument("--algorithm", choices=available_algorithms(), default="low_confidence")
    ev.add_argument("--json", action="store_true", help="print JSON")
    ev.set_defaults(func=cmd_eval_tiny)

    from cluster.config import describe_fields

    up = commands.add_parser(
        "up", help="start a local Ray cluster serving the model over an OpenAI API",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start Ray (local, or --address), the metrics actor and the Serve application; "
                    "Ctrl-C stops everything. Settings come from defaults, then --config, then --set, "
                    "then the shortcut flags.",
        epilog="settings (YAML keys for --config, dotted keys for --set):\n" + "\n".join(describe_fields()))
    up.add_argument("--config", help="YAML file with settings")
    up.add_argument("--set", action="append", metavar="KEY=VALUE", help="one setting, e.g. --set slo.latency_s=10")
    up.add_argument("--address", help="connect to an existing Ray cluster instead of starting one")
    up.add_argument("--model", help="checkpoint directory or 'tiny'")
    up.add_argument("--replicas", type=int, help="fixed number of replicas (sets min and max)")
    up.add_argument("--min-replicas", type=int)
    up.add_argument("--max-replicas", type=int)
    up.add_argument("--max-batch", type=int)
    up.add_argument("--mode", choices=MODES)
    up.add_argument("--algorithm", choices=available_algorithms())
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.add_argument("--metrics-port", type=int)
    up.add_argument("--api-key")
    _model_options(up)
    up.set_defaults(func=cmd_up)

    status = commands.add_parser("status", help="replicas of a running cluster and their stats")
    status.add_argument("--address", default="auto", help="Ray address (default: the local cluster)")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    render = commands.add_parser(
        "render", help="write deployment manifests from a config (k8s: a KubeRay RayService)",
        description="Render the KubeRay RayService for the settings of `dllm-serve up --config FILE`: "
                    "serveConfigV2 (the same app builder, deployment options and autoscaling), a head group "
                    "and a worker group (nvidia.com/gpu when kubernetes.worker_gpus > 0), probes, resources "
                    "and metrics ports. The kubernetes.* settings (see `dllm-serve up --help`) choose the "
                    "image and pod sizes; deploy/README.md has the steps to apply it.")
    render.add_argument("target", choices=["k8s"], help="what to render (k8s: a ray.io/v1 RayService)")
    render.add_argument("--config", required=True, help="YAML file with settings, as for `dllm-serve up`")
    render.add_argument("--set", action="append", metavar="KEY=VALUE", help="one setting, e.g. --set kubernetes.image=X")
    render.add_argument("-o", "--output", metavar="FILE", help="write here instead of standard output")
    render.set_defaults(func=cmd_render)

    bench = commands.add_parser("bench", help="benchmarks that print ratios measured side by side")
    targets = bench.add_subparsers(dest="target", required=True)
    engine = targets.add_parser("engine", help="fdfo vs sync vs static tokens/s on one closed workload")
    engine.add_argument("--requests", type=int, default=256, help="requests (default 256)")
    engine.add_argument("--calibration", metavar="FILE",
                        help="also write the simulator's calibration (step cost, step counts) here")
    policies = targets.add_parser(
        "policies", help="static, sync, fixed_fill and fdfo latency and goodput under one Poisson load")
    policies.add_argument("--requests", type=int, default=300, help="requests (default 300)")
    policies.add_argument("--rate", type=float, help="arrivals per second (default: --load x fdfo capacity)")
    policies.add_argument("--load", type=float, default=0.7, help="offered load as a fraction of fdfo capacity")
    policies.add_argument("--slo-latency", type=float, default=1.0, help="latency SLO for goodput (s)")
    policies.add_argument("--fill-timeout", type=float, help="fixed_fill timeout in s (default: tuned online)")
    policies.add_argument("--seed", type=int, default=0)
    for target in (engine, policies):
        target.add_argument("--model", default="tiny")
        target.add_argument("--max-batch", type=int, default=16)
        target.add_argument("--json", action="store_true", help="one JSON object on one line")
        target.set_defaults(func=cmd_bench)

    from loadgen.calibrate_cli import add_bench_calibration_parser, add_calibrate_parser

    add_bench_calibration_parser(targets)
    add_calibrate_parser(commands)

    from loadgen.cli import add_loadgen_parser

    add_loadgen_parser(commands).set_defaults(func=cmd_loadgen)
    _simulate_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cluster.config import ConfigError
    from replicas.models import CheckpointError
    from replicas.request import RequestError

    try:
        return args.func(args)
    except (CheckpointError, RequestError, ConfigError, ValueError) as exc:
        print(f"dllm-serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
