"""fixed_steps: LLaDA's transfer schedule, lowest-confidence and random remasking."""

import pytest
import torch
from algo_helpers import MASK, filled, logits_of, run_step, step_done

from algorithms import get_algorithm


def fill_counts(overrides, block, confidences=None):
    """Run the rule to completion with fixed logits; the number of tokens filled per step."""
    algorithm = get_algorithm("fixed_steps")
    params = [algorithm.make_params(overrides)]
    states = [algorithm.init_state(params[0], 0)]
    length = block.shape[1]
    confidences = confidences or [0.5 + 0.4 * i / length for i in range(length)]
    logits = logits_of([[(i % (MASK - 1), c) for i, c in enumerate(confidences)]])
    counts = []
    while True:
        before = block.clone()
        done = step_done(algorithm, logits, block, MASK, params, states)
        if done.item():
            assert torch.equal(before, block)
            return counts
        counts.append(int((before != block).sum()))


@pytest.mark.parametrize(
    ("length", "steps", "expected"),
    [
        (8, 3, [3, 3, 2]),
        (8, 4, [2, 2, 2, 2]),
        (8, 8, [1] * 8),
        (5, 32, [1] * 5),  # fewer masks than steps: one per step
        (32, 5, [7, 7, 6, 6, 6]),
    ],
)
def test_schedule_matches_llada(length, steps, expected):
    counts = fill_counts({"steps": steps}, torch.full((1, length), MASK))
    assert counts == expected
    assert sum(counts) == length
    algorithm = get_algorithm("fixed_steps")
    params = algorithm.make_params({"steps": steps})
    assert len(counts) + 1 == algorithm.max_steps_per_block(params, length)


def test_schedule_counts_masks_at_block_start():
    block = torch.tensor([[1, MASK, 2, MASK, MASK, MASK, MASK, 3]])
    assert fill_counts({"steps": 2}, block) == [3, 2]


def test_the_block_schedule_counts_the_block_length():
    """SDAR / LLaDA2.0: a first block that starts with the prompt's end (3 tokens here) still
    follows the block length's schedule, capped at the masks left."""
    block = torch.tensor([[1, 2, 3, MASK, MASK, MASK, MASK, MASK]])
    assert fill_counts({"steps": 2, "schedule": "block"}, block) == [4, 1]


def test_above_threshold_fills_more_than_the_quota_and_never_less():
    logits = logits_of([[(1, 0.5), (2, 0.9), (3, 0.3), (4, 0.8), (5, 0.6)]])
    block = torch.full((1, 5), MASK)
    after, _, _ = run_step("fixed_steps", logits, block, {"steps": 5, "threshold": 0.55})
    assert filled(block, after) == [[1, 3, 4]]  # three above 0.55, quota 1
    after, _, _ = run_step("fixed_steps", logits, block, {"steps": 2, "threshold": 0.85})
    assert filled(block, after) == [[1, 3, 4]]  # one above 0.85, quota 3: the three most confident


def test_sequential_remasking_fills_leftmost_first():
    logits = logits_of([[(1, 0.5), (2, 0.9), (3, 0.3), (4, 0.8), (5, 0.6)]])
    block = torch.tensor([[6, MASK, MASK, MASK, MASK]])
    after, _, _ = run_step("fixed_steps", logits, block, {"steps": 2, "remasking": "sequential", "schedule": "block"})
    assert filled(block, after) == [[1, 2, 3]]


def test_low_confidence_remasking_fills_the_most_confident():
    logits = logits_of([[(1, 0.5), (2, 0.9), (3, 0.3), (4, 0.8), (5, 0.6)]])
    block = torch.full((1, 5), MASK)
    after, done, _ = run_step("fixed_steps", logits, block, {"steps": 3})
    assert filled(block, after) == [[1, 3]]  # quota 2: the two most confident
    assert done.tolist() == [False]


def test_random_remasking_is_seeded_and_respects_the_quota():
    logits = logits_of([[(1, 0.5), (2, 0.9), (3, 0.3), (4, 0.8), (5, 0.6), (6, 0.7)]])
    block = torch.full((1, 6), MASK)
    choices = set()
    for seed in range(8):
        overrides = {"steps": 3, "remasking": "random", "seed": seed}
        first, _, _ = run_step("fixed_steps", logits, block, overrides)
        again, _, _ = run_step("fixed_steps", logits, block, overrides)
        assert torch.equal(first, again)
        assert len(filled(block, first)[0]) == 2
        choices.add(tuple(filled(block, first)[0]))
    assert len(choices) > 1


def test_rows_follow_their_own_schedule():
    algorithm = get_algorithm("fixed_steps")
    params = [algorithm.make_params({"steps": 2}), algorithm.make_params({"steps": 4})]
    states = [algorithm.init_state(p, 0) for p in params]
    logits = logits_of([[(i, 0.5 + 0.05 * i) for i in range(4)]] * 2)
    block = torch.full((2, 4), MASK)
    algorithm.step(logits, block, MASK, params, states)
    assert (block != MASK).sum(-1).tolist() == [2, 1]
