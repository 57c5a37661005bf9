"""The OpenAI-compatible ingress: a thin Serve deployment wiring preprocess -> dispatch -> render.

A completion meets the cheapest refusals first:

1. auth, draining and Content-Length (401, 503, 413) before the body is read;
2. admission's bound: 429 without reading the body when even a one-block request would
   be refused now (``AdmissionController.quick_refusal``). Steps 1-2 read only headers;
   ``cluster.completion_path`` runs them, and then the route, below FastAPI's machinery;
3. the key's concurrency limit (429);
4. ``cluster.preprocess``: the body parsed once, validated and tokenized into one engine
   request a prompt (``GenerateRequest``) with its cost and prefix hashes (400, 404, 429);
5. ``cluster.dispatch``: the exact cost charged (``try_admit``, or 429), the choices sent
   to the replicas, resumed elsewhere if a replica fails, and merged;
6. ``cluster.responses``: the chunks rendered as one JSON body or SSE events.

Admission counts, the row-steps outstanding and this process's CPU time reach the
metrics actor in one call per stats period, which also brings back the replicas' stats
and the draining order (`dllm-serve up` on SIGTERM: from then on every request gets 503
``server_draining`` with ``Retry-After`` before anything else, and the requests in flight
here, reported with each call, are left to finish); no request waits on the metrics actor.
"""

# No postponed annotations here: FastAPI must see the routes' parameter types as objects
# once Serve has shipped the routes to the replica.
import asyncio
import logging
import time
from collections.abc import Mapping

import ray
from fastapi import FastAPI, Header, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import ClientDisconnect

from cluster import completion_path, http_tally, protocol
from cluster.admission import AdmissionController, Refusals
from cluster.auth import ApiKey, KeyRing, KeySlot, load_keys
from cluster.config import AppConfig
from cluster.disconnects import unless_disconnected
from cluster.dispatch import Dispatch
from cluster.errors import APIError, client_left, install_error_handlers, logged_failure
from cluster.front_door import FrontDoor
from cluster.metrics import ACTOR_NAME, ACTOR_NAMESPACE
from cluster.preprocess import Preprocess
from cluster.request_path import logs_to_stderr_in_this_process, path_in_this_process
from cluster.responses import Render
from cluster.router import PrefixMemory
from replicas.gc_freeze import settle_after_start_up
from replicas.models import load_model_spec, load_tokenizer
from replicas.commits import OutputProcessor
from replicas.telemetry.reports import IngressReport, stale_after_s
from replicas.text_encoding import text_encoder

log = logging.getLogger(__name__)

# the API description routes are the Ingress's own, behind the key like the rest
app = FastAPI(title="dllm-serve", description="OpenAI-compatible API for masked diffusion LMs",
              docs_url=None, redoc_url=None, openapi_url=None)
install_error_handlers(app)
app.add_middleware(completion_path.CompletionPath)  # the completion routes skip FastAPI's machinery
app.add_middleware(http_tally.HttpTally)  # outermost: it counts every response, early answers included


@serve.ingress(app)
class Ingress:
    def __init__(self, replicas: DeploymentHandle, config: dict):
        self.config = AppConfig.model_validate(config)
        self.request_path = path_in_this_process()
        self.keys = KeyRing(load_keys(self.config.api_key_file))  # read here, never passed in the arguments
        self.tokenizer = load_tokenizer(self.config.model)
        self.spec = load_model_spec(self.config.model, self.config.replica.model_overrides)
        knob = self.config.quality_knob()
        quality_levels = knob.levels if knob else []  # the replicas' ladder: a response names its level's
        self.admission = AdmissionController(self.config.admission, self.config.slo.latency_s,
                                             self.config.autoscaling.min_replicas,
                                             stale_after_s=stale_after_s(self.config.stats_period_s))
        self.refusals = Refusals()
        sent_prefixes = PrefixMemory()  # the prompt pages admitted here: charged as cached next time
        self.ingress_id = protocol.new_id("ingress")
        self.preprocess = Preprocess(self.config, self.tokenizer, text_encoder(self.tokenizer), self.spec,
                                     self.admission, self.refusals, sent_prefixes, quality_levels)
        self.dispatch = Dispatch(replicas, self.config.failover, self.spec.block_length, self.admission,
                                 self.refusals, sent_prefixes, self.ingress_id,
                                 OutputProcessor(self.tokenizer, self.spec.end_token_ids).held_text)
        self.render = Render(self.config.model_name, self.tokenizer, quality_levels)
        self._metrics = None
        self._sync_task: asyncio.Task | None = None
        self.draining = False  # set once by the metrics actor's answer (`dllm-serve up` stopping); never unset
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
        return {"object": "list", "data": [self._model_card(None), *map(self._model_card, self.config.replica.adapters)]}

    @app.get("/v1/models/{model:path}")  # ``path``: a model name may hold slashes (org/name)
    async def model(self, model: str, authorization: str | None = Header(None)):
        self._authorize(authorization)
        return self._model_card(self.preprocess.check_model(model))

    def _model_card(self, adapter: str | None) -> dict:
        """The base model's card, or an unmerged adapter's (its ``parent`` the base, as vLLM lists them)."""
        base = self.config.model_name
        card = {"id": adapter or base, "object": "model", "owned_by": "dllm-serve", "created": 0, "root": base}
        return card if adapter is None else card | {"parent": base}

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
        return await self._complete(request, False, self.check_before_body(request.headers))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, True, self.check_before_body(request.headers))

    async def answer(self, scope: dict, receive, send, key: ApiKey | None,
                     body: completion_path.PeekedBody | None = None) -> None:
        """A completion route's answer, called below FastAPI (``cluster.completion_path``,
        which ran ``check_before_body``: ``key`` is what it returned; ``body``: the body it
        read, None where it left that to the route): what the route returns, or raises as
        its error envelope."""
        try:
            response = await self._complete(Request(scope, receive), scope["path"] == completion_path.CHAT_PATH,
                                            key, body)
        except APIError as exc:
            response = exc.response()
        except ClientDisconnect:
            response = client_left(scope["method"], scope["path"])
        except Exception as exc:
            response = logged_failure(scope["method"], scope["path"], exc).response()
        await response(scope, receive, send)

    # ---- the request path -------------------------------------------------------------------
    async def _complete(self, request: Request, chat: bool, key: ApiKey | None,
                        peeked: completion_path.PeekedBody | None = None):
        """A completion, once ``check_before_body`` passed (``key``: the caller's): the key's
        limit first, then preprocess, dispatch and render; the key's place is held until
        the response ends. ``peeked``: the body, where it was read and parsed already."""
        with self.dispatch.counted():
            slot = self._key_slot(key)
            try:
                if peeked is None:
                    body = self.preprocess.validated(await self._read(request), chat)
                else:
                    body = self.preprocess.validated(peeked.raw, chat, peeked.parsed)
                if body.stream:  # a stream notices its client leaving by itself
                    return await self._serve(body, chat, slot)
                answer = await unless_disconnected(request, self._serve(body, chat, slot))
                slot.release()  # (released already, unless the client left before the replicas were asked)
                return answer
            except BaseException:
                slot.release()
                raise

    async def _serve(self, body: protocol.SamplingFields, chat: bool, slot: KeySlot):
        completion = await self.preprocess.completion(body, chat)
        return await self.render.response(completion, self.dispatch.chunks(completion, slot))

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
        self.refusals.raise_if_refused(self.admission.quick_refusal())
        return key

    def check_body(self, body: object, chat: bool) -> None:
        """Preprocess's refusal from the body as parsed JSON (``cluster.completion_path``)."""
        self.preprocess.check_body(body, chat)

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

    async def _read(self, request: Request) -> bytes:
        """The body read, at most ``max_body_bytes``; raises APIError."""
        limit = self.config.ingress.max_body_bytes
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > limit:
                raise self._too_large(limit)
        return bytes(raw)

    @staticmethod
    def _too_large(limit: int) -> APIError:
        return APIError(413, f"the request body is over this server's limit of {limit} bytes",
                        code="request_too_large")

    @property
    def in_flight(self) -> int:
        """Routes running here, plus streams still sending after their route returned."""
        return self.dispatch.in_flight

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
        dispatch = self.dispatch
        return IngressReport(admitted=dispatch.admitted, rejected=dict(self.refusals.counts),
                             failovers=dispatch.failovers, stream_errors=dict(self.render.stream_errors),
                             outstanding=self.admission.outstanding, cpu_s=time.process_time(),
                             prediction_bias=self.admission.prediction_bias,
                             in_flight=dispatch.in_flight, draining=self.draining, **http_tally.TALLY.report()).model_dump()

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
