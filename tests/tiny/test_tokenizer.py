"""The character tokenizer through transformers.AutoTokenizer."""

import random

import pytest
from transformers import AutoTokenizer

from replicas.models import load_tokenizer
from replicas.tiny import task
from replicas.tiny.tokenizer import CHARACTERS, EOS, MASK, UNK, build_tokenizer, save_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def test_special_tokens(tokenizer):
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3, 4]) == ["[PAD]", "[BOS]", "[EOS]", "[MASK]", "[UNK]"]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id) == (0, 2, 3)


def test_prompt_is_112_tokens_without_bos(tokenizer):
    for request in task.make_requests(20, seed=0):
        ids = tokenizer(request.prompt)["input_ids"]
        assert len(ids) == 112
        assert tokenizer.decode(ids) == "".join(request.prompt.split())


def test_whitespace_is_ignored_and_decode_inserts_no_spaces(tokenizer):
    ids = tokenizer("1.3. ..2.\n4...", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "1.3...2.4..."
    eos = tokenizer.eos_token_id
    assert tokenizer.decode(ids + [eos, eos], skip_special_tokens=True) == "1.3...2.4..."
    assert tokenizer.decode(tokenizer("Hi, there!")["input_ids"]) == "Hi,there!"


def test_unknown_characters_map_to_unk(tokenizer):
    assert tokenizer("é")["input_ids"] == [tokenizer.unk_token_id]


def test_chat_template_renders_the_last_user_message(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "1.3. ----"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "1.3. ----"


def character_ids(text: str, vocab: dict[str, int]) -> list[int]:
    """The tokenizer's contract, written out: each character not whitespace is its own
    token, [UNK] where it is outside the vocabulary (special-token strings split too)."""
    return [vocab.get(c, vocab[UNK]) for c in text if not c.isspace()]


def test_shipped_tokenizer_splits_text_into_characters(tokenizer):
    """Random text over the vocabulary, whitespace and characters outside it: the shipped
    checkpoint's tokenizer, one saved afresh and one built afresh give the
    character-by-character ids, and decode back to the text without its whitespace."""
    shipped = load_tokenizer("tiny")
    vocab = shipped.get_vocab()
    rng = random.Random(0)
    alphabet = CHARACTERS + " \t\n中文😀é[]"
    built = build_tokenizer()
    built.encode_special_tokens = True
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) + rng.choice(["", MASK, EOS])
        ids = shipped(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert ids == character_ids(text, vocab) == built.encode(text, add_special_tokens=False).ids, text
        assert ids == tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        known = "".join(c for c in text if not c.isspace() and c in vocab)
        if len(known) == len([c for c in text if not c.isspace()]):
            assert shipped.decode(ids) == known
