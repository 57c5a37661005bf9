"""The OpenAI-compatible ingress: cheap refusals first, then validation, tokenization,
step-aware admission and streaming.

Everything a client can get wrong is caught here and answered with a 4xx error
envelope; a replica only ever sees tokenized, validated requests. A request meets the
cheapest checks first:

1. auth, draining and Content-Length (401, 503, 413) before the body is read;
2. admission's bound: 429 without reading the body when even a one-block request would
   be refused now (``AdmissionController.quick_refusal``). Steps 1-2 read only headers;
   ``cluster.completion_path`` runs them, and then the route, below FastAPI's machinery;
3. the body parsed and validated (400, 404), then the bound again for its output blocks, and
   a prompt of more characters than the model's context holds (``MAX_CHARS_PER_TOKEN``) refused;
4. chat template and tokenization (in a worker thread for long prompts, inline otherwise:
   a short one costs less than the hop to a thread);
5. the exact cost charged (``try_admit``), or 429.

A streamed request reads the replica's stream, one chunk per committed block; a
non-streamed one is one unary call (``EngineReplica.generate_unary``), answered once.

Admission counts, the row-steps outstanding and this process's CPU time reach the
metrics actor in one call per stats period, which also brings back the replicas' stats
and the draining order (`dllm-serve up` on SIGTERM: from then on every request gets 503
``server_draining`` with ``Retry-After`` before anything else, and the requests in flight
here, reported with each call, are left to finish); no request waits on the metrics actor.
"""

# No postponed annotations here: FastAPI must see the routes' parameter types as objects
# once Serve has shipped the routes to the replica.
import asyncio
import functools
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import ray
from fastapi import FastAPI, Header, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import ClientDisconnect

from algorithms import AlgorithmError, AlgorithmParams, DllmAlgorithm, get_algorithm
from algorithms.sampling import NO_FILTER
from cluster import completion_path, http_tally, protocol
from cluster.admission import AdmissionController, Charge, Decision
from cluster.auth import ApiKey, KeyRing, KeySlot, load_keys
from cluster.choices import merged, rows
from cluster.config import AppConfig
from cluster.disconnects import unless_disconnected
from cluster.errors import (APIError, bad_request, client_left, install_error_handlers, internal_error,
                            logged_failure, validation_error)
from cluster.failover import Failover, ReplicaFailed
from cluster.front_door import FrontDoor
from cluster.metrics import ACTOR_NAME, ACTOR_NAMESPACE
from cluster.request_path import logs_to_stderr_in_this_process, path_in_this_process
from cluster.router import PrefixMemory
from replicas.heap import settle_after_start_up
from replicas.limits import aligned_head, blocks_needed, prompt_pages, room_for_output
from replicas.messages import INFILL_NEEDS, GenerateChunk, GenerateRequest, SamplingParams, joined, request_problem
from replicas.models import load_model_spec, load_tokenizer
from replicas.output import OutputProcessor
from replicas.prefix_cache import page_hashes
from replicas.reports import IngressReport, stale_after_s
from replicas.request import FinishReason
from replicas.settings import ServingShape, resolve_algorithm
from replicas.text_encoding import text_encoder
from replicas.token_bytes import token_bytes

log = logging.getLogger(__name__)

# the API description routes are the Ingress's own, behind the key like the rest
app = FastAPI(title="dllm-serve", description="OpenAI-compatible API for masked diffusion LMs",
              docs_url=None, redoc_url=None, openapi_url=None)
install_error_handlers(app)
app.add_middleware(completion_path.CompletionPath)  # the completion routes skip FastAPI's machinery
app.add_middleware(http_tally.HttpTally)  # outermost: it counts every response, early answers included

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "threshold")
INLINE_PREPARE_CHARS = 4096  # prompts (or chats) up to this many characters are tokenized on the event loop
# far more characters a token than text averages (3-5): a prompt of more than max_model_len times
# this many is refused before it is tokenized
MAX_CHARS_PER_TOKEN = 32
# a stream's headers: no cache and no proxy (nginx: X-Accel-Buffering) holds its events back
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# Module-level helpers of the Ingress class go above it: `serve.ingress` copies the class
# when it decorates it, with the module globals defined at that moment.
def _unanswered(chunks: list[GenerateChunk], job: GenerateRequest) -> APIError | None:
    """The 504 of a request whose deadline ended a choice (``chunks``: each choice's latest)
    before any of its choices committed a token: it has no answer. None otherwise (what was
    committed is the answer, ``finish_reason`` "timeout")."""
    if any(c.completion_tokens for c in chunks) or all(c.finish_reason != FinishReason.TIMEOUT for c in chunks):
        return None
    return APIError(504, f"the request ran past its deadline of {job.params.timeout_s:g} s before it committed "
                         "a token", type_="timeout_error", code="request_timeout")


def _usage(answers: list[GenerateChunk], n: int) -> dict:
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
    a chat, ``n`` and the text each choice starts with (``Ingress._echoes``)."""

    job: GenerateRequest
    created: int
    chat: bool
    n: int
    echoes: list[str]

    def body(self, model: str, choices: list[protocol.Choice], chunk: bool, usage_: dict | None = None,
             extra: dict | None = None) -> dict:
        build = protocol.chat_body if self.chat else protocol.completion_body
        return build(self.job.request_id, self.created, model, choices, chunk, usage_, extra)


def _prompt_count(body: protocol.SamplingFields) -> int:
    return 1 if isinstance(body, protocol.ChatCompletionRequest) else len(body.prompts)


def _positive_int(value: object) -> bool:
    return type(value) is int and 0 < value <= protocol.MAX_INT


def _prompt_chars(body: protocol.SamplingFields) -> int:
    if isinstance(body, protocol.ChatCompletionRequest):
        return sum(len(str(m.content)) for m in body.messages)
    return sum(map(len, body.prompts))


@serve.ingress(app)
class Ingress:
    def __init__(self, replicas: DeploymentHandle, config: dict):
        self.config = AppConfig.model_validate(config)
        self.request_path = path_in_this_process()
        # Ray actor calls on every path (``request_path.GRPC_ENV``: Serve's gRPC transport
        # leaks native memory in this process)
        self.replicas = replicas.options(stream=True, _by_reference=True)
        self.replicas_unary = replicas.options(stream=False, _by_reference=True)
        self.keys = KeyRing(load_keys(self.config.api_key_file))  # read here, never passed in the arguments
        self.tokenizer = load_tokenizer(self.config.model)
        self.encode = text_encoder(self.tokenizer)
        raw = token_bytes(self.tokenizer)
        self._piece = functools.lru_cache(maxsize=1 << 16)(
            lambda token: protocol.Piece(self.tokenizer.decode([token]), raw(token)))
        self.spec = load_model_spec(self.config.model, self.config.replica.model_overrides)
        default_name, default_params = resolve_algorithm(self.config.replica, self.spec)
        get_algorithm(default_name).make_params(default_params)  # a bad default fails at start
        self.shape = ServingShape.of(self.config.replica, self.spec)  # what the replicas serve
        knob = self.config.quality_knob()
        self.quality_levels = knob.levels if knob else []  # the replicas' ladder: a response names its level's
        self.admission = AdmissionController(self.config.admission, self.config.slo.latency_s,
                                             self.config.autoscaling.min_replicas,
                                             stale_after_s=stale_after_s(self.config.stats_period_s))
        self.sent_prefixes = PrefixMemory()  # the prompt pages admitted here: charged as cached next time
        # one thread: a transformers tokenizer is not safe to call from several at once
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dllm-tokenize")
        self.ingress_id = protocol.new_id("ingress")
        self.admitted = 0
        self.failovers = 0
        self.rejected: Counter[str] = Counter()
        self.stream_errors: Counter[str] = Counter()  # error events ending streams sent as 200, by their status
        settings = self.config.failover
        failover = dict(max_attempts=settings.max_attempts, backoff_s=settings.backoff_s,
                        block_length=self.shape.block_length, aligned=self.shape.aligned,
                        on_failover=self._count_failover, healthy_elsewhere=self._healthy_elsewhere,
                        healthy_wait_s=settings.healthy_wait_s,
                        held_text=OutputProcessor(self.tokenizer, self.spec.end_token_ids).held_text)
        self.failover = Failover(lambda job: self.replicas.generate.remote(job), **failover)
        self.failover_unary = Failover(self._unary, **failover)
        self._metrics = None
        self._sync_task: asyncio.Task | None = None
        self.draining = False  # set once by the metrics actor's answer (`dllm-serve up` stopping); never unset
        self.in_flight = 0  # routes running here, plus streams still sending after their route returned
        try:  # the replicas' reports from the start, not from the first request
            self._ensure_sync_task()
        except RuntimeError:  # no event loop in this thread: the first request starts it
            pass
        completion_path.serve_for(self)
        # request path 'ingress': this replica serves the API port itself (Serve runs no proxy)
        own_http = self.request_path == "ingress"
        self.front_door = FrontDoor(app, self.config.host, self.config.port) if own_http else None
        settle_after_start_up()

    async def check_health(self) -> None:
        """Serve's health check: where this replica serves HTTP itself, its server must be up."""
        problem = self.front_door.problem() if self.front_door else None
        if problem:
            raise RuntimeError(problem)

    def __del__(self):
        if getattr(self, "front_door", None):
            self.front_door.close()

    # ---- routes -------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        self._ensure_sync_task()
        return {"status": "ok", "draining": self.draining, "replicas_reporting": len(self.admission.view),
                "slo_latency_s": self.admission.slo_latency_s,  # the SLO in force; `bench overload` reads it
                "request_path": self.request_path,
                "replica_stderr_kept": logs_to_stderr_in_this_process(),  # where the project's warnings go
                # the replicas' CPU seconds in forwards and in engine steps so far, as last reported:
                # `bench overload` shows their process CPU apart from them
                "forward_cpu_s": sum(v.forward_cpu_s for v in self.admission.view.values()),
                "step_cpu_s": sum(v.step_cpu_s for v in self.admission.view.values())}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, authorization: str | None = Header(None)):
        self._authorize(authorization)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(self, authorization: str | None = Header(None)):
        """Swagger UI with the API description inside the page: a page loaded with the key
        would fetch /openapi.json without it (401) and show nothing."""
        self._authorize(authorization)
        return get_swagger_ui_html(openapi_url="", title="dllm-serve", swagger_ui_parameters={"spec": app.openapi()})

    @app.get("/v1/models")
    async def models(self, authorization: str | None = Header(None)):
        self._authorize(authorization)
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model:path}")  # ``path``: a model name may hold slashes (org/name)
    async def model(self, model: str, authorization: str | None = Header(None)):
        self._authorize(authorization)
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "owned_by": "dllm-serve", "created": 0}

    def _check_model(self, model: str) -> None:
        """Raise the OpenAI 404 for a model this server does not serve."""
        if model != self.config.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{self.config.model_name}'", type_="not_found_error", param="model",
                           code="model_not_found")

    @app.get("/v1/dllm/calibration")
    async def calibration(self, window_s: float = Query(60.0, gt=0),
                          authorization: str | None = Header(None)):
        """What every live replica measured in the last ``window_s`` seconds (kept by the
        metrics actor), for `dllm-serve calibrate`."""
        self._authorize(authorization)
        actor = self._metrics_actor()
        if actor is None:
            raise APIError(503, "the metrics actor is not running", type_="server_error")
        try:
            replicas = await asyncio.wait_for(actor.calibration.remote(window_s),
                                              self.config.ingress.metrics_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(503, "the metrics actor did not answer in time", type_="server_error") from None
        except ray.exceptions.RayActorError:  # it died or is restarting: look it up afresh next time
            self._metrics = None
            raise APIError(503, "the metrics actor is restarting; retry", type_="server_error",
                           headers={"Retry-After": "1"}) from None
        return {"max_batch": self.config.replica.max_batch, "replicas": replicas}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request, False, self.check_before_body(request.headers))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate(request, True, self.check_before_body(request.headers))

    async def answer(self, scope: dict, receive, send, key: ApiKey | None) -> None:
        """A completion route's answer, called below FastAPI (``cluster.completion_path``,
        which ran ``check_before_body``: ``key`` is what it returned): what the route
        returns, or raises as its error envelope."""
        try:
            response = await self._generate(Request(scope, receive), scope["path"] == completion_path.CHAT_PATH, key)
        except APIError as exc:
            response = exc.response()
        except ClientDisconnect:
            response = client_left(scope["method"], scope["path"])
        except Exception as exc:
            response = logged_failure(scope["method"], scope["path"], exc).response()
        await response(scope, receive, send)

    # ---- the request path -------------------------------------------------------------------
    async def _generate(self, request: Request, chat: bool, key: ApiKey | None):
        """A completion route, once ``check_before_body`` passed (``key``: the caller's):
        the key's limit first, then ``_read`` and ``_serve``; the key's place is held until
        the response ends."""
        with self._counted():
            slot = self._key_slot(key)
            try:
                body = await self._read(request, protocol.ChatCompletionRequest if chat else protocol.CompletionRequest)
                if body.stream:  # a stream notices its client leaving by itself
                    return await self._serve(body, chat, slot)
                answer = await unless_disconnected(request, self._serve(body, chat, slot))
                slot.release()  # (released already, unless the client left before the replicas were asked)
                return answer
            except BaseException:
                slot.release()
                raise

    def check_before_body(self, headers: Mapping[str, str]) -> ApiKey | None:
        """The checks a request meets before its body is read, each before the costlier
        ones: key, draining, size, admission's bound; raises APIError, else returns the
        caller's key. ``cluster.completion_path`` runs them below FastAPI too."""
        key = self._authorize(headers.get("authorization"))
        if self.draining:
            raise APIError(503, "the server is shutting down and admits no new requests; retry on another "
                                "server or once it is back", type_="server_error", code="server_draining",
                           headers={"Retry-After": "1"})
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.config.ingress.max_body_bytes:
            raise self._too_large(self.config.ingress.max_body_bytes)
        self._ensure_sync_task()
        self._refuse_if(self.admission.quick_refusal())
        return key

    def _authorize(self, authorization: str | None) -> ApiKey | None:
        """The caller's key (None when no key is required), or 401."""
        key = self.keys.match(authorization)
        if key is None and self.keys.required:
            raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                           type_="authentication_error", code="invalid_api_key")
        return key

    def _key_slot(self, key: ApiKey | None) -> KeySlot:
        slot = self.keys.acquire(key)
        if slot is None:
            raise APIError(429, f"this API key has its {key.max_concurrent} requests in flight; retry when one ends",
                           type_="rate_limit_error", code="key_concurrency_exceeded", headers={"Retry-After": "1"})
        return slot

    async def _read(self, request: Request, model: type[BaseModel]):
        """The body read (at most ``max_body_bytes``) and validated; raises APIError."""
        limit = self.config.ingress.max_body_bytes
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > limit:
                raise self._too_large(limit)
        try:
            return model.model_validate_json(raw, context=protocol.RequestLimits.of(self.config.ingress))
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None

    @staticmethod
    def _too_large(limit: int) -> APIError:
        return APIError(413, f"the request body is over this server's limit of {limit} bytes",
                        code="request_too_large")

    def _refuse_if(self, decision: Decision | None) -> None:
        """429 with Retry-After for a refusal (counted for the metrics actor)."""
        if decision is None or decision.admitted:
            return
        self.rejected["step_capacity"] += 1
        raise APIError(429, f"the cluster is at its step capacity; retry in {decision.retry_after_s} s",
                       type_="rate_limit_error", code="step_capacity_exceeded",
                       headers={"Retry-After": str(decision.retry_after_s)})

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

    def _prepare(self, body: protocol.SamplingFields, prompt: str | list[int]) -> GenerateRequest:
        """Validate everything and build the replica's request; raises APIError."""
        self._check_model(body.model)
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
        algorithm, algorithm_params, made = self._algorithm(body)
        worst = algorithm.worst_case_steps(made, block, self.config.replica.fused_commit)
        # aligned blocks: the first answer block also holds the prompt's end
        head = aligned_head(len(prompt_ids), block, self.shape.aligned)
        # the engine's own parameters (every field checked above: its checks cannot refuse them)
        params = SamplingParams(
            max_tokens=max_tokens, stop=tuple(body.stop or ()), algorithm=algorithm.name,
            algorithm_params=algorithm_params, ignore_eos=body.ignore_eos, logprobs=body.logprobs_asked,
            timeout_s=min((t for t in (self.config.request_timeout_s, body.deadline_s) if t is not None), default=None),
            suffix_ids=suffix_ids, adaptive=(body.quality or self.config.quality.default) == "adaptive")
        cost = self.admission.cost(head + max_tokens, block, worst, self.shape.max_cost)
        if params.adaptive:
            cost = self._adaptive_cost(cost, algorithm.name)
        hashes = page_hashes(prompt_ids, block) if self.shape.prefix_cache else ()
        # the prompt's pages the replicas compute, less those of the longest prefix this ingress
        # sent: likely cached where it went
        uncached = prompt_pages(len(prompt_ids), block, self.shape.aligned) - self.sent_prefixes.known_pages(hashes)
        prompt_cost = math.ceil(self.admission.prompt_cost(uncached))
        return GenerateRequest(protocol.new_id("chatcmpl" if chat else "cmpl"), prompt_ids, params,
                               min(cost + prompt_cost, self.shape.max_cost), prompt_cost, hashes)

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
        on top of the default: ``replicas.settings.resolve_algorithm``) and those validated."""
        requested = {f: getattr(body, f) for f in _SAMPLING_FIELDS if getattr(body, f) is not None}
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

    @property
    def max_model_len(self) -> int:
        """The longest request the replicas serve: the settings' bound, or less where a
        replica's memory cut it at start (the least that a reporting replica serves)."""
        cut = [view.max_model_len for view in self.admission.view.values() if view.max_model_len]
        return min(self.shape.max_model_len, *cut) if cut else self.shape.max_model_len

    def _max_tokens(self, output_limit: int | None) -> int:
        """A request's max_tokens (or max_completion_tokens), else the server's default."""
        return output_limit if output_limit is not None else self.config.default_max_tokens

    def _refuse_output_bound(self, output_limit: int | None, n: int, prompts: int, deadline_s: float | None) -> None:
        """429 where admission refuses the request's output blocks alone (``n`` choices of
        ``prompts`` prompts), before its prompt is tokenized (its pages are charged later)."""
        limit = min(max(self._max_tokens(output_limit), 1), self.max_model_len)
        blocks = blocks_needed(limit, self.shape.block_length)
        self._refuse_if(self.admission.quick_refusal(blocks * n * prompts, deadline_s))

    def check_body(self, body: object, chat: bool) -> None:
        """The refusal of ``_serve``'s first check, from the body as parsed JSON, before it
        is validated (``cluster.completion_path``); raises APIError. A body whose fields the
        check reads are not plainly valid passes: the route validates it and says what is
        wrong."""
        if not isinstance(body, dict):
            return
        limit = body.get("max_completion_tokens")
        limit = body.get("max_tokens") if limit is None else limit
        n, deadline = body.get("n", 1), body.get("deadline_s")
        prompts = 1 if chat else protocol.plain_prompt_count(body.get("prompt"))
        if (limit is None or _positive_int(limit)) and _positive_int(n) and prompts \
                and n * prompts <= self.config.ingress.max_n \
                and (deadline is None or (type(deadline) in (int, float) and 0 < deadline < math.inf)):
            self._refuse_output_bound(limit, n, prompts, deadline)

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

    async def _serve(self, body: protocol.SamplingFields, chat: bool, slot: KeySlot):
        self._refuse_output_bound(body.output_limit, body.n, _prompt_count(body), body.deadline_s)
        chars = _prompt_chars(body)
        self._refuse_past_the_context(body, chat, chars)

        def prepare() -> list[GenerateRequest]:
            prompts = self._prompts(body)
            jobs = []
            for index, prompt in enumerate(prompts):
                try:
                    jobs.append(self._prepare(body, prompt))
                except APIError as exc:  # name the prompt of a list that is refused
                    if len(prompts) > 1 and exc.param == "prompt":
                        exc.message = f"prompt {index}: {exc.message}"
                    raise
            return jobs

        if chars <= INLINE_PREPARE_CHARS:
            jobs = prepare()
        else:
            jobs = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, prepare)
        decision = self.admission.try_admit(body.n * sum(job.cost for job in jobs), body.deadline_s)
        self._refuse_if(decision)
        self.admitted += 1
        for job in jobs:
            self.sent_prefixes.record(job.prefix_hashes, self.ingress_id)
        failover = self.failover if body.stream else self.failover_unary
        stream = self._charged_stream([row for job in jobs for row in rows(job, body.n)], failover,
                                      decision.charge, slot)
        answer = Answer(jobs[0], int(time.time()), chat, body.n, self._echoes(body))
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse(stream, answer, include_usage), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await self._collect(stream, answer)

    def _echoes(self, body: protocol.SamplingFields) -> list[str]:
        """The text each choice starts with (``n`` a prompt, prompt by prompt): its prompt,
        where a completion asks for ``echo``, else nothing."""
        if not getattr(body, "echo", False):
            return [""] * (_prompt_count(body) * body.n)
        return [prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
                for prompt in body.prompts for _ in range(body.n)]

    async def _unary(self, job: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The whole answer of ``job`` from one unary replica call, as a one-chunk stream."""
        yield await self.replicas_unary.generate_unary.remote(job)

    async def _charged_stream(self, jobs: list[GenerateRequest], failover: Failover, charge: Charge,
                              slot: KeySlot) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """The chunks of the request's choices from the replicas (each resumed elsewhere if
        its replica fails), with their choice's index, releasing the admission charge as
        steps are taken and the key's place at the end; raises APIError."""
        self.in_flight += 1
        steps = [0] * len(jobs)
        complete = True  # no choice failed or was cut short by its deadline (its time would say too little)
        try:
            async for index, chunk in merged([self._replica_stream(job, failover) for job in jobs]):
                steps[index] = jobs[index].prompt_cost + chunk.steps
                charge.progress(sum(steps))
                complete = complete and not chunk.error and chunk.finish_reason != FinishReason.TIMEOUT
                yield index, chunk
            if complete:  # its time against its prediction teaches admission (``prediction_bias``)
                charge.answered()
        finally:
            self.in_flight -= 1
            charge.close()
            slot.release()

    @staticmethod
    async def _replica_stream(job: GenerateRequest, failover: Failover) -> AsyncIterator[GenerateChunk]:
        """One replica request's chunks; its failures as APIError."""
        try:
            async for chunk in failover.stream(job):
                if chunk.error_kind == "invalid_request":
                    raise bad_request(chunk.error)
                yield chunk
        except ReplicaFailed as exc:
            log.error("request %s: %s", job.request_id, exc)
            raise APIError(503, f"the replicas serving the request failed; retry (request id {job.request_id})",
                           type_="server_error", code="replica_failed", headers={"Retry-After": "1"}) from None

    def _count_failover(self) -> None:
        self.failovers += 1

    def _healthy_elsewhere(self, failed: set[str]) -> bool:
        """Whether a replica outside ``failed`` reports (fresh) with no failing steps; with
        no reports at all this ingress knows nothing, and does not hold the request back."""
        views = self.admission.view
        return not views or any(replica not in failed and not view.failing_steps for replica, view in views.items())

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
        unanswered = _unanswered(answers, answer.job)
        if unanswered is not None:
            raise unanswered
        choices = [protocol.Choice(i, echo + a.text, a.finish_reason, self._logprobs(a, answer.chat, 0))
                   for i, (echo, a) in enumerate(zip(answer.echoes, answers))]
        return JSONResponse(answer.body(self.config.model_name, choices, chunk=False, usage_=_usage(answers, answer.n),
                                        extra={"dllm": self._dllm_info(answer.job, *answers)}))

    async def _sse(self, stream: AsyncIterator[tuple[int, GenerateChunk]], answer: Answer,
                   include_usage: bool) -> AsyncIterator[str]:
        """One event per committed block of each choice (``n`` a prompt; the first one after
        its echo), then ``data: [DONE]``."""
        request_id = answer.job.request_id
        model = self.config.model_name
        last: dict[int, GenerateChunk] = {}  # each choice's
        text_offsets: dict[int, int] = {}
        try:
            async for index, chunk in stream:
                if chunk.error:
                    log.error("request %s failed: %s", request_id, chunk.error)
                    yield self._error_event(internal_error(request_id))
                    break
                unanswered = _unanswered([*last.values(), chunk], answer.job)
                if unanswered is not None:
                    raise unanswered
                logprobs = self._logprobs(chunk, answer.chat, text_offsets.get(index, 0))
                if logprobs is not None and not answer.chat:
                    text_offsets[index] = text_offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
                first = index not in last
                text = answer.echoes[index] + chunk.text if first else chunk.text
                choice = protocol.Choice(index, text, chunk.finish_reason, logprobs, first=first)
                last[index] = chunk
                yield protocol.sse_event(answer.body(model, [choice], chunk=True,
                                                     extra={"dllm": self._dllm_info(answer.job, chunk)}))
        except APIError as exc:
            yield self._error_event(exc)
        except Exception:
            log.exception("request %s failed", request_id)
            yield self._error_event(internal_error(request_id))
        choices = len(answer.echoes)
        if include_usage and len(last) == choices and not any(c.error for c in last.values()):
            usage_ = _usage([last[i] for i in range(choices)], answer.n)
            yield protocol.sse_event(answer.body(model, [], chunk=True, usage_=usage_))
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

    # ---- cluster view and metrics -----------------------------------------------------------
    def _metrics_actor(self):
        if self._metrics is None:
            try:
                self._metrics = ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
            except ValueError:
                return None
        return self._metrics

    def ingress_report(self) -> dict:
        """This ingress's totals since it started (the metrics actor takes differences, so a
        report that is lost or sent twice changes nothing)."""
        return IngressReport(admitted=self.admitted, rejected=dict(self.rejected), failovers=self.failovers,
                             stream_errors=dict(self.stream_errors),
                             outstanding=self.admission.outstanding, cpu_s=time.process_time(),
                             prediction_bias=self.admission.prediction_bias,
                             in_flight=self.in_flight, draining=self.draining, **http_tally.TALLY.report()).model_dump()

    @contextmanager
    def _counted(self):
        """Count a request in ``in_flight`` while its route runs (`dllm-serve up` drains them)."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def _ensure_sync_task(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.get_running_loop().create_task(self._sync())

    async def _sync(self) -> None:
        """Once per stats period, one metrics-actor call: this ingress's report out, the
        replicas' routing stats back."""
        timeout = self.config.ingress.metrics_timeout_s
        while True:
            actor = self._metrics_actor()
            if actor is not None:
                try:
                    answer = await asyncio.wait_for(actor.ingress_sync.remote(self.ingress_id, self.ingress_report()),
                                                  timeout)
                    self.admission.update_view(answer["replicas"])
                    self.admission.ingress_replicas = answer["ingresses"]
                    self.draining = self.draining or answer["draining"]
                except asyncio.TimeoutError:  # a slow actor: keep the last view
                    log.debug("the metrics actor did not answer within %.1f s", timeout)
                except Exception as exc:  # the actor restarts: look it up again
                    log.debug("metrics actor call failed: %s", exc)
                    self._metrics = None
            await asyncio.sleep(self.config.stats_period_s)
