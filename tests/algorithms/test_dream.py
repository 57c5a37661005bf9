"""Dream's schedule and confidences (``algorithms.dream``)."""

import torch

from algo_helpers import step_done
from algorithms import get_algorithm

MASK = 9


def fills_per_step(length: int, steps: int) -> list[int]:
    algorithm = get_algorithm("dream")
    params = algorithm.make_params({"steps": steps, "alg": "maskgit_plus"})
    states = [algorithm.init_state(params, 0)]
    block = torch.full((1, length), MASK)
    logits = torch.randn(1, length, 10, generator=torch.Generator().manual_seed(0))
    fills = []
    while not step_done(algorithm, logits, block, MASK, [params], states).all():
        fills.append(int((block != MASK).sum()) - sum(fills))
    return fills


def test_the_schedule_is_dreams_time_grid():
    """int(m (1 - s/t)) on linspace(1, 1e-3, steps + 1), the rest at the last step: with as
    many steps as masks, the first step unmasks nothing (m (1 - s/t) = 0.999)."""
    assert fills_per_step(8, 8) == [0, 1, 1, 1, 1, 1, 1, 2]
    assert fills_per_step(8, 4) == [1, 2, 2, 3]
    assert fills_per_step(8, 1) == [8]


def test_each_confidence_picks_its_own_position():
    """Position 0 has the most likely token, position 1 the widest top-1/top-2 margin,
    position 2 the lowest entropy; one of three masks is unmasked (steps 2)."""
    probs = torch.full((3, 11), 1e-9)
    probs[0, :5] = torch.tensor([0.60, 0.10, 0.10, 0.10, 0.10])
    probs[1, 0], probs[1, 1:10] = 0.59, 0.41 / 9
    probs[2, :2] = 0.5
    logits = probs.log()[None]
    picked = {}
    for alg in ("maskgit_plus", "topk_margin", "entropy"):
        algorithm = get_algorithm("dream")
        params = algorithm.make_params({"steps": 2, "alg": alg})
        block = torch.full((1, 3), 10)
        algorithm.step(logits, block, 10, [params], [algorithm.init_state(params, 0)])
        picked[alg] = (block[0] != 10).nonzero().flatten().tolist()
    assert picked == {"maskgit_plus": [0], "topk_margin": [1], "entropy": [2]}
