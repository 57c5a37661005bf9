"""Resuming a request on another replica when its replica fails.

A committed dLLM block never changes. The ingress keeps the token ids of every block a
replica streamed; when the replica fails (Ray reports the actor dead or unavailable, the
stream breaks, or the replica reports a fault of its own), the same request goes out
again with those ids as ``resume_ids``. The next replica prefills prompt + committed
blocks and denoises on from the next block with the same per-block seeds, so the client
sees one stream, and a seeded or greedy request the same text a fault-free run gives.
A request that had not started is simply routed again. Attempts are bounded. A request
whose deadline passes between attempts is not resumed: it ends as a replica ends one at
its deadline, with what it committed and ``finish_reason`` "timeout".

Before a resumed attempt the request waits (bounded, and within its deadline) until some
replica other than those that failed it is up and stepping: with one replica left and
that one failing every step, attempts a backoff apart would all land on it and the
request would fail in two seconds, while Serve replaces the replica in ten or twenty.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

from ray.exceptions import RayError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from cluster.router import avoid
from replicas.request_cost import blocks_needed
from replicas.messages import GenerateChunk, GenerateRequest, SamplingParams
from replicas.request import FinishReason

log = logging.getLogger(__name__)

# what a failed replica looks like to the caller; our own cancellation is not one of them
_REPLICA_FAILURES = (RayError, BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError)
AVOID_FAILED_REPLICA_S = 10.0  # how long this process's router ranks a replica that failed a request last
HEALTHY_POLL_S = 0.1  # how often a waiting resumed attempt looks for a healthy replica


class ReplicaFailed(Exception):
    """The request failed on ``attempts`` replicas in a row; the message says how."""

    def __init__(self, reason: str, attempts: int):
        super().__init__(f"the request failed on {attempts} replica attempt(s); last: {reason}")
        self.attempts = attempts


class Failover:
    """Streams one request's chunks from the replicas behind ``generate``, resuming after failures.

    ``generate(job)`` returns the replica stream of a ``GenerateRequest``;
    ``on_failover()`` is called once per resumed attempt (for ``dllm_failovers_total``);
    ``healthy_elsewhere(failed)`` says whether a replica outside ``failed`` (ids) is up
    and stepping; a resumed attempt waits up to ``healthy_wait_s`` for one.
    ``held_text(params, ids)``: the text a replica holds back after the committed ``ids``
    (``OutputProcessor.held_text``), which ends a request whose deadline passes between
    attempts (without it: none).
    """

    def __init__(self, generate: Callable[[GenerateRequest], AsyncIterator[GenerateChunk]],
                 max_attempts: int, backoff_s: float, block_length: int,
                 on_failover: Callable[[], None] = lambda: None,
                 healthy_elsewhere: Callable[[set[str]], bool] = lambda failed: True, healthy_wait_s: float = 0.0,
                 held_text: Callable[[SamplingParams, list[int]], str] = lambda params, ids: ""):
        self.generate = generate
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.block_length = block_length
        self.on_failover = on_failover
        self.healthy_elsewhere = healthy_elsewhere
        self.healthy_wait_s = healthy_wait_s
        self.held_text = held_text

    async def stream(self, job: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """The request's chunks, as if one replica had served it: ``steps`` and
        ``block_steps`` count over all attempts. Raises ``ReplicaFailed``."""
        start = time.monotonic()
        committed: list[int] = []
        steps_before, block_steps_before = 0, []
        failed: set[str] = set()  # replicas that failed this request
        attempt, last = 1, None
        while True:
            steps, block_steps, failure, replica = 0, [], None, None
            attempt_job = job if attempt == 1 else self._resumed(job, committed, time.monotonic() - start, attempt)
            if attempt_job is None:
                yield self._timed_out(job, committed, last)
                return
            stream = self.generate(attempt_job)
            try:
                async for chunk in stream:
                    replica = chunk.replica or replica
                    if chunk.error_kind == "replica_fault":
                        failure = chunk.error
                        break
                    steps, block_steps = chunk.steps, chunk.block_steps
                    committed.extend(chunk.token_ids)
                    last = dataclasses.replace(chunk, steps=steps_before + steps,
                                               block_steps=block_steps_before + block_steps)
                    yield last
                    if chunk.finished:
                        return
                else:
                    failure = "the replica's stream ended before the request finished"
            except TaskCancelledError:
                raise  # our own cancellation (the client left): nothing to resume
            except _REPLICA_FAILURES as exc:
                failure = f"{type(exc).__name__}: {exc}".splitlines()[0]
            finally:
                await _close(stream)
            if replica:
                avoid(replica, AVOID_FAILED_REPLICA_S)
                failed.add(replica)
            if attempt >= self.max_attempts:
                raise ReplicaFailed(failure, attempt)
            log.warning("request %s: replica attempt %d failed (%s); resuming after %d committed tokens",
                        job.request_id, attempt, failure, len(committed))
            steps_before += steps
            block_steps_before = block_steps_before + block_steps
            await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            await self._wait_for_a_healthy_replica(job, failed, start)
            attempt += 1
            self.on_failover()

    async def _wait_for_a_healthy_replica(self, job: GenerateRequest, failed: set[str], start: float) -> None:
        """Until a replica outside ``failed`` is up and stepping, at most ``healthy_wait_s``
        and not past the request's deadline; then the attempt goes ahead either way."""
        until = time.monotonic() + self.healthy_wait_s
        if job.params.timeout_s is not None:
            until = min(until, start + job.params.timeout_s)
        logged = False
        while not self.healthy_elsewhere(failed) and time.monotonic() < until:
            if not logged:
                log.warning("request %s: waiting up to %.0f s for a replica other than %s", job.request_id,
                            until - time.monotonic(), ", ".join(sorted(failed)) or "the failed one")
                logged = True
            await asyncio.sleep(HEALTHY_POLL_S)

    def _timed_out(self, job: GenerateRequest, committed: list[int], last: GenerateChunk | None) -> GenerateChunk:
        """The last chunk of a request whose deadline passed between attempts (``last``: the
        chunk before): the text held back after its ``committed`` ids, finishing it."""
        if last is None:
            return GenerateChunk(finished=True, finish_reason=FinishReason.TIMEOUT.value)
        return dataclasses.replace(last, text=self.held_text(job.params, committed), token_ids=[], finished=True,
                                   finish_reason=FinishReason.TIMEOUT.value,
                                   logprobs=None if last.logprobs is None else [])

    def _resumed(self, job: GenerateRequest, committed: list[int], elapsed_s: float,
                 attempt: int) -> GenerateRequest | None:
        """The job for a later attempt: resumed after ``committed``, with what is left of
        its deadline and of its cost, under an id of its own (the replica may still hold
        the broken attempt); None once its deadline has passed."""
        params = job.params
        timeout = params.timeout_s
        if timeout is not None:
            timeout -= elapsed_s
            if timeout <= 0:
                return None
        cost = job.cost
        if cost is not None and committed:
            block = self.block_length
            total = blocks_needed(job.head + params.max_tokens, block)  # the blocks ``cost`` counted
            cost = math.ceil(cost * (total - (job.head + len(committed)) // block) / total)
        return dataclasses.replace(job, request_id=f"{job.request_id}.{attempt}", cost=cost,
                                   params=dataclasses.replace(params, resume_ids=tuple(committed), timeout_s=timeout))


async def _close(stream) -> None:
    """Close an async generator we stopped reading; a Serve response stream is cancelled."""
    close = getattr(stream, "aclose", None) or getattr(stream, "cancel", None)
    if close is None:
        return
    try:
        result = close()
        if asyncio.iscoroutine(result):
            await result
    except Exception as exc:  # closing a dead replica's stream may raise again
        log.debug("closing a replica stream: %s", exc)
