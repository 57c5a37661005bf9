"""The `dllm-serve` command line as the tests look at it: a (sub)command's parser, and the
check that its --help explains every option."""

import argparse

import pytest

from tools.cli import build_parser, main


def command_parser(*path: str) -> argparse.ArgumentParser:
    """The parser of `dllm-serve PATH...`, e.g. ``command_parser("bench", "overload")``."""
    parser = build_parser()
    for name in path:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = commands.choices[name]
    return parser


def assert_help_explains_every_option(capsys, path: tuple[str, ...], more_than: int, words: tuple[str, ...]) -> None:
    """`dllm-serve PATH... --help` exits 0 and names every option of more than
    ``more_than``, each with its help, and ``words``."""
    with pytest.raises(SystemExit) as exit_:
        main([*path, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    actions = [a for a in command_parser(*path)._actions if a.option_strings]
    assert len(actions) > more_than
    for action in actions:
        assert action.help, action.option_strings
        assert all(option in text for option in action.option_strings)
    assert all(word in text for word in words), words
