"""Fast-dLLM's threshold rule (NVlabs/Fast-dLLM ``llada/generate.py``, ``get_transfer_index``
with ``threshold``).

Fill every masked position whose confidence is at least ``threshold`` (default 0.9), and
always the most confident one. Tokens come from LLaDA's Gumbel-max draw at ``temperature``
(argmax at 0); the confidence is the token's untempered softmax probability.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from .base import AlgorithmParams, check_number, register
from .confidence_rule import ConfidenceRule
from .sampling import gumbel
from .selection import above_or_best, above_or_best_on_host, per_row, per_row_on_host


@dataclasses.dataclass(frozen=True)
class FastDllmThresholdParams(AlgorithmParams):
    threshold: float = 0.9

    def validate(self) -> None:
        super().validate()
        check_number("threshold", self.threshold, minimum=0, maximum=1)


@register
class FastDllmThreshold(ConfidenceRule):
    name = "fast_dllm_threshold"
    params_class = FastDllmThresholdParams
    chooses_on_host = True
    propose = staticmethod(gumbel)

    def choose(
        self, confidence: torch.Tensor, params: Sequence[FastDllmThresholdParams]
    ) -> torch.Tensor:
        threshold = per_row(params, "threshold", confidence.device)
        return above_or_best(confidence, threshold, inclusive=True)

    def choose_on_host(self, confidence: np.ndarray, params: Sequence[FastDllmThresholdParams]) -> np.ndarray:
        return above_or_best_on_host(confidence, per_row_on_host(params, "threshold"), inclusive=True)
