"""OpenAI-compatible request and response bodies, with the dLLM extensions.

Unknown fields are ignored (OpenAI clients send many); fields we cannot honour with a
different meaning (``n`` > 1, ``logprobs``, ``echo``, ``best_of``) are refused.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from replicas.batching import SchedulerMode


class DllmExtensions(BaseModel):
    """Request fields beyond OpenAI's: how the blocks are denoised."""

    algorithm: str | None = Field(None, description="denoise algorithm (default: the server's)")
    threshold: float | None = Field(None, description="confidence threshold of the algorithm")
    algorithm_params: dict[str, Any] | None = Field(None, description="any other algorithm parameter")
    block_length: int | None = Field(None, description="must equal the model's block length")
    mode: SchedulerMode | None = Field(None, description="must equal the replicas' mode")


class SamplingFields(DllmExtensions):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, description="output token limit (default: the server's)")
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    user: str | None = None
    ignore_eos: StrictBool = False

    @field_validator("n")
    @classmethod
    def _single_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    echo: StrictBool = False
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError("exactly one prompt per request is supported")
            prompt = prompt[0]
        return prompt

    @field_validator("echo", "logprobs", "best_of")
    @classmethod
    def _unsupported(cls, value, info):
        if value not in (None, False, 1):
            raise ValueError(f"{info.field_name} is not supported")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        return content


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    logprobs: StrictBool | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages):
        if not messages:
            raise ValueError("messages must not be empty")
        return messages

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value:
            raise ValueError("logprobs is not supported")
        return value


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, text: str, finish_reason: str | None,
                    chunk: bool, usage_: dict | None = None, extra: dict | None = None) -> dict:
    body = {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    if extra:
        body.update(extra)
    return body


def chat_body(request_id: str, model: str, text: str, finish_reason: str | None,
              chunk: bool, first: bool = False, usage_: dict | None = None, extra: dict | None = None) -> dict:
    if chunk:
        delta = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model, "choices": [choice]}
        if usage_ is not None:
            body["usage"] = usage_
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        body = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": [choice], "usage": usage_}
    if extra:
        body.update(extra)
    return body


def sse_event(body: dict) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {json.dumps(body)}\n\n"
