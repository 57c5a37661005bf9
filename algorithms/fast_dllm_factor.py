"""Fast-dLLM's factor rule (NVlabs/Fast-dLLM ``llada/generate.py``,
``get_transfer_index_dynamic``, ``factor=1`` by default).

Sort the masked confidences c(1) >= c(2) >= ... and fill the n most confident positions,
n the longest prefix with c(j) >= 1 - factor / (j + 1) for every 2 <= j <= n (the first
always passes, so n >= 1). Tokens as in ``fast_dllm_threshold``.

One deliberate difference: the reference code also fills *all* masked positions when
only the last one fails its bar (its loop index cannot tell "broke at the last rank" from
"never broke"); here the rule is applied as written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .base import AlgorithmParams, check_number, register
from .confidence_rule import ConfidenceRule
from .sampling import gumbel
from .selection import per_row, top_n


MAX_FACTOR = 1e6  # any factor above block_length + 1 already fills every masked position


@dataclasses.dataclass(frozen=True)
class FastDllmFactorParams(AlgorithmParams):
    factor: float = 1.0

    def validate(self) -> None:
        super().validate()
        check_number("factor", self.factor, minimum=0, exclusive_minimum=True, maximum=MAX_FACTOR)


@register
class FastDllmFactor(ConfidenceRule):
    name = "fast_dllm_factor"
    params_class = FastDllmFactorParams
    propose = staticmethod(gumbel)

    def choose(
        self, confidence: torch.Tensor, params: Sequence[FastDllmFactorParams]
    ) -> torch.Tensor:
        factor = per_row(params, "factor", confidence.device)
        ordered = confidence.sort(-1, descending=True).values
        rank = torch.arange(1, confidence.shape[-1] + 1, device=confidence.device)
        passes = ordered >= 1 - factor[:, None] / (rank + 1)
        passes[:, 0] = True
        passes &= ordered.isfinite()
        count = passes.long().cumprod(-1).sum(-1)
        return top_n(confidence, count)
