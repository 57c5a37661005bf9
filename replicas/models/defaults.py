"""Per-architecture serving defaults, in one table, and how config overrides apply.

The block length, mask and EOS ids and the default algorithm are facts about how a
checkpoint was trained and is meant to be decoded, not always present in its config.json.
An id that config.json does give wins over the table; the user's ``model_overrides``
(cluster config ``replica.model_overrides``) win over both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from replicas.models.spec import ATTENTION_KINDS, ModelSpec


class ModelSettingsError(ValueError):
    """An override that does not fit the model; the message names it."""


@dataclass(frozen=True)
class ModelDefaults:
    block_length: int
    mask_token_id: int
    eos_token_id: int
    attention: str
    shift_logits: bool = False
    algorithm: str = "low_confidence"
    algorithm_params: dict[str, Any] = field(default_factory=dict)


DEFAULTS: dict[str, ModelDefaults] = {
    # LLaDA-8B-Base/Instruct, LLaDA-1.5: <|mdm_mask|> 126336, <|endoftext|> 126081
    "LLaDAModelLM": ModelDefaults(32, 126336, 126081, "bidirectional", algorithm_params={"threshold": 0.9}),
    # Dream-v0-Base/Instruct-7B: <|mask|> 151666, <|endoftext|> 151643
    "DreamModel": ModelDefaults(32, 151666, 151643, "bidirectional", shift_logits=True,
                                algorithm_params={"threshold": 0.9}),
    # LLaDA2.0-mini: <|mask|> 156895, <|endoftext|> 156892
    "LLaDA2MoeModelLM": ModelDefaults(32, 156895, 156892, "block_causal", algorithm_params={"threshold": 0.95}),
    # SDAR (Qwen3 tokenizer): <|MASK|> 151669, <|im_end|> 151645
    "SDARForCausalLM": ModelDefaults(4, 151669, 151645, "block_causal", algorithm_params={"threshold": 0.95}),
}

OVERRIDABLE = ("block_length", "mask_token_id", "eos_token_id", "attention",
               "default_algorithm", "default_algorithm_params")


def _config_id(config, name: str, fallback: int) -> int:
    value = getattr(config, name, None)
    return value if isinstance(value, int) else fallback


def default_spec(architecture: str, config, shape) -> ModelSpec:
    """The spec of an architecture of the table: sizes from its ``DecoderShape``, ids from
    its ``config`` where it has them."""
    table = DEFAULTS[architecture]
    return ModelSpec(
        block_length=table.block_length,
        mask_token_id=_config_id(config, "mask_token_id", table.mask_token_id),
        eos_token_id=_config_id(config, "eos_token_id", table.eos_token_id),
        vocab_size=shape.vocab_size, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, max_positions=shape.max_positions, attention=table.attention, shift_logits=table.shift_logits,
        default_algorithm=table.algorithm, default_algorithm_params=dict(table.algorithm_params),
    )


def apply_overrides(spec: ModelSpec, overrides: dict[str, Any] | None) -> ModelSpec:
    """``spec`` with the user's overrides, checked against the model."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ModelSettingsError(f"unknown model override(s) {unknown}; allowed: {list(OVERRIDABLE)}")
    spec = dataclasses.replace(spec, **overrides)
    if spec.attention not in ATTENTION_KINDS:
        raise ModelSettingsError(f"model override attention={spec.attention!r}; allowed: {list(ATTENTION_KINDS)}")
    if spec.block_length < 1 or spec.max_positions // spec.block_length < 2:
        raise ModelSettingsError(f"block_length {spec.block_length} does not fit {spec.max_positions} positions")
    for name in ("mask_token_id", "eos_token_id"):
        if not 0 <= getattr(spec, name) < spec.vocab_size:
            raise ModelSettingsError(
                f"{name} {getattr(spec, name)} is outside the vocabulary of {spec.vocab_size}; "
                f"set it with the model override {name}")
    return spec
