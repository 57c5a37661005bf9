"""A token's bytes: joined over the tokens of a text, they are the text's UTF-8, also where
tokens split a character (byte-level BPE, SentencePiece byte fallback)."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tools.bench.detokenize import MIXED_SCRIPTS, byte_level_bpe
from replicas.models import load_tokenizer
from replicas.token_bytes import byte_level_alphabet, token_bytes


def test_the_byte_level_alphabet_is_the_pre_tokenizers_one_byte_for_byte():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    assert alphabet["A"] == 0x41 and alphabet["\u0120"] == 0x20  # "Ġ": the space


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE that knows "a" and the space, and writes other bytes as <0xAB>."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"a": 256, "\u2581": 257, "<unk>": 258}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")


@pytest.mark.parametrize("make", [byte_level_bpe, byte_fallback_tokenizer], ids=["byte-level BPE", "byte fallback"])
def test_joined_token_bytes_are_the_texts_utf8_where_tokens_split_characters(make):
    tokenizer = make()
    of = token_bytes(tokenizer)
    texts = MIXED_SCRIPTS if make is byte_level_bpe else ["a 你好 a", "🙂🎉👍🏽"]
    split = 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert b"".join(of(t) for t in ids) == tokenizer.decode(ids).encode(), text
        split += sum("\ufffd" in tokenizer.decode([t]) for t in ids)
    assert split >= 4  # tokens holding part of a character were there


def test_other_tokenizers_give_their_decoded_text():
    tokenizer = load_tokenizer("tiny")  # word-level: a character a token
    of = token_bytes(tokenizer)
    assert [of(t) for t in tokenizer("1.3.", add_special_tokens=False)["input_ids"]] == [b"1", b".", b"3", b"."]
