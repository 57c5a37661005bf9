"""JointThreshold: mask-to-token, token-to-token edits, the post-edit budget, 2-gram penalty."""

import torch
from algo_helpers import MASK, logits_of, run_step

from algorithms import get_algorithm
from algorithms.sampling import token_probability


def test_mask_to_token_is_strictly_above_threshold_with_fallback():
    logits = logits_of([[(1, 0.9), (2, 0.6), (3, 0.3)], [(1, 0.4), (2, 0.45), (3, 0.3)]])
    exact = token_probability(logits, torch.tensor([[1, 2, 3]] * 2))[0, 1].item()
    block = torch.full((2, 3), MASK)
    after, done, _ = run_step("joint_threshold", logits, block, {"threshold": exact})
    assert after.tolist() == [[1, MASK, MASK], [MASK, 2, MASK]]
    assert done.tolist() == [False, False]


def test_edits_generated_tokens_then_done_when_no_edit_is_proposed():
    block = torch.full((1, 3), MASK)
    first = logits_of([[(1, 0.9), (2, 0.9), (3, 0.3)]])
    block, done, states = run_step("joint_threshold", first, block)
    assert block.tolist() == [[1, 2, MASK]] and not done.item()

    # Position 0 now prefers 4 (an edit), position 2 is filled by the fallback.
    second = logits_of([[(4, 0.6), (2, 0.9), (3, 0.3)]])
    block, done, states = run_step("joint_threshold", second, block, states=states)
    assert block.tolist() == [[4, 2, 3]] and not done.item()

    # The forward saw no mask and agrees with every token: done, nothing changes.
    third = logits_of([[(4, 0.9), (2, 0.9), (3, 0.9)]])
    block, done, states = run_step("joint_threshold", third, block, states=states)
    assert block.tolist() == [[4, 2, 3]] and done.item()


def test_positions_filled_before_the_block_started_are_never_edited():
    block = torch.tensor([[5, MASK]])
    logits = logits_of([[(1, 0.99), (2, 0.99)]])
    block, done, states = run_step("joint_threshold", logits, block)
    assert block.tolist() == [[5, 2]] and not done.item()
    block, done, _ = run_step("joint_threshold", logits, block, states=states)
    assert block.tolist() == [[5, 2]] and done.item()


def one_filled_token(overrides):
    """A one-token block filled with token 1 by a first step, and its states."""
    block = torch.full((1, 1), MASK)
    block, _, states = run_step("joint_threshold", logits_of([[(1, 0.9)]]), block, overrides)
    return block, states


def test_edit_needs_probability_above_edit_threshold():
    overrides = {"edit_threshold": 0.7}
    block, states = one_filled_token(overrides)
    block, done, _ = run_step("joint_threshold", logits_of([[(4, 0.6)]]), block, overrides, states)
    assert block.tolist() == [[1]] and done.item()

    block, states = one_filled_token(overrides)
    block, done, _ = run_step("joint_threshold", logits_of([[(4, 0.8)]]), block, overrides, states)
    assert block.tolist() == [[4]] and not done.item()


def run_flipping(max_post_edit_steps):
    """Fill a one-token block, then feed logits that always propose an edit; count forwards."""
    overrides = {"max_post_edit_steps": max_post_edit_steps}
    block, states = one_filled_token(overrides)
    forwards, edits, done = 1, 0, torch.tensor([False])
    while not done.item():
        proposal = 2 if block.item() == 1 else 1
        before = block.clone()
        logits = logits_of([[(proposal, 0.9)]])
        block, done, states = run_step("joint_threshold", logits, block, overrides, states)
        forwards += 1
        edits += int(not torch.equal(before, block))
    return forwards, edits, states[0].post_edit_steps


def test_post_edit_budget_ends_the_block():
    forwards, edits, post_edit_steps = run_flipping(2)
    assert (forwards, edits, post_edit_steps) == (4, 2, 3)
    algorithm = get_algorithm("joint_threshold")
    params = algorithm.make_params({"max_post_edit_steps": 2})
    assert forwards == algorithm.max_steps_per_block(params, 1)


def test_zero_budget_is_done_at_the_first_forward_without_masks():
    assert run_flipping(0) == (2, 0, 1)


def test_bigram_penalty_discourages_repeating_the_previous_token():
    # Position 1 prefers token 1 (0.6) over token 2 (0.3); token 1 is also at position 0.
    row = [[0.0] * 8, [0.0] * 8]
    row[0][1] = 1.0
    row[1][1], row[1][2], row[1][3] = 0.6, 0.3, 0.1
    logits = torch.tensor([row]).clamp(min=1e-6).log()
    untouched = logits.clone()
    block = torch.tensor([[1, MASK]])
    plain, _, _ = run_step("joint_threshold", logits, block)
    penalized, _, _ = run_step("joint_threshold", logits, block, {"penalty_lambda": 2.0})
    assert plain.tolist() == [[1, 1]]
    assert penalized.tolist() == [[1, 2]]
    assert torch.equal(logits, untouched)


def test_never_done_while_masks_remain():
    logits = logits_of([[(1, 0.99), (2, 0.99)]])
    _, done, _ = run_step("joint_threshold", logits, torch.tensor([[MASK, MASK]]))
    assert done.tolist() == [False]
