"""A denoise rule whose every step raises, for the tests of how a failing rule is contained
(the engine fails only its rows; the API answers without leaking the message)."""

import algorithms.base
from algorithms.base import AlgorithmParams, DllmAlgorithm

NAME = "test_exploding"
MESSAGE = "boom: secret internal detail"  # must reach the log, never a client


class ExplodingAlgorithm(DllmAlgorithm):
    name = NAME
    params_class = AlgorithmParams

    def max_steps_per_block(self, params, block_length):
        return 1

    def step(self, logits, block, mask_id, params, states):
        raise RuntimeError(MESSAGE)


def register_exploding(monkeypatch) -> None:
    """Make ``NAME`` a known algorithm for the rest of the test."""
    monkeypatch.setitem(algorithms.base._REGISTRY, NAME, ExplodingAlgorithm())
