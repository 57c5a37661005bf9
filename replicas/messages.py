"""What the ingress and a replica send each other, and the checks of a request (no torch).

The ingress sends one ``GenerateRequest``, the engine request: tokenized, validated and
costed once by the ingress's preprocess (``cluster.preprocess``), with the engine's own
``SamplingParams``; the engine takes it as it comes (``Engine.submit``). The replica
answers with a stream of ``GenerateChunk``, one per committed block, the last one ``finished``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from replicas.request_cost import length_error, pages_needed
from replicas.logprobs import MAX_TOP_LOGPROBS, TokenLogprob

if TYPE_CHECKING:
    from replicas.models.spec import ModelSpec


class RequestError(ValueError):
    """A request the engine refuses; the message says why (the API turns it into a 4xx)."""



@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    algorithm: str | None = None  # None: the engine's default
    algorithm_params: dict[str, Any] = field(default_factory=dict)
    ignore_eos: bool = False
    # a continuation: the output a failed replica had committed (whole blocks); the
    # request goes on from the next block as if it had produced them itself
    resume_ids: tuple[int, ...] = ()
    timeout_s: float | None = None  # the request ends with a timeout this long after it arrived
    logprobs: int | None = None  # None: none; k: each token's log-probability and its step's k most likely
    # infilling: tokens fixed on the canvas after the answer's blocks, which the model fills
    # in between (a bidirectional model on the full canvas only)
    suffix_ids: tuple[int, ...] = ()
    # the request may run at a lower confidence bar while the replica is behind (``replicas.quality``)
    adaptive: bool = False
    # the answer's text matches this regular expression (``replicas.grammar``; the ingress
    # makes it of a response_format, a choice list or a client's own)
    regex: str | None = None

    def __post_init__(self):
        if self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise RequestError(f"timeout_s must be > 0, got {self.timeout_s}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs must be 0 to {MAX_TOP_LOGPROBS}, got {self.logprobs}")


@dataclass(frozen=True)
class GenerateRequest:
    """The engine request: one prompt, tokenized and checked against the model and the
    serving shape (``request_problem``), with what admission charged for it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cost: float | None = None  # row-steps charged at admission; None: the replica's worst case
    prompt_cost: int = 0  # of ``cost``, the row-steps charged for computing the prompt (done by the first block)
    # ``prefix_cache.page_hashes`` of the prompt where the replicas cache prefixes: the
    # router prefers the replica that was sent the longest of them
    prefix_hashes: tuple[int, ...] = ()
    # prompt tokens in the first answer block (blocks aligned to the sequence's start), as
    # ``cost`` counted them: a resumed attempt's cost is what is left of those blocks
    head: int = 0
    adapter: str | None = None  # the unmerged LoRA adapter it runs with (``EngineConfig.adapters``); None: the base model


@dataclass(slots=True)  # made per committed block; not frozen: a frozen init costs 4x
class GenerateChunk:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the block's committed ids (what a continuation resumes)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    # "invalid_request": the request itself was refused (a 400); "replica_fault": the
    # replica failed it for reasons of its own (another replica may serve it). (A request
    # past its deadline is no error: it finishes with what it committed, "timeout".)
    error_kind: Literal["invalid_request", "replica_fault"] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, found in the replica's prefix cache
    completion_tokens: int = 0
    steps: int = 0  # forwards the request took so far
    block_steps: list[int] = field(default_factory=list)  # steps of each committed block
    replica: str = ""
    engine_s: float = 0.0  # seconds since the replica received the request
    logprobs: list[TokenLogprob | None] | None = None  # one per token id, when the request asked
    quality_level: int = 0  # the load knob's level the request ran at (``replicas.quality``; 0: the default)

    @classmethod
    def refusal(cls, message: str) -> "GenerateChunk":
        return cls(finished=True, error=message, error_kind="invalid_request")


def text_at_end(params: SamplingParams, whole: bool) -> bool:
    """Whether a request's text is decoded once, from all its ids, by whoever receives its
    answer, on that thread (``Engine.with_answer_text``): a whole answer no stop string
    cuts, whose text nothing in the engine's step needs (detokenizing leaves the engine's
    loop, as it leaves vLLM's engine core)."""
    return whole and not params.stop


class WholeAnswer:
    """A whole answer put together by its receiver, the one place answers are joined: each
    block's text, ids and logprobs as it commits (``add``; ``on_block(steps, tokens)`` sees
    it), then the answer's last chunk (``ended``: the answer in one chunk, with the last
    chunk's counts and finish; an error chunk as it is). As a request's ``on_output`` it
    is called with that last chunk only and hands the answer to ``deliver``: the engine
    adds the blocks before it straight to it, without a chunk each."""

    __slots__ = ("deliver", "on_block", "texts", "token_ids", "logprobs")

    def __init__(self, deliver: Callable[[GenerateChunk], None] | None = None,
                 on_block: Callable[[int, int], None] | None = None):
        self.deliver, self.on_block = deliver, on_block
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []

    def add(self, text: str, token_ids: Sequence[int], logprobs: Sequence | None, steps: int) -> None:
        self.texts.append(text)
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs or ())
        if self.on_block is not None:
            self.on_block(steps, len(token_ids))

    def ended(self, last: GenerateChunk) -> GenerateChunk:
        """The answer: a new chunk (``last`` stays as it is)."""
        return last if last.error else self._joined_into(replace(last))

    def __call__(self, last: GenerateChunk) -> None:
        """The engine's last chunk, made for this receiver alone: the answer is joined into
        it (no copy of a chunk in the engine's step)."""
        if self.deliver is not None:
            self.deliver(last if last.error else self._joined_into(last))

    def _joined_into(self, last: GenerateChunk) -> GenerateChunk:
        last.text = "".join(self.texts) + last.text
        last.token_ids = self.token_ids + last.token_ids
        if last.logprobs is not None:
            last.logprobs = self.logprobs + last.logprobs
        return last


def joined(chunks: Sequence[GenerateChunk]) -> GenerateChunk:
    """A request's chunks as one (``WholeAnswer``), or its first error chunk as it is."""
    answer = WholeAnswer()
    for chunk in chunks[:-1]:
        if chunk.error:
            return chunk
        answer.add(chunk.text, chunk.token_ids, chunk.logprobs, chunk.steps)
    return answer.ended(chunks[-1])


INFILL_NEEDS = ("a suffix (infilling) needs a bidirectional model on the full canvas (replica.canvas 'full', "
                "LLaDA's and Dream's default): the answer's blocks must attend to the text after them")


@dataclass(frozen=True)
class RequestProblem:
    """Why a tokenized request cannot run; ``too_long``: it does not fit the context."""

    message: str
    too_long: bool = False


def outside_vocabulary(ids: Sequence[int], vocab_size: int) -> bool:
    """Whether any of ``ids`` is not a token id of a vocabulary of ``vocab_size``."""
    return bool(ids) and (min(ids) < 0 or max(ids) >= vocab_size)


def request_problem(prompt_ids: Sequence[int], max_tokens: int, spec: ModelSpec, max_model_len: int,
                    pool_pages: int | None = None, suffix_ids: Sequence[int] = ()) -> RequestProblem | None:
    """The first problem of a prompt, output limit and suffix (infilling) for this model, or
    None. ``pool_pages``: the KV pages of the replica's pool, where known."""
    if not prompt_ids:
        return RequestProblem("the prompt is empty")
    if outside_vocabulary(prompt_ids, spec.vocab_size):
        return RequestProblem("the prompt has token ids outside the vocabulary")
    if spec.mask_token_id in prompt_ids:
        return RequestProblem("the prompt contains the mask token id")
    if outside_vocabulary(suffix_ids, spec.vocab_size) or spec.mask_token_id in suffix_ids:
        return RequestProblem("the suffix has token ids outside the vocabulary or the mask token id")
    too_long = length_error(len(prompt_ids), max_tokens, spec.block_length, max_model_len, len(suffix_ids))
    if too_long:
        return RequestProblem(too_long, too_long=True)
    needed = pages_needed(len(prompt_ids), max_tokens, spec.block_length, len(suffix_ids))
    if pool_pages is not None and needed > pool_pages:
        return RequestProblem(f"the request needs {needed} KV pages; the pool has {pool_pages}")
    return None


def resume_problem(resume_ids: Sequence[int], max_tokens: int, spec: ModelSpec,
                   aligned_prompt_tokens: int = 0) -> str | None:
    """Why ``resume_ids`` cannot continue a request with this output limit, or None.
    Blocks aligned to the sequence's start (``aligned_prompt_tokens``: the prompt's length)
    end where prompt + resumed ids fill a whole block."""
    if not resume_ids:
        return None
    if (aligned_prompt_tokens + len(resume_ids)) % spec.block_length:
        what = "resume_ids, after the prompt, must end a block" if aligned_prompt_tokens else "resume_ids must be whole blocks"
        return f"{what} of {spec.block_length} tokens"
    if len(resume_ids) >= max_tokens:
        return "resume_ids must be shorter than max_tokens"
    if outside_vocabulary(resume_ids, spec.vocab_size) or spec.mask_token_id in resume_ids:
        return "resume_ids has token ids outside the vocabulary or the mask token id"
    return None
