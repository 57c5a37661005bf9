"""The zero-overhead closed-batch model that `bench engine` compares the engine with."""

import pytest

from tools.bench.closed_batch_model import ClosedRequest, closed_batch_seconds
from replicas.messages import SamplingParams

C0, C1 = 1.0, 0.5  # a forward of n tokens costs 1 + 0.5 n
L = 2  # block length


def requests(*specs):
    return [ClosedRequest(prompt, steps) for prompt, steps in specs]


@pytest.mark.parametrize("mode,specs,max_batch,expected", [
    # one row at a time; the second block's first forward also writes the first block
    ("fdfo", [(0, [2, 1]), (0, [3])], 1, 6 * C0 + (2 + 2 + 4 + 2 + 2 + 2) * C1),
    # the prompt is computed with the request's first forward
    ("fdfo", [(5, [1]), (3, [2])], 1, 3 * C0 + (7 + 5 + 2) * C1),
    # fdfo: each row moves on the step after its block is done, writing it then
    ("fdfo", [(0, [1, 3]), (0, [2, 2])], 2, 4 * C0 + (4 + 6 + 6 + 4) * C1),
    # sync: a round lasts its slowest block; A writes its block with its idle unit at
    # step 2, B (done at the round's last step) with its next block's first forward
    ("sync", [(0, [1, 3]), (0, [2, 2])], 2, 5 * C0 + (4 + 4 + 6 + 4 + 4) * C1),
    # static keeps the finished row in the forward until its batch is done, then C alone
    ("static", [(0, [1]), (0, [3]), (0, [1])], 2, 4 * C0 + (4 + 4 + 4 + 2) * C1),
    # fdfo: C takes A's row at step 2; B finishes alone at step 3
    ("fdfo", [(0, [1]), (0, [3]), (0, [1])], 2, 3 * C0 + (4 + 4 + 2) * C1),
])
def test_closed_batch_seconds_by_hand(mode, specs, max_batch, expected):
    assert closed_batch_seconds(mode, max_batch, requests(*specs), L, C0, C1) == pytest.approx(expected)


@pytest.mark.parametrize("steps", [[1, 0], []])
def test_a_request_without_a_block_or_a_block_without_steps_is_refused(steps):
    with pytest.raises(ValueError, match="at least one step"):
        closed_batch_seconds("fdfo", 2, requests((0, steps)), L, C0, C1)


@pytest.mark.parametrize("mode", ["fdfo", "sync", "static"])
def test_the_model_counts_the_engines_forwards_and_tokens(make_engine, mode):
    """With c0 = 1 and c1 = 0 the model's seconds are its forwards, with c0 = 0 and c1 = 1
    its tokens: the engine's own counts for the same prompts and steps per block (blocks
    of 1 step, threshold 0, and of 16, the untrained model filling one position a step),
    fdfo without holds for arrivals."""
    engine = make_engine(max_batch=3, mode=mode, fdfo_fill_hold=False)
    params = [SamplingParams(max_tokens=16 * blocks, ignore_eos=True, algorithm="fast_dllm_threshold",
                             algorithm_params={"threshold": threshold})
              for blocks, threshold in ((3, 0.9), (1, 0.0), (2, 0.0), (2, 0.9), (4, 0.0))]
    prompts = [[5 + i] * (3 + 7 * i) for i in range(len(params))]
    steps = []
    outputs = engine.generate(prompts, params, on_step=steps.append)
    assert {n for o in outputs for n in o.block_steps} == {1, 16}
    closed = [ClosedRequest(len(p), o.block_steps) for p, o in zip(prompts, outputs)]
    assert closed_batch_seconds(mode, 3, closed, 16, 1.0, 0.0) == len(steps)
    assert closed_batch_seconds(mode, 3, closed, 16, 0.0, 1.0) == sum(s.num_tokens for s in steps)
