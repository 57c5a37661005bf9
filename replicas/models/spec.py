"""What the engine needs to know about any model implementation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    block_length: int
    mask_token_id: int
    eos_token_id: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
