"""The body of the Ray Serve replica deployment: one engine per replica.

The cluster wraps this class with ``serve.deployment``; nothing here knows about the
ingress. Requests arrive tokenized, validated and costed, as a ``GenerateRequest`` (the
engine request, which the engine takes as it comes); every committed block goes back as
one ``GenerateChunk`` of a streaming generator (both in ``replicas.messages``).
Statistics are pushed to the metrics actor (looked up by name) every ``stats_period_s``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import torch
from ray import serve
from ray.serve.exceptions import RayServeException

from replicas.async_engine import AsyncEngine
from replicas.engine import Engine
from replicas.models.parallel import SINGLE, TensorParallel
from replicas.tensor_parallel import join_group
from replicas.gc_freeze import settle_after_start_up
from replicas.request_cost import aligned_head, request_cost
from replicas.messages import GenerateChunk, GenerateRequest, RequestError, SamplingParams
from replicas.telemetry.monitor import ReplicaMonitor
from replicas.quality import QualityKnob
from replicas.telemetry.reports import ReplicaStats
from replicas.request import FinishReason
from replicas.engine_config import EngineConfig, resolve_algorithm

log = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 10.0  # a metrics push unanswered this long is given up


class EngineReplica:
    def __init__(self, model: str, config: EngineConfig, metrics_actor: dict | None = None,
                 stats_period_s: float = 0.5, initial_row_steps_per_s: float = 500.0,
                 torch_threads: int | None = None, stall_timeout_s: float = 30.0,
                 unhealthy_after_failed_steps: int = 3, quality: QualityKnob | None = None,
                 rank_resources: dict | None = None):
        """``quality``: the load knob (``replicas.quality``); None: requests always run as asked.
        ``rank_resources``: what each of the other tensor-parallel ranks reserves
        (``num_cpus``, ``num_gpus``) in the deployment's placement group."""
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.replica_id = self._replica_tag()
        tp, self._ranks = SINGLE, None
        if config.tensor_parallel_size > 1:
            tp, self._ranks = self._start_ranks(model, config, rank_resources or {}, torch_threads)
        engine = Engine.from_pretrained(model, config, name=self.replica_id, tp=tp)
        engine.warm_up()  # the first report carries a measured step cost: admission is right from the start
        self.engine = engine
        self.monitor = ReplicaMonitor(initial_row_steps_per_s, cost_model=engine.cost_model,
                                      longest_blocks=max(1, engine.shape.max_pages_per_request - 1))  # one prompt page
        self.quality = quality
        self._refresh_gauges()
        self.stall_timeout_s = stall_timeout_s
        self.unhealthy_after_failed_steps = unhealthy_after_failed_steps
        self.node_id = self._node_id()
        self.async_engine = AsyncEngine(engine, on_step=self.monitor.on_step)
        self._load_adapter = self._adapter_loader(engine)
        self._metrics_actor = metrics_actor
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, args=(stats_period_s,),
                                          name="dllm-stats", daemon=True)
        self._reporter.start()
        settle_after_start_up()

    @staticmethod
    def _adapter_loader(engine: Engine):
        """Where the engine serves unmerged adapters: an async ``load(name)`` that loads one
        off the event loop before its request reaches the engine, through Serve's model
        multiplexing (``serve.multiplexed``), which tells the routers which replica holds
        which adapter (``multiplexed_model_ids``) and keeps as many as the engine does. A
        load that fails is left to the engine, which refuses the request with the reason."""
        if engine.adapters is None:
            return None

        async def load(name: str) -> None:
            try:
                await asyncio.to_thread(engine.adapters.get, name)
            except (KeyError, ValueError):
                log.exception("adapter %r did not load", name)

        try:
            serve.get_replica_context()
        except RayServeException:  # a replica built outside Serve (tests, benches): no router to tell
            return load
        return serve.multiplexed(max_num_models_per_replica=engine.adapters.capacity)(load)

    @staticmethod
    def _start_ranks(model: str, config: EngineConfig, resources: dict,
                     torch_threads: int | None) -> tuple[TensorParallel, tuple[list, list]]:
        """Start ranks 1..N-1 (``replicas.rank_workers``) and join them as rank 0."""
        from replicas.rank_workers import rendezvous_address, start_ranks

        address = rendezvous_address()
        ranks = start_ranks(model, config, address, resources.get("num_cpus", 1.0), resources.get("num_gpus", 0.0),
                            torch_threads)
        log.info("tensor-parallel replica: %d ranks, rendezvous at %s", config.tensor_parallel_size, address)
        return join_group(0, config.tensor_parallel_size, address, torch.device(config.device),
                          config.expert_parallel_size), ranks

    def _check_ranks(self) -> None:
        """Raise if another tensor-parallel rank has exited (its forwards cannot run)."""
        if self._ranks is None:
            return
        import ray

        _, runs = self._ranks
        ended, _ = ray.wait(runs, num_returns=1, timeout=0)
        if ended:
            try:
                ray.get(ended[0])
                why = "it stopped following"
            except Exception as exc:  # its actor died, or its loop raised
                why = f"{type(exc).__name__}: {str(exc)[:200]}"
            raise RuntimeError(f"tensor-parallel rank {runs.index(ended[0]) + 1} exited: {why}")

    @staticmethod
    def _replica_tag() -> str:
        try:
            from ray import serve

            return serve.get_replica_context().replica_tag
        except Exception:  # outside Serve (tests, offline use)
            return "local"

    @staticmethod
    def _node_id() -> str:
        import ray

        if not ray.is_initialized():  # outside Ray (tests, offline use): asking would start it
            return "local"
        return ray.get_runtime_context().get_node_id()

    # ---- requests -------------------------------------------------------------------
    def worst_case_cost(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """What a request that comes without a cost is charged: the algorithm's worst case
        (raises RequestError for an unknown algorithm or bad parameters)."""
        algorithm, algorithm_params = self.engine.algorithm_for(params)
        block = self.engine.block_length
        worst = algorithm.worst_case_steps(algorithm_params, block, self.engine.config.fused_commit)
        shape = self.engine.shape
        head = aligned_head(len(prompt_ids), block, shape.aligned)
        return request_cost(head + params.max_tokens, block, worst, shape.max_cost)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream one chunk per committed block of a tokenized request."""
        async for chunk in self._answer(request, whole=False):
            yield chunk

    async def _answer(self, request: GenerateRequest, whole: bool) -> AsyncIterator[GenerateChunk]:
        """The request's chunks (``whole``: one, the whole answer), counted by the monitor:
        its cost when it starts, its steps as blocks commit, its end."""
        start = time.monotonic()
        request_id = request.request_id
        first_block = None

        def progressed(steps: int, tokens: int) -> None:  # the event loop's thread, or the engine's (whole)
            nonlocal first_block
            self.monitor.request_progressed(request_id, request.prompt_cost + steps)
            if first_block is None and tokens:
                first_block = time.monotonic() - start

        if request.adapter is not None and self._load_adapter is not None:
            await self._load_adapter(request.adapter)
        try:
            params, level = self._quality_for(request.params)
            cost = request.cost if request.cost is not None else self.worst_case_cost(request.prompt_ids, params)
            job = request if params is request.params else replace(request, params=params)
            stream = self.async_engine.generate(job, whole=whole, on_progress=progressed if whole else None)
        except RequestError as exc:
            yield GenerateChunk.refusal(str(exc))
            return
        self.monitor.request_started(request_id, cost, level)
        reason, tokens, blocks = FinishReason.ABORT.value, 0, 0
        try:
            async for chunk in stream:
                progressed(chunk.steps, len(chunk.token_ids))  # a whole answer's: its last block's news
                tokens = chunk.completion_tokens
                if chunk.finished:
                    reason = chunk.finish_reason
                    blocks = 0 if chunk.error else len(chunk.block_steps)
                yield replace(chunk, quality_level=level) if level else chunk
        except RequestError as exc:
            reason = FinishReason.ERROR.value
            yield GenerateChunk.refusal(str(exc))
        finally:
            self.monitor.request_finished(request_id, reason, time.monotonic() - start, first_block, tokens, blocks)

    def _quality_for(self, params: SamplingParams) -> tuple[SamplingParams, int]:
        """The request's parameters at the load knob's level, which its arrival updates."""
        if self.quality is None or not params.adaptive:
            return params, 0
        self.quality.observe(self.monitor.predicted_drain_s())
        algorithm, _ = resolve_algorithm(self.engine.config, self.engine.spec, params.algorithm)  # checked by the engine
        return self.quality.apply(params, algorithm)

    async def generate_whole(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The whole answer of a tokenized request as a stream of one chunk
        (``messages.joined``), for a caller that does not stream: one message instead of one
        a block, and this replica's event loop woken once for it instead of once a block. A
        stream, not a unary call, so that the caller cancelling it (its client left) aborts
        the request here over Serve's actor-call transport too."""
        async for chunk in self._answer(request, whole=True):
            yield chunk

    # ---- Serve hooks -------------------------------------------------------------------
    async def record_routing_stats(self) -> dict:
        self._refresh_gauges()
        return ReplicaStats(**self.monitor.routing_stats(), **self._identity()).model_dump()

    def _identity(self) -> dict:
        """Who this replica is and whether its steps are failing, with every stats report."""
        return {"replica": self.replica_id, "pid": os.getpid(), "node": self.node_id,
                "failing_steps": self.engine.failed_steps_in_a_row}

    def _refresh_gauges(self) -> None:
        scheduler, pool, cache = self.engine.scheduler, self.engine.pool, self.engine.pool.cache
        self.monitor.set_gauges(waiting=len(scheduler.waiting), running=len(scheduler.running),
                                free_pages=pool.num_unheld, total_pages=pool.capacity,
                                kv_cache_bytes=self.engine.runner.kv_cache.nbytes,
                                max_model_len=self.engine.shape.max_model_len)
        if self.quality is not None:  # the level also comes back when no adaptive request arrives
            self.monitor.set_gauges(quality_level=self.quality.observe(self.monitor.predicted_drain_s()))
        if cache is not None:
            totals = cache.totals
            self.monitor.set_gauges(cached_pages=cache.num_pages, prefix_pages_looked_up=totals.pages_looked_up,
                                    prefix_pages_hit=totals.pages_hit, prefix_tokens_hit=totals.tokens_hit,
                                    prefix_evictions=totals.evictions)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return self.monitor.autoscaling_stats()

    async def check_health(self) -> None:
        """Unhealthy (Serve replaces the replica and the ingress resumes its requests
        elsewhere) when the engine thread is gone, it has not finished a step for
        ``stall_timeout_s`` with work pending, or its last steps failed: after
        ``unhealthy_after_failed_steps`` failures in a row at once, after fewer when a probe
        request (one block) fails too; routers rank a failing replica last, so the probe
        is what tells a broken engine from one bad step."""
        if not self.async_engine.alive:
            raise RuntimeError("the engine loop thread has died")
        self._check_ranks()
        stalled = self.async_engine.stalled_for()
        if stalled > self.stall_timeout_s:
            raise RuntimeError(f"the engine loop has not finished a step for {stalled:.0f} s with work pending")
        failed = self.engine.failed_steps_in_a_row
        if failed >= self.unhealthy_after_failed_steps:
            raise RuntimeError(f"the last {failed} engine steps failed")
        if failed:
            await self._probe()

    async def _probe(self) -> None:
        """Run a one-block request through the engine; raise if it fails or stalls."""
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        last = None
        try:
            async with asyncio.timeout(self.stall_timeout_s):
                async for last in self.async_engine.generate([self.engine.spec.eos_token_id], params):
                    pass
        except TimeoutError:
            raise RuntimeError(f"a probe request did not finish within {self.stall_timeout_s:g} s") from None
        if last is None or last.error:
            raise RuntimeError(f"a probe request failed: {last.error if last else 'no output'}")

    async def stats(self) -> dict:
        """Routing stats plus engine totals, for `dllm-serve status` and tests."""
        totals = self.engine.totals
        return {
            **(await self.record_routing_stats()),
            "steps": totals.steps, "output_tokens": totals.output_tokens,
            "requests_finished": totals.requests_finished, "requests_aborted": totals.requests_aborted,
            "requests_failed": totals.requests_failed, "requests_timed_out": totals.requests_timed_out,
            "compute_ratio": totals.compute_ratio,
        }

    def __del__(self):
        """Serve's graceful shutdown: in-flight requests are done; stop the threads."""
        self._stop.set()
        async_engine = getattr(self, "async_engine", None)
        if async_engine is not None:
            async_engine.shutdown(drain_timeout=5.0)
        if getattr(self, "_ranks", None) is not None:  # the other ranks end with this one
            import ray

            for worker in self._ranks[0]:
                ray.kill(worker)

    # ---- metrics push ------------------------------------------------------------------
    def _report_loop(self, period_s: float) -> None:
        """Push a report every ``period_s``, at most one at a time: while the previous push
        is on its way (the metrics actor is slow or restarting) nothing new is sent and the
        monitor keeps adding up, so the next report carries it all. A push unanswered for
        ``PUSH_TIMEOUT_S`` is given up (the actor is looked up again); without an actor for
        that long, what the monitor holds is dropped so that it stays bounded. The push in
        flight when the actor dies is lost with it (one report's increments)."""
        if self._metrics_actor is None:
            return
        import ray

        actor, pending, sent_at, delivered_at = None, None, 0.0, time.monotonic()
        while not self._stop.wait(period_s):
            now = time.monotonic()
            if pending is not None:
                done, _ = ray.wait([pending], timeout=0)
                if done:
                    pending = None
                    try:
                        ray.get(done[0], timeout=0)
                        delivered_at = now
                    except Exception as exc:  # lost with the actor that died: look it up again
                        log.debug("metrics push failed: %s", exc)
                        actor = None
                elif now - sent_at < PUSH_TIMEOUT_S:
                    continue
                else:
                    log.debug("metrics push unanswered for %.0f s; giving it up", now - sent_at)
                    pending, actor = None, None
            try:
                if actor is None:
                    actor = ray.get_actor(self._metrics_actor["name"], namespace=self._metrics_actor["namespace"])
                self._refresh_gauges()
                report = self.monitor.report()
                report["gauges"] = ReplicaStats(**report["gauges"], **self._identity()).model_dump()
                pending, sent_at = actor.push_replica.remote(self.replica_id, report), now
            except Exception as exc:  # the metrics actor may start later or restart
                log.debug("metrics push failed: %s", exc)
                actor = None
                if now - delivered_at > PUSH_TIMEOUT_S:
                    self.monitor.report()  # nobody to take it: drop it rather than grow

