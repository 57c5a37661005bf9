"""The confidence rules' host path (numpy, for greedy batches of CPU logits) writes exactly
the tokens their tensor ops write, ties, a predicted mask id and NaN logits included."""

import numpy as np
import pytest
import torch
from algo_helpers import MASK, VOCAB

import algorithms.confidence_rule as confidence_rule
from algorithms import get_algorithm
from algorithms.sampling import greedy, greedy_on_host

HOST_RULES = ("low_confidence", "fast_dllm_threshold")


def hard_logits(seed: int, rows: int = 6, length: int = 8) -> torch.Tensor:
    """Logits full of ties (a few values only), some positions predicting the mask id, one NaN."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (rows, length, VOCAB), generator=generator).float()
    logits[0, 0, MASK] = 5.0  # the mask id is the argmax: the best other id wins
    logits[1, 1, :] = 1.0  # a position where every id ties
    logits[2, 2, 4] = float("nan")
    return logits


def hard_block(seed: int, rows: int = 6, length: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 1)
    block = torch.where(torch.rand(rows, length, generator=generator) < 0.6, MASK,
                        torch.randint(0, MASK, (rows, length), generator=generator))
    block[3] = MASK  # all masked
    block[4] = 1  # none masked
    return block


def step_both_ways(name: str, logits: torch.Tensor, block: torch.Tensor, thresholds: list[float],
                   monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    algorithm = get_algorithm(name)
    params = [algorithm.make_params({"threshold": t}) for t in thresholds]
    on_host = block.clone()
    assert algorithm.step(logits, on_host, MASK, params, [None] * len(params)) == (None, None)  # done where fed unmasked
    with monkeypatch.context() as patch:
        patch.setattr(confidence_rule, "on_host", lambda scores: False)
        with_tensors = block.clone()
        algorithm.step(logits, with_tensors, MASK, params, [None] * len(params))
    return on_host, with_tensors


@pytest.mark.parametrize("name", HOST_RULES)
@pytest.mark.parametrize("seed", range(4))
def test_the_host_path_writes_what_the_tensor_ops_write(name, seed, monkeypatch):
    logits, block = hard_logits(seed), hard_block(seed)
    thresholds = [0.0, 0.1, 0.3, 0.5, 0.9, 1.0]
    on_host, with_tensors = step_both_ways(name, logits, block, thresholds, monkeypatch)
    assert torch.equal(on_host, with_tensors)
    assert not torch.equal(on_host, block)  # the case steps: it fills something
    assert not (on_host[~(block == MASK)] != block[~(block == MASK)]).any()  # never a filled position


@pytest.mark.parametrize("name", HOST_RULES)
def test_a_confidence_equal_to_the_threshold_is_decided_alike(name, monkeypatch):
    logits = torch.tensor([[[2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 3])
    exact = torch.softmax(logits[0, 0], -1)[0].item()
    block = torch.full((1, 3), MASK)
    on_host, with_tensors = step_both_ways(name, logits, block, [exact], monkeypatch)
    assert torch.equal(on_host, with_tensors)
    # inclusive: every position (all at the threshold); strict: none passes, the first is the best
    assert on_host.tolist() == ([[0, 0, 0]] if name == "fast_dllm_threshold" else [[0, MASK, MASK]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_greedy_on_host_gives_greedy_values(dtype):
    logits = hard_logits(7).to(dtype)
    tokens, confidence = greedy_on_host(logits, MASK)
    expected = greedy(logits, MASK)
    assert tokens.tolist() == expected.tokens.tolist()
    assert np.array_equal(confidence, expected.confidence.numpy(), equal_nan=True)
    assert MASK not in tokens


def test_a_sampling_row_takes_the_tensor_path(monkeypatch):
    """The host path is greedy only: a batch with a sampling row steps with its tensor ops."""
    algorithm = get_algorithm("low_confidence")
    params = [algorithm.make_params({}), algorithm.make_params({"temperature": 1.0, "seed": 3})]
    states = [algorithm.init_state(p, 0) for p in params]
    monkeypatch.setattr(confidence_rule, "greedy_on_host", None)  # calling it would raise
    block = torch.full((2, 4), MASK)
    algorithm.step(torch.randn(2, 4, VOCAB), block, MASK, params, states)
    assert (block != MASK).any(-1).all()
