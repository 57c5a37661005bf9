"""The OpenAI-compatible ingress: validation, step-aware admission, streaming.

Everything a client can get wrong is caught here and answered with a 4xx error
envelope; a replica only ever sees tokenized, validated requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import ray
from fastapi import FastAPI, Header, Query
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from algorithms import AlgorithmError, get_algorithm
from cluster import protocol
from cluster.admission import AdmissionController, Charge
from cluster.config import AppConfig
from cluster.errors import APIError, bad_request, install_error_handlers
from cluster.metrics import ACTOR_NAME, ACTOR_NAMESPACE
from replicas.messages import GenerateChunk, GenerateRequest, request_problem
from replicas.models import load_model_spec, load_tokenizer
from replicas.settings import resolve_algorithm

log = logging.getLogger(__name__)

app = FastAPI(title="dllm-serve", description="OpenAI-compatible API for masked diffusion LMs")
install_error_handlers(app)

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "threshold")


@serve.ingress(app)
class Ingress:
    def __init__(self, replicas: DeploymentHandle, config: dict):
        self.config = AppConfig.model_validate(config)
        self.replicas = replicas.options(stream=True)
        self.tokenizer = load_tokenizer(self.config.model)
        self.spec = load_model_spec(self.config.model, self.config.replica.model_overrides)
        default_name, default_params = resolve_algorithm(self.config.replica, self.spec)
        get_algorithm(default_name).make_params(default_params)  # a bad default fails at start
        self.max_model_len = self.config.replica.max_model_len or self.spec.max_positions
        self.admission = AdmissionController(self.config.admission, self.config.slo.latency_s,
                                             self.config.autoscaling.min_replicas)
        self._metrics = None
        self._view_task: asyncio.Task | None = None

    # ---- routes -------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        self._ensure_view_task()
        return {"status": "ok", "replicas_reporting": len(self.admission.view)}

    @app.get("/v1/models")
    async def models(self, authorization: str | None = Header(None)):
        self._authorize(authorization)
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                            "owned_by": "dllm-serve", "created": 0}]}

    @app.get("/v1/dllm/calibration")
    async def calibration(self, window_s: float = Query(60.0, gt=0),
                          authorization: str | None = Header(None)):
        """What every live replica measured in the last ``window_s`` seconds (kept by the
        metrics actor), for `dllm-serve calibrate`."""
        self._authorize(authorization)
        actor = self._metrics_actor()
        if actor is None:
            raise APIError(503, "the metrics actor is not running", type_="server_error")
        return {"max_batch": self.config.replica.max_batch,
                "replicas": await actor.calibration.remote(window_s)}

    @app.post("/v1/completions")
    async def completions(self, body: protocol.CompletionRequest, authorization: str | None = Header(None)):
        self._authorize(authorization)
        return await self._serve(body, body.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: protocol.ChatCompletionRequest,
                               authorization: str | None = Header(None)):
        self._authorize(authorization)
        messages = [m.model_dump() for m in body.messages]
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise bad_request(f"messages cannot be rendered by the chat template: {exc}", param="messages")
        return await self._serve(body, prompt, chat=True)

    # ---- the request path -------------------------------------------------------------------
    def _authorize(self, authorization: str | None) -> None:
        key = self.config.api_key
        if key is not None and authorization != f"Bearer {key.get_secret_value()}":
            raise APIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                           type_="authentication_error", code="invalid_api_key")

    def _prepare(self, body: protocol.SamplingFields, prompt: str) -> GenerateRequest:
        """Validate everything and build the replica's request; raises APIError."""
        if body.model != self.config.model_name:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves "
                                f"'{self.config.model_name}'", type_="not_found_error", param="model",
                           code="model_not_found")
        block = self.spec.block_length
        if body.block_length is not None and body.block_length != block:
            raise bad_request(f"this model decodes in blocks of {block}; block_length {body.block_length} "
                              f"is not available", param="block_length")
        if body.mode is not None and body.mode != self.config.replica.mode:
            raise bad_request(f"the replicas run in mode '{self.config.replica.mode.value}'", param="mode")
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        max_tokens = body.output_limit if body.output_limit is not None else self.config.default_max_tokens
        if max_tokens <= 0:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if max_tokens > self.max_model_len:
            raise bad_request(f"max_tokens {max_tokens} is over this model's limit of {self.max_model_len}",
                              param="max_tokens")
        problem = request_problem(prompt_ids, max_tokens, self.spec, self.max_model_len)
        if problem is not None:
            chat = isinstance(body, protocol.ChatCompletionRequest)
            raise bad_request(problem.message, param="messages" if chat and problem.too_long else "prompt",
                              code="context_length_exceeded" if problem.too_long else None)
        algorithm_name, algorithm_params = self._algorithm(body)
        algorithm = get_algorithm(algorithm_name)
        worst = algorithm.max_steps_per_block(algorithm.make_params(algorithm_params), block)
        return GenerateRequest(
            request_id=protocol.new_id("cmpl"),
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stop=tuple(body.stop or ()),
            algorithm=algorithm_name,
            algorithm_params=algorithm_params,
            ignore_eos=body.ignore_eos,
            cost=self.admission.cost(max_tokens, block, worst),
        )

    def _algorithm(self, body: protocol.SamplingFields) -> tuple[str, dict]:
        """The request's algorithm and parameters: its sampling fields and algorithm_params
        on top of the default (``replicas.settings.resolve_algorithm``)."""
        requested = {f: getattr(body, f) for f in _SAMPLING_FIELDS if getattr(body, f) is not None}
        name, params = resolve_algorithm(self.config.replica, self.spec, body.algorithm,
                                         {**requested, **(body.algorithm_params or {})})
        try:
            algorithm = get_algorithm(name)
        except AlgorithmError as exc:
            raise bad_request(str(exc), param="algorithm")
        known = set(algorithm.params_class.__dataclass_fields__)
        for field in requested:
            if field not in known:
                raise bad_request(f"algorithm '{name}' has no parameter '{field}'", param=field)
        try:
            algorithm.make_params(params)
        except AlgorithmError as exc:
            raise bad_request(str(exc), param="algorithm_params")
        return name, params

    async def _serve(self, body: protocol.SamplingFields, prompt: str, chat: bool):
        self._ensure_view_task()
        job = self._prepare(body, prompt)
        decision = self.admission.try_admit(job.cost)
        self._record_admission(decision.admitted)
        if not decision.admitted:
            raise APIError(429, f"the cluster is at its step capacity; retry in {decision.retry_after_s} s",
                           type_="rate_limit_error", code="step_capacity_exceeded",
                           headers={"Retry-After": str(decision.retry_after_s)})
        stream = self._charged_stream(job, Charge(self.admission, job.cost))
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse(stream, job.request_id, chat, include_usage),
                                     media_type="text/event-stream")
        return await self._collect(stream, job.request_id, chat)

    async def _charged_stream(self, job: GenerateRequest, charge: Charge) -> AsyncIterator[GenerateChunk]:
        """The replica's chunks, releasing the admission charge as steps are taken."""
        try:
            async for chunk in self.replicas.generate.remote(job):
                if chunk.error_kind == "invalid_request":
                    raise bad_request(chunk.error)
                charge.progress(chunk.steps)
                yield chunk
        finally:
            charge.close()

    async def _collect(self, stream: AsyncIterator[GenerateChunk], request_id: str, chat: bool) -> JSONResponse:
        text, last = [], None
        try:
            async for chunk in stream:
                text.append(chunk.text)
                last = chunk
        except APIError:
            raise
        except Exception as exc:
            log.exception("request %s failed in a replica", request_id)
            raise APIError(503, f"the replica serving the request failed: {type(exc).__name__}",
                           type_="server_error") from None
        if last is None or last.error:
            raise APIError(500, f"generation failed: {last.error if last else 'no output'}",
                           type_="server_error")
        usage = protocol.usage(last.prompt_tokens, last.completion_tokens)
        build = protocol.chat_body if chat else protocol.completion_body
        return JSONResponse(build(request_id, self.config.model_name, "".join(text), last.finish_reason,
                                  chunk=False, usage_=usage, extra={"dllm": self._dllm_info(last)}))

    async def _sse(self, stream: AsyncIterator[GenerateChunk], request_id: str, chat: bool,
                   include_usage: bool) -> AsyncIterator[str]:
        """One event per committed block, then ``data: [DONE]``."""
        model = self.config.model_name
        build = protocol.chat_body if chat else protocol.completion_body
        first, last = True, None
        try:
            async for chunk in stream:
                last = chunk
                if chunk.error:
                    yield protocol.sse_event(APIError(500, f"generation failed: {chunk.error}", type_="server_error").body())
                    break
                extra = {"dllm": self._dllm_info(chunk)}
                kwargs = {"first": first} if chat else {}
                yield protocol.sse_event(build(request_id, model, chunk.text, chunk.finish_reason, chunk=True,
                                   extra=extra, **kwargs))
                first = False
        except APIError as exc:
            yield protocol.sse_event(exc.body())
        except Exception as exc:
            log.exception("stream %s failed in a replica", request_id)
            yield protocol.sse_event(APIError(503, f"the replica serving the request failed: {type(exc).__name__}",
                                  type_="server_error").body())
        if include_usage and last is not None and not last.error:
            usage = protocol.usage(last.prompt_tokens, last.completion_tokens)
            body = build(request_id, model, "", None, chunk=True, usage_=usage)
            body["choices"] = []
            yield protocol.sse_event(body)
        yield "data: [DONE]\n\n"

    @staticmethod
    def _dllm_info(chunk: GenerateChunk) -> dict:
        return {"steps": chunk.steps, "block_steps": chunk.block_steps, "replica": chunk.replica,
                "engine_s": chunk.engine_s}

    # ---- cluster view and metrics -----------------------------------------------------------
    def _metrics_actor(self):
        if self._metrics is None:
            try:
                self._metrics = ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
            except ValueError:
                return None
        return self._metrics

    def _record_admission(self, admitted: bool) -> None:
        actor = self._metrics_actor()
        if actor is not None:
            actor.record_admission.remote(admitted, "" if admitted else "step_capacity")

    def _ensure_view_task(self) -> None:
        if self._view_task is None or self._view_task.done():
            self._view_task = asyncio.get_running_loop().create_task(self._refresh_view())

    async def _refresh_view(self) -> None:
        while True:
            actor = self._metrics_actor()
            if actor is not None:
                try:
                    self.admission.update_view(await actor.cluster_view.remote())
                except Exception as exc:  # the actor restarts; keep the last view
                    log.debug("cluster view refresh failed: %s", exc)
                    self._metrics = None
            await asyncio.sleep(self.config.stats_period_s)
