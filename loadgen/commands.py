"""The load generator's commands: `loadgen`, `bench overload` and `bench soak`, all client
commands (HTTP to a running cluster, no torch)."""

from __future__ import annotations

from loadgen.cli import add_loadgen_parser
from loadgen.overload import add_bench_overload_parser
from loadgen.soak import add_bench_soak_parser


def register(commands, benches, client_only: bool) -> None:
    """Add them to ``commands`` and ``benches()``, whatever ``client_only``."""
    add_bench_overload_parser(benches())
    add_bench_soak_parser(benches())
    add_loadgen_parser(commands)
