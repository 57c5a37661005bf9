"""The body of the Ray Serve replica deployment: one engine per replica.

The cluster wraps this class with ``serve.deployment``; nothing here knows about the
ingress. Requests arrive tokenized and validated, as a ``GenerateRequest``; every
committed block goes back as one ``GenerateChunk`` of a streaming generator (both in
``replicas.messages``). Statistics are pushed to the metrics actor (looked up by name)
every ``stats_period_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator

import torch

from replicas.async_engine import AsyncEngine
from replicas.engine import Engine
from replicas.limits import request_cost
from replicas.messages import GenerateChunk, GenerateRequest
from replicas.monitor import ReplicaMonitor
from replicas.request import FinishReason, RequestError, SamplingParams
from replicas.settings import EngineConfig

log = logging.getLogger(__name__)


class EngineReplica:
    def __init__(self, model: str, config: EngineConfig, metrics_actor: dict | None = None,
                 stats_period_s: float = 0.5, initial_row_steps_per_s: float = 500.0,
                 torch_threads: int | None = None, stuck_after_s: float = 60.0):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        engine = Engine.from_pretrained(model, config)
        self.engine = engine
        self.monitor = ReplicaMonitor(initial_row_steps_per_s,
                                      steps_per_block=engine.cost_model.steps_per_block_counts)
        self._refresh_gauges()
        self.stuck_after_s = stuck_after_s
        self.replica_id = self._replica_tag()
        self.runner = AsyncEngine(engine, on_step=self.monitor.on_step)
        self._metrics_actor = metrics_actor
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, args=(stats_period_s,),
                                          name="dllm-stats", daemon=True)
        self._reporter.start()

    @staticmethod
    def _replica_tag() -> str:
        try:
            from ray import serve

            return serve.get_replica_context().replica_tag
        except Exception:  # outside Serve (tests, offline use)
            return "local"

    # ---- requests -------------------------------------------------------------------
    def worst_case_cost(self, params: SamplingParams) -> float:
        request = self.engine.make_request([0], params)
        block = self.engine.block_length
        return request_cost(params.max_tokens, block, request.algorithm.max_steps_per_block(request.algorithm_params, block))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream one chunk per committed block of a tokenized request."""
        start = time.monotonic()
        request_id = request.request_id
        try:
            params = SamplingParams(
                max_tokens=request.max_tokens, stop=tuple(request.stop), algorithm=request.algorithm,
                algorithm_params=request.algorithm_params, ignore_eos=request.ignore_eos)
            cost = request.cost if request.cost is not None else self.worst_case_cost(params)
            stream = self.runner.generate(request.prompt_ids, params, request_id)
            first_block = None
        except RequestError as exc:
            yield GenerateChunk.refusal(str(exc))
            return
        self.monitor.request_started(request_id, cost)
        reason, tokens, blocks = FinishReason.ABORT.value, 0, 0
        try:
            async for output in stream:
                self.monitor.request_progressed(request_id, output.num_steps)
                if first_block is None and output.new_token_ids:
                    first_block = time.monotonic() - start
                tokens = output.num_output_tokens
                if output.finished:
                    reason = output.finish_reason.value
                    blocks = 0 if output.error else len(output.block_steps)
                yield GenerateChunk(
                    text=output.new_text,
                    num_new_tokens=len(output.new_token_ids),
                    finished=output.finished,
                    finish_reason=output.finish_reason.value if output.finish_reason else None,
                    error=output.error,
                    prompt_tokens=output.num_prompt_tokens,
                    completion_tokens=output.num_output_tokens,
                    steps=output.num_steps,
                    block_steps=output.block_steps,
                    replica=self.replica_id,
                    engine_s=time.monotonic() - start,
                )
        except RequestError as exc:
            reason = FinishReason.ERROR.value
            yield GenerateChunk.refusal(str(exc))
        finally:
            self.monitor.request_finished(request_id, reason, time.monotonic() - start, first_block, tokens, blocks)

    # ---- Serve hooks -------------------------------------------------------------------
    async def record_routing_stats(self) -> dict:
        self._refresh_gauges()
        return {**self.monitor.routing_stats(), "replica": self.replica_id}

    def _refresh_gauges(self) -> None:
        scheduler, pool = self.engine.scheduler, self.engine.pool
        self.monitor.set_gauges(len(scheduler.waiting), len(scheduler.running), pool.num_free, pool.capacity)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return self.monitor.autoscaling_stats()

    async def check_health(self) -> None:
        if not self.runner.alive:
            raise RuntimeError("the engine loop thread has died")
        idle_for = time.monotonic() - self.runner.last_step_time
        if idle_for > self.stuck_after_s:
            raise RuntimeError(f"the engine loop has not come round for {idle_for:.0f} s")

    async def stats(self) -> dict:
        """Routing stats plus engine totals, for `dllm-serve status` and tests."""
        totals = self.engine.totals
        return {
            **(await self.record_routing_stats()),
            "steps": totals.steps, "output_tokens": totals.output_tokens,
            "requests_finished": totals.requests_finished, "requests_aborted": totals.requests_aborted,
            "requests_failed": totals.requests_failed, "compute_ratio": totals.compute_ratio,
        }

    def __del__(self):
        """Serve's graceful shutdown: in-flight requests are done; stop the threads."""
        self._stop.set()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.shutdown(drain_timeout=5.0)

    # ---- metrics push ------------------------------------------------------------------
    def _report_loop(self, period_s: float) -> None:
        actor = None
        while not self._stop.wait(period_s):
            if self._metrics_actor is None:
                continue
            try:
                if actor is None:
                    import ray

                    actor = ray.get_actor(self._metrics_actor["name"], namespace=self._metrics_actor["namespace"])
                self._refresh_gauges()
                actor.push_replica.remote(self.replica_id, self.monitor.report())
            except Exception as exc:  # the metrics actor may start later or restart
                log.debug("metrics push failed: %s", exc)
                actor = None
