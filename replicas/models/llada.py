"""LLaDA (``LLaDAModelLM``: LLaDA-8B-Base/Instruct, LLaDA-1.5).

An OLMo-format Llama: RMSNorm, rotary, SwiGLU (``ff_proj`` is the gate, ``up_proj`` the
up projection, ``ff_out`` the down projection), no biases, fully bidirectional attention
and no logit shift. Parameter names: ``model.transformer.{wte, blocks.N.*, ln_f, ff_out}``.
"""

from __future__ import annotations

from dataclasses import dataclass

from replicas.models.parallel import SINGLE, TensorParallel
from replicas.models.spec import ConfigFields
from replicas.models.transformer import DecoderLM, DecoderShape

_BLOCK = r"^model\.transformer\.blocks\.(\d+)\."


@dataclass
class LLaDAConfig(ConfigFields):
    d_model: int
    n_heads: int
    n_layers: int
    mlp_hidden_size: int
    vocab_size: int
    n_kv_heads: int | None = None
    embedding_size: int | None = None  # rows of wte / ff_out (vocab padded up)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_sequence_length: int = 4096
    include_bias: bool = False
    include_qkv_bias: bool = False
    weight_tying: bool = False
    mask_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    architectures: tuple[str, ...] = ("LLaDAModelLM",)
    model_type: str = "llada"


class LLaDAModelLM(DecoderLM):
    config_class = LLaDAConfig
    checkpoint_renames = (
        (r"^model\.transformer\.wte\.", "model.embed_tokens."),
        (r"^model\.transformer\.ln_f\.", "model.norm."),
        (r"^model\.transformer\.ff_out\.", "lm_head."),
        (_BLOCK + r"(q_proj|k_proj|v_proj)\.", r"model.layers.\1.self_attn.\2."),
        (_BLOCK + r"attn_out\.", r"model.layers.\1.self_attn.o_proj."),
        (_BLOCK + r"ff_proj\.", r"model.layers.\1.mlp.gate_proj."),
        (_BLOCK + r"up_proj\.", r"model.layers.\1.mlp.up_proj."),
        (_BLOCK + r"ff_out\.", r"model.layers.\1.mlp.down_proj."),
        (_BLOCK + r"attn_norm\.", r"model.layers.\1.input_layernorm."),
        (_BLOCK + r"ff_norm\.", r"model.layers.\1.post_attention_layernorm."),
    )

    def __init__(self, config: LLaDAConfig, tp: TensorParallel = SINGLE):
        shape = DecoderShape(
            vocab_size=config.embedding_size or config.vocab_size, hidden_size=config.d_model,
            num_layers=config.n_layers, num_heads=config.n_heads,
            num_kv_heads=config.n_kv_heads or config.n_heads, head_dim=config.d_model // config.n_heads,
            intermediate_size=config.mlp_hidden_size, rope_theta=config.rope_theta,
            rms_norm_eps=config.rms_norm_eps, max_positions=config.max_sequence_length,
            qkv_bias=config.include_bias or config.include_qkv_bias, tie_word_embeddings=config.weight_tying)
        super().__init__(config, shape, tp=tp)
