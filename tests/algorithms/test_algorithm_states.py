"""An algorithm's per-block state is a value: ``step`` reads the rows' states and returns
their next ones, and leaves the ones it was given as they were."""

import copy

import pytest
import torch

from algorithms import available_algorithms, get_algorithm

MASK, VOCAB, LENGTH = 10, 11, 8


def snapshot(state):
    """A comparable copy of a state (tensors as lists; a noise stream by identity)."""
    if state is None or not isinstance(state, tuple):
        return state if state is None else id(state)
    return tuple(value.tolist() if isinstance(value, torch.Tensor) else
                 value if isinstance(value, (int, float, type(None))) else id(value) for value in state)


@pytest.mark.parametrize("name", available_algorithms())
def test_a_step_returns_the_next_states_and_changes_none_it_was_given(name):
    algorithm = get_algorithm(name)
    params = [algorithm.make_params({}), algorithm.make_params({"temperature": 1.0, "seed": 4})]
    given = [algorithm.init_state(p, 0) for p in params]
    before = [snapshot(s) for s in given]
    block = torch.full((2, LENGTH), MASK)
    block[:, :2] = torch.tensor([1, 2])
    logits = torch.randn(2, LENGTH, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    done, states = algorithm.step(logits, block, MASK, params, copy.copy(given))
    assert [snapshot(s) for s in given] == before
    if states is None:  # the rule keeps no state beyond its noise stream
        assert all(s is None or not isinstance(s, tuple) for s in given)
    else:
        assert len(states) == 2 and [snapshot(s) for s in states] != before
        # the next step reads them: the schedule goes on from where this one left it
        again = block.clone()
        algorithm.step(logits, again, MASK, params, states)
        assert ((again != MASK).sum(-1) >= (block != MASK).sum(-1)).all()
