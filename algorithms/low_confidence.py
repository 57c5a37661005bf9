"""SGLang's LowConfidence rule (``python/sglang/srt/dllm/algorithm/low_confidence.py``).

Fill every masked position whose confidence is strictly above ``threshold`` (default
0.95); if none is, fill the single most confident one. Tokens are argmax at temperature
0, otherwise drawn as in SGLang's dLLM sampling (temperature, top-k, top-p).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from .base import check_number, register
from .confidence_rule import ConfidenceRule
from .sampling import TopKTopPParams, categorical
from .selection import above_or_best, above_or_best_on_host, per_row, per_row_on_host


@dataclasses.dataclass(frozen=True)
class LowConfidenceParams(TopKTopPParams):
    threshold: float = 0.95

    def validate(self) -> None:
        super().validate()
        check_number("threshold", self.threshold, minimum=0, maximum=1)


@register
class LowConfidence(ConfidenceRule):
    name = "low_confidence"
    params_class = LowConfidenceParams
    chooses_on_host = True
    propose = staticmethod(categorical)

    def choose(
        self, confidence: torch.Tensor, params: Sequence[LowConfidenceParams]
    ) -> torch.Tensor:
        threshold = per_row(params, "threshold", confidence.device)
        return above_or_best(confidence, threshold)

    def choose_on_host(self, confidence: np.ndarray, params: Sequence[LowConfidenceParams]) -> np.ndarray:
        return above_or_best_on_host(confidence, per_row_on_host(params, "threshold"))
