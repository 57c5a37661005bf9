"""The shipped tiny model through the engine: mode parity, accuracy, the benchmark's report."""

import pytest

from algorithms import available_algorithms
from replicas.engine import Engine, EngineConfig
from replicas.models import load_model, load_tokenizer
from replicas.request import SamplingParams
from replicas.batching import SchedulerMode
from replicas.tiny import task
from replicas.tiny.bench import bench_engine
from replicas.tiny.evaluation import evaluate_tiny
from replicas.tiny.task import MAX_TOKENS as TINY_MAX_TOKENS

ALGORITHM_CASES = {
    "low_confidence": {},
    "joint_threshold": {},
    "fast_dllm_threshold": {},
    "fast_dllm_factor": {},
    "fixed_steps": {"steps": 4},
    "low_confidence (sampled)": {"temperature": 0.8, "top_p": 0.9, "seed": 11},
    "fixed_steps (sampled)": {"steps": 4, "temperature": 0.7, "seed": 5},
}


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny"), load_tokenizer("tiny")


def test_every_algorithm_is_covered():
    assert {name.split(" ")[0] for name in ALGORITHM_CASES} == set(available_algorithms())


@pytest.mark.parametrize("case", ALGORITHM_CASES)
def test_modes_are_byte_identical_at_batch_1(tiny, case):
    """Every scheduler mode produces the same tokens for 50 prompts at batch size 1."""
    net, tokenizer = tiny
    requests = [r for r in task.heldout_requests() if len(r.puzzles) <= 2][:50]
    params = SamplingParams(max_tokens=TINY_MAX_TOKENS, algorithm=case.split(" ")[0],
                            algorithm_params=ALGORITHM_CASES[case])
    outputs = {}
    for mode in SchedulerMode:
        engine = Engine(net, tokenizer, EngineConfig(mode=mode.value, max_batch=1))
        outputs[mode] = [o.new_token_ids for o in engine.generate([r.prompt for r in requests], params)]
    assert len(outputs[SchedulerMode.FDFO]) == 50 and all(outputs[SchedulerMode.FDFO])
    assert all(outputs[mode] == outputs[SchedulerMode.FDFO] for mode in SchedulerMode)


def test_accuracy_in_both_modes_at_batch_1_and_16():
    report = evaluate_tiny("tiny", modes=("fdfo", "sync"), batch_sizes=(1, 16), num_requests=300)
    for run in report["runs"]:
        assert run["request_accuracy"] >= 0.90, run
        assert run["requests"] == 300
    assert report["max_mode_gap_points"] <= 1.0
    histogram = report["runs"][0]["steps_per_block_histogram"]
    assert len(histogram) >= 5  # steps per block spread over at least five levels


def test_bench_engine_report_is_consistent():
    result = bench_engine("tiny", num_requests=48, max_batch=16, rounds=2)
    for mode in ("fdfo", "sync", "static"):
        assert result[f"{mode}_tokens_per_s"] > 0
        assert 0 < result["tokens_per_forward"][mode] <= 16  # at most a block per row-forward
    for baseline in ("sync", "static"):
        assert result[f"fdfo_over_{baseline}"] > 0 and result[f"fdfo_over_{baseline}_spread"] >= 0
        # the baselines keep idle rows in their forwards: fewer tokens per row-forward
        assert result["tokens_per_forward"]["fdfo"] >= result["tokens_per_forward"][baseline]
    assert 0 < result["compute_ratio"] <= 1
    assert result["overhead_ms_per_step_p50"] > 0
    assert sum(result["steps_per_block_histogram"].values()) > 48
    # the baselines do the same useful work in more steps
    assert result["sync_steps"] >= result["fdfo_steps"] and result["static_steps"] >= result["sync_steps"]
    assert set(result["accuracy"]) == {"fdfo", "sync", "static"}
