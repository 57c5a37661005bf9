"""The streamed text of a block-by-block output with a real byte-level BPE: exactly what
decoding the returned ids gives, cut at the stop string; nothing held back lost."""

import time
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from tools.bench.detokenize import byte_level_bpe as train_byte_level_bpe
from replicas.detokenizer import CONTEXT_TOKENS, Detokenizer, held_suffix
from replicas.commits import OutputProcessor, text_decoder
from replicas.request import FinishReason, Request
from replicas.messages import SamplingParams


@lru_cache(maxsize=2)
def byte_level_bpe(clean_up: bool = False):
    return train_byte_level_bpe(clean_up)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run(tokenizer, ids, block, stop=(), max_tokens=None, resume_blocks=0):
    """Commit ``ids`` block by block (EOS ends it, as the engine would); returns the pieces
    of text, the ids returned with them, and the request."""
    eos = tokenizer.eos_token_id
    processor = OutputProcessor(tokenizer, frozenset({eos}))
    resumed = tuple(ids[:resume_blocks * block])
    params = SamplingParams(max_tokens=max_tokens or len(ids) + block, stop=tuple(stop), resume_ids=resumed)
    request = Request("r", [1], params, None, None, block, 0.0, output_ids=list(resumed),
                      detokenizer=processor.detokenizer(params))
    pieces, returned = [], list(resumed)
    position = len(resumed)
    while request.finish_reason is None:
        chunk = ids[position:position + block] or [eos] * block
        position += block
        commit = processor.commit_block(request, chunk)
        pieces.append(commit.text)
        returned += commit.token_ids
        request.output_ids += commit.token_ids  # what the scheduler applies
        request.finish_reason = commit.finish_reason
    assert returned == request.output_ids
    return pieces, returned, request


def expected(tokenizer, ids, stop):
    """What the whole answer must be: the decode of the ids up to EOS, cut where the stop
    string that is complete first (earliest end, then the longest) begins."""
    eos = tokenizer.eos_token_id
    ids = ids[:ids.index(eos)] if eos in ids else ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [(text.find(s) + len(s), text.find(s)) for s in stop if s in text]
    return text[:min(hits)[1]] if hits else text


def assert_exact(tokenizer, ids, block, stop=(), resume_blocks=0):
    pieces, returned, request = run(tokenizer, ids, block, stop, resume_blocks=resume_blocks)
    text = "".join(pieces)
    full = tokenizer.decode(returned, skip_special_tokens=True)
    want = expected(tokenizer, ids, stop)
    if resume_blocks:  # a continuation: the failed replica emitted the resumed blocks' text, less what it held
        first_replica = Detokenizer(text_decoder(tokenizer), stop)
        text = first_replica.feed(returned[:resume_blocks * block], 0, final=False)[0] + text
    assert text == want
    assert full.startswith(want)  # the returned ids decode to the text, then the stop string (if any)
    if any(s in full for s in stop):
        assert request.finish_reason is FinishReason.STOP
        shorter = tokenizer.decode(returned[:-1], skip_special_tokens=True)
        assert not any(s in shorter for s in stop)  # no id after the stop's last
    assert ("\ufffd" in text) <= ("\ufffd" in full)


unicode_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
mixed_text = st.lists(st.sampled_from(["a", "é", "e\u0301", "€", "数", "字", "🙂", "👍🏽", "ש", "م", " ", ".", "END",
                                       "\u200f", "!"]), max_size=40).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(unicode_text, mixed_text), block=st.integers(1, 8),
       stop=st.lists(st.text(st.sampled_from("a€数🙂 .E N D"), min_size=1, max_size=4), max_size=2),
       resume_blocks=st.integers(0, 2))
@example(text="a€b", block=2, stop=[], resume_blocks=0)
@example(text="abcENDxy", block=2, stop=["END"], resume_blocks=0)
@example(text="🙂🙂", block=1, stop=["🙂"], resume_blocks=0)
@example(text="\u200fEND", block=7, stop=["END", "N"], resume_blocks=0)
@example(text=" aDD", block=1, stop=["D", " aDD"], resume_blocks=0)
def test_streamed_text_is_the_decode_of_the_returned_ids(text, block, stop, resume_blocks):
    tokenizer = byte_level_bpe()
    ids = encode(tokenizer, text)
    resume_blocks = min(resume_blocks, len(ids) // block)
    if any(s in tokenizer.decode(ids[:resume_blocks * block]) for s in stop):
        resume_blocks = 0  # the first replica would have stopped there: nothing to resume
    assert_exact(tokenizer, ids, block, stop, resume_blocks)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(unicode_text, mixed_text), block=st.integers(1, 8), resume_blocks=st.integers(0, 2))
@example(text="数字🙂", block=1, resume_blocks=1)
def test_a_whole_answers_text_decoded_by_its_receiver_is_its_streamed_text(text, block, resume_blocks):
    """A whole answer without stop strings leaves the engine without its text, and its
    receiver decodes its ids at once (``OutputProcessor.answer_text``): the text its blocks
    would have streamed, a continuation's too (less the text emitted before it)."""
    tokenizer = byte_level_bpe()
    ids = encode(tokenizer, text)
    resume_blocks = min(resume_blocks, len(ids) // block)
    pieces, returned, request = run(tokenizer, ids, block, resume_blocks=resume_blocks)
    processor = OutputProcessor(tokenizer, frozenset({tokenizer.eos_token_id}))
    assert processor.answer_text(request.params, returned[resume_blocks * block:]) == "".join(pieces)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(2, 399), max_size=40), block=st.integers(1, 6))
def test_any_ids_even_invalid_utf8(ids, block):
    """Random ids (bytes that need not form valid UTF-8): a U+FFFD only where the ids decode to one."""
    assert_exact(byte_level_bpe(), ids, block)


@settings(max_examples=60, deadline=None)
@given(text=st.lists(st.sampled_from(["do", " n't", " ", " .", " ,", "I", " 'm", " ' ", "x", " ?"]),
                     max_size=20).map("".join), block=st.integers(1, 4))
def test_clean_up_of_tokenization_spaces(text, block):
    tokenizer = byte_level_bpe(clean_up=True)
    assert_exact(tokenizer, encode(tokenizer, text), block)


def test_the_reported_cases():
    tokenizer = byte_level_bpe()
    pieces, _, _ = run(tokenizer, encode(tokenizer, "a€b"), 2)
    assert "".join(pieces) == "a€b" and "\ufffd" not in "".join(pieces)
    ids = encode(tokenizer, "abcENDxy")
    pieces, returned, request = run(tokenizer, ids, 2, stop=["END"])
    assert "".join(pieces) == "abc" and all("E" not in p for p in pieces)
    assert tokenizer.decode(returned).startswith("abcEND") and len(returned) < len(ids)
    assert request.finish_reason is FinishReason.STOP


def test_stop_and_eos_and_max_tokens_in_one_block():
    tokenizer = byte_level_bpe()
    eos = tokenizer.eos_token_id
    ids = encode(tokenizer, "ab.cd")
    # the stop string comes before EOS: stop; EOS before the stop: stop, the text up to EOS
    _, returned, request = run(tokenizer, ids + [eos], 16, stop=["."])
    assert request.finish_reason is FinishReason.STOP and tokenizer.decode(returned) == "ab."
    pieces, returned, request = run(tokenizer, encode(tokenizer, "ab") + [eos] + encode(tokenizer, ".x"), 16,
                                    stop=["."])
    assert request.finish_reason is FinishReason.STOP and "".join(pieces) == "ab"
    # max_tokens cuts before the stop string: length; the stop inside max_tokens: stop
    pieces, returned, request = run(tokenizer, ids, 16, stop=["d"], max_tokens=2)
    assert request.finish_reason is FinishReason.LENGTH and len(returned) == 2
    pieces, returned, request = run(tokenizer, ids, 16, stop=["b"], max_tokens=len(ids))
    assert request.finish_reason is FinishReason.STOP and "".join(pieces) == "a"
    # max_tokens cuts before EOS: length (the EOS past it was never produced), also where EOS
    # would have been the next token; EOS inside max_tokens: stop
    for max_tokens in (2, len(ids)):
        pieces, returned, request = run(tokenizer, ids + [eos], 16, max_tokens=max_tokens)
        assert request.finish_reason is FinishReason.LENGTH and len(returned) == max_tokens, max_tokens
    pieces, returned, request = run(tokenizer, ids + [eos], 16, max_tokens=len(ids) + 1)
    assert request.finish_reason is FinishReason.STOP and returned == ids


def test_held_suffix():
    assert held_suffix("abcE", ["END"]) == 1 and held_suffix("abcEN", ["END", "NX"]) == 2
    assert held_suffix("abc", ["END"]) == 0 and held_suffix("", ["END"]) == 0
    assert held_suffix("xEND", ["END"]) == 0  # a whole stop is not a beginning of one


@pytest.mark.parametrize("length", [256, 4096])
def test_a_block_costs_the_same_late_in_a_long_answer(length, record_property):
    """Per-block decode work does not grow with the answer: the window stays small (the
    time is ``dllm-serve bench detokenize``'s to show)."""
    tokenizer = byte_level_bpe()
    decoded = []
    detokenizer = Detokenizer(lambda ids: decoded.append(len(ids)) or tokenizer.decode(ids), ())
    ids = (encode(tokenizer, "数字 12 345 和 🙂 text ") * length)[:length]
    for before in range(0, length, 32):
        detokenizer.feed(ids[:before + 32], before, final=False)
    assert max(decoded) <= 32 + CONTEXT_TOKENS + 8
    start = time.perf_counter()
    detokenizer.feed(ids + ids[:32], length, final=True)
    record_property("last_block_s", time.perf_counter() - start)
