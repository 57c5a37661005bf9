"""The direct encode gives transformers' ids, and two threads asking for different
special-token settings each get their own."""

import threading

import pytest
from transformers import PreTrainedTokenizerFast

from tools.bench.detokenize import byte_level_bpe
from replicas.models import load_tokenizer
from replicas.text_encoding import text_encoder

TEXTS = ["Hello, world! It's a test .", "你好，世界 🌍🚀 👍🏽", "<|endoftext|> and <|mask|> as text",
         "[MASK] <eos> <|mask|><|mask|>", "", " a  b ", "mixed 中文 text 🙂 <|endoftext|>"]


def wrapper_ids(tokenizer, texts, split):
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=split)["input_ids"]


@pytest.mark.parametrize("make", [lambda: load_tokenizer("tiny"), byte_level_bpe], ids=["tiny", "byte-level BPE"])
@pytest.mark.parametrize("split", [True, False], ids=["specials as text", "specials as tokens"])
def test_direct_encode_equals_transformers_call(make, split):
    tokenizer = make()
    encode = text_encoder(tokenizer)
    assert encode(TEXTS, split) == wrapper_ids(tokenizer, TEXTS, split)
    for text in TEXTS:
        assert encode(text, split) == wrapper_ids(tokenizer, text, split), text


def test_special_tokens_are_split_or_not_as_asked():
    tokenizer = byte_level_bpe()
    encode = text_encoder(tokenizer)
    special = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert encode("<|endoftext|>", False) == [special]
    assert special not in encode("<|endoftext|>", True)


def test_threads_asking_for_different_settings_each_get_theirs():
    """transformers sets the shared backend's setting before each call: a thread between
    that and its encode could get the other thread's; the copies per setting cannot."""
    tokenizer = byte_level_bpe()
    encode = text_encoder(tokenizer)
    text = "<|endoftext|> 你好 " * 200
    expected = {split: wrapper_ids(tokenizer, text, split) for split in (True, False)}
    wrong = []

    def worker(split):
        for _ in range(100):
            if encode(text, split) != expected[split]:
                wrong.append(split)

    threads = [threading.Thread(target=worker, args=(split,)) for split in (True, False, True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_a_backend_set_to_truncate_is_not_truncated_as_in_transformers_call():
    tokenizer = byte_level_bpe()
    tokenizer.backend_tokenizer.enable_truncation(max_length=3)
    text = "a longer text than three tokens, 你好"
    encode = text_encoder(tokenizer)
    assert len(encode(text, True)) > 3
    assert encode(text, True) == wrapper_ids(tokenizer, text, True)


def test_a_tokenizer_that_customises_its_encoding_is_called_as_it_is():
    class Shouting(PreTrainedTokenizerFast):
        def _encode_plus(self, text, *args, **kwargs):
            upper = text.upper() if isinstance(text, str) else [t.upper() for t in text]
            return super()._encode_plus(upper, *args, **kwargs)

    plain = byte_level_bpe()
    shouting = Shouting(tokenizer_object=plain.backend_tokenizer, eos_token="<|endoftext|>")
    encode = text_encoder(shouting)
    assert encode("hello", True) == wrapper_ids(plain, "HELLO", True) != wrapper_ids(plain, "hello", True)
