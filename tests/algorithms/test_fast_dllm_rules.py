"""Fast-dLLM threshold and factor rules: exact positions chosen."""

import pytest
import torch
from algo_helpers import MASK, filled, logits_of, run_step

from algorithms.sampling import token_probability


def test_threshold_fills_positions_at_or_above_threshold():
    logits = logits_of([[(1, 0.95), (2, 0.5), (3, 0.91), (4, 0.89)]])
    after, done, _ = run_step("fast_dllm_threshold", logits, torch.full((1, 4), MASK))
    assert after.tolist() == [[1, MASK, 3, MASK]]
    assert done.tolist() == [False]


def test_threshold_is_inclusive():
    logits = logits_of([[(1, 0.99), (2, 0.6)]])
    exact = token_probability(logits, torch.tensor([[1, 2]]))[0, 1].item()
    block = torch.full((1, 2), MASK)
    after, _, _ = run_step("fast_dllm_threshold", logits, block, {"threshold": exact})
    assert after.tolist() == [[1, 2]]


def test_threshold_fills_the_most_confident_when_none_passes():
    logits = logits_of([[(1, 0.4), (2, 0.6), (3, 0.5)]])
    after, _, _ = run_step("fast_dllm_threshold", logits, torch.full((1, 3), MASK))
    assert after.tolist() == [[MASK, 2, MASK]]


def test_threshold_done_when_no_mask_and_block_untouched():
    logits = logits_of([[(1, 0.99), (2, 0.99)]])
    after, done, _ = run_step("fast_dllm_threshold", logits, torch.tensor([[5, 6]]))
    assert done.tolist() == [True]
    assert after.tolist() == [[5, 6]]


# factor 1: bars 1 - 1/(j+1) for ranks j = 2, 3, 4, 5 are 0.667, 0.75, 0.8, 0.833.
@pytest.mark.parametrize(
    ("confidences", "factor", "expected"),
    [
        # sorted .95 .90 .79 .76 .70: ranks 2, 3 pass, rank 4 (.76 < .8) fails -> 3.
        ([0.95, 0.70, 0.76, 0.79, 0.90], 1.0, [0, 3, 4]),
        # every rank passes -> all.
        ([0.99, 0.98, 0.97, 0.96, 0.95], 1.0, [0, 1, 2, 3, 4]),
        # rank 2 fails (.6 < .667): only the first.
        ([0.6, 0.99, 0.5, 0.3], 1.0, [1]),
        # rank 3 fails (.6 < .75), rank 4 (.5 < .8) too: the first two.
        ([0.6, 0.99, 0.9, 0.5], 1.0, [1, 2]),
        # only the last rank fails: the prefix before it (the reference would fill all).
        ([0.99, 0.9, 0.5], 1.0, [0, 1]),
        # the first always passes, however low.
        ([0.2, 0.1], 1.0, [0]),
        # factor 2: bars 0.333, 0.5, 0.6 for ranks 2, 3, 4: .62 .55 .52 pass, .35 fails.
        ([0.52, 0.55, 0.35, 0.62], 2.0, [0, 1, 3]),
        # the same confidences under factor 1: rank 2 (.55 < .667) fails.
        ([0.52, 0.55, 0.35, 0.62], 1.0, [3]),
    ],
)
def test_factor_rule(confidences, factor, expected):
    logits = logits_of([[(t % (MASK - 1), c) for t, c in enumerate(confidences)]])
    block = torch.full((1, len(confidences)), MASK)
    after, _, _ = run_step("fast_dllm_factor", logits, block, {"factor": factor})
    assert filled(block, after) == [expected]


def test_factor_ranks_only_masked_positions():
    # The filled position 0 would rank first; ranks start at the best masked position.
    logits = logits_of([[(1, 0.99), (2, 0.9), (3, 0.7)]])
    block = torch.tensor([[5, MASK, MASK]])
    after, done, _ = run_step("fast_dllm_factor", logits, block)
    assert after.tolist() == [[5, 2, 3]]  # rank 2 is 0.7 >= 0.667
    assert done.tolist() == [False]
