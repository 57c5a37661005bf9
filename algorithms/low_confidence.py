"""SGLang's LowConfidence rule (``python/sglang/srt/dllm/algorithm/low_confidence.py``).

Fill every masked position whose confidence is strictly above ``threshold`` (default
0.95); if none is, fill the single most confident one. Tokens are argmax at temperature
0, otherwise drawn as in SGLang's dLLM sampling (temperature, top-k, top-p).
"""

from __future__ import annotations

import dataclasses

from .base import check_number, register
from .confidence_rule import ThresholdRule
from .sampling import TopKTopPParams, categorical


@dataclasses.dataclass(frozen=True)
class LowConfidenceParams(TopKTopPParams):
    threshold: float = 0.95

    def validate(self) -> None:
        super().validate()
        check_number("threshold", self.threshold, minimum=0, maximum=1)


@register
class LowConfidence(ThresholdRule):
    name = "low_confidence"
    params_class = LowConfidenceParams
    propose = staticmethod(categorical)
