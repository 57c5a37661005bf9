"""Benchmarks and the accuracy evaluation of the engine, run in-process (torch): the engine
bench (fdfo against the baselines), the canvas, forward, prefix and quality benches, the
detokenizer bench, the tiny model's evaluation, and the zero-overhead model of a closed
batch they compare with. The command line (``tools.bench.cli``) imports them only when
one of these commands runs, never for the client commands."""
