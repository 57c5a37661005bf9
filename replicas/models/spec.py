"""What the engine needs to know about any model implementation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ATTENTION_KINDS = ("block_causal", "bidirectional", "block_causal_whole_prompt")


@dataclass(frozen=True)
class ModelSpec:
    block_length: int
    mask_token_id: int
    eos_token_id: int  # ends an answer; also the padding of unused row positions
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    # "block_causal": a block sees earlier blocks and itself (exact KV cache);
    # "bidirectional": every token sees the whole sequence (LLaDA, Dream);
    # "block_causal_whole_prompt": block-causal, the prompt one block whose tokens see each
    # other both ways (D2F's LLaDA: its prompt is computed in one forward, never from a cache)
    attention: str = "block_causal"
    shift_logits: bool = False  # the logit of position i is the output at i - 1 (Dream)
    # "full": every block's masks are in the sequence from the start (bidirectional models'
    # reference generation); "block": a block sees only what precedes it (replicas.runner)
    canvas: str = "block"
    # "prompt": blocks are aligned to the sequence's start, the first answer block fills the
    # rest of the prompt's last block (SDAR, LLaDA2.0); "page": it starts on a fresh page
    block_alignment: str = "page"
    # positions run on from the prompt's last token into the first block; False leaves the
    # gap up to the prompt's page boundary (the tiny model was trained that way)
    contiguous_positions: bool = True
    default_algorithm: str = "low_confidence"
    default_algorithm_params: dict[str, Any] = field(default_factory=dict)
    # more ids that end an answer, e.g. LLaDA-Instruct's <|eot_id|> before its <|endoftext|> padding
    stop_token_ids: tuple[int, ...] = ()

    @property
    def bidirectional(self) -> bool:
        return self.attention == "bidirectional"

    @property
    def whole_prompt(self) -> bool:
        """The prompt is one block: every prompt token sees the whole prompt."""
        return self.attention == "block_causal_whole_prompt"

    @property
    def end_token_ids(self) -> frozenset[int]:
        """Every id that ends an answer: the EOS and the stop ids."""
        return frozenset((self.eos_token_id, *self.stop_token_ids))


class ConfigFields:
    """Mixin for config dataclasses read from a checkpoint's config.json: unknown keys are ignored."""

    @classmethod
    def from_dict(cls, raw: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in names}
        if "architectures" in values:
            values["architectures"] = tuple(values["architectures"])
        return cls(**values)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["architectures"] = list(self.architectures)
        return out
