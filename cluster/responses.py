"""Render: a completion's chunks as the API's response: one JSON body, or SSE events.

A whole answer is one JSON body with every choice; a stream is one event per committed
block of each choice, then ``data: [DONE]``. Both carry the tokens' ``logprobs`` where
asked and the ``dllm`` block (steps, replica, engine time, the load knob's level and the
threshold the request ran with). An error after a stream's first event ends it with an
error event (its status, 200, went out already), counted in ``stream_errors``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse, StreamingResponse

from algorithms import get_algorithm
from cluster import protocol
from cluster.errors import APIError, internal_error
from cluster.preprocess import Completion, prompt_count
from cluster.tool_calls import StreamedCall, ToolChoice, whole_call
from replicas.messages import GenerateChunk, GenerateRequest, joined
from replicas.request import FinishReason
from replicas.token_bytes import token_bytes

log = logging.getLogger(__name__)

# a stream's headers: no cache and no proxy (nginx: X-Accel-Buffering) holds its events back
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def unanswered(chunks: list[GenerateChunk], job: GenerateRequest) -> APIError | None:
    """The 504 of a request whose deadline ended a choice (``chunks``: each choice's latest)
    before any of its choices committed a token: it has no answer. None otherwise (what was
    committed is the answer, ``finish_reason`` "timeout")."""
    if any(c.completion_tokens for c in chunks) or all(c.finish_reason != FinishReason.TIMEOUT for c in chunks):
        return None
    return APIError(504, f"the request ran past its deadline of {job.params.timeout_s:g} s before it committed "
                         "a token", type_="timeout_error", code="request_timeout")


def usage(answers: list[GenerateChunk], n: int) -> dict:
    """The usage of a request's choices, ``n`` a prompt, prompt by prompt: each prompt once,
    every choice's tokens."""
    per_prompt = [answers[i:i + n] for i in range(0, len(answers), n)]
    return protocol.usage(sum(choices[0].prompt_tokens for choices in per_prompt),
                          sum(a.completion_tokens for a in answers),
                          sum(min(a.cached_tokens for a in choices) for choices in per_prompt))


@dataclass(frozen=True)
class Answer:
    """What a response's bodies share: the first prompt's job (its id is the response's),
    when the request came (``created``, the same in every event of a stream), whether it is
    a chat, ``n`` and the text each choice starts with (``Render.echoes``)."""

    job: GenerateRequest
    created: int
    chat: bool
    n: int
    echoes: list[str]
    tools: ToolChoice | None = None  # the answers are calls of these tools

    def body(self, model: str, choices: list[protocol.Choice], chunk: bool, usage_: dict | None = None,
             extra: dict | None = None) -> dict:
        build = protocol.chat_body if self.chat else protocol.completion_body
        return build(self.job.request_id, self.created, model, choices, chunk, usage_, extra)


class Render:
    """The responses of ``model_name``'s completions; ``quality_levels``: the replicas' load-knob ladder."""

    def __init__(self, model_name: str, tokenizer, quality_levels: list):
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.quality_levels = quality_levels
        raw = token_bytes(tokenizer)
        self._piece = functools.lru_cache(maxsize=1 << 16)(
            lambda token: protocol.Piece(tokenizer.decode([token]), raw(token)))
        self.stream_errors: Counter[str] = Counter()  # error events ending streams sent as 200, by their status

    async def response(self, completion: Completion, chunks: AsyncIterator[tuple[int, GenerateChunk]]):
        """The completion's response from its choices' ``chunks`` (``cluster.dispatch``)."""
        body = completion.body
        answer = Answer(completion.jobs[0], int(time.time()), completion.chat, body.n, self.echoes(body),
                        completion.tools)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse(chunks, answer, include_usage), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await self._collect(chunks, answer)

    def echoes(self, body: protocol.SamplingFields) -> list[str]:
        """The text each choice starts with (``n`` a prompt, prompt by prompt): its prompt,
        where a completion asks for ``echo``, else nothing."""
        if not getattr(body, "echo", False):
            return [""] * (prompt_count(body) * body.n)
        return [prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
                for prompt in body.prompts for _ in range(body.n)]

    async def _collect(self, stream: AsyncIterator[tuple[int, GenerateChunk]], answer: Answer) -> JSONResponse:
        """The whole answer: every choice (``n`` a prompt, each starting with its echo)."""
        request_id = answer.job.request_id
        chunks: list[list[GenerateChunk]] = [[] for _ in answer.echoes]
        try:
            async for index, chunk in stream:
                chunks[index].append(chunk)
        except APIError:
            raise
        except Exception:
            log.exception("request %s failed", request_id)
            raise internal_error(request_id) from None
        if not all(chunks):
            log.error("request %s failed: no output from the replica", request_id)
            raise internal_error(request_id)
        answers = [joined(c) for c in chunks]
        failed = next((a for a in answers if a.error), None)
        if failed is not None:
            log.error("request %s failed: %s", request_id, failed.error)
            raise internal_error(request_id)
        refusal = unanswered(answers, answer.job)
        if refusal is not None:
            raise refusal
        choices = [protocol.Choice(i, echo + a.text, a.finish_reason, self._logprobs(a, answer.chat, 0),
                                   tool_call=whole_call(answer.tools, a.text))
                   for i, (echo, a) in enumerate(zip(answer.echoes, answers))]
        return JSONResponse(answer.body(answer.job.adapter or self.model_name, choices, chunk=False, usage_=usage(answers, answer.n),
                                        extra={"dllm": self._dllm_info(answer.job, *answers)}))

    async def _sse(self, stream: AsyncIterator[tuple[int, GenerateChunk]], answer: Answer,
                   include_usage: bool) -> AsyncIterator[str]:
        """One event per committed block of each choice (``n`` a prompt; the first one after
        its echo), then ``data: [DONE]``."""
        request_id = answer.job.request_id
        model = answer.job.adapter or self.model_name
        last: dict[int, GenerateChunk] = {}  # each choice's
        text_offsets: dict[int, int] = {}
        calls = {index: StreamedCall(answer.tools) for index in range(len(answer.echoes))} if answer.tools else {}
        try:
            async with contextlib.aclosing(stream):  # closed where an event ends it early: its charge released now
                async for index, chunk in stream:
                    if chunk.error:
                        log.error("request %s failed: %s", request_id, chunk.error)
                        yield self._error_event(internal_error(request_id))
                        break
                    refusal = unanswered([*last.values(), chunk], answer.job)
                    if refusal is not None:
                        raise refusal
                    logprobs = self._logprobs(chunk, answer.chat, text_offsets.get(index, 0))
                    if logprobs is not None and not answer.chat:
                        text_offsets[index] = text_offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
                    first = index not in last
                    text = answer.echoes[index] + chunk.text if first else chunk.text
                    choice = protocol.Choice(index, text, chunk.finish_reason, logprobs, first=first)
                    last[index] = chunk
                    if calls:
                        choice = calls[index].event(choice, chunk.finished)
                        if choice is None:  # a call that names its function: sent once whole
                            continue
                    yield protocol.sse_event(answer.body(model, [choice], chunk=True,
                                                         extra={"dllm": self._dllm_info(answer.job, chunk)}))
        except APIError as exc:
            yield self._error_event(exc)
        except Exception:
            log.exception("request %s failed", request_id)
            yield self._error_event(internal_error(request_id))
        choices = len(answer.echoes)
        if include_usage and len(last) == choices and not any(c.error for c in last.values()):
            yield protocol.sse_event(answer.body(model, [], chunk=True,
                                                 usage_=usage([last[i] for i in range(choices)], answer.n)))
        yield "data: [DONE]\n\n"

    def _error_event(self, error: APIError) -> str:
        """The event that ends a stream with ``error``, counted by its status: the stream's
        own status, 200, went out with its first event (``dllm_stream_errors_total``)."""
        self.stream_errors[str(error.status)] += 1
        return protocol.sse_event(error.body())

    def _logprobs(self, chunk: GenerateChunk, chat: bool, text_offset: int) -> dict | None:
        """The chunk's tokens' ``logprobs`` as the API shapes them; None when not asked."""
        if chunk.logprobs is None:
            return None
        piece = self._piece
        entries = [protocol.TokenEntry(piece(token), None if record is None else record.logprob,
                                       () if record is None else tuple((piece(t), lp) for t, lp in record.top))
                   for token, record in zip(chunk.token_ids, chunk.logprobs)]
        return protocol.chat_logprobs(entries) if chat else protocol.completion_logprobs(entries, text_offset)

    def _dllm_info(self, job: GenerateRequest, *chunks: GenerateChunk) -> dict:
        """The first choice's steps, replica, engine time, the load knob's level it ran at
        and its algorithm's threshold (where it has one); with several choices, each
        choice's under ``choices``."""
        def info(chunk: GenerateChunk) -> dict:
            threshold = self._threshold(job, chunk.quality_level)
            return {"steps": chunk.steps, "block_steps": chunk.block_steps, "replica": chunk.replica,
                    "engine_s": chunk.engine_s, "quality_level": chunk.quality_level,
                    **({} if threshold is None else {"threshold": threshold})}

        first = info(chunks[0])
        return first if len(chunks) == 1 else {**first, "choices": [info(c) for c in chunks]}

    def _threshold(self, job: GenerateRequest, quality_level: int) -> float | None:
        """The confidence threshold ``job`` ran with at the load knob's ``quality_level``
        (None where its algorithm has none)."""
        ran = job.params.algorithm_params
        if quality_level:
            ran = {**ran, **self.quality_levels[quality_level - 1].params}
        if "threshold" in ran:
            return ran["threshold"]
        field = get_algorithm(job.params.algorithm).params_class.__dataclass_fields__.get("threshold")
        return None if field is None else field.default
