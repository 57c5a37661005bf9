"""The shared proposals: greedy, categorical (temperature/top-k/top-p), Gumbel-max, noise."""

import pytest
import torch
from algo_helpers import MASK

from algorithms import get_algorithm
from algorithms.sampling import RowNoise, argmax_last, categorical, greedy, greedy_tokens, gumbel, uniform_rows

PROBS = [0.5, 0.3, 0.2, 0.0]  # token 3 impossible
DRAWS = 4000


def repeated(probs, length=DRAWS):
    """``[1, length, V]`` logits with the same distribution at every position."""
    logits = torch.tensor(probs).clamp(min=1e-12).log()
    return logits.expand(1, length, len(probs)).clone()


def params(name="low_confidence", **overrides):
    return get_algorithm(name).make_params(overrides)


def frequencies(tokens, vocab):
    return (torch.bincount(tokens.flatten(), minlength=vocab).float() / tokens.numel()).tolist()


def test_greedy_skips_the_mask_id_and_breaks_ties_low():
    logits = torch.tensor([[[0.0, 2.0, 2.0, 1.0, 0.0, 0.0, 0.0, 5.0]]])
    assert greedy_tokens(logits, MASK).tolist() == [[1]]
    assert greedy_tokens(logits, 2).tolist() == [[7]]
    logits[0, 0, MASK] = float("inf")  # an overflowing mask logit is still never proposed
    assert greedy_tokens(logits, MASK).tolist() == [[1]]


def test_greedy_confidence_is_the_softmax_probability():
    logits = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    tokens, confidence = greedy(logits, MASK)
    expected = logits.softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(confidence, expected)


def test_categorical_at_temperature_zero_is_greedy():
    logits = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))
    proposal = categorical(logits, MASK, [params()] * 3, [None] * 3)
    assert all(torch.equal(a, b) for a, b in zip(proposal, greedy(logits, MASK)))


def test_categorical_samples_the_tempered_distribution():
    p = params(temperature=1.0, seed=0)
    tokens, confidence = categorical(repeated(PROBS), 3, [p], [RowNoise.for_block(0, 0)])
    for got, want in zip(frequencies(tokens, 4), PROBS):
        assert got == pytest.approx(want, abs=0.03)
    torch.testing.assert_close(confidence, torch.tensor(PROBS)[tokens])


def test_categorical_temperature_sharpens():
    p = params(temperature=0.5, seed=0)
    tokens, _ = categorical(repeated(PROBS), 3, [p], [RowNoise.for_block(0, 0)])
    sharpened = [q**2 / sum(r**2 for r in PROBS) for q in PROBS]
    for got, want in zip(frequencies(tokens, 4), sharpened):
        assert got == pytest.approx(want, abs=0.03)


@pytest.mark.parametrize(
    ("filters", "allowed"),
    [({"top_k": 1}, {0}), ({"top_k": 2}, {0, 1}), ({"top_p": 0.4}, {0}), ({"top_p": 0.6}, {0, 1}),
     ({"top_p": 0}, {0}), ({"top_k": -1}, {0, 1, 2})],
)
def test_top_k_and_top_p_restrict_the_draw(filters, allowed):
    p = params(temperature=1.0, seed=0, **filters)
    tokens, confidence = categorical(repeated(PROBS), 3, [p], [RowNoise.for_block(0, 0)])
    assert set(tokens.flatten().tolist()) == allowed
    renormalized = torch.tensor(PROBS) / sum(PROBS[t] for t in allowed)
    torch.testing.assert_close(confidence, renormalized[tokens])


def test_sampling_never_proposes_the_mask_id():
    p = params(temperature=2.0, seed=0)
    tokens, _ = categorical(repeated([0.9, 0.05, 0.05, 0.0]), 0, [p], [RowNoise.for_block(0, 0)])
    assert 0 not in tokens.flatten().tolist()
    g = params("fast_dllm_threshold", temperature=2.0, seed=0)
    tokens, _ = gumbel(repeated([0.9, 0.05, 0.05, 0.0]), 0, [g], [RowNoise.for_block(0, 0)])
    assert 0 not in tokens.flatten().tolist()


def test_gumbel_at_temperature_zero_is_greedy():
    logits = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    proposal = gumbel(logits, MASK, [params("fixed_steps")] * 2, [None] * 2)
    assert all(torch.equal(a, b) for a, b in zip(proposal, greedy(logits, MASK)))


def test_gumbel_samples_softmax_over_temperature_with_untempered_confidence():
    p = params("fast_dllm_threshold", temperature=0.5, seed=0)
    tokens, confidence = gumbel(repeated(PROBS), 3, [p], [RowNoise.for_block(0, 0)])
    sharpened = [q**2 / sum(r**2 for r in PROBS) for q in PROBS]
    for got, want in zip(frequencies(tokens, 4), sharpened):
        assert got == pytest.approx(want, abs=0.03)
    torch.testing.assert_close(confidence, torch.tensor(PROBS)[tokens])


def test_row_noise_is_a_function_of_seed_and_block():
    draw = lambda noise: noise.uniform((6,), torch.device("cpu"), torch.float64)  # noqa: E731
    assert torch.equal(draw(RowNoise.for_block(7, 2)), draw(RowNoise.for_block(7, 2)))
    assert not torch.equal(draw(RowNoise.for_block(7, 2)), draw(RowNoise.for_block(7, 3)))
    assert not torch.equal(draw(RowNoise.for_block(7, 2)), draw(RowNoise.for_block(8, 2)))
    assert not torch.equal(draw(RowNoise.for_block(None, 2)), draw(RowNoise.for_block(None, 2)))


def test_rows_that_sample_need_state():
    with pytest.raises(ValueError, match="init_state"):
        uniform_rows([None], [0], (3,), torch.device("cpu"), torch.float32)


def test_unseeded_sampling_still_gives_valid_tokens():
    algorithm = get_algorithm("low_confidence")
    p = algorithm.make_params({"temperature": 1.0})
    block = torch.full((1, 4), MASK)
    logits = torch.randn(1, 4, 8)
    algorithm.step(logits, block, MASK, [p], [algorithm.init_state(p, 0)])
    assert (block != MASK).sum() >= 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.bfloat16])
def test_argmax_last_is_torchs_argmax_with_ties_nan_and_infinities(dtype):
    """numpy's argmax on the CPU (torch's for bfloat16) gives torch's indices: ties to the
    lowest, a NaN as the maximum, rows of -inf to 0."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        shape = tuple(torch.randint(1, 12, (2,), generator=generator).tolist()) + (
            int(torch.randint(2, 90, (1,), generator=generator)),)
        scores = torch.randint(-2, 3, shape, generator=generator).to(dtype)  # many ties
        special = torch.rand(shape, generator=generator)
        scores[special < 0.05] = float("nan")
        scores[(special > 0.6) & (special < 0.8)] = float("-inf")
        scores[special > 0.97] = float("inf")
        scores[0, 0] = float("-inf")
        assert torch.equal(argmax_last(scores), scores.argmax(-1))
