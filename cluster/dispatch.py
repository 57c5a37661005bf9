"""Dispatch: a preprocessed completion's engine requests to the replicas, and their chunks back.

Admission charges the request's exact cost (``try_admit``, or 429); each prompt's ``n``
choices go out as engine requests of their own (``cluster.choices``), each resumed on
another replica if its replica fails (``cluster.failover``), and their chunks come back
merged, each with its choice's index. A streamed request reads the replica's stream, one
chunk per committed block; a non-streamed one a stream of one chunk, the whole answer
(``EngineReplica.generate_whole``). The charge is released as steps are taken and in full
at the end.

The replicas are called by reference (Ray actor calls), not over Serve's gRPC transport
between deployments: over gRPC this process kept native memory per request
(``request_path.GRPC_ENV``; a soak's ingress grew 145 MiB an hour), where actor calls cost
more CPU (``bench overload``: ~1.5 ms more in the ingress and in the replica per request).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

from cluster.admission import AdmissionController, Charge, Refusals
from cluster.auth import KeySlot
from cluster.choices import merged, rows
from cluster.config import FailoverSettings
from cluster.errors import APIError, bad_request
from cluster.failover import Failover, ReplicaFailed
from cluster.preprocess import Completion
from cluster.router import PrefixMemory
from replicas.messages import GenerateChunk, GenerateRequest, SamplingParams
from replicas.request import FinishReason

log = logging.getLogger(__name__)


class Dispatch:
    """``replicas``: the engine replicas' handle; ``sent_prefixes`` remembers the prompt
    pages admitted here (``ingress_id``'s) for the next requests' costs; ``held_text``: see
    ``Failover``."""

    def __init__(self, replicas, settings: FailoverSettings, block_length: int, admission: AdmissionController,
                 refusals: Refusals, sent_prefixes: PrefixMemory, ingress_id: str,
                 held_text: Callable[[SamplingParams, list[int]], str]):
        self.replicas = replicas.options(stream=True, _by_reference=True)
        self.admission = admission
        self.refusals = refusals
        self.sent_prefixes = sent_prefixes
        self.ingress_id = ingress_id
        self.admitted = 0
        self.failovers = 0
        self.in_flight = 0  # routes running here, plus streams still sending after their route returned
        failover = dict(max_attempts=settings.max_attempts, backoff_s=settings.backoff_s, block_length=block_length,
                        on_failover=self._count_failover, healthy_elsewhere=self._healthy_elsewhere,
                        healthy_wait_s=settings.healthy_wait_s, held_text=held_text)
        self.failover = Failover(lambda job: self._replicas_for(job).generate.remote(job), **failover)
        self.failover_whole = Failover(lambda job: self._replicas_for(job).generate_whole.remote(job), **failover)

    def _replicas_for(self, job: GenerateRequest):
        """The handle for ``job``: with its adapter as Serve's multiplexed model id (the
        router prefers the replicas that hold it)."""
        return self.replicas if job.adapter is None else self.replicas.options(multiplexed_model_id=job.adapter)

    @contextmanager
    def counted(self) -> Iterator[None]:
        """Count a request in ``in_flight`` while its route runs (`dllm-serve up` drains them)."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def chunks(self, completion: Completion, slot: KeySlot) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """Admit the completion (429 where admission refuses it) and return its choices'
        chunks, each with its choice's index (``n`` a prompt, prompt by prompt); the key's
        place ``slot`` is released at their end."""
        body = completion.body
        decision = self.admission.try_admit(body.n * sum(job.cost for job in completion.jobs), body.deadline_s)
        self.refusals.raise_if_refused(decision)
        self.admitted += 1
        for job in completion.jobs:
            self.sent_prefixes.record(job.prefix_hashes, self.ingress_id)
        failover = self.failover if body.stream else self.failover_whole
        return self._charged([row for job in completion.jobs for row in rows(job, body.n)], failover,
                             decision.charge, slot)

    async def _charged(self, jobs: list[GenerateRequest], failover: Failover, charge: Charge,
                       slot: KeySlot) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """The chunks of the request's choices from the replicas (each resumed elsewhere if
        its replica fails), with their choice's index, releasing the admission charge as
        steps are taken and the key's place at the end; raises APIError."""
        self.in_flight += 1
        steps = [0] * len(jobs)
        complete = True  # no choice failed or was cut short by its deadline (its time would say too little)
        try:
            async for index, chunk in merged([_replica_stream(job, failover) for job in jobs]):
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

    def _count_failover(self) -> None:
        self.failovers += 1

    def _healthy_elsewhere(self, failed: set[str]) -> bool:
        """Whether a replica outside ``failed`` reports (fresh) with no failing steps; with
        no reports at all this ingress knows nothing, and does not hold the request back."""
        views = self.admission.view
        return not views or any(replica not in failed and not view.failing_steps for replica, view in views.items())


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
