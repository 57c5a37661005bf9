"""Our own tiny block-diffusion LM, trained by `dllm-serve train-tiny` and shipped inside
the package.

A pre-norm transformer (RMSNorm, rotary attention, SwiGLU) whose attention is block-causal:
a block attends to the prompt, to earlier blocks, and bidirectionally within itself (the
SDAR / LLaDA2.0 / D2F family), so committed blocks have an exact KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from replicas.models.layers import RMSNorm, RotaryEmbedding, Rotation, SwiGLU
from replicas.models.spec import ConfigFields, ModelSpec


@dataclass
class TinyDllmConfig(ConfigFields):
    vocab_size: int
    mask_token_id: int
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 384
    block_length: int = 16
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    architectures: tuple[str, ...] = ("TinyDllmForBlockDiffusion",)
    model_type: str = "tiny_dllm"


class TinyAttention(nn.Module):
    def __init__(self, config: TinyDllmConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, rotation: Rotation, context) -> torch.Tensor:
        shape = (*x.shape[:-1], self.heads, self.head_dim)
        q = rotation.rotate(self.q_proj(x).view(shape))
        k = rotation.rotate(self.k_proj(x).view(shape))
        v = self.v_proj(x).view(shape)
        out = context.attend(self.layer_index, q, k, v)
        return self.o_proj(out.reshape(x.shape))


class TinyDecoderLayer(nn.Module):
    def __init__(self, config: TinyDllmConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = TinyAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, rotation: Rotation, context) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotation, context)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyDllmForBlockDiffusion(nn.Module):
    config_class = TinyDllmConfig

    def __init__(self, config: TinyDllmConfig):
        super().__init__()
        self.config = config
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(head_dim, config.rope_theta)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # the position inside its block, added to the token embedding: rotary attention
        # alone sees only relative offsets, and the tiny tasks are laid out in block cells
        self.embed_block_positions = nn.Embedding(config.block_length, config.hidden_size)
        self.layers = nn.ModuleList(
            TinyDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.spec = ModelSpec(
            block_length=config.block_length,
            mask_token_id=config.mask_token_id,
            eos_token_id=config.eos_token_id,
            vocab_size=config.vocab_size,
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_attention_heads,
            head_dim=head_dim,
            max_positions=config.max_position_embeddings,
            contiguous_positions=False,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for ``input_ids`` (``[T]`` packed or ``[B, S]`` dense).

        ``logits_index`` selects the packed tokens whose logits are needed (the active
        blocks), so the prompt positions never pay for the LM head.
        """
        x = self.embed_tokens(input_ids) + self.embed_block_positions(positions % self.config.block_length)
        rotation = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rotation, context)
        if logits_index is not None:
            x = x[logits_index]
        return self.lm_head(self.norm(x))
