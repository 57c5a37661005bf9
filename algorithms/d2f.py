"""D2F's pipelined decoding (Discrete Diffusion Forcing; zhijie-group/Discrete-Diffusion-Forcing,
``D2F-eval/eval_llada.py``, ``_generate_block_single``).

A request decodes several blocks at once: a new block joins its active blocks once the
last one has ``block_add_threshold`` of its positions decoded (one new block a step), and
a block is *complete* (fully activated) once the block before it has
``decoded_token_threshold`` decoded. Each step, every active block fills each masked
position whose confidence is above ``skip_threshold``; a complete block where none is
fills its single most confident one, an incomplete one may fill none. Blocks are
block-causal (a block sees the prompt, the blocks before it and itself), so a later block
never changes an earlier one's logits; the engine commits them in order
(``replicas.block_pipeline`` adds blocks and sets the complete flags; this rule decides one
block's positions).

Tokens: greedy (temperature 0: the argmax, its probability the confidence), or drawn from
the tempered, top-k/top-p filtered distribution (the confidence the drawn token's
probability in it), as the published code samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import torch

from .base import UNCHANGED, AlgorithmStep, DllmAlgorithm, check_number, register
from .sampling import RowNoise, TopKTopPParams, categorical
from .selection import masked_confidence, per_row


@dataclasses.dataclass(frozen=True)
class D2FParams(TopKTopPParams):
    """Defaults: the published evaluation's LLaDA-8B-Instruct settings (``eval_llada.sh``:
    decoded 0.95, skip 0.9; its block_add_threshold is 0.1 to 0.9 by task, the class default 0.5)."""

    block_add_threshold: float = 0.5
    decoded_token_threshold: float = 0.95
    skip_threshold: float = 0.9

    def validate(self) -> None:
        super().validate()
        for name in ("block_add_threshold", "decoded_token_threshold", "skip_threshold"):
            check_number(name, getattr(self, name), minimum=0, maximum=1)


@dataclasses.dataclass(frozen=True)
class D2FBlockState:
    # the block before it is committed, or decoded past decoded_token_threshold (sticky); a
    # block starts complete (the front one), one joining behind another as the engine says
    complete: bool = True
    noise: RowNoise | None = None


@register
class D2F(DllmAlgorithm):
    name = "d2f"
    params_class = D2FParams
    fills_every_step = False  # an incomplete block may wait for the block before it
    pipelined: ClassVar[bool] = True

    def init_state(self, params: D2FParams, block_index: int) -> D2FBlockState:
        return D2FBlockState(noise=RowNoise.for_block(params.seed, block_index) if self.draws_noise(params) else None)

    def max_steps_per_block(self, params: D2FParams, block_length: int) -> int:
        return block_length + 1  # once complete (always, at the front), at least one position a step

    def adds_block(self, params: D2FParams, last_decoded: float) -> bool:
        """Whether a block joins after the last one, ``last_decoded`` of it decoded."""
        return last_decoded >= params.block_add_threshold

    def completes_next(self, params: D2FParams, decoded: float) -> bool:
        """Whether the block after one ``decoded`` this far is complete."""
        return decoded >= params.decoded_token_threshold

    def step(self, logits: torch.Tensor, block: torch.Tensor, mask_id: int, params: Sequence[D2FParams],
             states: Sequence[D2FBlockState]) -> AlgorithmStep:
        tokens, confidence = categorical(logits, mask_id, params, [state.noise for state in states])
        confidence = masked_confidence(confidence, block == mask_id)
        chosen = confidence > per_row(params, "skip_threshold", confidence.device)[:, None]
        best = confidence.max(-1, keepdim=True)
        complete = torch.tensor([state.complete for state in states], device=confidence.device)
        forced = complete[:, None] & ~chosen.any(-1, keepdim=True) & (best.values != float("-inf"))
        chosen.scatter_(-1, best.indices, chosen.gather(-1, best.indices) | forced)
        torch.where(chosen, tokens, block, out=block)
        return UNCHANGED
