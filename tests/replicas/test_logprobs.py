"""Log-probabilities of committed tokens: the distribution of the step that wrote each one."""

import math

import pytest
import torch

from replicas.logprobs import TokenLogprob, step_logprobs
from replicas.messages import RequestError, SamplingParams


def test_a_steps_logprobs_are_those_of_the_positions_it_wrote():
    mask = 9
    logits = torch.log(torch.tensor([[[0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]]]))
    logits = torch.cat([logits, torch.full((1, 3, 7), -1e9)], dim=-1)  # a vocabulary of 10
    before = torch.tensor([[mask, 4, mask]])
    after = torch.tensor([[2, 4, mask]])  # position 0 unmasked as token 2; 1 was there; 2 still masked
    [[(position, first)]] = step_logprobs([2], logits, before, after, mask)
    assert position == 0
    assert first.logprob == pytest.approx(math.log(0.3), abs=1e-5)
    assert [t for t, _ in first.top] == [1, 2] and first.top[0][1] == pytest.approx(math.log(0.6), abs=1e-5)
    assert step_logprobs([0], logits, after, torch.tensor([[2, 4, 1]]), mask) == \
        [[(2, TokenLogprob(pytest.approx(math.log(0.2), abs=1e-5), ()))]]


def test_greedy_tokens_are_their_steps_most_likely(make_engine):
    engine = make_engine(max_batch=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=3,
                            algorithm="low_confidence", algorithm_params={"temperature": 0.0})
    asked, plain = engine.generate(["1.3. ..2.", "1.3. ..2."], [params, SamplingParams(
        max_tokens=40, ignore_eos=True, algorithm="low_confidence", algorithm_params={"temperature": 0.0})])
    assert asked.token_ids == plain.token_ids and plain.logprobs is None
    assert len(asked.logprobs) == len(asked.token_ids) == 40
    for token, record in zip(asked.token_ids, asked.logprobs):
        assert len(record.top) == 3 and record.top[0][0] == token  # greedy: the argmax of its step
        assert record.logprob == pytest.approx(record.top[0][1]) and record.logprob <= 0
        assert record.top[0][1] >= record.top[1][1] >= record.top[2][1]


def test_sampled_tokens_have_their_own_logprob_and_none_without_alternatives(make_engine):
    engine = make_engine(max_batch=2)
    [out] = engine.generate(["abc"], SamplingParams(max_tokens=16, ignore_eos=True, logprobs=0,
                                                   algorithm_params={"temperature": 1.0, "seed": 5}))
    assert len(out.logprobs) == 16 and all(r.top == () and r.logprob <= 0 for r in out.logprobs)


@pytest.mark.parametrize("k", [-1, 21])
def test_logprobs_are_bounded(k):
    with pytest.raises(RequestError, match="logprobs must be 0 to 20"):
        SamplingParams(logprobs=k)
