"""The scheduler owns request state: statuses and outputs change through schedule /
update_from_output / finish, its batch is plain host arrays, and its waits run on the clock
it is given."""

import dataclasses

import numpy as np
import pytest

from algorithms import get_algorithm
from replicas.batching import Phase, SchedulerMode
from replicas.engine import Engine, EngineConfig
from replicas.kv_cache import PagePool
from replicas.request import FinishReason, Request
from replicas.messages import SamplingParams
from replicas.commits import OutputProcessor
from replicas.rows import RowTable
from replicas.scheduler import Scheduler
from replicas.step import StepOutput

BLOCK = 4
MASK = 99


class SilentTokenizer:
    """Every id decodes to nothing: these tests look at ids and statuses, not text."""

    def decode(self, ids, skip_special_tokens=True):
        return ""


OUTPUTS = OutputProcessor(SilentTokenizer(), frozenset())  # no end ids: an answer ends at max_tokens


def make_scheduler(mode, max_batch=2, max_tokens_per_step=16, **kwargs) -> Scheduler:
    pool = PagePool(32)
    rows = RowTable(max_batch, 8, BLOCK, pad_id=0)
    return Scheduler(SchedulerMode(mode), pool, rows, OUTPUTS, max_batch, max_tokens_per_step, BLOCK, MASK, **kwargs)


def output(step, done) -> StepOutput:
    """A step's output without a model: each stepped block filled with 7s, ``done`` or not."""
    count = len(step.stepped)
    return StepOutput([[7] * BLOCK] * count, done, [False] * count, None, [])


def make_request(name, prompt_len, blocks, arrival_time=0.0) -> Request:
    algorithm = get_algorithm("low_confidence")
    params = SamplingParams(max_tokens=blocks * BLOCK)
    return Request(request_id=name, prompt_ids=list(range(1, prompt_len + 1)), params=params, algorithm=algorithm,
                   algorithm_params=algorithm.make_params({}), block_length=BLOCK, arrival_time=arrival_time,
                   detokenizer=OUTPUTS.detokenizer(params))


def run_step(scheduler, steps_per_block):
    """One engine step without a model: a block is done after ``steps_per_block[name]``
    steps; the commit of a request's last block ends it (``max_tokens``)."""
    step = scheduler.schedule()
    assert step is not None
    batch = step.batch
    assert all(isinstance(getattr(batch, f.name), (np.ndarray, int)) for f in dataclasses.fields(batch))
    assert batch.advances.sum() == len(step.stepped)
    commits = scheduler.update_from_output(step, output(step, [
        request.steps_in_block + 1 == steps_per_block[request.request_id] for request in step.stepped]))
    assert all(request.finish_reason is (FinishReason.LENGTH if request.block_index == request.max_blocks - 1
                                         else None) for request, _ in commits)
    return batch


def test_fdfo_phases_from_chunked_prefill_to_release():
    scheduler = make_scheduler("fdfo", max_batch=1, max_tokens_per_step=BLOCK)
    request = make_request("a", prompt_len=6, blocks=2)
    scheduler.add(request)
    phases = [request.status]
    for _ in range(6):
        run_step(scheduler, {"a": 2})
        phases.append(request.status)
    assert phases == [Phase.WAITING, Phase.PREFILL, Phase.PREFILL, Phase.DENOISE, Phase.BLOCK_DONE,
                      Phase.DENOISE, Phase.FINISHED]
    assert request.committed_block_steps == [2, 2] and request.num_steps == 4
    assert request.output_ids == [7] * 2 * BLOCK and request.finish_reason is FinishReason.LENGTH
    assert scheduler.schedule() is None and not scheduler.has_work()
    assert request.row == -1 and scheduler.pool.num_available == scheduler.pool.capacity


@pytest.mark.parametrize("mode", ["sync", "static"])
def test_batch_synchronous_rounds(mode):
    """a: two one-step blocks; b: one three-step block. a's done block waits for the round
    (computed, not stepped); static also keeps finished b until a finishes."""
    scheduler = make_scheduler(mode)
    a, b = make_request("a", 4, blocks=2), make_request("b", 4, blocks=1)
    scheduler.add(a)
    scheduler.add(b)
    steps = {"a": 1, "b": 3}
    history = []
    for _ in range(4):
        batch = run_step(scheduler, steps)
        history.append((a.status, b.status, batch.advances.tolist()))
    assert history == [
        (Phase.BLOCK_DONE, Phase.DENOISE, [True, True]),
        (Phase.BLOCK_DONE, Phase.DENOISE, [False, True]),  # a idles until b's block is done
        (Phase.BLOCK_DONE, Phase.FINISHED, [False, True]),
        (Phase.FINISHED, Phase.FINISHED, [True] if mode == "sync" else [True, False]),
    ]
    assert scheduler.schedule() is None and not scheduler.has_work()
    assert a.committed_block_steps == [1, 1] and b.committed_block_steps == [3]


def test_a_request_ended_since_scheduling_is_skipped_by_the_update():
    scheduler = make_scheduler("fdfo")
    a, b = make_request("a", 4, blocks=1), make_request("b", 4, blocks=1)
    scheduler.add(a)
    scheduler.add(b)
    step = scheduler.schedule()
    assert scheduler.finish(a, FinishReason.ERROR)  # its algorithm failed
    assert not scheduler.finish(a, FinishReason.ABORT)  # ended once: the first reason stays
    assert scheduler.update_from_output(step, output(step, [True, False])) == []
    assert a.status is Phase.FINISHED and a.row == -1 and a.steps_in_block == 0 and a.output_ids == []
    assert a.finish_reason is FinishReason.ERROR
    assert b.status is Phase.DENOISE and b.steps_in_block == 1


def test_finish_frees_a_waiting_or_running_request():
    scheduler = make_scheduler("fdfo", max_batch=1)
    a, b = make_request("a", 4, blocks=2), make_request("b", 4, blocks=1)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()  # a runs, b waits for a row
    assert scheduler.finish(b, FinishReason.TIMEOUT) and not scheduler.waiting
    assert scheduler.finish(a, FinishReason.ABORT) and not scheduler.has_work()
    assert scheduler.pool.num_available == scheduler.pool.capacity and scheduler.rows.num_free == 1


def test_waits_run_on_the_given_clock():
    now = [0.0]
    fill = make_scheduler("fixed_fill", fill_timeout=lambda: 1.0, clock=lambda: now[0])
    fill.add(make_request("a", 4, blocks=1, arrival_time=0.0))
    assert fill.schedule() is None and fill.hold_until == 1.0
    now[0] = 0.99
    assert fill.schedule() is None
    now[0] = 1.0
    assert fill.schedule() is not None

    now[0] = 0.0
    fdfo = make_scheduler("fdfo", fdfo_hold=lambda rows: 0.5, clock=lambda: now[0])
    fdfo.add(make_request("a", 4, blocks=1))
    assert fdfo.schedule() is None and fdfo.hold_until == 0.5  # one free row, an empty queue
    now[0] = 0.5
    assert fdfo.schedule() is not None


def test_engine_runs_on_a_virtual_clock(random_model, tokenizer):
    now = [100.0]
    engine = Engine(random_model, tokenizer, EngineConfig(mode="fixed_fill", max_batch=2, fill_timeout_s=5.0),
                    clock=lambda: now[0])
    finals = []
    engine.add_request("abc", SamplingParams(max_tokens=16, ignore_eos=True),
                       on_output=lambda o: o.finished and finals.append(o))
    assert engine.step() is None and engine.hold_s() == 5.0  # a lone request waits to fill the batch
    [request] = engine.scheduler.waiting
    now[0] += 5.0
    while engine.has_work():
        engine.step()
    assert request.arrival_time == 100.0
    assert len(finals) == 1 and finals[0].completion_tokens == 16 and finals[0].engine_s == 5.0
