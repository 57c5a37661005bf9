"""The engine's benchmarks and the tiny model's evaluation on the command line: `dllm-serve
bench engine | policies | quality | canvas | forward | prefix | structured | adapters | d2f` and `dllm-serve eval-tiny`.
Their modules (torch, the engine) are imported when a command runs, not to build its parser."""

from __future__ import annotations

import json


def add_eval_tiny_parser(commands) -> None:
    from algorithms import available_algorithms
    from replicas.batching import MODES

    ev = commands.add_parser("eval-tiny", help="accuracy and steps-per-block histogram of the tiny model")
    ev.add_argument("--model", default="tiny")
    ev.add_argument("--modes", nargs="+", default=["fdfo", "sync"], choices=MODES)
    ev.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    ev.add_argument("--requests", type=int, default=300, help="held-out requests (default 300)")
    ev.add_argument("--algorithm", choices=available_algorithms(), default="low_confidence")
    ev.add_argument("--json", action="store_true", help="print JSON")
    ev.set_defaults(func=cmd_eval_tiny)


def cmd_eval_tiny(args) -> int:
    from tools.bench.evaluation import evaluate_tiny, format_report

    report = evaluate_tiny(args.model, modes=args.modes, batch_sizes=args.batch_sizes,
                           num_requests=args.requests, algorithm=args.algorithm)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _calibration_writer(path: str | None, max_batch: int):
    """A callback that fits the simulator's calibration to the fdfo run and saves it."""
    if path is None:
        return None
    from tools.capacity.calibration import fit_calibration, save_calibration

    def write(steps, outputs) -> None:
        calibration = fit_calibration(
            [(s.batch_size, s.prefix_units, s.step_s) for s in steps], [n for o in outputs for n in o.block_steps],
            [len(o.block_steps) for o in outputs], sum(s.prefix_units for s in steps) / len(outputs),
            max_batch, source="dllm-serve bench engine")
        save_calibration(calibration, path)

    return write


def _add_workload_options(parser, batch_sizes: list[int], steps: int, rounds: int, rounds_help: str) -> None:
    """The closed-batch workload of the random-weight benches: batch sizes, prompt and
    answer lengths, fixed_steps forwards per block, rounds."""
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=batch_sizes,
                        help=f"(default: {' '.join(map(str, batch_sizes))})")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default 64)")
    parser.add_argument("--max-tokens", type=int, default=128, help="answer tokens per request (default 128)")
    parser.add_argument("--steps", type=int, default=steps, help=f"fixed_steps forwards per block (default {steps})")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"{rounds_help} (default {rounds})")


def cmd_bench(args) -> int:
    if args.target == "engine":
        from tools.bench.engine import bench_engine

        paced_by = None if args.hidden is None else dict(hidden=args.hidden, layers=args.layers, heads=args.heads,
                                                         vocab=args.vocab)
        result = bench_engine(args.model, num_requests=args.requests, max_batch=args.max_batch, rounds=args.rounds,
                              workload=args.workload,
                              on_fdfo_run=_calibration_writer(args.calibration, args.max_batch),
                              device=args.device, dtype=args.dtype, paced_by=paced_by)
    elif args.target == "prefix":
        from tools.bench.prefix import bench_prefix

        result = bench_prefix(args.requests, args.prefix_len, args.tail_len, args.max_tokens, args.max_batch,
                              args.steps, args.rounds, hidden=args.hidden, layers=args.layers, heads=args.heads)
    elif args.target == "quality":
        return _bench_quality(args)
    elif args.target == "forward":
        from tools.bench.forward import bench_forward

        heads = args.heads or max(1, args.d_model // 64)
        vocab = {} if args.vocab is None else {"vocab": args.vocab}
        shape = {"llada": dict(d_model=args.d_model, layers=args.layers, heads=heads,
                               mlp=args.mlp or int(args.d_model * 2.75), **vocab),
                 "sdar": dict(hidden=args.d_model, layers=args.layers, heads=heads, ffn=args.mlp, **vocab)}
        result = bench_forward(tuple(args.architectures), tuple(args.batch_sizes), args.prompt_len, args.max_tokens,
                               args.steps, args.rounds, device=args.device, dtype=args.dtype, **shape)
    elif args.target == "tp":
        from tools.bench.tp import bench_tp

        result = bench_tp(tuple(args.sizes), tuple(args.batch_sizes), d_model=args.d_model, layers=args.layers,
                          heads=args.heads, mlp=args.mlp, vocab=args.vocab, steps=args.steps,
                          prompt_len=args.prompt_len, max_tokens=args.max_tokens, rounds=args.rounds)
    elif args.target == "structured":
        from tools.bench.structured import bench_structured

        result = bench_structured(args.vocab, tuple(args.batch_sizes), args.rounds, args.requests, hidden=args.hidden,
                                  layers=args.layers)
    elif args.target == "d2f":
        from tools.bench.d2f import bench_d2f

        thresholds = {"block_add_threshold": args.block_add_threshold,
                      "decoded_token_threshold": args.decoded_token_threshold, "skip_threshold": args.skip_threshold}
        result = bench_d2f(tuple(args.batch_sizes), args.rounds, args.requests, thresholds, tuple(args.checkpoints),
                           args.d_model, args.layers, max_tokens=args.max_tokens, device=args.device,
                           dtype=args.dtype)
    elif args.target == "adapters":
        from tools.bench.adapters import bench_adapters

        result = bench_adapters(tuple(args.batch_sizes), args.rank, args.adapters, args.prompt_len, args.max_tokens,
                                args.steps, args.rounds, d_model=args.d_model, layers=args.layers,
                                heads=max(1, args.d_model // 64), mlp=int(args.d_model * 2.75), vocab=args.vocab)
    elif args.target == "canvas":
        from tools.bench.canvas import bench_canvas

        result = bench_canvas(tuple(args.batch_sizes), args.prompt_len, args.max_tokens, args.steps, args.rounds,
                              d_model=args.d_model, layers=args.layers, mlp=int(args.d_model * 2.75))
    else:
        from tools.capacity.policy_bench import bench_policies

        result = bench_policies(args.model, num_requests=args.requests, load=args.load, rate=args.rate,
                                max_batch=args.max_batch, slo_latency_s=args.slo_latency, seed=args.seed,
                                fill_timeout_s=args.fill_timeout)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _bench_quality(args) -> int:
    from tools.bench.quality import bench_quality, bench_quality_random, format_quality, plot_quality, sweep

    settings = sweep(tuple(args.thresholds), tuple(args.factors))
    if args.random:
        result = bench_quality_random(args.random, settings=settings)
    else:
        result = bench_quality(args.model, num_requests=args.requests, max_batch=args.max_batch,
                               rounds=args.rounds, workload=args.workload, settings=settings)
        if args.plot:
            plot_quality(result, args.plot)
    print(json.dumps(result) if args.json else format_quality(result))
    return 0


def _add_shape_options(parser, d_model: int, layers: int, whose: str = "") -> None:
    """``--d-model`` and ``--layers`` of a bench's random model (``whose``: which, where it has several)."""
    parser.add_argument("--d-model", type=int, default=d_model, help=f"{whose}hidden size (default {d_model})")
    parser.add_argument("--layers", type=int, default=layers,
                        help=f"{whose or 'transformer '}layers (default {layers})")


def _add_device_options(target) -> None:
    target.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the engine runs (default cpu)")
    target.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="weights, activations and KV (default: bfloat16 on cuda, float32 on cpu)")


def add_engine_benches(targets) -> None:
    """bench engine, policies, quality, canvas and prefix: benchmarks of the engine itself."""
    from tools.bench.quality import FACTORS, THRESHOLDS

    engine = targets.add_parser("engine", help="fdfo vs sync vs static tokens/s on one closed workload")
    engine.add_argument("--requests", type=int, default=256, help="requests (default 256)")
    engine.add_argument("--rounds", type=int, default=3,
                        help="rounds of fdfo, sync, static and fdfo with a separate KV-write forward, interleaved; "
                             "ratios are the median over the rounds, with their spread (default 3)")
    engine.add_argument("--workload", choices=["default", "hard"], default="default",
                        help="default: 0 to 12 blanks a puzzle; hard: 8 to 12, so blocks take more steps")
    engine.add_argument("--calibration", metavar="FILE",
                        help="also write the simulator's calibration (step cost, step counts) here")
    engine.add_argument("--hidden", type=int,
                        help="pace every forward by a random SDAR of this hidden size: each mode's run of the model "
                             "is recorded once, and the timed runs replay its answers while that model's forward "
                             "runs in its place (same steps and tokens, a larger model's cost); 2048 with the "
                             "defaults below is SDAR-1.7B's shape (default: no pacing, the model's own forward)")
    engine.add_argument("--layers", type=int, default=28, help="the pacing SDAR's layers (default 28)")
    engine.add_argument("--heads", type=int, default=16,
                        help="its attention heads (default 16; half as many KV heads, heads of hidden/heads, an FFN "
                             "of 3 x hidden)")
    engine.add_argument("--vocab", type=int, default=151936, help="its vocabulary (default 151936)")
    _add_device_options(engine)
    policies = targets.add_parser(
        "policies", help="static, sync, fixed_fill and fdfo latency and goodput under one Poisson load")
    policies.add_argument("--requests", type=int, default=300, help="requests (default 300)")
    policies.add_argument("--rate", type=float, help="arrivals per second (default: --load x fdfo capacity)")
    policies.add_argument("--load", type=float, default=0.7, help="offered load as a fraction of fdfo capacity")
    policies.add_argument("--slo-latency", type=float, default=1.0, help="latency SLO for goodput (s)")
    policies.add_argument("--fill-timeout", type=float, help="fixed_fill timeout in s (default: tuned online)")
    policies.add_argument("--seed", type=int, default=0)

    quality = targets.add_parser(
        "quality", help="accuracy, tokens per forward and tokens/s as the confidence bar is lowered",
        description="Sweeps low_confidence's threshold and fast_dllm_factor's factor on the trained tiny model: "
                    "per setting, request accuracy, tokens per row-forward, steps per block and tokens/s, the "
                    "settings run in turn for --rounds rounds (tokens/s and its ratio to the default setting, "
                    "low_confidence threshold=0.95, are medians over the rounds). --random sweeps random weights "
                    "instead, where only tokens per forward mean anything.")
    quality.add_argument("--requests", type=int, default=400, help="requests (default 400: the whole held-out set)")
    quality.add_argument("--workload", choices=["heldout", "hard"], default="heldout",
                         help="heldout: the tiny model's held-out set; hard: 8 to 12 blanks a puzzle")
    quality.add_argument("--rounds", type=int, default=3, help="rounds of every setting (default 3)")
    quality.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS),
                         help=f"low_confidence thresholds (default {' '.join(map(str, THRESHOLDS))})")
    quality.add_argument("--factors", type=float, nargs="+", default=list(FACTORS),
                         help=f"fast_dllm_factor factors (default {' '.join(map(str, FACTORS))})")
    quality.add_argument("--random", choices=["sdar", "llada"],
                         help="random weights of this architecture (42M-class SDAR, 1B-class LLaDA): tokens per "
                              "forward only")
    quality.add_argument("--plot", metavar="OUT.png", help="accuracy against tokens per forward (tiny model)")
    for target in (engine, policies, quality):
        target.add_argument("--model", default="tiny")
        target.add_argument("--max-batch", type=int, default=16)
        target.add_argument("--json", action="store_true", help="one JSON object on one line")
        target.set_defaults(func=cmd_bench)

    canvas = targets.add_parser(
        "canvas", help="full canvas (dual cache) vs block canvas tokens/s on a random 1B-class LLaDA")
    _add_workload_options(canvas, batch_sizes=[1, 16], steps=8, rounds=2,
                          rounds_help="rounds of both canvases in alternating order; ratios are medians")
    _add_shape_options(canvas, d_model=2048, layers=16)
    canvas.add_argument("--json", action="store_true", help="one JSON object on one line")
    canvas.set_defaults(func=cmd_bench)

    d2f = targets.add_parser(
        "d2f", help="D2F pipelined decoding vs plain block decoding: forwards, tokens per forward, tokens/s",
        description="The d2f rule with blocks joining early (the thresholds given) against the same rule one "
                    "block at a time (block_add_threshold 1), on the trained tiny model (with its accuracy) and a "
                    "random LLaDA served as D2F's (block-causal, the prompt one block); medians of alternating rounds.")
    d2f.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="(default: 1 16)")
    d2f.add_argument("--requests", type=int, default=32, help="requests per batch (default 32)")
    d2f.add_argument("--rounds", type=int, default=3, help="rounds of both settings, alternating (default 3)")
    d2f.add_argument("--checkpoints", nargs="+", choices=["tiny", "random"], default=["tiny", "random"],
                     help="the trained tiny model, a random LLaDA or both (default both)")
    d2f.add_argument("--block-add-threshold", type=float, default=0.1, help="(default 0.1, the published math setting)")
    d2f.add_argument("--decoded-token-threshold", type=float, default=0.5, help="(default 0.5)")
    d2f.add_argument("--skip-threshold", type=float, default=0.9, help="(default 0.9, the published evaluation's)")
    _add_shape_options(d2f, d_model=512, layers=8, whose="random LLaDA's ")
    d2f.add_argument("--max-tokens", type=int, default=128, help="random LLaDA's answer tokens (default 128)")
    _add_device_options(d2f)
    d2f.add_argument("--json", action="store_true", help="one JSON object on one line")
    d2f.set_defaults(func=cmd_bench)

    adapters = targets.add_parser(
        "adapters", help="step time with unmerged LoRA adapters (base rows, one adapter, several) vs none",
        description="Random LLaDA weights and random rank-r adapters on all seven projections of every layer; "
                    "the same closed batch runs without adapters, on an engine serving adapters with every row "
                    "the base model's, every row one adapter, and the rows spread over several; each figure is "
                    "the median step time over the plain engine's, rounds alternating.")
    _add_workload_options(adapters, batch_sizes=[1, 16], steps=8, rounds=3,
                          rounds_help="rounds of the four ways in alternating order; ratios are medians")
    _add_shape_options(adapters, d_model=512, layers=8)
    adapters.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    adapters.add_argument("--rank", type=int, default=16, help="the adapters' rank (default 16)")
    adapters.add_argument("--adapters", type=int, default=4, help="adapters the mixed batch spreads over (default 4)")
    adapters.add_argument("--json", action="store_true", help="one JSON object on one line")
    adapters.set_defaults(func=cmd_bench)

    tp = targets.add_parser(
        "tp", help="an engine step at tensor-parallel sizes 1 and 2 (gloo CPU ranks): compute, collectives, host",
        description="A random LLaDA answers a closed batch with fixed_steps at each tensor-parallel size (ranks "
                    "are processes on this machine joined by gloo, one torch thread each); per step on rank 0: "
                    "wall time, compute (the forward less its collectives), collectives (the all-reduces and the "
                    "logits' all-gather, waits included) and host work (the rest of the step), medians over the "
                    "rounds, and the collectives' share of the step.")
    tp.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (default: 1 2)")
    _add_workload_options(tp, batch_sizes=[1, 16], steps=4, rounds=3, rounds_help="timed runs per setting; medians")
    _add_shape_options(tp, d_model=512, layers=8)
    tp.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    tp.add_argument("--mlp", type=int, default=1376, help="MLP width (default 1376)")
    tp.add_argument("--vocab", type=int, default=320, help="vocabulary (default 320)")
    tp.add_argument("--json", action="store_true", help="one JSON object on one line")
    tp.set_defaults(func=cmd_bench)

    forward = targets.add_parser(
        "forward", help="the engine's forward vs a plain reference forward of the same weights, per architecture",
        description="Random LLaDA (full canvas) and SDAR (block canvas) weights; the engine runs without a KV cache "
                    "(every forward recomputes each row's sequence) and the reference, the published models' math "
                    "written out densely (LM head over every position), runs the same shapes. Rounds alternate "
                    "which side goes first; project/reference forward seconds is the median over every forward and "
                    "the reference's beside it, with the quartiles (under 1: the project's forward is faster).")
    forward.add_argument("--architectures", nargs="+", choices=["llada", "sdar"], default=["llada", "sdar"],
                         help="random weights of these (default: both): LLaDA on its full canvas, SDAR on blocks")
    _add_workload_options(forward, batch_sizes=[1, 8], steps=4, rounds=3, rounds_help="rounds of both sides")
    forward.add_argument("--d-model", type=int, default=512, help="hidden size (default 512; heads of 64)")
    forward.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    forward.add_argument("--heads", type=int,
                         help="attention heads (default: d-model / 64; SDAR has half as many KV heads)")
    forward.add_argument("--mlp", type=int, help="the MLP's width (default: 2.75 x d-model for LLaDA, 3 x for SDAR)")
    forward.add_argument("--vocab", type=int,
                         help="the vocabulary (default: LLaDA's 126464 and 32768 for SDAR; --d-model 2048 --layers 28 "
                              "--heads 16 --mlp 6144 --vocab 151936 is SDAR-1.7B's shape). A small one leaves the "
                              "layers' own cost: --architectures llada --d-model 512 --layers 8 --heads 8 --mlp 1376 "
                              "--vocab 320 is where the engine once lost to Fast-dLLM's model code")
    _add_device_options(forward)
    forward.add_argument("--json", action="store_true", help="one JSON object on one line")
    forward.set_defaults(func=cmd_bench)

    structured = targets.add_parser(
        "structured", help="structured output: constrained vs free step time, schema compile time, tiny accuracy",
        description="Random SDAR weights over a byte-level BPE trained here answer the same prompts as one closed "
                    "batch free and constrained by a JSON schema, in alternating order: the ratio is the median "
                    "step time constrained over free. Each schema and regex of the bench's set is compiled for that "
                    "vocabulary (p50, p99). The trained tiny model answers its held-out Sudoku requests free and "
                    "constrained by each request's format (givens kept, a digit in every blank): the accuracies.")
    structured.add_argument("--vocab", type=int, default=4000,
                            help="the BPE's vocabulary as asked (its training text may give fewer; default 4000)")
    structured.add_argument("--hidden", type=int, default=64,
                            help="the random SDAR's hidden size (default 64: a forward of a few ms, the constrained "
                                 "decoding's worst case; 512 gives tens of ms)")
    structured.add_argument("--layers", type=int, default=2, help="its layers (default 2)")
    structured.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="(default: 1 16)")
    structured.add_argument("--rounds", type=int, default=3, help="rounds of both, alternating (default 3)")
    structured.add_argument("--requests", type=int, default=200, help="held-out tiny requests (default 200)")
    structured.add_argument("--json", action="store_true", help="one JSON object on one line")
    structured.set_defaults(func=cmd_bench)

    prefix = targets.add_parser(
        "prefix", help="prefix cache on vs off: tokens/s and time to first block on a random SDAR, shared prompts",
        description="Requests that share a long prefix (a system prompt) and each add a tail of their own, on a "
                    "random SDAR (blocks of 32, fixed_steps); one request warms the cache, then the rest arrive "
                    "at once. Cache on and off run in alternating order; ratios are medians over the rounds.")
    prefix.add_argument("--requests", type=int, default=8, help="timed requests (default 8)")
    prefix.add_argument("--prefix-len", type=int, default=1024, help="shared prefix tokens (default 1024)")
    prefix.add_argument("--tail-len", type=int, default=64, help="each request's own tokens after it (default 64)")
    prefix.add_argument("--max-tokens", type=int, default=128, help="answer tokens per request (default 128)")
    prefix.add_argument("--max-batch", type=int, default=8, help="rows per step (default 8)")
    prefix.add_argument("--steps", type=int, default=8, help="fixed_steps forwards per block (default 8)")
    prefix.add_argument("--rounds", type=int, default=2, help="rounds of both settings (default 2)")
    prefix.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024: ~185M parameters)")
    prefix.add_argument("--layers", type=int, default=12, help="transformer layers (default 12)")
    prefix.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    prefix.add_argument("--json", action="store_true", help="one JSON object on one line")
    prefix.set_defaults(func=cmd_bench)
