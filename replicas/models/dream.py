"""Dream (``DreamModel``: Dream-v0-Base/Instruct-7B).

Qwen2.5 weights and names (QKV bias, RMSNorm, SwiGLU) with fully bidirectional attention.
Dream was adapted from an autoregressive model and keeps its shift: the logit for
position i is read from the output at position i - 1 (``ModelSpec.shift_logits``).
"""

from __future__ import annotations

from replicas.models.parallel import SINGLE, TensorParallel
from replicas.models.transformer import DecoderLM, QwenStyleConfig


class DreamModel(DecoderLM):
    config_class = QwenStyleConfig

    def __init__(self, config: QwenStyleConfig, tp: TensorParallel = SINGLE):
        super().__init__(config, config.decoder_shape(qkv_bias=True), tp=tp)
