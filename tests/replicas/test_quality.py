"""The load knob (replicas.quality): its level follows the replica's predicted drain time
with hysteresis, only requests that allow it are degraded, and a replica under a burst
runs its adaptive requests at the degraded setting and comes back when the load falls."""

import asyncio
import pickle

import pytest

from replicas.deployment import EngineReplica
from replicas.messages import GenerateRequest, SamplingParams
from replicas.quality import QualityKnob, QualityLevel
from replicas.engine_config import EngineConfig

LADDER = [QualityLevel("low_confidence", {"threshold": 0.9}, 0.5),
          QualityLevel("low_confidence", {"threshold": 0.8}, 0.9),
          QualityLevel("low_confidence", {"threshold": 0.5}, 30.0)]  # over any budget below


def test_the_level_moves_one_step_at_a_time_holds_and_comes_back():
    now = [0.0]
    knob = QualityKnob(LADDER, slo_s=10.0, raise_at=0.8, lower_at=0.4, hold_s=2.0, clock=lambda: now[0])
    assert len(knob.levels) == 2  # the budget (1 point) keeps the 30-point level out
    assert knob.observe(9.0) == 1  # behind: one level lower
    now[0] = 1.0
    assert knob.observe(20.0) == 1  # the move holds for hold_s
    now[0] = 2.5
    assert knob.observe(20.0) == 2
    now[0] = 5.0
    assert knob.observe(20.0) == 2  # the ladder's end
    assert knob.observe(6.0) == 2  # between the bands: no move
    now[0] = 8.0
    assert knob.observe(1.0) == 1
    now[0] = 8.5
    assert knob.observe(0.0) == 1  # holds again
    now[0] = 11.0
    assert knob.observe(0.0) == 0
    assert knob.observe(0.0) == 0


def test_only_adaptive_requests_of_the_levels_algorithm_change():
    knob = QualityKnob(LADDER, slo_s=1.0, hold_s=0.0)
    knob.observe(5.0)
    adaptive = SamplingParams(algorithm="low_confidence", algorithm_params={"threshold": 0.95, "seed": 3}, adaptive=True)
    params, level = knob.apply(adaptive, "low_confidence")
    assert level == 1 and params.algorithm_params == {"threshold": 0.9, "seed": 3}
    assert knob.apply(SamplingParams(algorithm_params={"threshold": 0.95}), "low_confidence") == (
        SamplingParams(algorithm_params={"threshold": 0.95}), 0)  # fixed
    assert knob.apply(adaptive, "fast_dllm_threshold")[1] == 0  # another algorithm
    again = pickle.loads(pickle.dumps(knob))  # as the cluster sends it to each replica
    assert again.level == 1 and again.apply(adaptive, "low_confidence")[1] == 1 and again.observe(0.0) == 0
    with pytest.raises(ValueError, match="below raise_at"):
        QualityKnob(LADDER, slo_s=1.0, raise_at=0.5, lower_at=0.5)


@pytest.fixture
def replica():
    # an SLO far below what a burst of 24 requests takes: the knob moves at once
    knob = QualityKnob(LADDER[:1], slo_s=0.05, hold_s=0.0)
    replica = EngineReplica("tiny", EngineConfig(max_batch=8), metrics_actor=None, quality=knob)
    yield replica
    replica.__del__()


def _burst(replica, adaptive: list[bool]) -> list:
    prompt = replica.engine.encode("1.3. ..2. 4... .1.4")

    async def one(i: int, allows: bool):
        params = SamplingParams(max_tokens=32, algorithm="low_confidence", algorithm_params={"threshold": 0.95},
                                adaptive=allows)
        return [chunk async for chunk in replica.generate(GenerateRequest(f"r{i}", prompt, params))]

    async def all_of():
        return await asyncio.gather(*(one(i, allows) for i, allows in enumerate(adaptive)))
    return asyncio.run(all_of())


def test_a_burst_degrades_adaptive_requests_only_and_the_level_comes_back(replica):
    adaptive = [i % 2 == 0 for i in range(24)]
    answers = _burst(replica, adaptive)
    levels = [{chunk.quality_level for chunk in chunks} for chunks in answers]
    assert all(level == {0} for level, allows in zip(levels, adaptive) if not allows)  # fixed: never
    assert sum(level == {1} for level, allows in zip(levels, adaptive) if allows) >= 6  # the later ones
    assert all(chunks[-1].finished and not chunks[-1].error for chunks in answers)
    # the load is gone: the next report (and the next arrival) finds the default again
    replica._refresh_gauges()
    assert replica.quality.level == 0 and replica.monitor.routing_stats()["quality_level"] == 0
    [single] = _burst(replica, [True])
    assert {chunk.quality_level for chunk in single} == {0}
    assert replica.monitor.report()["degraded"] >= 6
