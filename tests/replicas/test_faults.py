"""Faults inside a replica: a failing step fails only its rows (as a replica fault, which
the ingress resumes elsewhere), repeated failures or a stalled loop make the replica
unhealthy, no queued add is dropped, and deadlines end requests and free their pages."""

import asyncio
import threading
import time

import pytest

from failing_call import failing_on_call
from replicas.async_engine import AsyncEngine
from replicas.deployment import EngineReplica
from replicas.messages import GenerateRequest, SamplingParams
from replicas.request import FinishReason
from replicas.engine_config import EngineConfig
from tests.replicas.step_spies import inject_faults

PARAMS = SamplingParams(max_tokens=64, ignore_eos=True)


def pool_is_free(engine) -> bool:
    return (engine.pool.num_available == engine.pool.capacity and engine.rows.num_free == engine.config.max_batch
            and not engine.scheduler.running and not engine.scheduler.waiting)


def test_one_failing_step_fails_only_its_rows_as_a_replica_fault(make_engine):
    engine = make_engine(max_batch=2)
    outputs = {}
    for prompt in ["abc", "def", "ghi"]:  # the third waits for a row
        engine.add_request(prompt, PARAMS, request_id=prompt,
                           on_output=outputs.setdefault(prompt, []).append)
    engine.step()  # the first two prefill and take a step
    inject_faults(engine, 1)
    assert engine.step() is None and engine.failed_steps_in_a_row == 1
    while engine.has_work():
        engine.step()
    assert engine.failed_steps_in_a_row == 0
    failed = {rid for rid, outs in outputs.items() if outs[-1].error}
    assert failed == {"abc", "def"}
    assert all(outputs[rid][-1].error_kind == "replica_fault" for rid in failed)
    assert outputs["ghi"][-1].finish_reason == FinishReason.LENGTH
    assert pool_is_free(engine)


def test_a_failing_add_does_not_drop_the_others_in_the_inbox(make_engine, monkeypatch):
    engine = make_engine(max_batch=4)
    monkeypatch.setattr(engine.scheduler, "add",
                        failing_on_call(engine.scheduler.add, 1, RuntimeError("queue broken")))
    outs = engine.generate(["abc", "def", "ghi"], PARAMS)
    assert outs[0].finish_reason == FinishReason.ERROR and outs[0].error_kind == "replica_fault"
    assert [o.finish_reason for o in outs[1:]] == [FinishReason.LENGTH] * 2
    assert pool_is_free(engine)


def test_a_deadline_ends_the_request_and_frees_its_pages(make_engine):
    now = [0.0]
    engine = make_engine(max_batch=1)
    engine.clock = engine.scheduler.clock = engine.outputs.clock = lambda: now[0]
    outputs = []
    engine.add_request("abc", SamplingParams(max_tokens=128, ignore_eos=True, timeout_s=5.0), on_output=outputs.append)
    engine.add_request("def", SamplingParams(max_tokens=128, ignore_eos=True, timeout_s=5.0), on_output=outputs.append)
    engine.step()
    now[0] = 5.0
    engine.step()
    assert [o.finish_reason for o in outputs if o.finished] == [FinishReason.TIMEOUT] * 2  # running and waiting
    assert not any(o.error for o in outputs)  # an answer cut short, not a failure
    assert engine.totals.requests_timed_out == 2
    assert pool_is_free(engine)


@pytest.mark.parametrize("whole,stop", [(False, True), (True, True), (True, False)],
                         ids=["streamed", "whole", "whole decoded by its receiver"])
def test_a_request_past_its_deadline_ends_with_the_text_it_committed(make_engine, whole, stop):
    """Its deadline passes once its first block committed: the answer is that block, the
    text the detokenizer held back (here the beginning of a stop string) included, and it
    finishes with ``timeout``, not an error."""
    engine = make_engine(max_batch=1)
    size = engine.block_length
    [first] = engine.generate(["abc"], SamplingParams(max_tokens=size, ignore_eos=True))
    params = SamplingParams(max_tokens=4 * size, ignore_eos=True, timeout_s=5.0,
                            stop=(first.text[-1] + "|",) if stop else ())  # its last character held back
    now = [0.0]
    engine.clock = engine.scheduler.clock = lambda: now[0]
    outputs = []
    engine.add_request("abc", params, on_output=outputs.append, whole=whole)
    before = engine.totals.output_tokens
    while engine.totals.output_tokens == before:
        engine.step()
    if not whole:
        assert outputs[0].text == first.text[:-1]
    now[0] = 5.0
    engine.step()
    outputs = [engine.with_answer_text(o, params) for o in outputs] if whole else outputs
    last = outputs[-1]
    assert last.finished and last.finish_reason == FinishReason.TIMEOUT and last.error is None
    assert "".join(o.text for o in outputs) == first.text
    assert [t for o in outputs for t in o.token_ids] == first.token_ids and last.completion_tokens == size
    assert engine.totals.requests_timed_out == 1 and pool_is_free(engine)


def test_deadlines_expire_in_their_own_order_and_spare_finished_requests(make_engine):
    """Deadlines of 9, 3 and 6 s, and a short request with 4 s that finishes first:
    each request times out when its own deadline passes, the finished one never."""
    now = [0.0]
    engine = make_engine(max_batch=4)
    engine.clock = engine.scheduler.clock = engine.outputs.clock = lambda: now[0]
    ended = {}

    def record(name):
        return lambda output: output.finished and ended.__setitem__(name, output.finish_reason)

    for name, timeout, tokens in (("nine", 9.0, 128), ("three", 3.0, 128), ("six", 6.0, 128), ("short", 4.0, 1)):
        engine.add_request("abc", SamplingParams(max_tokens=tokens, ignore_eos=True, timeout_s=timeout),
                           request_id=name, on_output=record(name))
    while "short" not in ended:
        engine.step()
    for at, expected in ((3.5, {"three"}), (6.0, {"three", "six"}), (9.0, {"three", "six", "nine"})):
        now[0] = at
        engine.step()
        assert {r for r, reason in ended.items() if reason == FinishReason.TIMEOUT} == expected
    assert ended["short"] == FinishReason.LENGTH and engine.totals.requests_timed_out == 3
    assert pool_is_free(engine)


@pytest.fixture
def replica(monkeypatch):
    replica = EngineReplica("tiny", EngineConfig(max_batch=4), metrics_actor=None, stall_timeout_s=0.5,
                            unhealthy_after_failed_steps=3)
    yield replica
    replica.__del__()


def _generate(replica, prompt: str) -> list:
    async def collect():
        job = GenerateRequest(prompt, replica.engine.encode(prompt), SamplingParams(64, ignore_eos=True))
        return [chunk async for chunk in replica.generate(job)]
    return asyncio.run(collect())


def test_steps_failing_in_a_row_make_the_replica_unhealthy(replica):
    asyncio.run(replica.check_health())
    inject_faults(replica.engine, -1)
    for prompt in ["1.", "2.", "3."]:
        [chunk] = _generate(replica, prompt)
        assert chunk.error_kind == "replica_fault" and "injected" in chunk.error
    with pytest.raises(RuntimeError, match="engine steps failed"):
        asyncio.run(replica.check_health())
    inject_faults(replica.engine, 0)
    assert _generate(replica, "4.")[-1].finish_reason == "length"
    asyncio.run(replica.check_health())  # healthy again after a good step


def test_after_one_failed_step_a_probe_tells_a_broken_engine_from_a_bad_step(replica):
    inject_faults(replica.engine, 1)
    assert _generate(replica, "1.")[-1].error_kind == "replica_fault"
    asyncio.run(replica.check_health())  # the probe ran a good step
    assert replica.engine.failed_steps_in_a_row == 0
    inject_faults(replica.engine, -1)
    assert _generate(replica, "2.")[-1].error_kind == "replica_fault"
    with pytest.raises(RuntimeError, match="probe request failed"):
        asyncio.run(replica.check_health())
    inject_faults(replica.engine, 0)
    asyncio.run(replica.check_health())


def test_a_stalled_engine_loop_makes_the_replica_unhealthy(replica):
    release = threading.Event()
    forward = replica.engine.runner.forward

    def stuck(batch):
        release.wait(timeout=60)
        return forward(batch)

    replica.engine.runner.forward = stuck
    worker = threading.Thread(target=_generate, args=(replica, "1."))
    worker.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            asyncio.run(replica.check_health())
        except RuntimeError as exc:
            assert "has not finished a step" in str(exc)
            break
        time.sleep(0.1)
    else:
        pytest.fail("the stalled replica stayed healthy")
    release.set()
    worker.join(timeout=60)
    asyncio.run(replica.check_health())


def test_the_loop_survives_a_step_that_raises_past_the_engine(make_engine, monkeypatch):
    engine = make_engine()
    runner = AsyncEngine(engine)
    monkeypatch.setattr(engine, "step", failing_on_call(engine.step, 1, RuntimeError("outside everything")))

    async def collect():
        return [o async for o in runner.generate("abc", PARAMS)]

    try:
        assert asyncio.run(collect())[-1].finish_reason == FinishReason.LENGTH
    finally:
        runner.shutdown(drain_timeout=0)
