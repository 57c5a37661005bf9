"""The `dllm-serve` command line: the commands that each package registers.

Each module of ``PACKAGES`` has ``register(commands, benches, client_only)``: it adds its
commands to ``commands`` (argparse subparsers) and its benches to ``benches()``, the
targets of `dllm-serve bench`; with ``client_only`` only those that run on a client
machine, whose parsers and modules import neither torch nor the engine."""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from cluster import cli as cluster_commands
from loadgen import commands as loadgen_commands
from tools import commands as tool_commands

PACKAGES = (cluster_commands, tool_commands, loadgen_commands)  # in the order --help lists them


def build_parser(client_only: bool = False) -> argparse.ArgumentParser:
    """The whole CLI; ``client_only``: only the client commands (load, calibration of a
    running server, simulation)."""
    parser = argparse.ArgumentParser(
        prog="dllm-serve",
        description="Serve masked diffusion language models with a block-granular FDFO engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    @functools.cache
    def benches():
        bench = commands.add_parser("bench", help="benchmarks that print ratios measured side by side")
        return bench.add_subparsers(dest="target", required=True)

    for package in PACKAGES:
        package.register(commands, benches, client_only)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def names_a_command_of(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    """Whether the words of ``argv`` (its arguments that are not options) begin with a
    whole command of ``parser``, e.g. `loadgen` or `bench overload`."""
    words = [word for word in argv if not word.startswith("-")]
    for word in words:
        commands = _subcommands(parser)
        if commands is None:
            return True
        if word not in commands.choices:
            return False
        parser = commands.choices[word]
    return _subcommands(parser) is None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(client_only=True)
    client = names_a_command_of(parser, argv)  # then neither torch nor the engine is imported, not even for --help
    args = (parser if client else build_parser()).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cluster.config import ConfigError

    refusals: tuple[type[Exception], ...] = (ConfigError, ValueError)
    if not client:
        from replicas.messages import RequestError
        from replicas.models import CheckpointError

        refusals += (CheckpointError, RequestError)
    try:
        return args.func(args)
    except refusals as exc:
        print(f"dllm-serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
