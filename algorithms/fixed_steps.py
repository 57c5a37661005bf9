"""A fixed number of tokens per step: the reference samplers of LLaDA (ML-GSAI/LLaDA
``generate.py``), SDAR and LLaDA2.0.

The block's n positions are spread over ``steps`` steps as ``get_num_transfer_tokens``
does: n // steps each, one more in the first n % steps steps; n is the block's masks at
its first step (``schedule="masks"``, LLaDA) or the block length (``"block"``, SDAR and
LLaDA2.0, whose first block may start with the prompt's end). Each step fills that many
masked positions (at most those left), the most confident ones, or every one above
``threshold`` when they are more (SDAR's and LLaDA2.0's dynamic rule; 1 never fires).
Confidence is the token's softmax probability (``remasking="low_confidence"``), uniform
noise (``"random"``) or the position, leftmost first (``"sequential"``, SDAR); tokens are
LLaDA's Gumbel-max draw at ``temperature`` (argmax at 0).

LLaDA's ``steps`` counts steps over the whole answer (``steps // num_blocks`` per block);
here ``steps`` is per block. The default 32 is LLaDA's own example (128 steps, 128 tokens,
blocks of 32): one token per step for blocks of up to 32 tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .base import AlgorithmError, AlgorithmParams, AlgorithmStep, DllmAlgorithm, check_number, register, short_repr
from .sampling import RowNoise, gumbel_tokens, token_probability, uniform_rows
from .selection import masked_confidence, per_row, top_n

REMASKING = ("low_confidence", "random", "sequential")
SCHEDULES = ("masks", "block")
MAX_STEPS = 4096  # per block; more steps than a block has masks fill one token per step anyway


@dataclasses.dataclass(frozen=True)
class FixedStepsParams(AlgorithmParams):
    steps: int = 32
    remasking: str = "low_confidence"
    schedule: str = "masks"
    threshold: float = 1.0

    def validate(self) -> None:
        super().validate()
        check_number("steps", self.steps, minimum=1, maximum=MAX_STEPS, integer=True)
        check_number("threshold", self.threshold, minimum=0, maximum=1)
        for name, allowed in (("remasking", REMASKING), ("schedule", SCHEDULES)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise AlgorithmError(f"{name} must be one of {allowed}, got {short_repr(value)}", param=name)


class FixedStepsState(NamedTuple):
    noise: RowNoise | None
    initial_masks: int | None = None  # masks in the block at its first step
    steps_taken: int = 0


@register
class FixedSteps(DllmAlgorithm):
    name = "fixed_steps"
    params_class = FixedStepsParams

    def init_state(self, params: FixedStepsParams, block_index: int) -> FixedStepsState:
        return FixedStepsState(RowNoise.for_block(params.seed, block_index) if self.draws_noise(params) else None)

    def draws_noise(self, params: FixedStepsParams) -> bool:
        return params.temperature > 0 or params.remasking == "random"

    def max_steps_per_block(self, params: FixedStepsParams, block_length: int) -> int:
        # A block with m masks takes min(steps, m) filling forwards, plus the one that sees none.
        return min(params.steps, block_length) + 1

    def step(
        self,
        logits: torch.Tensor,
        block: torch.Tensor,
        mask_id: int,
        params: Sequence[FixedStepsParams],
        states: Sequence[FixedStepsState],
    ) -> AlgorithmStep:
        device = block.device
        masked = block == mask_id
        remaining = masked.sum(-1)
        states = _counted(remaining, block.shape[1], params, states)
        quota = _quota(remaining, params, states)

        noise = [state.noise for state in states]
        tokens = gumbel_tokens(logits, mask_id, params, noise)
        confidence = token_probability(logits, tokens)
        random_rows = [row for row, p in enumerate(params) if p.remasking == "random"]
        if random_rows:
            shape = (block.shape[1],)
            confidence[random_rows] = uniform_rows(noise, random_rows, shape, device, torch.float32)
        sequential_rows = [row for row, p in enumerate(params) if p.remasking == "sequential"]
        if sequential_rows:
            confidence[sequential_rows] = -torch.arange(block.shape[1], device=device, dtype=confidence.dtype)

        confidence = masked_confidence(confidence, masked)
        chosen = top_n(confidence, quota)
        if any(p.threshold < 1 for p in params):  # every mask above it, when they outnumber the quota
            above = confidence > per_row(params, "threshold", device, confidence.dtype)[:, None]
            chosen = torch.where((above.sum(-1) >= quota)[:, None], above, chosen)
        block.copy_(torch.where(chosen, tokens, block))
        return AlgorithmStep(remaining == 0, [state._replace(steps_taken=state.steps_taken + 1) for state in states])


def _counted(remaining: torch.Tensor, block_length: int, params: Sequence[FixedStepsParams],
             states: Sequence[FixedStepsState]) -> list[FixedStepsState]:
    """The states with the masks each row's schedule counts from, set at its block's first step."""
    return [state if state.initial_masks is not None else
            state._replace(initial_masks=count if p.schedule == "masks" else block_length)
            for state, p, count in zip(states, params, remaining.tolist())]


def _quota(remaining: torch.Tensor, params: Sequence[FixedStepsParams],
           states: Sequence[FixedStepsState]) -> torch.Tensor:
    """Tokens to fill this step per row, from LLaDA's schedule.

    Never 0 while masks remain (should the block hold more masks than the schedule expects).
    """
    device = remaining.device
    initial = per_row(states, "initial_masks", device, torch.long)
    taken = per_row(states, "steps_taken", device, torch.long)
    steps = per_row(params, "steps", device, torch.long)
    scheduled = initial // steps + (taken < initial % steps)
    return scheduled.clamp(min=1).minimum(remaining)
