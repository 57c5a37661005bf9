"""cluster.failover over a real (local) engine replica whose streams break on purpose:
the stitched stream equals an unbroken one, attempts are bounded, deadlines hold."""

import asyncio
import time
from dataclasses import replace

import pytest
from ray.exceptions import ActorDiedError

from cluster.failover import Failover, ReplicaFailed
from replicas.deployment import EngineReplica
from replicas.messages import GenerateChunk, GenerateRequest, SamplingParams
from replicas.engine_config import EngineConfig


@pytest.fixture(scope="module")
def replica():
    replica = EngineReplica("tiny", EngineConfig(max_batch=4), metrics_actor=None)
    yield replica
    replica.__del__()


def breaking(replica, break_after: list[int | None]):
    """A ``generate`` whose n-th stream dies (as a killed actor) after ``break_after[n]`` chunks."""
    attempts = []

    async def generate(job: GenerateRequest):
        limit = break_after[len(attempts)] if len(attempts) < len(break_after) else None
        attempts.append(job)
        count = 0
        async for chunk in replica.generate(job):
            if limit is not None and count == limit:
                raise ActorDiedError()
            count += 1
            yield chunk
    return generate, attempts


def collect(failover: Failover, job: GenerateRequest) -> list[GenerateChunk]:
    async def run():
        return [chunk async for chunk in failover.stream(job)]
    return asyncio.run(run())


def job_for(replica, **fields) -> GenerateRequest:
    prompt = "12.4..7.9"
    return GenerateRequest("r1", replica.engine.encode(prompt), SamplingParams(
        96, ignore_eos=True, algorithm_params={"temperature": 1.0, "seed": 3}, **fields))


def test_a_stream_broken_twice_is_stitched_into_the_unbroken_one(replica):
    whole = collect(Failover(replica.generate, 1, 0.0, 16), job_for(replica))
    generate, attempts = breaking(replica, [2, 0, 1])
    counted = []
    stitched = collect(Failover(generate, 4, 0.0, 16, on_failover=lambda: counted.append(1)), job_for(replica))
    assert "".join(c.text for c in stitched) == "".join(c.text for c in whole)
    assert [t for c in stitched for t in c.token_ids] == [t for c in whole for t in c.token_ids]
    assert len(counted) == 3 and len(attempts) == 4
    assert [len(a.params.resume_ids) for a in attempts] == [0, 32, 32, 48]  # resumed after the committed blocks
    assert [a.request_id for a in attempts] == ["r1", "r1.2", "r1.3", "r1.4"]
    assert attempts[-1].cost is None or attempts[-1].cost < attempts[0].cost
    final = stitched[-1]
    assert final.finished and final.completion_tokens == 96 and len(final.block_steps) == 6
    assert final.steps >= sum(final.block_steps)


def test_a_replica_fault_chunk_is_resumed_and_an_invalid_request_is_not(replica):
    async def faulty_once(job, calls=[]):
        calls.append(job)
        if len(calls) == 1:
            yield GenerateChunk(finished=True, error="the replica's engine step failed", error_kind="replica_fault")
            return
        async for chunk in replica.generate(job):
            yield chunk

    chunks = collect(Failover(faulty_once, 2, 0.0, 16), job_for(replica))
    assert chunks[-1].finish_reason == "length" and chunks[-1].error is None


def faulty_replica_then(replica, faults: int):
    """A ``generate`` whose first ``faults`` streams come from a replica "sick" whose every
    step fails; the later ones from ``replica``."""
    attempts = []

    async def generate(job):
        attempts.append((job, time.monotonic()))
        if len(attempts) <= faults:
            yield GenerateChunk(finished=True, error="the replica's engine step failed", error_kind="replica_fault",
                                replica="sick")
            return
        async for chunk in replica.generate(job):
            yield chunk
    return generate, attempts


def test_a_resumed_attempt_waits_for_a_replica_that_did_not_fail_it(replica):
    """The only replica up fails every step (Serve is replacing it): the resumed attempt
    waits until another reports healthy, instead of spending every attempt on the sick one."""
    generate, attempts = faulty_replica_then(replica, faults=1)
    asked, healthy_at = [], time.monotonic() + 0.5

    def healthy_elsewhere(failed):
        asked.append(set(failed))
        return time.monotonic() >= healthy_at
    chunks = collect(Failover(generate, 2, 0.0, 16, healthy_elsewhere=healthy_elsewhere, healthy_wait_s=30), job_for(replica))
    assert chunks[-1].finish_reason == "length" and chunks[-1].error is None
    assert attempts[1][1] >= healthy_at  # not before a healthy replica was there
    assert asked[0] == {"sick"}


def test_the_wait_for_a_healthy_replica_is_bounded_by_the_setting_and_the_deadline(replica):
    for wait_s, timeout_s in ((0.3, None), (30.0, 0.3)):
        generate, attempts = faulty_replica_then(replica, faults=1)
        failover = Failover(generate, 2, 0.0, 16, healthy_elsewhere=lambda failed: False, healthy_wait_s=wait_s)
        if timeout_s is None:  # the wait ends, and the attempt goes ahead (here: to a healthy one)
            assert collect(failover, job_for(replica))[-1].finish_reason == "length"
            assert 0.3 <= attempts[1][1] - attempts[0][1] < 10
        else:  # the deadline ends it, having committed nothing, instead of waiting 30 s
            started = time.monotonic()
            [end] = collect(failover, job_for(replica, timeout_s=timeout_s))
            assert (end.finished, end.finish_reason, end.completion_tokens) == (True, "timeout", 0)
            assert time.monotonic() - started < 10 and len(attempts) == 1


def test_a_deadline_between_attempts_ends_the_request_with_what_it_committed(replica):
    """The replica dies after the first block; no other is healthy before the deadline:
    the request is not resumed, and ends with its committed block's text, the character
    the replica held back (the beginning of a stop string) included."""
    [first, *_] = collect(Failover(replica.generate, 1, 0.0, 16), job_for(replica))
    generate, attempts = breaking(replica, [1])
    failover = Failover(generate, 2, 0.0, 16, healthy_elsewhere=lambda failed: False, healthy_wait_s=30,
                        held_text=replica.engine.outputs.held_text)
    chunks = collect(failover, job_for(replica, timeout_s=1.0, stop=(first.text[-1] + "|",)))
    assert [c.text for c in chunks] == [first.text[:-1], first.text[-1]] and len(attempts) == 1
    assert chunks[-1].finished and chunks[-1].finish_reason == "timeout" and chunks[-1].error is None
    assert chunks[-1].token_ids == [] and chunks[-1].completion_tokens == 16


def test_attempts_are_bounded(replica):
    generate, attempts = breaking(replica, [0, 0, 0, 0])
    with pytest.raises(ReplicaFailed, match="3 replica attempt"):
        collect(Failover(generate, 3, 0.0, 16), job_for(replica))
    assert len(attempts) == 3


def test_the_deadline_carries_over_to_the_resumed_attempt(replica):
    generate, attempts = breaking(replica, [1])
    collect(Failover(generate, 2, 0.0, 16), job_for(replica, timeout_s=60.0))
    assert attempts[1].params.timeout_s < 60.0
    assert Failover(generate, 2, 0.0, 16)._resumed(job_for(replica, timeout_s=60.0), [], elapsed_s=60.5,
                                                   attempt=2) is None  # not resumed past its deadline


def test_an_aligned_continuation_sent_without_a_cost_is_served():
    """Aligned blocks (SDAR's and LLaDA2.0's default): a continuation's resumed ids end a
    block only together with the prompt; the replica's worst-case charge once refused it."""
    replica = EngineReplica("tiny", EngineConfig(max_batch=4, block_alignment="prompt"), metrics_actor=None)
    try:
        prompt = replica.engine.encode("12.4..7.9")  # 9 tokens: the first answer block holds 7 answer ids
        params = SamplingParams(96, ignore_eos=True, algorithm_params={"temperature": 1.0, "seed": 3})
        job = GenerateRequest("a", prompt, params)
        whole = collect(Failover(replica.generate, 1, 0.0, 16), job)
        committed = [t for c in whole[:2] for t in c.token_ids]
        assert len(committed) == 7 + 16
        rest = collect(Failover(replica.generate, 1, 0.0, 16),
                       GenerateRequest("b", prompt, replace(params, resume_ids=tuple(committed))))
        assert not rest[0].error, rest[0].error
        assert committed + [t for c in rest for t in c.token_ids] == [t for c in whole for t in c.token_ids]
    finally:
        replica.__del__()


@pytest.mark.parametrize("aligned, committed, blocks", [(False, 32, 6), (True, 7 + 16, 7)])
def test_a_continuation_is_charged_the_blocks_left(aligned, committed, blocks):
    """Prompt of 9 tokens, 96 answer tokens, blocks of 16: unaligned 6 blocks; aligned 7 (the
    first holds the prompt's end, the job's ``head`` of 9, and 7 answer ids). Either way 2 are done."""
    job = GenerateRequest("r", [1] * 9, SamplingParams(96), cost=700.0, head=9 if aligned else 0)
    resumed = Failover(None, 2, 0.0, 16)._resumed(job, [5] * committed, 0.0, 2)
    assert resumed.cost == -(-700 * (blocks - 2) // blocks)


def test_a_request_for_an_adapter_resumes_with_its_adapter(tmp_path):
    """An unmerged adapter's request broken twice: every attempt names the adapter, and the
    stitched answer is the adapter's (an engine over the merged checkpoint's)."""
    from replicas.engine import Engine
    from tests.replicas.models.checkpoint_builders import OVERRIDES, write_checkpoint
    from tests.replicas.models.test_lora import checkpoint_weights, write_adapter

    checkpoint = write_checkpoint(tmp_path / "sdar", "SDARForCausalLM")
    weights = checkpoint_weights(checkpoint)
    write_adapter(tmp_path / "a", {name: weights[name].shape for name in weights if name.endswith("proj.weight")})
    settings = dict(max_batch=2, model_overrides=OVERRIDES["SDARForCausalLM"])
    config = EngineConfig(adapters={"a": str(tmp_path / "a")}, **settings)
    replica = EngineReplica(str(checkpoint), config, metrics_actor=None)
    try:
        job = GenerateRequest("r1", [5, 17, 42, 99, 3, 6, 7], SamplingParams(24, ignore_eos=True), adapter="a")
        generate, attempts = breaking(replica, [1, 1])
        stitched = collect(Failover(generate, 3, 0.0, replica.engine.block_length), job)
        assert [a.adapter for a in attempts] == ["a", "a", "a"]
        assert [len(a.params.resume_ids) for a in attempts] == [0, 1, 5]  # aligned: the prompt ends in block 1
        merged = Engine.from_pretrained(str(checkpoint), EngineConfig(lora=str(tmp_path / "a"), **settings))
        [alone] = merged.generate([job.prompt_ids], job.params)
        base = Engine.from_pretrained(str(checkpoint), EngineConfig(**settings))
        [unadapted] = base.generate([job.prompt_ids], job.params)
        ids = [t for c in stitched for t in c.token_ids]
        assert ids == alone.token_ids != unadapted.token_ids
    finally:
        replica.__del__()


def test_a_pipelined_request_resumes_after_its_committed_blocks(replica):
    """D2F decodes blocks ahead of the one it commits: a broken stream resumes after the
    committed blocks only (the blocks decoded ahead are decoded again)."""
    params = SamplingParams(96, ignore_eos=True, algorithm="d2f", algorithm_params={
        "block_add_threshold": 0.25, "decoded_token_threshold": 0.5, "skip_threshold": 0.6})
    job = GenerateRequest("r1", replica.engine.encode("12.4..7.9"), params)
    whole = [t for c in collect(Failover(replica.generate, 1, 0.0, 16), job) for t in c.token_ids]
    generate, attempts = breaking(replica, [2])
    stitched = collect(Failover(generate, 2, 0.0, 16), job)
    ids = [t for c in stitched for t in c.token_ids]
    assert len(ids) == 96 and stitched[-1].finished and stitched[-1].finish_reason == "length"
    assert ids[:32] == whole[:32] and attempts[1].params.resume_ids == tuple(whole[:32])
