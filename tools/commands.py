"""The tools' commands: train-tiny, eval-tiny, the engine's benches, `bench detokenize`,
and the simulator's `bench calibration`, `calibrate` and `simulate` (client commands)."""

from __future__ import annotations

from tools.bench.cli import add_engine_benches, add_eval_tiny_parser
from tools.bench.detokenize import add_bench_detokenize_parser
from tools.capacity.cli import add_bench_calibration_parser, add_calibrate_parser, add_simulate_parser
from tools.tiny_training.cli import add_train_tiny_parser


def register(commands, benches, client_only: bool) -> None:
    """Add the tools' commands to ``commands`` and their benches to ``benches()``
    (``client_only``: only those that run on a client machine, without torch)."""
    if not client_only:
        add_train_tiny_parser(commands)
        add_eval_tiny_parser(commands)
        add_engine_benches(benches())
        add_bench_detokenize_parser(benches())
    add_bench_calibration_parser(benches())
    add_calibrate_parser(commands)
    add_simulate_parser(commands)
