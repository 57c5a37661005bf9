"""Preprocess: a completion's body -> its engine requests, checked, tokenized and costed once.

Both entries of a completion (``cluster.completion_path`` below FastAPI, and the FastAPI
route) hand the body here: the bytes read and, for a small body, the JSON parsed of them
once (to refuse it cheaply under overload; validation takes the parsed JSON). What comes out is a ``Completion``: the validated body
and one ``GenerateRequest`` a prompt, each with its cost and prefix hashes, computed from
the serving shape; the replicas do not check or cost them again. The checks, cheapest
first (each one a 4xx error envelope):

1. under overload, admission's bound for the body's output blocks alone (``check_body``,
   from the parsed JSON before it is validated; again after);
2. the body validated (400, 404), and a prompt of more characters than the model's context
   holds (``MAX_CHARS_PER_TOKEN``) refused;
3. chat template and tokenization (in a worker thread for long prompts, inline otherwise:
   a short one costs less than the hop to a thread), then each prompt against the model
   (``messages.request_problem``) and its algorithm's parameters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pydantic import ValidationError

from algorithms import AlgorithmError, AlgorithmParams, DllmAlgorithm, get_algorithm
from algorithms.sampling import NO_FILTER
from cluster import protocol
from cluster.admission import AdmissionController, Refusals
from cluster.config import AppConfig
from cluster.errors import APIError, bad_request, validation_error
from cluster.router import PrefixMemory
from cluster.structure_compiler import ProcessCompiler
from cluster.structured import StructureError, constraint_regex, schema_regex
from cluster.tool_calls import ToolChoice, tool_choice
from replicas.grammar import IGNORE_EOS_UNSTRUCTURED, ConstraintError, Grammars, TokenAutomaton
from replicas.request_cost import aligned_head, blocks_needed, prompt_pages, room_for_output
from replicas.messages import INFILL_NEEDS, GenerateRequest, SamplingParams, request_problem
from replicas import block_pipeline
from replicas.prefix_cache import page_hashes
from replicas.engine_config import ServingShape, resolve_algorithm

log = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "threshold")
INLINE_PREPARE_CHARS = 4096  # prompts (or chats) up to this many characters are tokenized on the event loop
# far more characters a token than text averages (3-5): a prompt of more than max_model_len times
# this many is refused before it is tokenized
MAX_CHARS_PER_TOKEN = 32
# a JSON escape of a UTF-16 surrogate: ``json.loads`` takes a lone one that pydantic's parser refuses
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


COMPILE_TIMEOUT_S = 10.0  # a structure that takes longer to compile gets a 400 (its worker process stopped)


@dataclass(frozen=True)
class Constraint:
    """A request's structure: its regular expression and automaton, and the field that asked."""

    regex: str
    automaton: TokenAutomaton
    param: str

    def check_room(self, max_tokens: int) -> None:
        """400 where no answer of ``max_tokens`` tokens can match."""
        try:
            self.automaton.check_room(self.automaton.start, max_tokens)
        except ConstraintError as exc:
            raise bad_request(str(exc), param=exc.param or self.param) from None


def parsed_json(raw: bytes) -> dict | None:
    """``raw`` as a parsed JSON object, or None where the body's validation must read the
    bytes themselves: not a JSON object, or JSON that pydantic's own parser reads otherwise
    (a surrogate escape), so that either way a body gets the same answer."""
    if _SURROGATE_ESCAPE.search(raw):
        return None
    try:
        parsed = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deep
        return None
    return parsed if isinstance(parsed, dict) else None


@dataclass(frozen=True)
class Completion:
    """A completion request after preprocess: its validated body, whether it is a chat,
    and its engine requests, one a prompt (each of its ``n`` choices runs one)."""

    body: protocol.SamplingFields
    chat: bool
    jobs: list[GenerateRequest]
    tools: ToolChoice | None = None  # the answers are tool calls


def _positive_int(value: object) -> bool:
    return type(value) is int and 0 < value <= protocol.MAX_INT


def prompt_count(body: protocol.SamplingFields) -> int:
    """The prompts of a validated body (a chat's messages are one)."""
    return 1 if isinstance(body, protocol.ChatCompletionRequest) else len(body.prompts)


def _prompt_chars(body: protocol.SamplingFields) -> int:
    if isinstance(body, protocol.ChatCompletionRequest):
        return sum(len(str(m.content)) for m in body.messages)
    return sum(map(len, body.prompts))


class Preprocess:
    """The ingress's preprocess (see the module docstring). ``admission``: its bound and its
    costs; ``sent_prefixes``: the prompt pages admitted here, charged as cached next time;
    ``quality_levels``: the replicas' load-knob ladder."""

    def __init__(self, config: AppConfig, tokenizer, encode, spec, admission: AdmissionController,
                 refusals: Refusals, sent_prefixes: PrefixMemory, quality_levels: list):
        self.config = config
        self.tokenizer = tokenizer
        self.encode = encode
        self.spec = spec
        self.shape = ServingShape.of(config.replica, spec)  # what the replicas serve
        self.admission = admission
        self.refusals = refusals
        self.sent_prefixes = sent_prefixes
        self.quality_levels = quality_levels
        default_name, default_params = resolve_algorithm(config.replica, spec)
        get_algorithm(default_name).make_params(default_params)  # a bad default fails at start
        # one thread: a transformers tokenizer is not safe to call from several at once
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dllm-tokenize")
        self.grammars = Grammars(tokenizer, spec.end_token_ids, (spec.mask_token_id,), spec.vocab_size,
                                 index_of=ProcessCompiler(COMPILE_TIMEOUT_S))
        self._grammar_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dllm-grammar")

    # ---- the body ---------------------------------------------------------------------------
    def validated(self, raw: bytes, chat: bool, parsed: object = None) -> protocol.SamplingFields:
        """The body validated: ``parsed``, the JSON ``parsed_json`` made of ``raw``, where
        given, else ``raw`` itself; raises APIError. An invalid body's error is the one
        pydantic gives for ``raw`` (its messages name JSON's types, not Python's)."""
        model = protocol.ChatCompletionRequest if chat else protocol.CompletionRequest
        limits = protocol.RequestLimits.of(self.config.ingress)
        if parsed is not None:
            try:
                return model.model_validate(parsed, context=limits)
            except ValidationError:
                pass  # the error as the bytes give it, below
        try:
            return model.model_validate_json(raw, context=limits)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None

    def check_body(self, body: object, chat: bool) -> None:
        """The refusal of the output bound (``refuse_output_bound``), from the body as parsed
        JSON, before it is validated (``cluster.completion_path``); raises APIError. A body
        whose fields the check reads are not plainly valid passes: validation says what is wrong."""
        if not isinstance(body, dict):
            return
        limit = body.get("max_completion_tokens")
        limit = body.get("max_tokens") if limit is None else limit
        n, deadline = body.get("n", 1), body.get("deadline_s")
        prompts = 1 if chat else protocol.plain_prompt_count(body.get("prompt"))
        if (limit is None or _positive_int(limit)) and _positive_int(n) and prompts \
                and n * prompts <= self.config.ingress.max_n \
                and (deadline is None or (type(deadline) in (int, float) and 0 < deadline < math.inf)):
            self.refuse_output_bound(limit, n, prompts, deadline)

    def refuse_output_bound(self, output_limit: int | None, n: int, prompts: int, deadline_s: float | None) -> None:
        """429 where admission refuses the request's output blocks alone (``n`` choices of
        ``prompts`` prompts), before its prompt is tokenized (its pages are charged later)."""
        limit = min(max(self._max_tokens(output_limit), 1), self.max_model_len)
        blocks = blocks_needed(limit, self.shape.block_length)
        self.refusals.raise_if_refused(self.admission.quick_refusal(blocks * n * prompts, deadline_s))

    def check_model(self, model: str) -> str | None:
        """The unmerged adapter ``model`` names (None: the base model); the OpenAI 404 for a
        model this server does not serve."""
        if model == self.config.model_name:
            return None
        if model in self.config.replica.adapters:
            return model
        served = ", ".join(f"'{name}'" for name in [self.config.model_name, *self.config.replica.adapters])
        raise APIError(404, f"the model '{model}' does not exist; this server serves {served}",
                       type_="not_found_error", param="model", code="model_not_found")

    @property
    def max_model_len(self) -> int:
        """The longest request the replicas serve: the settings' bound, or less where a
        replica's memory cut it at start (the least that a reporting replica serves)."""
        cut = [view.max_model_len for view in self.admission.view.values() if view.max_model_len]
        return min(self.shape.max_model_len, *cut) if cut else self.shape.max_model_len

    def _max_tokens(self, output_limit: int | None) -> int:
        """A request's max_tokens (or max_completion_tokens), else the server's default."""
        return output_limit if output_limit is not None else self.config.default_max_tokens

    # ---- the engine requests ------------------------------------------------------------------
    async def completion(self, body: protocol.SamplingFields, chat: bool) -> Completion:
        """The validated body's engine requests; raises APIError."""
        self.refuse_output_bound(body.output_limit, body.n, prompt_count(body), body.deadline_s)
        chars = _prompt_chars(body)
        self._refuse_past_the_context(body, chat, chars)
        tools, constraint = await self._constraint(body, chat)
        if chars <= INLINE_PREPARE_CHARS:
            jobs = self._jobs(body, constraint)
        else:
            jobs = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self._jobs, body,
                                                                    constraint)
        return Completion(body, chat, jobs, tools)

    async def _constraint(self, body: protocol.SamplingFields, chat: bool) -> tuple[ToolChoice | None,
                                                                                     Constraint | None]:
        """The tools an answer calls, and the structure the body asks for (a tool call's
        arguments, or ``cluster.structured``'s fields), compiled for the model off the event
        loop, in a worker process stopped at ``COMPILE_TIMEOUT_S`` (cached); raises APIError
        (400 naming the field)."""
        try:
            if body.tools and not chat:
                raise StructureError("the chat route calls tools", "tools")
            tools = tool_choice(body.tools, body.tool_choice)
            asked = constraint_regex(body.response_format, body.guided_json, body.guided_regex, body.guided_choice)
            if tools is not None:
                if asked is not None:
                    raise StructureError("a tool call's arguments follow its function's schema; ask for no other "
                                         "structure", asked[0])
                asked = "tools", schema_regex(tools.schema, "tools")
        except StructureError as exc:
            raise bad_request(str(exc), param=exc.param) from None
        if asked is None:
            return None, None
        param, regex = asked
        if body.ignore_eos:
            raise bad_request(IGNORE_EOS_UNSTRUCTURED, param="ignore_eos")
        loop = asyncio.get_running_loop()
        # the model's vocabulary as the compiler reads it, made at the first structure (seconds
        # at 150K tokens) and outside the compile's bound, which counts the compile alone
        await loop.run_in_executor(self._grammar_thread, lambda: self.grammars.vocabulary)
        compiling = loop.run_in_executor(self._grammar_thread, self.grammars.automaton, regex)
        try:
            automaton = await compiling  # bounded by its worker process (``ProcessCompiler``)
        except ConstraintError as exc:
            raise bad_request(f"the structure {exc}", param=param) from None
        return tools, Constraint(regex, automaton, param)

    def _jobs(self, body: protocol.SamplingFields, constraint: Constraint | None = None) -> list[GenerateRequest]:
        prompts = self._prompts(body)
        jobs = []
        for index, prompt in enumerate(prompts):
            try:
                jobs.append(self.prepare(body, prompt, constraint))
            except APIError as exc:  # name the prompt of a list that is refused
                if len(prompts) > 1 and exc.param == "prompt":
                    exc.message = f"prompt {index}: {exc.message}"
                raise
        return jobs

    def _refuse_past_the_context(self, body: protocol.SamplingFields, chat: bool, chars: int) -> None:
        """400 ``context_length_exceeded``, before any tokenizing, for a prompt (a chat: its
        messages) of more characters than ``max_model_len`` tokens hold at ``MAX_CHARS_PER_TOKEN``
        each; ``chars``: every prompt's together."""
        limit = self.max_model_len * MAX_CHARS_PER_TOKEN
        if chars <= limit:
            return
        longest = chars if chat else max((len(p) for p in body.prompts if isinstance(p, str)), default=0)
        if longest > limit:  # (token ids: the model's own check counts them)
            what = "the messages have" if chat else "a prompt has"
            raise bad_request(f"{what} {longest} characters, over the {limit} that {self.max_model_len} tokens "
                              f"(this model's limit) hold at {MAX_CHARS_PER_TOKEN} characters a token",
                              param="messages" if chat else "prompt", code="context_length_exceeded")

    def _prompts(self, body: protocol.SamplingFields) -> list[str | list[int]]:
        """The prompts: a completion's own (texts or token ids), or the chat template applied to the messages."""
        if not isinstance(body, protocol.ChatCompletionRequest):
            return body.prompts
        messages = [m.model_dump() for m in body.messages]
        try:
            return [self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)]
        except Exception as exc:
            if type(exc).__module__.startswith("jinja2"):  # the template's refusal (raise_exception): about the messages
                raise bad_request(f"messages cannot be rendered by the chat template: {exc}", param="messages")
            log.exception("the chat template failed on a request's messages")  # no internal text to the client
            raise bad_request("messages cannot be rendered by the chat template", param="messages") from None

    def prepare(self, body: protocol.SamplingFields, prompt: str | list[int],
                constraint: Constraint | None = None) -> GenerateRequest:
        """Validate everything and build the engine request of one prompt; raises APIError."""
        adapter = self.check_model(body.model)
        block = self.spec.block_length
        if body.block_length is not None and body.block_length != block:
            raise bad_request(f"this model decodes in blocks of {block}; block_length {body.block_length} "
                              f"is not available", param="block_length")
        if body.mode is not None and body.mode != self.config.replica.mode:
            raise bad_request(f"the replicas run in mode '{self.config.replica.mode.value}'", param="mode")
        chat = isinstance(body, protocol.ChatCompletionRequest)
        if isinstance(prompt, str):
            # a rendered chat's markers are the template's special tokens, recognized as the model's own
            # apply_chat_template does; a completion's text stays text, special-token look-alikes included
            prompt_ids = self.encode(prompt, not chat)
        else:
            prompt_ids = prompt
        suffix_ids = self._suffix_ids(body)
        max_tokens = self._max_tokens(body.output_limit)
        max_model_len = self.max_model_len
        if max_tokens <= 0:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if max_tokens > max_model_len:
            raise bad_request(f"max_tokens {max_tokens} is over this model's limit of {max_model_len}",
                              param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        if body.output_limit is None:  # the default: at most what fits beside this prompt
            room = room_for_output(len(prompt_ids), block, max_model_len, len(suffix_ids))
            if room < 1:
                what = "the messages as the chat template renders them leave" if chat else "the prompt leaves"
                raise bad_request(f"{what} no room for an answer ({len(prompt_ids)} tokens): this model "
                                  f"serves at most {max_model_len} positions in blocks of {block}",
                                  param="messages" if chat else "prompt", code="context_length_exceeded")
            max_tokens = min(max_tokens, room)
        problem = request_problem(prompt_ids, max_tokens, self.spec, max_model_len, suffix_ids=suffix_ids)
        if problem is not None:  # a chat's prompt is its messages as the chat template renders them
            message = f"the messages as the chat template renders them: {problem.message}" if chat else problem.message
            raise bad_request(message, param="messages" if chat else "prompt",
                              code="context_length_exceeded" if problem.too_long else None)
        if constraint is not None:
            constraint.check_room(max_tokens)
        algorithm, algorithm_params, made = self._algorithm(body)
        if algorithm.pipelined:
            problem = block_pipeline.refusal(algorithm.name, self.spec, self.shape, constraint is not None,
                                             body.logprobs_asked is not None)
            if problem:
                raise bad_request(problem, param="algorithm")
        worst = algorithm.worst_case_steps(made, block, self.config.replica.fused_commit)
        # aligned blocks: the first answer block also holds the prompt's end
        head = aligned_head(len(prompt_ids), block, self.shape.aligned)
        # the engine's own parameters (every field checked above: its checks cannot refuse them)
        params = SamplingParams(
            max_tokens=max_tokens, stop=tuple(body.stop or ()), algorithm=algorithm.name,
            algorithm_params=algorithm_params, ignore_eos=body.ignore_eos, logprobs=body.logprobs_asked,
            timeout_s=min((t for t in (self.config.request_timeout_s, body.deadline_s) if t is not None), default=None),
            suffix_ids=suffix_ids, adaptive=(body.quality or self.config.quality.default) == "adaptive",
            regex=None if constraint is None else constraint.regex)
        cost = self.admission.cost(head + max_tokens, block, worst, self.shape.max_cost)
        if params.adaptive:
            cost = self._adaptive_cost(cost, algorithm.name)
        hashes = page_hashes(prompt_ids, block, adapter) if self.shape.prefix_cache else ()
        # the prompt's pages the replicas compute, less those of the longest prefix this ingress
        # sent: likely cached where it went
        uncached = prompt_pages(len(prompt_ids), block, self.shape.aligned) - self.sent_prefixes.known_pages(hashes)
        prompt_cost = math.ceil(self.admission.prompt_cost(uncached))
        return GenerateRequest(protocol.new_id("chatcmpl" if chat else "cmpl"), prompt_ids, params,
                               min(cost + prompt_cost, self.shape.max_cost), prompt_cost, hashes, head, adapter)

    def _adaptive_cost(self, cost: int, algorithm: str) -> int:
        """An adaptive request's charge while the replicas run degraded: ``cost`` at the
        level of the least degraded replica (its setting takes fewer steps a block), where
        that level changes the request's algorithm."""
        level = min((view.quality_level for view in self.admission.view.values()), default=0)
        if not 0 < level <= len(self.quality_levels) or self.quality_levels[level - 1].algorithm != algorithm:
            return cost
        return max(1, math.ceil(cost * self.quality_levels[level - 1].step_ratio))

    def _suffix_ids(self, body: protocol.SamplingFields) -> tuple[int, ...]:
        """A completion's suffix (infilling), tokenized; 400 where the replicas cannot infill."""
        suffix = getattr(body, "suffix", None)
        if not suffix:
            return ()
        if self.shape.canvas != "full":
            raise bad_request(f"{INFILL_NEEDS}; this model is {'bidirectional on the block canvas' if self.spec.bidirectional else 'block-causal'}",
                              param="suffix")
        return tuple(self.encode(suffix, True))

    def _algorithm(self, body: protocol.SamplingFields) -> tuple[DllmAlgorithm, dict, AlgorithmParams]:
        """The request's algorithm, its parameters (its sampling fields and algorithm_params
        on top of the default: ``replicas.engine_config.resolve_algorithm``) and those validated."""
        requested = {f: getattr(body, f) for f in SAMPLING_FIELDS if getattr(body, f) is not None}
        name, params = resolve_algorithm(self.config.replica, self.spec, body.algorithm)
        try:
            algorithm = get_algorithm(name)
        except AlgorithmError as exc:
            raise bad_request(str(exc), param="algorithm")
        known = algorithm.params_class.__dataclass_fields__
        for field, value in requested.items():
            if field in known:
                params[field] = value
            elif value not in NO_FILTER.get(field, ()):  # a filter's neutral value is as if absent
                raise bad_request(f"algorithm '{name}' has no parameter '{field}'", param=field)
        params.update(body.algorithm_params or {})
        try:
            made = algorithm.make_params(params)
        except AlgorithmError as exc:  # named as the client sent it: a top-level field or algorithm_params.<name>
            param = (f"algorithm_params.{exc.param}" if exc.param in (body.algorithm_params or {})
                     else exc.param if exc.param in requested else "algorithm_params")
            raise bad_request(str(exc), param=param)
        if made.seed is None and algorithm.draws_noise(made):  # a resumed request draws what the first would have
            params["seed"] = secrets.randbits(63)
        return algorithm, params, made
