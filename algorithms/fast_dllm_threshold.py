"""Fast-dLLM's threshold rule (NVlabs/Fast-dLLM ``llada/generate.py``, ``get_transfer_index``
with ``threshold``).

Fill every masked position whose confidence is at least ``threshold`` (default 0.9), and
always the most confident one. Tokens come from LLaDA's Gumbel-max draw at ``temperature``
(argmax at 0); the confidence is the token's untempered softmax probability.
"""

from __future__ import annotations

import dataclasses

from .base import AlgorithmParams, check_number, register
from .confidence_rule import ThresholdRule
from .sampling import gumbel


@dataclasses.dataclass(frozen=True)
class FastDllmThresholdParams(AlgorithmParams):
    threshold: float = 0.9

    def validate(self) -> None:
        super().validate()
        check_number("threshold", self.threshold, minimum=0, maximum=1)


@register
class FastDllmThreshold(ThresholdRule):
    name = "fast_dllm_threshold"
    params_class = FastDllmThresholdParams
    inclusive = True
    propose = staticmethod(gumbel)
