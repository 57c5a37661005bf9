"""SDAR (``SDARForCausalLM``: SDAR-1.7B/4B/8B-Chat).

Qwen3 weights and names (per-head q/k RMSNorm before rotary, no biases unless
``attention_bias``) with block-causal attention of block size 4, so committed blocks
have an exact KV cache.
"""

from __future__ import annotations

from replicas.models.parallel import SINGLE, TensorParallel
from replicas.models.transformer import DecoderLM, QwenStyleConfig


class SDARForCausalLM(DecoderLM):
    config_class = QwenStyleConfig

    def __init__(self, config: QwenStyleConfig, tp: TensorParallel = SINGLE):
        super().__init__(config, config.decoder_shape(qk_norm=True), tp=tp)
