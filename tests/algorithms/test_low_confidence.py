"""LowConfidence: strict threshold, the at-least-one fallback, done semantics."""

import torch
from algo_helpers import MASK, filled, logits_of, run_step

from algorithms import get_algorithm
from algorithms.sampling import token_probability


def test_fills_positions_strictly_above_threshold():
    logits = logits_of([[(1, 0.99), (2, 0.96), (3, 0.5), (4, 0.97)]])
    block = torch.full((1, 4), MASK)
    after, done, _ = run_step("low_confidence", logits, block)
    assert after.tolist() == [[1, 2, MASK, 4]]
    assert done.tolist() == [False]


def test_confidence_equal_to_threshold_is_not_enough():
    logits = logits_of([[(1, 0.99), (2, 0.6)]])
    exact = token_probability(logits, torch.tensor([[1, 2]]))[0, 1].item()
    after, _, _ = run_step("low_confidence", logits, torch.full((1, 2), MASK), {"threshold": exact})
    assert filled(torch.full((1, 2), MASK), after) == [[0]]


def test_falls_back_to_the_single_most_confident_mask():
    # Position 0 is more confident but already filled; the fallback only looks at masks.
    logits = logits_of([[(5, 0.9), (1, 0.3), (2, 0.6), (3, 0.5)]])
    block = torch.tensor([[5, MASK, MASK, MASK]])
    after, _, _ = run_step("low_confidence", logits, block)
    assert after.tolist() == [[5, MASK, 2, MASK]]


def test_never_changes_filled_positions():
    logits = logits_of([[(1, 0.99), (2, 0.99), (3, 0.99)]])
    block = torch.tensor([[4, MASK, 6]])
    after, _, _ = run_step("low_confidence", logits, block)
    assert after.tolist() == [[4, 2, 6]]


def test_done_only_when_the_forward_saw_no_mask():
    logits = logits_of([[(1, 0.99), (2, 0.99)], [(1, 0.99), (2, 0.99)]])
    block = torch.tensor([[MASK, MASK], [3, 4]])
    after, done, _ = run_step("low_confidence", logits, block)
    # Row 0 is complete now, but its final tokens were not seen by a forward yet.
    assert done.tolist() == [False, True]
    assert after.tolist() == [[1, 2], [3, 4]]


def test_rows_use_their_own_threshold():
    logits = logits_of([[(1, 0.8), (2, 0.7)], [(1, 0.8), (2, 0.7)]])
    algorithm = get_algorithm("low_confidence")
    params = [algorithm.make_params({"threshold": 0.5}), algorithm.make_params({"threshold": 0.75})]
    block = torch.full((2, 2), MASK)
    algorithm.step(logits, block, MASK, params, [None, None])
    assert block.tolist() == [[1, 2], [1, MASK]]


def test_a_predicted_mask_token_is_never_written():
    # The model is sure of [MASK] at the only masked position: the fallback still fills it,
    # with the best other token (all tie, so the lowest id).
    logits = logits_of([[(MASK, 0.99), (2, 0.99)]])
    after, _, _ = run_step("low_confidence", logits, torch.tensor([[MASK, 2]]))
    assert after.tolist() == [[0, 2]]
