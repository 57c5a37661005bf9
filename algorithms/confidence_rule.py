"""The shared skeleton of the stateless mask-to-token rules (LowConfidence, Fast-dLLM).

Each step: propose a token and a confidence for every position, choose among the masked
positions by confidence, write the chosen tokens. Nothing else is ever written, and a
block is done when the forward that produced the logits saw no mask in it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from .base import AlgorithmParams, DllmAlgorithm
from .sampling import Proposal, RowNoise
from .selection import masked_confidence


class ConfidenceRule(DllmAlgorithm):
    """Subclasses set ``propose`` (a function of ``sampling``) and implement ``choose``."""

    propose: ClassVar[Callable[..., Proposal]]

    def init_state(self, params: AlgorithmParams, block_index: int) -> RowNoise | None:
        return RowNoise.for_block(params.seed, block_index) if params.temperature > 0 else None

    def max_steps_per_block(self, params: AlgorithmParams, block_length: int) -> int:
        # At least one mask is filled per forward, plus the forward that sees none.
        return block_length + 1

    def step(
        self,
        logits: torch.Tensor,
        block: torch.Tensor,
        mask_id: int,
        params: Sequence[AlgorithmParams],
        states: Sequence[RowNoise | None],
    ) -> None:
        masked = block == mask_id
        tokens, confidence = self.propose(logits, mask_id, params, states)
        chosen = self.choose(masked_confidence(confidence, masked), params)
        torch.where(chosen, tokens, block, out=block)
        return None  # done: fed with no mask (nothing else is ever written)

    @abstractmethod
    def choose(self, confidence: torch.Tensor, params: Sequence[AlgorithmParams]) -> torch.Tensor:
        """Positions to fill, given confidences that are -inf outside the masked positions:
        only positions whose confidence is not -inf (so only masked ones), and at least one
        in every row that has such a position."""
