"""Property tests of every rule over random logits, blocks, parameters and batch sizes.

``drive`` runs rows to completion the way the engine does (FDFO: each step only the rows
not yet done, with their carried state) and checks the step invariants on every step.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo_helpers import step_done
from algorithms import available_algorithms, get_algorithm

EDITING = {"joint_threshold"}

SAMPLING = {
    "temperature": st.sampled_from([0.0, 0.0, 0.7, 1.5]),
    "seed": st.integers(0, 2**40),
}
FILTERS = {"top_k": st.sampled_from([0, 1, 3]), "top_p": st.sampled_from([0.3, 0.9, 1.0])}
THRESHOLD = st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0])
RULE_PARAMS = {
    "low_confidence": {"threshold": THRESHOLD, **FILTERS},
    "joint_threshold": {
        "threshold": THRESHOLD,
        "edit_threshold": st.sampled_from([0.0, 0.0, 0.4]),
        "max_post_edit_steps": st.integers(0, 3),
        "penalty_lambda": st.sampled_from([0.0, 1.5]),
        **FILTERS,
    },
    "fast_dllm_threshold": {"threshold": THRESHOLD},
    "fast_dllm_factor": {"factor": st.sampled_from([0.1, 1.0, 3.0])},
    "fixed_steps": {
        "steps": st.integers(1, 10),
        "remasking": st.sampled_from(["low_confidence", "random", "sequential"]),
        "schedule": st.sampled_from(["masks", "block"]),
        "threshold": st.sampled_from([1.0, 1.0, 0.5, 0.0]),
    },
    "dream": {
        "steps": st.integers(1, 10),
        "alg": st.sampled_from(["entropy", "maskgit_plus", "topk_margin", "origin"]),
        "alg_temp": st.sampled_from([0.0, 0.0, 0.5]),
        **FILTERS,
    },
    # the front block of a pipelined request (complete: it fills one position a step at least)
    "d2f": {"skip_threshold": THRESHOLD, "block_add_threshold": THRESHOLD, "decoded_token_threshold": THRESHOLD,
            **FILTERS},
}


@dataclasses.dataclass
class Case:
    name: str
    params: list
    block: torch.Tensor  # [B, L], the block at its first step
    mask_id: int
    vocab: int
    logits_seed: int
    scale: float  # small: flat distributions (fallbacks); large: confident ones
    block_index: int

    def logits(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.logits_seed + step)
        return torch.randn(*self.block.shape, self.vocab, generator=generator) * self.scale


@st.composite
def cases(draw, temperature=None):
    name = draw(st.sampled_from(available_algorithms()))
    algorithm = get_algorithm(name)
    batch, length = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    vocab = draw(st.integers(3, 10))
    sampling = dict(SAMPLING)
    if temperature is not None:
        sampling["temperature"] = st.just(temperature)
    strategy = st.fixed_dictionaries({**sampling, **RULE_PARAMS[name]})
    params = [algorithm.make_params(draw(strategy)) for _ in range(batch)]
    mask_id = draw(st.integers(0, vocab - 1))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    tokens = torch.randint(0, vocab - 1, (batch, length), generator=generator)
    tokens += tokens >= mask_id  # never the mask id
    mask_share = draw(st.sampled_from([0.0, 0.5, 1.0, 1.0]))
    masked = torch.rand(batch, length, generator=generator) < mask_share
    block = torch.where(masked, mask_id, tokens)
    return Case(
        name=name,
        params=params,
        block=block,
        mask_id=mask_id,
        vocab=vocab,
        logits_seed=draw(st.integers(0, 2**31)),
        scale=draw(st.sampled_from([0.3, 3.0, 12.0])),
        block_index=draw(st.integers(0, 5)),
    )


def drive(case: Case, rows: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Run ``rows`` of ``case`` until done; return their final blocks and forwards per row."""
    algorithm = get_algorithm(case.name)
    params = [case.params[r] for r in rows]
    states = [algorithm.init_state(p, case.block_index) for p in params]
    block = case.block[rows].clone()
    generated = block == case.mask_id  # what this block may edit
    forwards = [0] * len(rows)
    active = list(range(len(rows)))
    bound = max(algorithm.max_steps_per_block(p, block.shape[1]) for p in params)
    for step in range(bound):
        logits = case.logits(step)[rows][active]
        before = block[active]
        after = before.clone()
        active_states = [states[i] for i in active]
        done = step_done(algorithm, logits, after, case.mask_id, [params[i] for i in active], active_states)
        for i, state in zip(active, active_states):
            states[i] = state
        check_step(case.name, before, after, done, case.mask_id, generated[active])
        block[active] = after
        for i in active:
            forwards[i] += 1
        active = [i for i, d in zip(active, done.tolist()) if not d]
        if not active:
            break
    assert not active, f"rows {active} not done after max_steps_per_block"
    for i, p in enumerate(params):
        assert forwards[i] <= algorithm.max_steps_per_block(p, block.shape[1])
    return block, forwards


def check_step(name, before, after, done, mask_id, generated):
    fills_every_step = get_algorithm(name).fills_every_step
    masked = before == mask_id
    has_mask = masked.any(-1)
    # Nothing writes the mask id; masks only ever get filled.
    assert not ((after == mask_id) & ~masked).any()
    # Every row with masks makes progress (or its schedule bounds its forwards).
    assert ((masked & (after != mask_id)).any(-1) | ~has_mask).all() or not fills_every_step
    # Filled positions keep their token, except edits of generated positions by editing rules.
    changed = ~masked & (after != before)
    allowed = generated if name in EDITING else torch.zeros_like(generated)
    assert not (changed & ~allowed).any()
    # Done rows are untouched; done needs a forward that saw no mask.
    assert torch.equal(after[done], before[done])
    assert not (done & has_mask).any()
    if name not in EDITING:
        assert torch.equal(done, ~has_mask)


PROPERTY = settings(deadline=None, max_examples=60)


@PROPERTY
@given(cases())
def test_invariants_hold_until_done_within_max_steps(case):
    drive(case, list(range(len(case.params))))


@PROPERTY
@given(cases())
def test_a_row_alone_or_in_a_batch_gets_the_same_tokens(case):
    rows = list(range(len(case.params)))
    together, forwards = drive(case, rows)
    for r in rows:
        alone, alone_forwards = drive(case, [r])
        assert torch.equal(alone[0], together[r])
        assert alone_forwards == [forwards[r]]


@PROPERTY
@given(cases(temperature=1.0))
def test_seeded_sampling_is_reproducible(case):
    rows = list(range(len(case.params)))
    first, first_forwards = drive(case, rows)
    again, again_forwards = drive(case, rows)
    assert torch.equal(first, again)
    assert first_forwards == again_forwards
