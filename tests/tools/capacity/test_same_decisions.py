"""The engine and the simulator make the same batching decisions on the same arrivals.

The real engine (tiny model) runs on a virtual clock: a request is added when the clock
reaches its arrival time, each step moves the clock on by the step's measured cost, and
a waiting engine (fdfo hold, fixed_fill fill wait) sleeps until its deadline or the next
arrival. The simulator then runs the same arrivals with the engine's steps per block for
every request and the engine's step costs replayed in order (``ReplayedSteps``); every
step must hold as many rows and start as many requests, and every request must commit its
first block and finish at the same time.
"""

from collections import Counter

import numpy as np
import pytest

from loadgen.arrivals import poisson_times
from tools.capacity.simulator import ReplayedSteps, Workload, simulate
from replicas.engine import Engine, EngineConfig
from replicas.fill_timeout import fdfo_hold
from replicas.models import load_model, load_tokenizer
from replicas.tiny import task
from tools.bench.evaluation import tiny_params

MAX_BATCH = 4
REQUESTS = 24
RATE = 8.0  # arrivals per second: batches fill and drain
FILL_TIMEOUT_S = 0.02
HOLD_COST = {"c0": 0.3, "c1": 0.0}  # the step cost the fdfo hold rule assumes: holds of 175, 50 and 0 ms
PROMPT_PAGES = task.SLOTS  # every tiny-task prompt is 7 pages


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny"), load_tokenizer("tiny")


@pytest.fixture(scope="module")
def arrivals():
    return poisson_times(RATE, seed=3, count=REQUESTS), [r.prompt for r in task.make_requests(REQUESTS, seed=3)]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def run_engine(tiny, mode: str, hold: bool, times: list[float], prompts: list[str]) -> dict:
    """Drive the engine on a virtual clock; its steps, costs and per-request times."""
    clock = Clock()
    engine = Engine(*tiny, EngineConfig(mode=mode, max_batch=MAX_BATCH, fill_timeout_s=FILL_TIMEOUT_S,
                                        fdfo_fill_hold=hold), clock=clock)
    if hold:  # the simulator's rule at the trace's true rate, instead of the engine's online estimates
        rate = Workload(np.asarray(times), np.ones(len(times)), np.ones((len(times), 1))).rate
        engine.scheduler.fdfo_hold = lambda rows: fdfo_hold(rate, rows, MAX_BATCH, **HOLD_COST)
    ends, taken, costs, first_step, last_step, block_steps = [], [], [], {}, {}, {}

    def record(index: int):
        def on_output(output) -> None:
            first_step.setdefault(index, len(costs))
            if output.finished:
                last_step[index] = len(costs)
                block_steps[index] = output.block_steps
        return on_output

    now, sent, waits = 0.0, 0, 0
    while sent < len(times) or engine.has_work():
        while sent < len(times) and times[sent] <= now:
            clock.now = times[sent]  # the request arrives at its arrival time
            engine.add_request(prompts[sent], tiny_params(), on_output=record(sent))
            sent += 1
        clock.now = now
        stats = engine.step()
        if stats is None:
            wake = engine.scheduler.hold_until
            if wake is None and sent == len(times):  # the step only released finished rows
                assert not engine.has_work(), "the engine waits for nothing"
                break
            waits += wake is not None
            now = min(np.inf if wake is None else wake, times[sent] if sent < len(times) else np.inf)
            continue
        costs.append(stats.step_s)
        taken.append((stats.batch_size, stats.prefix_units // PROMPT_PAGES))
        now += stats.step_s
        ends.append(now)
    assert len(block_steps) == len(times)
    return {"costs": costs, "waits": waits, "taken": taken, "block_steps": [block_steps[i] for i in range(len(times))],
            "first_block": [ends[first_step[i]] for i in range(len(times))],
            "finish": [ends[last_step[i]] for i in range(len(times))]}


@pytest.mark.parametrize("mode, hold", [("fdfo", True), ("fdfo", False), ("sync", False), ("static", False),
                                        ("fixed_fill", False)])
def test_engine_and_simulator_decide_alike(tiny, arrivals, mode, hold):
    times, prompts = arrivals
    engine = run_engine(tiny, mode, hold, times, prompts)
    blocks = [len(steps) for steps in engine["block_steps"]]
    steps = np.zeros((len(times), max(blocks)), dtype=np.int64)
    for i, counts in enumerate(engine["block_steps"]):
        steps[i, :len(counts)] = counts
    calibration = {**HOLD_COST, "max_batch": MAX_BATCH, "blocks_per_request": Counter(blocks),
                   "steps_per_block": Counter(s for counts in engine["block_steps"] for s in counts)}
    replay = ReplayedSteps(engine["costs"])
    result = simulate(calibration, Workload(np.asarray(times), np.asarray(blocks), steps), mode,
                      fill_timeout=FILL_TIMEOUT_S, fdfo_fill_hold=hold, step_costs=replay)
    assert replay.taken == engine["taken"]  # every step: its rows and the requests it admitted
    assert result.ttfb + result.arrival == pytest.approx(engine["first_block"], rel=1e-9, abs=1e-9)
    assert result.latency + result.arrival == pytest.approx(engine["finish"], rel=1e-9, abs=1e-9)
    if hold or mode == "fixed_fill":
        assert engine["waits"] > 0  # the waits were decided alike too
