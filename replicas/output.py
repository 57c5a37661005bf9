"""Committing a finished block into a request's output: EOS, max_tokens, stop strings, text
(``replicas.detokenizer``: emitted only once final)."""

from __future__ import annotations

import time
from collections.abc import Callable

from replicas.detokenizer import Detokenizer
from replicas.logprobs import TokenLogprob
from replicas.request import FinishReason, Request, RequestOutput


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``; for a fast tokenizer without
    clean-up of tokenization spaces, its Rust backend called directly (what transformers'
    decode then does, without its per-call Python conversions: a sizeable part of an engine
    step's host time)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


class OutputProcessor:
    def __init__(self, tokenizer, end_ids: frozenset[int], clock: Callable[[], float] = time.monotonic):
        """``end_ids``: the ids that end an answer (``ModelSpec.end_token_ids``)."""
        self.decode = text_decoder(tokenizer)
        self.clean_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.end_ids = end_ids
        self.clock = clock

    def start(self, request: Request) -> None:
        """Start the request's output: empty, or for a continuation the blocks it resumes
        (``params.resume_ids``), whose text was emitted before."""
        request.output_ids = list(request.params.resume_ids)
        request.detokenizer = Detokenizer(self.decode, request.params.stop, self.clean_up, request.output_ids)

    def commit_block(self, request: Request, block_ids: list[int]) -> tuple[list[int], str]:
        """Append a done block to ``request``'s output, set its finish reason if this ends
        it (EOS, max_tokens, a stop string), and return the token ids and text it added:
        the ids up to the end (a stop string's included), the text up to the stop string."""
        params = request.params
        finish = None
        end = None if params.ignore_eos else next((i for i, t in enumerate(block_ids) if t in self.end_ids), None)
        if end is not None:
            block_ids = block_ids[:end]
            finish = FinishReason.STOP
        room = params.max_tokens - len(request.output_ids)
        if len(block_ids) >= room:
            block_ids = block_ids[:room]
            finish = finish or FinishReason.LENGTH
        before = len(request.output_ids)
        request.output_ids.extend(block_ids)
        new_text, kept = request.detokenizer.feed(request.output_ids, before, final=finish is not None)
        if kept is not None:  # a stop string ended here: the output ends with it
            del request.output_ids[kept:]
            block_ids = request.output_ids[before:]
            finish = FinishReason.STOP
        now = self.clock()
        if request.first_block_time is None:
            request.first_block_time = now
        if finish is not None:
            request.finish_reason = finish
            request.finish_time = now
        return block_ids, new_text

    @staticmethod
    def snapshot(request: Request, new_ids: list[int], new_text: str, error: str | None = None,
                 replica_fault: bool = False, new_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=request.finish_reason is not None,
            finish_reason=request.finish_reason,
            error=error,
            replica_fault=replica_fault,
            num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=len(request.output_ids),
            num_steps=request.num_steps,
            block_steps=list(request.committed_block_steps),
            new_logprobs=new_logprobs,
        )
