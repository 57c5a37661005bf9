"""The engine's direct decode equals transformers' decode, special tokens skipped."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from replicas.models import load_tokenizer
from replicas.commits import text_decoder

CORPUS = ["Hello, world! It's a test .", "ünïcödé text, don't split ; ok ?", "numbers 12 345 and  spaces"] * 20


def byte_level_bpe(clean_up: bool) -> PreTrainedTokenizerFast:
    """A small byte-level BPE (the GPT-2/Qwen kind) with special tokens, trained here."""
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|mask|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|endoftext|>", mask_token="<|mask|>",
                                   clean_up_tokenization_spaces=clean_up)


@pytest.mark.parametrize("make", [lambda: load_tokenizer("tiny"), lambda: byte_level_bpe(False),
                                  lambda: byte_level_bpe(True)], ids=["tiny", "bpe", "bpe, clean-up"])
def test_direct_decode_equals_transformers_decode(make):
    tokenizer = make()
    decode = text_decoder(tokenizer)
    rng = random.Random(0)
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in CORPUS[:3]]
    ids += [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    for sequence in ids:
        assert decode(sequence) == tokenizer.decode(sequence, skip_special_tokens=True), sequence
