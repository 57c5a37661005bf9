"""The tiny model's character-level tokenizer, saved in the transformers format.

Whitespace separates nothing and is dropped: text is split into single characters, so
"1.3. ..2." and "1.3...2." tokenize alike. Decoding concatenates the characters with no
separator, so generated cells decode back to the cell text.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

PAD, BOS, EOS, MASK, UNK = "[PAD]", "[BOS]", "[EOS]", "[MASK]", "[UNK]"
SPECIAL_TOKENS = (PAD, BOS, EOS, MASK, UNK)
CHARACTERS = string.digits + ".-" + string.ascii_lowercase + string.ascii_uppercase + ",;:!?'\"()+*/=_#|"
MODEL_MAX_LENGTH = 512
# the prompt is the last user message's content, verbatim
CHAT_TEMPLATE = (
    "{%- set ns = namespace(prompt='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{%- set ns.prompt = message['content'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{- ns.prompt -}}"
)


def build_tokenizer() -> Tokenizer:
    """Special tokens take ids 0-4 ([PAD], [BOS], [EOS], [MASK], [UNK]), then the characters.

    A BPE model without merges splits each whitespace-separated word into its characters
    (one [UNK] for each character outside the vocabulary): the same ids as a split into
    single characters before a word-level lookup, at less than half the cost (one
    pre-token a word instead of one a character)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def save_tokenizer(path: str | Path) -> Tokenizer:
    """Write tokenizer.json and tokenizer_config.json into ``path``; returns the tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "mask_token": MASK,
        "unk_token": UNK,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer
