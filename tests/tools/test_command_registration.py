"""The `dllm-serve` entry gathers the commands that each package registers; the client
commands (those a client-only parser holds) run without the engine."""

import argparse
import functools

import pytest

from cluster import cli as cluster_commands
from loadgen import commands as loadgen_commands
from tools import commands as tool_commands
from tools.cli import PACKAGES, build_parser, names_a_command_of

REGISTERED = {  # package -> (its commands, its bench targets)
    cluster_commands: ({"generate", "up", "status", "render"}, set()),
    tool_commands: ({"train-tiny", "eval-tiny", "calibrate", "simulate"},
                    {"engine", "policies", "quality", "canvas", "forward", "prefix", "detokenize", "calibration", "tp",
                     "structured", "adapters", "d2f"}),
    loadgen_commands: ({"loadgen"}, {"overload", "soak"}),
}
CLIENT = ({"loadgen", "calibrate", "simulate"}, {"overload", "calibration", "soak"})


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _registered(package, client_only: bool) -> tuple[set[str], set[str]]:
    """The commands and bench targets that ``package`` alone registers."""
    commands = argparse.ArgumentParser().add_subparsers()
    targets = argparse.ArgumentParser().add_subparsers()
    package.register(commands, functools.cache(lambda: targets), client_only)
    return set(commands.choices), set(targets.choices)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda package: package.__name__)
def test_each_package_registers_its_own_commands(package):
    assert _registered(package, client_only=False) == REGISTERED[package]
    commands, targets = _registered(package, client_only=True)
    assert commands == REGISTERED[package][0] & CLIENT[0] and targets == REGISTERED[package][1] & CLIENT[1]


def test_the_entry_holds_every_package_command_once_and_bench_holds_the_targets():
    full = _choices(build_parser())
    assert set(full) == set().union(*(commands for commands, _ in REGISTERED.values())) | {"bench"}
    assert set(_choices(full["bench"])) == set().union(*(targets for _, targets in REGISTERED.values()))
    client = _choices(build_parser(client_only=True))
    assert set(client) == CLIENT[0] | {"bench"} and set(_choices(client["bench"])) == CLIENT[1]


@pytest.mark.parametrize("argv, client", [
    (["loadgen", "--url", "http://127.0.0.1:9"], True), (["-v", "simulate", "--help"], True),
    (["bench", "overload", "--help"], True), (["bench", "calibration"], True),
    (["bench"], False), (["bench", "engine"], False), (["up", "--help"], False), (["--help"], False), ([], False),
])
def test_a_client_command_is_one_the_client_parser_holds_whole(argv, client):
    assert names_a_command_of(build_parser(client_only=True), argv) is client
