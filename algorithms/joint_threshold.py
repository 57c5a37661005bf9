"""SGLang's JointThreshold rule, the LLaDA2.0 decoder with post-fill editing
(``python/sglang/srt/dllm/algorithm/joint_threshold.py``).

Defaults: threshold 0.5, edit_threshold 0, max_post_edit_steps 16, penalty_lambda 0.
Each step, on logits with an optional 2-gram penalty (subtract ``penalty_lambda`` from the
logit, at position i, of the token at i - 1):

* mask to token: as LowConfidence with ``threshold`` (strictly above, else the single most
  confident masked position); tokens argmax or sampled (temperature, top-k, top-p);
* token to token: every generated position (filled during this block, not already filled
  when the block started) whose argmax differs from its token and has probability above
  ``edit_threshold`` takes the argmax (edits are greedy, as in SGLang).

A forward that sees no mask counts one post-edit step. The block is done when the forward
saw no mask and either no edit is proposed or this is post-edit step
``max_post_edit_steps + 1`` (the budget is spent: no more edits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .base import AlgorithmStep, DllmAlgorithm, check_number, register
from .sampling import RowNoise, TopKTopPParams, categorical, greedy
from .selection import above_or_best, masked_confidence, per_row


MAX_POST_EDIT_STEPS = 256  # SGLang's default is 16; each one can cost a forward of the block
MAX_PENALTY_LAMBDA = 1000.0  # in logits: far past a ban of the repeated token already


@dataclasses.dataclass(frozen=True)
class JointThresholdParams(TopKTopPParams):
    threshold: float = 0.5
    edit_threshold: float = 0.0
    max_post_edit_steps: int = 16
    penalty_lambda: float = 0.0

    def validate(self) -> None:
        super().validate()
        check_number("threshold", self.threshold, minimum=0, maximum=1)
        check_number("edit_threshold", self.edit_threshold, minimum=0, maximum=1)
        check_number("max_post_edit_steps", self.max_post_edit_steps, minimum=0,
                     maximum=MAX_POST_EDIT_STEPS, integer=True)
        check_number("penalty_lambda", self.penalty_lambda, minimum=0, maximum=MAX_PENALTY_LAMBDA)


class JointThresholdState(NamedTuple):
    noise: RowNoise | None
    post_edit_steps: int = 0
    # Positions already filled at the block's first step: not generated here, never edited.
    fixed: torch.Tensor | None = None


@register
class JointThreshold(DllmAlgorithm):
    name = "joint_threshold"
    params_class = JointThresholdParams
    final_when_filled = False  # the forwards after the last fill may edit

    def init_state(self, params: JointThresholdParams, block_index: int) -> JointThresholdState:
        return JointThresholdState(RowNoise.for_block(params.seed, block_index) if self.draws_noise(params) else None)

    def max_steps_per_block(self, params: JointThresholdParams, block_length: int) -> int:
        return block_length + params.max_post_edit_steps + 1

    def step(
        self,
        logits: torch.Tensor,
        block: torch.Tensor,
        mask_id: int,
        params: Sequence[JointThresholdParams],
        states: Sequence[JointThresholdState],
    ) -> AlgorithmStep:
        device = block.device
        masked = block == mask_id
        has_mask = masked.any(-1)
        fixed = [~masked[row] if state.fixed is None else state.fixed for row, state in enumerate(states)]

        post_edit_steps = per_row(states, "post_edit_steps", device, torch.long) + ~has_mask
        states = [state._replace(post_edit_steps=count, fixed=row_fixed)
                  for state, count, row_fixed in zip(states, post_edit_steps.tolist(), fixed)]
        fixed = torch.stack(fixed)
        spent = post_edit_steps > per_row(params, "max_post_edit_steps", device, torch.long)

        scores = _penalize_repeats(logits, block, params)
        best = greedy(scores, mask_id)
        tokens, confidence = categorical(scores, mask_id, params, [s.noise for s in states], best)
        confidence = masked_confidence(confidence, masked)
        threshold = per_row(params, "threshold", device)
        fill = above_or_best(confidence, threshold)

        edit_threshold = per_row(params, "edit_threshold", device)
        edit = (
            ~masked
            & ~fixed
            & ~spent[:, None]
            & (best.tokens != block)
            & (best.confidence > edit_threshold[:, None])
        )
        block.copy_(torch.where(fill, tokens, torch.where(edit, best.tokens, block)))
        return AlgorithmStep(~has_mask & (spent | ~edit.any(-1)), states)


def _penalize_repeats(
    logits: torch.Tensor, block: torch.Tensor, params: Sequence[JointThresholdParams]
) -> torch.Tensor:
    """A copy of ``logits`` with the 2-gram penalty applied (``logits`` itself if all 0)."""
    if not any(p.penalty_lambda > 0 for p in params):
        return logits
    penalty = per_row(params, "penalty_lambda", logits.device, logits.dtype)
    previous = block[:, :-1].unsqueeze(-1)
    penalized = logits.clone()
    penalized[:, 1:].scatter_add_(-1, previous, -penalty[:, None, None].expand(previous.shape))
    return penalized
