"""The load knob through the ingress (no Ray): a request's dllm.quality (or the server's
quality.default) reaches the replica, and the response's dllm block names the level and
the threshold the request ran with."""

import asyncio
import json
import math
import time

import pytest

from cluster.config import ConfigError, load_config
from replicas.deployment import EngineReplica
from replicas.engine_config import EngineConfig
from test_ingress_path import PROMPT, answer
from test_input_bounds import ingress_over

LEVELS = [{"algorithm": "low_confidence", "params": {"threshold": 0.7}, "accuracy_loss": 0.5}]


@pytest.fixture(scope="module")
def replica():
    replica = EngineReplica("tiny", EngineConfig(max_batch=4), metrics_actor=None,
                            quality=load_config(overrides={"quality.levels": LEVELS}).quality_knob())
    yield replica
    replica.__del__()


def dllm_block(plain, instance, **fields) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, **fields}
    response = asyncio.run(answer(plain, instance, body))
    assert response.status_code == 200, response.body
    return json.loads(response.body)["dllm"]


@pytest.mark.parametrize("default", ["fixed", "adaptive"])
def test_the_response_names_the_level_and_threshold_it_ran_with(replica, default):
    asked = []  # each request's adaptive flag, as the replica receives it

    def generate(job):
        asked.append(job.params.adaptive)
        return replica.generate(job)

    plain, instance = ingress_over(generate, **{"quality.levels": LEVELS, "quality.default": default})
    replica.quality.level = 0
    assert dllm_block(plain, instance)["quality_level"] == 0 and dllm_block(plain, instance)["threshold"] == 0.95
    replica.quality.level = 1  # behind: as the knob would set it
    replica.quality.hold_s = 3600.0  # and let it hold there
    replica.quality._moved_at = float("inf")
    degraded = dllm_block(plain, instance, quality="adaptive")
    assert (degraded["quality_level"], degraded["threshold"]) == (1, 0.7)
    fixed = dllm_block(plain, instance, quality="fixed", threshold=0.9)
    assert (fixed["quality_level"], fixed["threshold"]) == (0, 0.9)
    by_default = dllm_block(plain, instance)
    assert by_default["quality_level"] == (1 if default == "adaptive" else 0)
    assert asked == [default == "adaptive"] * 2 + [True, False, default == "adaptive"]


def test_while_the_replicas_run_degraded_admission_charges_adaptive_requests_the_levels_steps(replica):
    levels = [{**LEVELS[0], "step_ratio": 0.5}]
    costs = {}  # quality asked -> the charge the replica received

    def generate(job):
        costs[job.params.adaptive] = job.cost
        return replica.generate(job)

    plain, instance = ingress_over(generate, **{"quality.levels": levels})

    def charges(level: int) -> tuple[float, float]:
        instance.admission.update_view({"r1": {"quality_level": level, "stats_time": time.time()}})
        for quality in ("fixed", "adaptive"):
            dllm_block(plain, instance, quality=quality)
        return costs[False], costs[True]

    fixed, adaptive = charges(0)
    assert adaptive == fixed  # the replicas run the default: so is the charge
    fixed, adaptive = charges(1)
    assert adaptive == math.ceil(fixed * 0.5) and fixed > 1


def test_a_level_with_bad_parameters_or_a_band_upside_down_is_a_config_error():
    with pytest.raises(ConfigError, match="quality.levels.0.*threshold"):
        load_config(overrides={"quality.levels": [{**LEVELS[0], "params": {"threshold": 2}}]})
    with pytest.raises(ConfigError, match="lower_at must be below"):
        load_config(overrides={"quality.raise_at": 0.3, "quality.lower_at": 0.5})
    assert load_config().quality_knob() is None  # no level: the knob is off
