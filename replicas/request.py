"""A generation request: what the user asked for and where it stands in the engine."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from algorithms import AlgorithmParams, DllmAlgorithm
from replicas.batching import Phase
from replicas.detokenizer import Detokenizer
from replicas.logprobs import TokenLogprob
from replicas.limits import aligned_head, blocks_needed, prompt_pages
from replicas.messages import GenerateChunk, SamplingParams
from replicas.kv_cache import PageAllocation


class cached_property:  # noqa: N801 (named as the functools one it replaces)
    """``functools.cached_property`` without the lock Python 3.11's takes on every first
    read (0.9 against 0.3 us a first read in a loop; a request reads eleven, and the
    engine's replayed steps took ~50 us less at full batch). What it computes depends only
    on fields that never change, so two threads reading it at once compute the same value."""

    def __init__(self, compute: Callable[[Any], Any]):
        self.compute = compute
        self.name = compute.__name__
        self.__doc__ = compute.__doc__

    def __get__(self, request: Any, owner: type | None = None) -> Any:
        if request is None:
            return self
        value = request.__dict__[self.name] = self.compute(request)  # read from the instance from now on
        return value


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"
    ERROR = "error"
    TIMEOUT = "timeout"  # past its deadline (``SamplingParams.timeout_s``)


@dataclass(eq=False)
class Request:
    """A request in the engine; ``finish_reason`` set is the one record of "finished"."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    algorithm: DllmAlgorithm
    algorithm_params: AlgorithmParams
    block_length: int
    arrival_time: float  # on the engine's clock
    on_output: Callable[[GenerateChunk], None] | None = None
    # the caller takes one chunk, the whole answer: ``on_output`` sees only that, and
    # ``on_progress(steps, the block's tokens)`` each block committed before it
    whole: bool = False
    on_progress: Callable[[int, int], None] | None = None
    # blocks aligned to the sequence's start (EngineConfig.block_alignment 'prompt'): the
    # first answer block is the one holding the prompt's (or the resumed output's) end
    aligned: bool = False
    # (the fields above never change: the cached properties below derive from them)

    # where the request stands and what it produced: changed by the scheduler only
    # (replicas.scheduler), which applies each committed block (``replicas.output.BlockCommit``)
    phase: Phase = Phase.WAITING
    row: int = -1
    # its pages (``replicas.kv_cache``); ``allocation.shared``: how many of its first pages
    # are the prefix cache's (found there at admission, or computed here and cached since)
    allocation: PageAllocation = field(default_factory=PageAllocation)
    prefilled_pages: int = 0  # pages of the prefix (prompt, resumed blocks) whose KV is in the cache
    cached_tokens: int = 0  # prefix tokens found in the cache at admission
    block_index: int = 0  # index of the active answer block
    steps_in_block: int = 0  # forwards of the active block so far
    committed_block_steps: list[int] = field(default_factory=list)
    unwritten_page: int | None = None  # page index of a committed block whose final KV is not cached yet
    unwritten_ids: tuple[int, ...] | None = None  # that block's ids, which key its page in the prefix cache
    num_steps: int = 0
    algorithm_state: Any = None
    output_ids: list[int] = field(default_factory=list)  # starts as ``params.resume_ids``
    # its text so far: advanced by the output processor as blocks commit
    detokenizer: Detokenizer | None = None
    # the active block's, when asked: filled in place by each step (``replicas.logprobs``)
    block_logprobs: list[TokenLogprob | None] | None = None
    # a whole answer's text and log-probabilities of its committed blocks, for its one chunk
    answer_text: list[str] = field(default_factory=list)
    answer_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @cached_property
    def text_at_end(self) -> bool:
        """A whole answer that no stop string needs the text of as it comes: its text is
        decoded once, with the block that ends it."""
        return self.whole and not self.params.stop

    @cached_property
    def prompt_pages(self) -> int:
        """Pages of the prompt (the last one maybe partial); aligned: its full pages only."""
        return prompt_pages(len(self.prompt_ids), self.block_length, self.aligned)

    @cached_property
    def fixed_tokens(self) -> int:
        """Tokens the request starts with: its prompt and the output it resumes."""
        return len(self.prompt_ids) + len(self.params.resume_ids)

    @cached_property
    def answer_continues_prompt(self) -> bool:
        """Whether the answer's blocks sit right after the prompt's tokens in the sequence
        (aligned blocks, or a prompt of whole pages), so that a later prompt repeating this
        prompt and answer continues its pages (the prefix cache keeps committed blocks)."""
        return self.aligned or len(self.prompt_ids) % self.block_length == 0

    @cached_property
    def head(self) -> int:
        """Prompt (or resumed) tokens at the start of the first denoised block (aligned only)."""
        return aligned_head(self.fixed_tokens, self.block_length, self.aligned)

    @cached_property
    def first_block_index(self) -> int:
        """The block index the request starts denoising at (a continuation goes on from its resumed blocks)."""
        if self.aligned:  # the answer's blocks start with the one holding the prompt's end
            return self.prefix_pages - len(self.prompt_ids) // self.block_length
        return self.resumed_blocks

    @property
    def answer_offset(self) -> int:
        """Where the answer starts in the active block: after the head in the first block."""
        return self.head if self.block_index == self.first_block_index else 0

    @property
    def active_page_index(self) -> int:
        """Page index of the active block."""
        return self.prefix_pages + self.block_index - self.first_block_index

    @property
    def deadline(self) -> float | None:
        timeout = self.params.timeout_s
        return None if timeout is None else self.arrival_time + timeout

    @cached_property
    def resumed_blocks(self) -> int:
        return len(self.params.resume_ids) // self.block_length

    @cached_property
    def prefix_pages(self) -> int:
        """Pages prefilled before the first denoised block: the prompt's and the resumed
        blocks' (aligned: the whole pages of prompt + resumed output)."""
        if self.aligned:
            return self.fixed_tokens // self.block_length
        return self.prompt_pages + self.resumed_blocks

    @cached_property
    def prefix_page_tokens(self) -> tuple[int, ...]:
        """Tokens on each prefix page: full pages, except the prompt's last (unaligned)."""
        tokens = [self.block_length] * self.prefix_pages
        if not self.aligned and self.prompt_pages:
            tokens[self.prompt_pages - 1] = len(self.prompt_ids) - (self.prompt_pages - 1) * self.block_length
        return tuple(tokens)

    @cached_property
    def prefix_keys(self) -> tuple[tuple[int, ...], ...]:
        """The tokens on each prefix page: the prefix cache's keys of the pages."""
        size = self.block_length

        def pages(ids: Sequence[int], count: int) -> list[tuple[int, ...]]:
            return [tuple(ids[i * size:(i + 1) * size]) for i in range(count)]

        if self.aligned:  # prompt and resumed ids run on without a gap, in whole pages
            return tuple(pages(self.prompt_ids + list(self.params.resume_ids), self.prefix_pages))
        # the prompt's pages (its last maybe partial), then the resumed blocks'
        return tuple(pages(self.prompt_ids, self.prompt_pages) + pages(self.params.resume_ids, self.resumed_blocks))

    @cached_property
    def suffix_pages(self) -> int:
        return -(-len(self.params.suffix_ids) // self.block_length)

    @cached_property
    def max_blocks(self) -> int:
        return blocks_needed(self.params.max_tokens, self.block_length)

    @cached_property
    def blocks_to_denoise(self) -> int:
        """Blocks the request can still take (each one page)."""
        if self.aligned:
            return blocks_needed(self.head + self.params.max_tokens - len(self.params.resume_ids), self.block_length)
        return self.max_blocks - self.resumed_blocks

    def emit(self, output: GenerateChunk) -> None:
        if self.on_output is not None:
            self.on_output(output)
