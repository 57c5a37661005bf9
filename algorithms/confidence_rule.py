"""The shared skeleton of the stateless mask-to-token rules (LowConfidence, Fast-dLLM).

Each step: propose a token and a confidence for every position, choose among the masked
positions by confidence, write the chosen tokens. Nothing else is ever written, and a
block is done when the forward that produced the logits saw no mask in it.

The threshold rules (``ThresholdRule``) step a greedy batch (no row samples) on CPU logits
in numpy: the same tokens as their tensor ops, with a fraction of their host cost (right
after a CPU forward, the step's tensor ops took ~220 us at batch 16).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import torch

from .base import UNCHANGED, AlgorithmParams, AlgorithmStep, DllmAlgorithm
from .sampling import Proposal, RowNoise, greedy_on_host, on_host
from .selection import above_or_best, above_or_best_on_host, masked_confidence, per_row, per_row_on_host


class ConfidenceRule(DllmAlgorithm):
    """Subclasses set ``propose`` (a function of ``sampling``) and implement ``choose``."""

    propose: ClassVar[Callable[..., Proposal]]
    # ``choose`` on numpy arrays, for a rule that has one (``ThresholdRule``)
    choose_on_host: ClassVar[Callable[..., np.ndarray] | None] = None

    def init_state(self, params: AlgorithmParams, block_index: int) -> RowNoise | None:
        return RowNoise.for_block(params.seed, block_index) if self.draws_noise(params) else None

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
    ) -> AlgorithmStep:
        if self.choose_on_host is not None and on_host(logits) and not any(p.temperature > 0 for p in params):
            tokens, confidence = greedy_on_host(logits, mask_id)
            fed = block.numpy()
            chosen = self.choose_on_host(np.where(fed == mask_id, confidence, -np.inf), params)
            np.copyto(fed, tokens, where=chosen)
            return UNCHANGED
        masked = block == mask_id
        tokens, confidence = self.propose(logits, mask_id, params, states)
        chosen = self.choose(masked_confidence(confidence, masked), params)
        torch.where(chosen, tokens, block, out=block)
        return UNCHANGED  # done: fed with no mask (nothing else is ever written); the state: its noise

    @abstractmethod
    def choose(self, confidence: torch.Tensor, params: Sequence[AlgorithmParams]) -> torch.Tensor:
        """Positions to fill, given confidences that are -inf outside the masked positions:
        only positions whose confidence is not -inf (so only masked ones), and at least one
        in every row that has such a position."""


class ThresholdRule(ConfidenceRule):
    """Fill every masked position whose confidence is above the row's ``threshold``
    parameter (at or above it, if ``inclusive``), and at least the most confident one."""

    inclusive: ClassVar[bool] = False

    def choose(self, confidence: torch.Tensor, params: Sequence[AlgorithmParams]) -> torch.Tensor:
        return above_or_best(confidence, per_row(params, "threshold", confidence.device), self.inclusive)

    def choose_on_host(self, confidence: np.ndarray, params: Sequence[AlgorithmParams]) -> np.ndarray:
        return above_or_best_on_host(confidence, per_row_on_host(params, "threshold"), self.inclusive)
