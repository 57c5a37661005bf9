"""Committing a finished block into a request's output: EOS, max_tokens, stop strings, text
(``replicas.detokenizer``: emitted only once final).

``OutputProcessor.commit_block`` computes what a done block adds as a ``BlockCommit``
value; the scheduler applies it to the request (``Scheduler.update_from_step``), the one
place that changes request state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from replicas.detokenizer import Detokenizer
from replicas.logprobs import TokenLogprob
from replicas.messages import SamplingParams
from replicas.request import FinishReason, Request


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``; for a fast tokenizer without
    clean-up of tokenization spaces, its Rust backend called directly (what transformers'
    decode then does, without its per-call Python conversions: a sizeable part of an engine
    step's host time)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


@dataclass(slots=True)  # made per committed block: slots make it cheap
class BlockCommit:
    """What a done block adds to its request's output."""

    token_ids: list[int]  # up to the end (EOS, max_tokens, a stop string's last id included)
    text: str  # the text that became final, up to a stop string
    finish_reason: FinishReason | None  # set when this block ends the output
    logprobs: list[TokenLogprob | None] | None = None  # one per id, when the request asked


class OutputProcessor:
    def __init__(self, tokenizer, end_ids: frozenset[int]):
        """``end_ids``: the ids that end an answer (``ModelSpec.end_token_ids``)."""
        self.decode = text_decoder(tokenizer)
        self.clean_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.end_ids = end_ids

    def detokenizer(self, params: SamplingParams) -> Detokenizer:
        """A new request's text state; a continuation's starts after the blocks it resumes
        (``params.resume_ids``), whose text was emitted before."""
        return Detokenizer(self.decode, params.stop, self.clean_up, params.resume_ids)

    def answer_text(self, params: SamplingParams, answer_ids: Sequence[int]) -> str:
        """The text of a ``text_at_end`` answer (its ids after the ones it resumed): what its
        detokenizer emits fed them all at once. A function of the ids alone, so the answer's
        receiver decodes it on its own thread."""
        resumed = list(params.resume_ids)
        return self.detokenizer(params).feed(resumed + list(answer_ids), len(resumed), final=True)[0]

    def held_text(self, params: SamplingParams, ids: Sequence[int]) -> str:
        """The text a detokenizer fed ``ids`` (a request's committed output) holds back, which
        it emits once no more ids come (``Detokenizer.feed``'s ``final``)."""
        return self.answer_text(replace(params, resume_ids=tuple(ids)), ())

    def commit_block(self, request: Request, block_ids: list[int],
                     logprobs: Sequence[TokenLogprob | None] | None = None,
                     ends: FinishReason | None = None) -> BlockCommit:
        """What appending a done block (its answer ids, ``logprobs`` aligned with them) to
        ``request``'s output adds, and whether it ends it (EOS, max_tokens, a stop string;
        ``ends``: it ends for that reason anyway, e.g. an empty block at its deadline, whose
        commit is the text held back, now final). Advances the request's detokenizer (a
        ``text_at_end`` request has none: its receiver decodes its text, ``answer_text``);
        the request itself is left to the scheduler."""
        params = request.params
        finish = ends
        end = None
        if not params.ignore_eos and not self.end_ids.isdisjoint(block_ids):
            end = next(i for i, t in enumerate(block_ids) if t in self.end_ids)
        room = params.max_tokens - len(request.output_ids)
        if end is not None and end < room:  # an end id within max_tokens
            block_ids = block_ids[:end]
            finish = FinishReason.STOP
        elif len(block_ids) >= room:  # max_tokens reached first (an end id past it was never produced)
            block_ids = block_ids[:room]
            finish = FinishReason.LENGTH
        logprobs = None if logprobs is None else list(logprobs[:len(block_ids)])
        if request.text_at_end:
            return BlockCommit(block_ids, "", finish, logprobs)
        before = len(request.output_ids)
        output = request.output_ids + block_ids
        new_text, kept = request.detokenizer.feed(output, before, final=finish is not None)
        if kept is not None:  # a stop string ended here: the output ends with it
            block_ids = output[before:kept]
            finish = FinishReason.STOP
            logprobs = None if logprobs is None else logprobs[:len(block_ids)]
        return BlockCommit(block_ids, new_text, finish, logprobs)
