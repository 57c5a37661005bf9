"""OpenAI-compatible request and response bodies, with the dLLM extensions.

Unknown fields are ignored (OpenAI clients send many, as OpenAI's servers do); every field
OpenAI defines that this server cannot honour is refused (400, naming it) unless it has its
neutral value (``UNHONOURED``): a client that asks for JSON or tools gets an error, not free text.

Every field is bounded (docs/api.md "Request bounds"): the shape of a request here, with
constant limits and the ingress's settings (``RequestLimits``, passed as the validation
context: prompt characters and chat messages); the sampling values by the algorithms'
``validate`` (``algorithms``: temperature, top_k, seed, steps, ...); ``max_tokens`` and
``block_length`` by the model, at the ingress. The body itself is bounded by
``ingress.max_body_bytes`` before it is read.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, create_model,
                      field_validator)

from replicas.batching import SchedulerMode
from replicas.logprobs import MAX_TOP_LOGPROBS

MAX_NAME_CHARS = 256  # model, algorithm, user
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_ALGORITHM_PARAMS = 32
MAX_PARAM_NAME_CHARS = 64
MAX_CONTENT_PARTS = 256  # text parts of one chat message
MAX_STREAM_OPTIONS = 8
MAX_INT = 2**63 - 1  # integers the model bounds later (max_tokens, block_length) fit in 64 bits


@dataclass(frozen=True)
class RequestLimits:
    """The bounds that come from the ingress's settings (``IngressSettings``, same
    defaults): the validation context of the request models; without one, these defaults."""

    max_prompt_chars: int = 1 << 18  # a completion's prompt, and all the messages of a chat together
    max_messages: int = 512
    max_n: int = 8  # choices of one request (n x its prompts)

    @classmethod
    def of(cls, settings: Any) -> RequestLimits:
        return cls(settings.max_prompt_chars, settings.max_messages, settings.max_n)


def _limits(info: ValidationInfo) -> RequestLimits:
    return info.context if isinstance(info.context, RequestLimits) else RequestLimits()


class DllmExtensions(BaseModel):
    """Request fields beyond OpenAI's: how the blocks are denoised."""

    model_config = ConfigDict(allow_inf_nan=False)

    algorithm: str | None = Field(None, max_length=MAX_NAME_CHARS,
                                  description="denoise algorithm (default: the server's)")
    threshold: float | None = Field(None, description="confidence threshold of the algorithm")
    algorithm_params: dict[str, Any] | None = Field(None, description="any other algorithm parameter")
    block_length: int | None = Field(None, ge=1, le=MAX_INT, description="must equal the model's block length")
    mode: SchedulerMode | None = Field(None, description="must equal the replicas' mode")
    quality: Literal["fixed", "adaptive"] | None = Field(
        None, description="'adaptive': the replica may run the request at a lower confidence bar while it is "
                          "behind (the response's dllm.quality_level says which level); 'fixed': never "
                          "(default: the server's quality.default)")
    deadline_s: float | None = Field(
        None, gt=0, description="the latency this client accepts: refused at once (429) unless the cluster "
                                "predicts the answer within it, and ended if it runs past it: what it "
                                "committed, finish_reason 'timeout' (504 where nothing was) (default: the "
                                "server's slo.latency_s and request_timeout_s)")

    @field_validator("algorithm_params")
    @classmethod
    def _few_params(cls, params):
        """At most a few, with short names; the algorithm checks each value."""
        if params and len(params) > MAX_ALGORITHM_PARAMS:
            raise ValueError(f"algorithm_params takes at most {MAX_ALGORITHM_PARAMS} parameters")
        if params and any(len(name) > MAX_PARAM_NAME_CHARS for name in params):
            raise ValueError(f"algorithm_params names are at most {MAX_PARAM_NAME_CHARS} characters")
        return params


def _empty(value) -> bool:
    return not value


def _zero(value) -> bool:
    return value in (None, 0)


# OpenAI fields this server cannot honour: name -> (is the value neutral?, why not)
UNHONOURED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_empty, "function calling is not supported"),
    "function_call": (lambda v: v in (None, "none"), "function calling is not supported"),
    "logit_bias": (_empty, "not supported by the denoise algorithms"),
    "presence_penalty": (_zero, "repetition penalties are not supported by the denoise algorithms"),
    "frequency_penalty": (_zero, "repetition penalties are not supported by the denoise algorithms"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
}


# one optional field of any value per entry of UNHONOURED (their validator checks the value)
_UnhonouredFields = create_model("_UnhonouredFields", __base__=DllmExtensions,
                                 **{name: (Any, None) for name in UNHONOURED})


class SamplingFields(_UnhonouredFields):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(max_length=MAX_NAME_CHARS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT, description="output token limit (default: the server's)")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    ignore_eos: StrictBool = False
    # structured output (``cluster.structured``): OpenAI's, or one of vLLM's guided_* fields
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, max_length=65_536)
    guided_choice: list[str] | None = None
    # tool calls (``cluster.tool_calls``; the chat route's)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @field_validator(*UNHONOURED, mode="before")
    @classmethod
    def _neutral(cls, value, info: ValidationInfo):
        neutral, why = UNHONOURED[info.field_name]
        if not neutral(value):
            raise ValueError(why)
        return value

    @field_validator("n")
    @classmethod
    def _few_choices(cls, n: int, info: ValidationInfo) -> int:
        limit = _limits(info).max_n
        if not 1 <= n <= limit:
            raise ValueError(f"n must be 1 to {limit} on this server")
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, stop):
        """As a list, less empty strings (they stop nothing, as OpenAI takes them); one error
        for any other shape or size (not one per branch of the union)."""
        stops = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
        if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or any(
                not isinstance(s, str) or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"must be a string or a list of up to {MAX_STOP_STRINGS} strings of at most "
                             f"{MAX_STOP_CHARS} characters")
        return [s for s in stops if s]

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, options):
        if options is None:
            return options
        if len(options) > MAX_STREAM_OPTIONS:
            raise ValueError(f"stream_options takes at most {MAX_STREAM_OPTIONS} options")
        if not isinstance(options.get("include_usage", False), bool | None):
            raise ValueError("stream_options.include_usage must be a boolean")
        return options

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def is_prompt_shape(prompt: object) -> bool:
    """Whether a completion's unvalidated ``prompt`` is of a shape the API takes: text,
    token ids, or a list of texts or of token-id lists (empty or not)."""
    return isinstance(prompt, str) or _token_ids(prompt) or (isinstance(prompt, list) and (
        all(isinstance(p, str) for p in prompt) or all(map(_token_ids, prompt))))


def plain_prompt_count(prompt: object) -> int:
    """How many prompts an unvalidated ``prompt`` holds, or 0 where it is of no shape the API takes."""
    return len(prompt_list(prompt)) if is_prompt_shape(prompt) else 0


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """A completion's ``prompt`` as its prompts: text, token ids (``[int, ...]``), or a list of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class CompletionRequest(SamplingFields):
    """``prompt``: text, token ids (``[int, ...]``), or a list of either (each prompt gets
    ``n`` choices of its own, indexed prompt by prompt as OpenAI's API does)."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    suffix: str | None = Field(None, description="infilling: text after the answer, which the model fills in "
                                                 "before it (bidirectional models on the full canvas)")
    echo: StrictBool = Field(False, description="the prompt's text before each choice's answer")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="each token's log-probability and this many alternatives")
    best_of: StrictInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_of_the_prompt_shapes(cls, prompt):
        """One clear error for a prompt of another shape (a number, a mixed list, floats),
        instead of one per branch of the union, named after the branch."""
        if not is_prompt_shape(prompt):
            raise ValueError("must be a string, a list of strings, a list of token ids (integers) or a list "
                             "of lists of token ids")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _prompts_within_bounds(cls, prompt, info: ValidationInfo):
        """At least one prompt; prompts x n choices within ``max_n``; each prompt within
        ``max_prompt_chars`` (token ids: the model checks them, vocabulary and length)."""
        prompts, limits, n = prompt_list(prompt), _limits(info), info.data.get("n", 1)
        if not prompts:
            raise ValueError("the prompt list is empty")
        if len(prompts) * n > limits.max_n:
            raise ValueError(f"{len(prompts)} prompts x n {n} make {len(prompts) * n} choices; "
                             f"this server answers at most {limits.max_n} a request")
        for one in prompts:
            if len(one) > limits.max_prompt_chars:
                what = "characters" if isinstance(one, str) else "token ids"
                raise ValueError(f"a prompt has {len(one)} {what}; this server takes at most {limits.max_prompt_chars}")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt)

    @property
    def logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("suffix")
    @classmethod
    def _suffix_within_the_limit(cls, suffix, info: ValidationInfo):
        limit = _limits(info).max_prompt_chars
        if suffix is not None and len(suffix) > limit:
            raise ValueError(f"the suffix has {len(suffix)} characters; this server takes at most {limit}")
        return suffix

    @field_validator("logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, logprobs, info: ValidationInfo):
        if logprobs is not None and info.data.get("echo"):
            raise ValueError("logprobs with echo is not supported: the prompt's log-probabilities are not computed")
        return logprobs

    @field_validator("best_of")
    @classmethod
    def _one_of_one(cls, best_of):
        if best_of not in (None, 1):
            raise ValueError("best_of is not supported (1 only); n asks for several answers")
        return best_of


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role):
        """OpenAI's ``developer`` messages are the served templates' ``system`` ones (Qwen's,
        which Dream and SDAR use, render nothing of a role they do not know)."""
        return "system" if role == "developer" else role

    @field_validator("content", mode="before")
    @classmethod
    def _string_or_parts(cls, content, info: ValidationInfo):
        """One clear error for content of another type (null, a number, an object), instead
        of one per branch of the union, named after the branch. An assistant's message that
        called tools has none: empty (its calls are not rendered: the served templates know none)."""
        if content is None and info.data.get("role") == "assistant":
            return ""
        parts = isinstance(content, list) and all(isinstance(part, dict) for part in content)
        if not (isinstance(content, str) or parts):
            raise ValueError("must be a string or a list of text parts")
        return content

    @field_validator("content")
    @classmethod
    def _text_only(cls, content, info: ValidationInfo):
        if isinstance(content, list):
            if len(content) > MAX_CONTENT_PARTS:
                raise ValueError(f"content takes at most {MAX_CONTENT_PARTS} parts")
            parts = []
            for part in content:
                if part.get("type") != "text":
                    raise ValueError("only text content parts are supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text part needs its text (a string)")
                parts.append(part["text"])
            content = "\n".join(parts)  # one line each, as vLLM joins them
        limit = _limits(info).max_prompt_chars
        if len(content) > limit:
            raise ValueError(f"the content has {len(content)} characters; this server takes at most {limit}")
        return content


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top, info: ValidationInfo):
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @field_validator("messages", mode="before")
    @classmethod
    def _not_too_many(cls, messages, info: ValidationInfo):
        """Counted before any message is validated."""
        limit = _limits(info).max_messages
        if isinstance(messages, list) and len(messages) > limit:
            raise ValueError(f"{len(messages)} messages; this server takes at most {limit}")
        return messages

    @field_validator("messages")
    @classmethod
    def _some_within_the_limit(cls, messages, info: ValidationInfo):
        if not messages:
            raise ValueError("messages must not be empty")
        limit = _limits(info).max_prompt_chars
        chars = sum(len(m.content) for m in messages)
        if chars > limit:
            raise ValueError(f"the messages have {chars} characters together; this server takes at most {limit}")
        return messages


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; ``cached_tokens``: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class Choice:
    """One choice of an answer, or what a streamed event carries of one."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: dict | None = None
    first: bool = False  # a chat stream's first event of this choice: its delta names the role
    # a tool call (``cluster.tool_calls``): the whole call, or a stream event's part of it
    tool_call: dict | None = None


def completion_body(request_id: str, created: int, model: str, choices: list[Choice], chunk: bool,
                    usage_: dict | None = None, extra: dict | None = None) -> dict:
    """A completion, or one event of its stream (``created``: the request's, the same in every event)."""
    body = {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                    for c in choices],
    }
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    if extra:
        body.update(extra)
    return body


def _said(choice: Choice) -> dict:
    """A chat message's (or delta's) content, or its tool call."""
    if choice.tool_call is None:
        return {"content": choice.text}
    return {"content": None, "tool_calls": [{"index": 0, **choice.tool_call}]}


def _finish(choice: Choice) -> str | None:
    """``finish_reason``: OpenAI's "tool_calls" for a call whose arguments are whole (a
    structured answer that is whole at max_tokens stops there: ``Scheduler._commit``)."""
    return "tool_calls" if choice.tool_call is not None and choice.finish_reason == "stop" else choice.finish_reason


def chat_body(request_id: str, created: int, model: str, choices: list[Choice], chunk: bool,
              usage_: dict | None = None, extra: dict | None = None) -> dict:
    """A chat completion, or one event of its stream (``created`` as in ``completion_body``)."""
    if chunk:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": c.index, "delta": {**({"role": "assistant"} if c.first else {}), **_said(c)},
                             "logprobs": c.logprobs, "finish_reason": _finish(c)} for c in choices]}
        if usage_ is not None:
            body["usage"] = usage_
    else:
        body = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": c.index, "message": {"role": "assistant", **_said(c)},
                             "logprobs": c.logprobs, "finish_reason": _finish(c)} for c in choices],
                "usage": usage_}
    if extra:
        body.update(extra)
    return body


@dataclass(frozen=True)
class Piece:
    """A token as ``logprobs`` show it: its decoded ``text`` and the ``raw`` bytes it stands
    for (``replicas.token_bytes``); they differ where a token holds part of a character."""

    text: str
    raw: bytes

    @property
    def shown(self) -> str:
        """The text, or where the token holds only part of a character (its text decodes to
        U+FFFD), its bytes written as ``\\xe4\\xbd``: U+FFFD would stand for any of them."""
        if "\ufffd" not in self.text:
            return self.text
        try:
            return self.raw.decode()
        except UnicodeDecodeError:
            return "".join(f"\\x{b:02x}" for b in self.raw)


@dataclass(frozen=True)
class TokenEntry:
    """One returned token for ``logprobs``: the token, its log-probability (None: not
    recorded) and the alternatives ``(token, log-probability)``, the most likely first."""

    token: Piece
    logprob: float | None
    top: tuple[tuple[Piece, float], ...] = ()


UNLIKELY = -9999.0  # OpenAI's stand-in for a log-probability it cannot give


def completion_logprobs(entries: list[TokenEntry], text_offset: int) -> dict:
    """The ``logprobs`` of a completion choice (tokens as decoded text); ``text_offset``:
    the first token's offset in the answer."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token.text)
    return {"tokens": [e.token.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{piece.text: lp for piece, lp in e.top} for e in entries], "text_offset": offsets}


def chat_logprobs(entries: list[TokenEntry]) -> dict:
    """The ``logprobs`` of a chat choice: each token with the bytes it stands for, which a
    client joins over the tokens that split a character."""
    def described(piece: Piece, logprob: float | None) -> dict:
        return {"token": piece.shown, "logprob": UNLIKELY if logprob is None else logprob, "bytes": list(piece.raw)}

    return {"content": [{**described(e.token, e.logprob), "top_logprobs": [described(p, lp) for p, lp in e.top]}
                        for e in entries], "refusal": None}


def sse_event(body: dict) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {json.dumps(body)}\n\n"
