"""Per-architecture serving defaults, in one table, and how config overrides apply.

The block length, mask and EOS ids and the default algorithm are facts about how a
checkpoint was trained and is meant to be decoded, not always present in its config.json.
An id that config.json does give wins over the table; the user's ``model_overrides``
(cluster config ``replica.model_overrides``) win over both. The ids that end an answer
are the EOS and every other id of the table, config.json and generation_config.json
(``eos_token_id`` there may be a list); those outside the vocabulary can never be
generated and are left out.
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
    canvas: str = "block"
    block_alignment: str = "page"
    algorithm: str = "low_confidence"
    algorithm_params: dict[str, Any] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()


DEFAULTS: dict[str, ModelDefaults] = {
    # LLaDA-8B-Base/Instruct, LLaDA-1.5: <|mdm_mask|> 126336, <|endoftext|> 126081; Instruct
    # ends its answer with <|eot_id|> 126348 and pads the rest with <|endoftext|>
    "LLaDAModelLM": ModelDefaults(32, 126336, 126081, "bidirectional", canvas="full",
                                  algorithm_params={"threshold": 0.9}, stop_token_ids=(126348,)),
    # Dream-v0-Base/Instruct-7B: <|mask|> 151666, <|endoftext|> 151643, <|im_end|> 151645
    "DreamModel": ModelDefaults(32, 151666, 151643, "bidirectional", shift_logits=True, canvas="full",
                                algorithm_params={"threshold": 0.9}, stop_token_ids=(151645,)),
    # LLaDA2.0-mini: <|mask|> 156895, <|endoftext|> 156892
    "LLaDA2MoeModelLM": ModelDefaults(32, 156895, 156892, "block_causal", block_alignment="prompt",
                                      algorithm_params={"threshold": 0.95}),
    # SDAR (Qwen3 tokenizer): <|MASK|> 151669, <|im_end|> 151645, <|endoftext|> 151643
    "SDARForCausalLM": ModelDefaults(4, 151669, 151645, "block_causal", block_alignment="prompt",
                                     algorithm_params={"threshold": 0.95}, stop_token_ids=(151643,)),
}

OVERRIDABLE = ("block_length", "mask_token_id", "eos_token_id", "stop_token_ids", "attention",
               "default_algorithm", "default_algorithm_params")


def _config_id(config, name: str, fallback: int) -> int:
    value = getattr(config, name, None)
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return value[0]
    return value if isinstance(value, int) else fallback


def listed_ids(value) -> tuple[int, ...]:
    """An ``eos_token_id`` field of config.json or generation_config.json as ids: an int or a list."""
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def with_stop_ids(spec: ModelSpec, ids) -> ModelSpec:
    """``spec`` ending answers at ``ids`` too (those in its vocabulary, its EOS aside)."""
    extra: list[int] = []
    for i in ids:
        if 0 <= i < spec.vocab_size and i not in spec.end_token_ids and i not in extra:
            extra.append(i)
    return dataclasses.replace(spec, stop_token_ids=spec.stop_token_ids + tuple(extra))


def default_spec(architecture: str, config, shape) -> ModelSpec:
    """The spec of an architecture of the table: sizes from its ``DecoderShape``, ids from
    its ``config`` where it has them."""
    table = DEFAULTS[architecture]
    spec = ModelSpec(
        block_length=table.block_length,
        mask_token_id=_config_id(config, "mask_token_id", table.mask_token_id),
        eos_token_id=_config_id(config, "eos_token_id", table.eos_token_id),
        vocab_size=shape.vocab_size, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, max_positions=shape.max_positions, attention=table.attention,
        shift_logits=table.shift_logits, canvas=table.canvas, block_alignment=table.block_alignment,
        default_algorithm=table.algorithm, default_algorithm_params=dict(table.algorithm_params),
    )
    return with_stop_ids(spec, table.stop_token_ids + listed_ids(getattr(config, "eos_token_id", None)))


def apply_overrides(spec: ModelSpec, overrides: dict[str, Any] | None) -> ModelSpec:
    """``spec`` with the user's overrides, checked against the model."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ModelSettingsError(f"unknown model override(s) {unknown}; allowed: {list(OVERRIDABLE)}")
    if "stop_token_ids" in overrides:
        ids = overrides["stop_token_ids"]
        if not isinstance(ids, (list, tuple)) or listed_ids(list(ids)) != tuple(ids):
            raise ModelSettingsError(f"model override stop_token_ids must be a list of token ids, got {ids!r}")
        overrides["stop_token_ids"] = tuple(ids)
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
    outside = [i for i in spec.stop_token_ids if not 0 <= i < spec.vocab_size]
    if outside:
        raise ModelSettingsError(f"stop_token_ids {outside} are outside the vocabulary of {spec.vocab_size}")
    return spec
