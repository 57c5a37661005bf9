"""A generation request: what the user asked for and where it stands in the engine."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from algorithms import AlgorithmParams, DllmAlgorithm
from replicas.batching import Phase
from replicas.detokenizer import Detokenizer
from replicas.grammar import TokenAutomaton
from replicas.logprobs import TokenLogprob
from replicas.request_cost import aligned_head, blocks_needed, prompt_pages
from replicas.messages import GenerateChunk, SamplingParams, text_at_end
from replicas.kv_cache import PageAllocation


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"
    ERROR = "error"
    TIMEOUT = "timeout"  # past its deadline (``SamplingParams.timeout_s``)


@dataclass(eq=False)
class Request:
    """A request in the engine. Its ``status`` says where it stands: its ``phase`` while it
    runs, ``Phase.FINISHED`` once ``finish_reason`` (the one record of its end) is set."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    algorithm: DllmAlgorithm
    algorithm_params: AlgorithmParams
    block_length: int
    arrival_time: float  # on the engine's clock
    on_output: Callable[[GenerateChunk], None] | None = None
    whole: bool = False  # the caller joins its chunks into one answer (``messages.joined``)
    # blocks aligned to the sequence's start (EngineConfig.block_alignment 'prompt'): the
    # first answer block is the one holding the prompt's (or the resumed output's) end
    aligned: bool = False
    # (the fields above never change: the layout fields at the end derive from them)

    # where the request stands and what it produced: changed by the scheduler only
    # (replicas.scheduler), which applies each committed block (``replicas.commits.BlockCommit``)
    phase: Phase = Phase.WAITING  # where its row stands (never FINISHED: ``status`` says that)
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
    algorithm_state: Any = None  # the algorithm's own, for the active block: a value its step reads and replaces
    output_ids: list[int] = field(default_factory=list)  # starts as ``params.resume_ids``
    # its text so far: advanced by the output processor as blocks commit (None where the
    # receiver decodes the text, ``text_at_end``)
    detokenizer: Detokenizer | None = None
    # the active block's, when asked: each step's written positions (``replicas.logprobs``)
    block_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: FinishReason | None = None
    # a constrained answer's automaton (``replicas.grammar``) and its state after the committed output
    constraint: TokenAutomaton | None = None
    constraint_state: int = 0
    adapter: Any = None  # its unmerged LoRA adapter (``replicas.adapters.Adapter``); None: the base model
    # pipelined decoding (``DllmAlgorithm.pipelined``): the blocks decoded after the active one, in order
    ahead: list[AheadBlock] = field(default_factory=list)

    # the request's layout, derived at construction from the fields that never change (on
    # the submitting thread, so that admission inside the engine's step only reads it)
    text_at_end: bool = field(init=False)  # its text is decoded by its receiver (``messages.text_at_end``)
    fixed_tokens: int = field(init=False)  # the prompt's and the resumed output's tokens
    resumed_blocks: int = field(init=False)  # blocks of output it resumes with
    prompt_pages: int = field(init=False)  # pages of the prompt (the last maybe partial); aligned: its full pages only
    prefix_pages: int = field(init=False)  # pages prefilled before the first denoised block (prompt's, resumed blocks')
    # tokens on each prefix page: full pages, but the prompt's last (unaligned)
    prefix_page_tokens: tuple[int, ...] = field(init=False)
    prefix_keys: tuple[tuple[int, ...], ...] = field(init=False)  # each prefix page's tokens: its prefix-cache key
    head: int = field(init=False)  # prompt (or resumed) tokens at the start of the first denoised block (aligned only)
    first_block_index: int = field(init=False)  # the block index denoising starts at (a continuation: after its resumed blocks)
    # the answer's blocks sit right after the prompt's tokens (aligned blocks, or a prompt of
    # whole pages): a later prompt repeating this prompt and answer continues its pages
    answer_continues_prompt: bool = field(init=False)
    suffix_pages: int = field(init=False)  # pages of an infill's text after the answer
    max_blocks: int = field(init=False)  # answer blocks max_tokens allows
    blocks_to_denoise: int = field(init=False)  # blocks the request can still take (each one page)

    def __post_init__(self) -> None:
        size, params, prompt = self.block_length, self.params, self.prompt_ids
        resume_ids = params.resume_ids
        self.text_at_end = text_at_end(params, self.whole)
        self.fixed_tokens = len(prompt) + len(resume_ids)
        self.resumed_blocks = len(resume_ids) // size
        self.prompt_pages = prompt_pages(len(prompt), size, self.aligned)
        self.head = aligned_head(self.fixed_tokens, size, self.aligned)
        self.max_blocks = blocks_needed(params.max_tokens, size)
        self.suffix_pages = -(-len(params.suffix_ids) // size)
        self.answer_continues_prompt = self.aligned or len(prompt) % size == 0

        def pages(ids: Sequence[int], count: int) -> list[tuple[int, ...]]:
            return [tuple(ids[i * size:(i + 1) * size]) for i in range(count)]

        if self.aligned:  # prompt and resumed ids run on without a gap, in whole pages
            self.prefix_pages = self.fixed_tokens // size
            self.prefix_page_tokens = (size,) * self.prefix_pages
            self.prefix_keys = tuple(pages(prompt + list(resume_ids), self.prefix_pages))
            # the answer's blocks start with the one holding the prompt's end
            self.first_block_index = self.prefix_pages - len(prompt) // size
            self.blocks_to_denoise = blocks_needed(self.head + params.max_tokens - len(resume_ids), size)
        else:  # the prompt's pages (its last maybe partial), then the resumed blocks'
            self.prefix_pages = self.prompt_pages + self.resumed_blocks
            tokens = [size] * self.prefix_pages
            if self.prompt_pages:
                tokens[self.prompt_pages - 1] = len(prompt) - (self.prompt_pages - 1) * size
            self.prefix_page_tokens = tuple(tokens)
            self.prefix_keys = tuple(pages(prompt, self.prompt_pages) + pages(resume_ids, self.resumed_blocks))
            self.first_block_index = self.resumed_blocks
            self.blocks_to_denoise = self.max_blocks - self.resumed_blocks

    @property
    def owner(self) -> Request:
        """The request a stepped block belongs to: itself (its active block's; see ``AheadBlock``)."""
        return self

    @property
    def cache_tree(self) -> str | None:
        """Whose prefix-cache KV it reads and writes: its adapter's, or the base model's (None)."""
        return None if self.adapter is None else self.adapter.name

    @property
    def status(self) -> Phase:
        """``phase``, or ``Phase.FINISHED`` once it has ended."""
        return self.phase if self.finish_reason is None else Phase.FINISHED

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

    def emit(self, output: GenerateChunk) -> None:
        if self.on_output is not None:
            self.on_output(output)


@dataclass(eq=False, slots=True)
class AheadBlock:
    """A block decoded after its request's active one (pipelined decoding): it is stepped
    with the active block and keeps its own algorithm state; it becomes the active block
    when the one before it commits (``Scheduler._start_block``), and commits only then."""

    owner: Request
    page_index: int
    algorithm_state: Any
    steps: int = 0  # forwards it was stepped in

    @property
    def algorithm(self) -> DllmAlgorithm:
        return self.owner.algorithm

    @property
    def algorithm_params(self) -> AlgorithmParams:
        return self.owner.algorithm_params

    @property
    def params(self) -> SamplingParams:
        return self.owner.params

    @property
    def constraint(self) -> None:
        return None  # structured output and pipelined decoding are not asked together (the engine refuses it)
