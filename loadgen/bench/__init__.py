"""Benchmarks and the accuracy evaluation of the engine, run in-process (torch): the engine
bench (fdfo against the baselines), the canvas bench, the tiny model's evaluation, and
the zero-overhead model of a closed batch they compare with. Imported by the engine's
`dllm-serve bench ...` and `eval-tiny` commands only, never by the client commands."""
